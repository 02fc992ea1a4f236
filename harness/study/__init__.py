"""The study in one command: train every pooling arm per seed with one recipe, evaluate every run, write a report.

    python scripts/study.py --dataset cifar10 --epochs 30 --seeds 0 1 2 --output study/c10

The arms (table ``ARMS``; ``--arms``, default ``cls``, ``gap``, ``rollout``, ``rollout-grad``; ``map`` and
``rollout-max-discard0.9`` on request) differ only in pooling.
Each run trains with ``python -m timm_rollout.train`` and is evaluated with ``python -m harness.eval`` (k-NN
and linear probe against the train split); each ``cls`` backbone is also read out post hoc with rollout
weights and with the patch mean (``harness.eval --pool``, no training), arms of their own in the report.
Finished runs and evaluations are skipped and interrupted runs resume, so re-running the same command after
a crash completes the study; arms and seeds can be added to a folder later, and ``--report-only`` reports on
the seeds every arm has finished so far. ``--commit`` commits each finished run (weights, logs, evaluation)
with ``study.json`` to the git repository holding ``--output``. One seed of each arm, picked without the test set
(lowest final training loss), is exported as a Hub upload folder ``hub/<arm>`` with its model card
(``scripts/push_to_hub.py --dry-run``). ``report.md`` holds every metric per arm (mean +- std over seeds, the
pooling diagnostics included), the paired-by-seed difference of each arm against ``cls`` and
against ``gap`` (95% CI, p-value, Holm-adjusted p for the secondary metrics within each comparison, minimum
detectable effect, McNemar's per-image test for accuracies; see :mod:`harness.compare`), overlaid training
curves, the distribution of effective patches and the mean rollout weight map per arm, the cosine-similarity
matrices and a heatmap grid of the same test images under every arm.

The modules, in the order a study meets them: :mod:`.cli` (flags, the command), :mod:`.plan` (arms, train
commands), :mod:`.folder` (``study.json``: identity and remembered settings; the folder layout), :mod:`.jobs`
(training and evaluation processes, ``--jobs``, ``--pack``, ``--commit``), :mod:`.report` (``report.md``, its
figures, the Hub exports), :mod:`.tables` (its markdown tables) and :mod:`.dose` (the dose analysis).
"""

from .cli import build_parser, main

__all__ = ["build_parser", "main"]
