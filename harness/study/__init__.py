"""The study in one command: train every pooling arm per seed with one recipe, evaluate every run, write a report.

    python scripts/study.py --dataset cifar10 --epochs 30 --seeds 0 1 2 --output study/c10

What it trains, evaluates and reports is described in scripts/README.md. The modules, in the order a study meets
them: :mod:`.command` (flags, the command), :mod:`.plan` (arms, train commands), :mod:`.folder` (``study.json``:
identity and remembered settings; the folder layout), :mod:`.jobs` (training and evaluation processes, ``--jobs``,
``--commit``), :mod:`.cluster` (``--executor slurm``, ``--status``), :mod:`.report` (``report.md``, its figures, the
Hub exports), :mod:`.tables` (its markdown tables) and :mod:`.dose` (the dose analysis).
"""

from .command import build_parser, main

__all__ = ["build_parser", "main"]
