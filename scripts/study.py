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
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import queue
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from timm.utils import ParseKwargs

from harness import stats
from harness.compare import (
    METRICS,
    ORIGINAL_METRICS,
    PRIMARY,
    STATISTICS_NOTE,
    Group,
    compare_groups,
    evaluated_images,
    format_ci,
    format_number,
    format_p,
    load_results,
    render_comparison,
    same_images,
    summarise,
)
from harness.diagnose import outdated
from harness.dose import contrast_metric, dose_section
from harness.eval import set_pool
from harness.features import saliency_maps
from harness.figures import plot_heatmaps, plot_object_weights, plot_pooling_diagnostics
from harness.metrics import LOCALISATION, POOLING_DIAGNOSTICS
from harness.predictions import read_predictions
from timm_rollout.atomic import save_figure, write_json, write_text
from timm_rollout.data import dataset_arg, load_image_set, normalize
from timm_rollout.device import device_arg
from timm_rollout.errors import (
    CliParser,
    UserError,
    as_type,
    non_negative_int,
    number,
    output_dir,
    positive_int,
    run_cli,
    seed_arg,
)
from timm_rollout.explain import MAP_LABELS
from timm_rollout.hub import write_upload_folder
from timm_rollout.loading import load_model
from timm_rollout.records import (
    CARD_FILE,
    CURVES_FILE,
    DATA_DIR,
    HEATMAPS_FILE,
    HUB_DIR,
    LOCALISATION_FILE,
    LOG_FILE,
    NOTES_FILE,
    POOLING_FILE,
    REPORT_FILE,
    RESULTS_FILE,
    RESUME_FILE,
    STUDY_FILE,
    SUMMARY_FILE,
    WEIGHTS_FILE,
    data_card_title,
    sha256_file,
)
from timm_rollout.train import build_parser as train_parser
from timm_rollout.train_log import epoch_axis, read_log, seeds_phrase

# Trained arms: the pooling (any timm pooling, or rollout) and its rollout options. On the tiny CIFAR ViT (no
# --model) an arm is the registered model of its pooling with the options as model arguments (the committed
# studies' commands); on any other timm ViT (--model) it is `--pool` / `--pool-kwargs` of timm_rollout.train, and
# `map` builds the model with timm's learned attention pooling.
ARMS = {
    "cls": ("token", {}),
    "gap": ("avg", {}),
    "rollout": ("rollout", {}),
    "rollout-grad": ("rollout", {"grad": True}),
    "map": ("map", {}),  # timm's learned attention pooling (one latent query)
    # Sharpened rollout: max over heads, the weakest 90% of patch-to-patch attention discarded: of the rollout
    # variants, the least uniform weights on trained rollout and cls backbones (effective patches).
    "rollout-max-discard0.9": ("rollout", {"head_fusion": "max", "discard_ratio": 0.9}),
}
TINY = {"token": "vit_tiny_cifar_cls", "avg": "vit_tiny_cifar_gap", "rollout": "vit_tiny_cifar_rollout",
        "map": "vit_tiny_cifar_cls"}  # the tiny CIFAR ViT of each pooling


def arm_model(base: str | None, arm: str) -> tuple[str, list[str], list[str]]:
    """(timm model, --model-kwargs items, other train flags) of ``arm`` on ``base`` (None: the tiny CIFAR ViT)."""
    pool, options = ARMS[arm]
    if base is None:
        kwargs = ["global_pool=map"] if pool == "map" else [f"rollout_{k}={v}" for k, v in options.items()]
        return TINY[pool], kwargs, []
    if pool == "map":
        return base, ["global_pool=map"], []
    flags = ["--pool", pool]
    return base, [], flags + (["--pool-kwargs", *[f"{k}={v}" for k, v in options.items()]] if options else [])


# The arms a study trains unless --arms names others (the README quickstart runs these on the sample).
DEFAULT_ARMS = ("cls", "gap", "rollout", "rollout-grad")
# Post-hoc readouts of the cls backbones (no training): arm -> harness.eval --pool.
POSTHOC = {"cls-posthoc-rollout": "rollout", "cls-posthoc-avg": "avg"}
# Every other arm is compared with each of these that the study has: [CLS], plain averaging, and the detached
# rollout (so rollout-grad's own question, "do gradients through the weights change anything?", has its table).
REFERENCES = ("cls", "gap", "rollout")
COMMIT_METRICS = ("top1", "linear_probe", "knn_bank")  # named in --commit messages
_GIT = threading.Lock()  # runs side by side commit one at a time (git's index lock)
_GIT_BUSY = ("index.lock", "middle of a merge", "during a merge")  # another process is using the repository
# The original study's CIFAR-10 figures (200 epochs, one seed, dropout 0.1), to set beside the table above.
ORIGINAL_STUDY = """The original study reported on CIFAR-10 (200 epochs, one seed, dropout 0.1; its k-NN@5 counts the
query as its own neighbour, so it is not our `knn_loo`):

| metric | cls | rollout |
|---|---:|---:|
| intra_original | 0.717 | 0.694 |
| inter_original | 1.000 | 1.063 |
| ratio_original | 1.40 | 1.53 |
| silhouette | 0.143 | 0.134 |
| k-NN@5 (query included) | 0.845 | 0.850 |"""
def primary_arg(value: str) -> tuple[str, str]:
    """``BASE:ARM`` of two study arms, for ``--primary``."""
    base, _, arm = value.partition(":")
    unknown = [a for a in (base, arm) if a not in ARMS and a not in POSTHOC]
    if not arm or unknown or base == arm:
        raise UserError(f"expected BASE:ARM of two arms ({', '.join([*ARMS, *POSTHOC])}), e.g. gap:rollout")
    return base, arm


# Report settings a folder remembers once given: a later command inherits them, or must repeat them unchanged.
REMEMBERED = ("also_eval", "primary", "interaction")
# Study flags that make two studies the same recipe, so that their primary comparisons can be set against each other.
SAME_RECIPE = ("model", "epochs", "train_args", "max_train_samples", "eval_per_class", "bank_per_class",
               "faithfulness_images")
# Study flags that change what is computed: a re-run must repeat them to reuse the folder (arms and seeds may grow).
IDENTITY = ("model", "dataset", "epochs", "train_args", "max_train_samples", "eval_per_class", "bank_per_class",
            "faithfulness_images")


def build_parser() -> CliParser:
    """The CLI; bad values are one-line errors before anything is recorded in ``study.json``."""
    p = CliParser(prog="python scripts/study.py", description=__doc__.splitlines()[0], checks=[check_train_args],
                  removed={"--stack": "run seeds side by side as separate processes with --jobs N",
                           "--capture": "for CUDA graphs pass --train-args '--compile --compile-mode reduce-overhead'"})
    p.add_argument("--dataset", required=True, type=as_type(dataset_arg),
                   help="alias (cifar10, cifar100, svhn, cifar10-sample), Hub id or folder")
    p.add_argument("--epochs", type=positive_int, required=True)
    p.add_argument("--model", default=None,
                   help="base timm ViT every arm pools (default: the tiny CIFAR ViT, vit_tiny_cifar_<pooling>); size "
                        "and depth via --train-args '--model-kwargs img_size=32 ...'")
    p.add_argument("--seeds", type=seed_arg, nargs="+", default=[0])
    p.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=list(DEFAULT_ARMS),
                   help=f"trained arms (default: {' '.join(DEFAULT_ARMS)}); cls brings its post-hoc rollout and "
                   "patch-mean readouts")
    p.add_argument("--output", required=True, type=output_dir, help="study folder (runs/, eval/, report.md)")
    p.add_argument("--train-args", default="", help="extra flags for timm_rollout.train, quoted, same for every arm")
    p.add_argument("--max-train-samples", type=positive_int, help="class-balanced training subset (quick studies)")
    p.add_argument("--eval-per-class", type=number(int, 2),
                   help="evaluate N random test images per class, at least 2 (default: all)")
    p.add_argument("--bank-per-class", type=positive_int,
                   help="k-NN bank: N random train images per class (default: all)")
    p.add_argument("--faithfulness-images", type=non_negative_int, default=0,
                   help="deletion/insertion faithfulness on N evaluated images (0: off)")
    p.add_argument("--also-eval", type=as_type(dataset_arg), metavar="DATASET", nargs="+",
                   help="also evaluate every run on these data sets' test splits (the same classes, e.g. the same "
                        "objects without clutter, or at several doses of clutter, lowest first; no k-NN bank or "
                        "faithfulness there): the report adds each arm's top-1 on each and the paired changes, and "
                        "with several the dose analysis; remembered by the folder")
    p.add_argument("--primary", type=as_type(primary_arg), metavar="BASE:ARM",
                   help="the comparison named before the runs, e.g. gap:rollout for rollout - gap: its table comes "
                        "first and only its top-1 is the primary test (the others' top-1 rows are uncorrected, "
                        "secondary); remembered by the folder")
    p.add_argument("--interaction", metavar="FOLDER", type=os.path.normpath,
                   help="another study folder, of the same recipe and --primary arms on another data set (e.g. the "
                        "objects without clutter): the report adds the primary comparison's difference between the "
                        "two studies, paired by seed; remembered by the folder")
    p.add_argument("--heatmaps", type=non_negative_int, default=6,
                   help="test images in the side-by-side heatmap grid (0: no grid)")
    p.add_argument("--pack", type=positive_int, default=1,
                   help="seeds of one arm trained in one trainer process, one after another (data loaded once); "
                        "not part of the study's identity")
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="runs side by side, the CPU cores split between them (and the GPUs, when several are visible)")
    p.add_argument("--commit", action="store_true",
                   help="git-commit each finished run with its evaluations (--output must be in a git work tree)")
    p.add_argument("--hub-org", default="timm-rollout",
                   help="owner in the repo ids of the Hub exports (hub/<arm>: the seed of each arm with the lowest "
                        "final training loss, dry run)")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: report (and export) over the seeds every arm of --arms has finished")
    p.add_argument("--device", default="auto", type=device_arg, help="auto, cpu, cuda, cuda:1 ...")
    return p


# Trainer flags (argparse destinations of timm_rollout.train) that the study's own train command sets for every
# run (train_command), with the study flag that sets them: --train-args may not contradict them.
STUDY_SETS = {
    "model": "use the study's --model", "dataset": "use the study's --dataset",
    "epochs": "use the study's --epochs", "seed": "use the study's --seeds", "output": "use the study's --output",
    "device": "use the study's --device", "max_train_samples": "use the study's --max-train-samples",
    "pool": "choose the pooling with --arms",
    "pool_kwargs": "choose the pooling with --arms",
    "resume": "drop it: re-running the study command resumes interrupted runs",
    "overwrite": "drop it: the study never overwrites a run; use a new --output to start again",
}
# --model-kwargs keys that define an arm's pooling (arm_model): set by --arms, never by --train-args.
ARM_KWARGS = ("global_pool", "rollout_")


def _train_flags(tokens: list[str]) -> tuple[frozenset[str], dict[str, Any]]:
    """The trainer flags ``tokens`` set (destinations, abbreviations and ``--flag=value`` resolved as the trainer
    resolves them) and their ``--model-kwargs``; values are checked later, with the whole command."""
    probe = train_parser()
    for action in probe._actions:
        action.required = False
        if not isinstance(action, ParseKwargs):
            action.type = action.choices = None
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # -h would print the trainer's help and exit mid-check
            parsed, extras = probe.parse_known_args(tokens)
    except UserError as e:
        raise UserError(f"--train-args: {e}") from None
    except SystemExit:
        raise UserError("--train-args asks for the trainer's help; read it with python -m timm_rollout.train "
                        "--help") from None
    if extras:
        raise UserError(f"--train-args: unrecognized training flags {' '.join(extras)}; see python -m "
                        "timm_rollout.train --help")
    return probe.given, dict(parsed.model_kwargs)


def check_train_args(args: argparse.Namespace) -> None:
    """Parse-time checks of ``--train-args``: it must split as a shell would, set none of the flags the study sets
    for every run (:data:`STUDY_SETS`, the arms' pooling keys of ``--model-kwargs``), and give every arm's training
    command values the trainer accepts."""
    try:
        tokens = shlex.split(args.train_args)
    except ValueError as e:
        raise UserError(f"--train-args {args.train_args!r} does not split as shell words ({e}); balance its "
                        "quotes") from None
    given, model_kwargs = _train_flags(tokens)
    for dest, fix in STUDY_SETS.items():
        if dest in given:
            raise UserError(f"--train-args sets --{dest.replace('_', '-')}, which the study sets itself; {fix}")
    for key in model_kwargs:
        if key.startswith(ARM_KWARGS):
            raise UserError(f"--train-args sets --model-kwargs {key}, which defines an arm's pooling; choose the "
                            "pooling with --arms")
    short = [t.split("=", 1)[0] for t in tokens if t.startswith("--model-k") and t.split("=", 1)[0] != "--model-kwargs"]
    if short:  # merge_model_kwargs would miss it, and the arm's own list would replace it
        raise UserError(f"--train-args: write {short[0]} out as --model-kwargs; the study merges it with each arm's "
                        "own")
    for arm in args.arms:
        output = str(Path(args.output) / "runs" / f"{arm}-s{{seed}}")
        try:
            train_parser().parse_args(train_command(args, arm, args.seeds, output))
        except UserError as e:
            raise UserError(f"arm {arm} would not train: {e} (check --train-args)") from None


def train_command(args: argparse.Namespace, arm: str, seeds: Sequence[int], output: str) -> list[str]:
    """The ``timm_rollout.train`` flags that train (or resume) ``arm``'s runs of ``seeds`` into ``output``."""
    model, kwargs, flags = arm_model(args.model, arm)
    cmd = ["--model", model, "--dataset", args.dataset, "--epochs", str(args.epochs), "--seed", *map(str, seeds),
           "--output", output, "--resume", "--device", args.device,
           *merge_model_kwargs(shlex.split(args.train_args), kwargs), *flags]
    if args.max_train_samples is not None:
        cmd += ["--max-train-samples", str(args.max_train_samples)]
    return cmd


def _run(cmd: list[str], threads: int | None) -> None:
    """Run one step; ``threads`` caps its torch/OpenMP threads when runs go side by side."""
    print("+ " + shlex.join(cmd) + "\n", end="", flush=True)  # one write: jobs print from several threads
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(cmd, check=False, env=env)
    if done.returncode != 0:
        raise UserError(f"step failed (exit {done.returncode}): {shlex.join(cmd)}; fix it and re-run the study "
                        "command, finished runs are kept")


def job_devices(device: str, jobs: int) -> list[str]:
    """The ``--device`` of each of ``jobs`` side-by-side runs: round-robin over the visible GPUs when there are
    several and ``device`` is ``auto`` or ``cuda``; otherwise ``device`` for all (they share it)."""
    count = torch.cuda.device_count() if device in ("auto", "cuda") and torch.cuda.is_available() else 0
    return [f"cuda:{i % count}" for i in range(jobs)] if count > 1 else [device] * jobs


def _check_identity(args: argparse.Namespace, out: Path) -> tuple[list[str], list[int], list[str]]:
    """The folder remembers the flags that define the study; once one of its runs has saved an epoch (a resumed
    run keeps its own settings) or finished, a re-run with other values is refused; before that, the new values
    replace the recorded ones, so a mistyped first command can be corrected. Arms and seeds are not part of it:
    they accumulate in ``study.json``, so a later command can add some. Returns the folder's arms, seeds and every
    distinct command run on it."""
    path = out / STUDY_FILE
    wanted = {k: getattr(args, k) for k in IDENTITY}
    arms, seeds, commands = set(args.arms), set(args.seeds), []
    typed = args.interaction is not None
    if path.exists():
        saved = json.loads(path.read_text(encoding="utf-8"))
        diff = [f"--{k.replace('_', '-')} {saved['identity'].get(k)!r} (now {v!r})" for k, v in wanted.items()
                if saved["identity"].get(k) != v]
        trained = any(any((out / "runs").glob(f"*/{name}")) for name in (SUMMARY_FILE, RESUME_FILE))
        if diff and trained:
            raise UserError(f"{out} holds a study run with {', '.join(diff)}; repeat those flags or use a new --output")
        if diff:
            print(f"= {out}: no run trained with {', '.join(diff)}; the new settings replace them", flush=True)
        else:
            arms |= set(saved.get("arms", ()))
            seeds |= set(saved.get("seeds", ()))
            commands = saved.get("commands", [saved["command"]] if "command" in saved else [])
        _remember(args, saved, out)
    check_interaction(args, out, typed)
    commands += [] if args.command in commands else [args.command]
    write_json(path, {"identity": wanted, "arms": [a for a in ARMS if a in arms], "seeds": sorted(seeds),
                      "commands": commands, **{k: getattr(args, k) for k in REMEMBERED}})
    return [a for a in ARMS if a in arms], sorted(seeds), commands


def _remember(args: argparse.Namespace, saved: dict[str, Any], out: Path) -> None:
    """``args`` takes the report settings the folder recorded (:data:`REMEMBERED`) where the command left them
    out; one given otherwise is refused."""
    for key in REMEMBERED:
        was, now = saved.get(key), getattr(args, key)
        was = (was,) if key == "also_eval" and isinstance(was, str) else was  # recorded as one name before lists
        was, now = (tuple(v) if isinstance(v, list) else v for v in (was, now))
        flag = f"--{key.replace('_', '-')}"
        if now is not None and was is not None and now != was:
            shown = (" " if key == "also_eval" else ":").join(was) if isinstance(was, tuple) else was
            raise UserError(f"{out} was run with {flag} {shown}; repeat it, or leave {flag} out to keep it")
        if now is None:
            setattr(args, key, list(was) if key == "also_eval" and was is not None else was)


def check_interaction(args: argparse.Namespace, out: Path, typed: bool) -> None:
    """``--interaction FOLDER`` names a study of the same recipe (:data:`SAME_RECIPE`) on another data set, and
    the comparison to set against it is ``--primary``'s; checked before anything is recorded. ``typed``: the flag
    is on this command (else the folder remembered it)."""
    if args.interaction is None:
        return
    other = Path(args.interaction)
    given = "" if typed else f" (--interaction as {out / STUDY_FILE} remembers it, read from the current directory)"
    if args.primary is None:
        raise UserError("--interaction sets the primary comparison of two studies against each other; add "
                        "--primary BASE:ARM")
    if other.resolve() == out.resolve():
        raise UserError("--interaction names this study's own --output; name the study of the same recipe on "
                        "another data set")
    try:
        saved = json.loads((other / STUDY_FILE).read_text(encoding="utf-8"))["identity"]
    except (FileNotFoundError, NotADirectoryError):
        raise UserError(f"{other} holds no {STUDY_FILE}{given}; name a folder written by scripts/study.py "
                        "--output") from None
    except (json.JSONDecodeError, KeyError, TypeError):
        raise UserError(f"{other / STUDY_FILE} is not a study record{given}; name a folder written by "
                        "scripts/study.py --output") from None
    diff = [f"--{k.replace('_', '-')} {saved.get(k)!r} (here {getattr(args, k)!r})" for k in SAME_RECIPE
            if saved.get(k) != getattr(args, k)]
    if diff:
        raise UserError(f"{other} was run with {', '.join(diff)}{given}; an interaction needs the same recipe on "
                        "another --dataset")
    there = data_fingerprints(other)
    here = (data_fingerprints(out) or {load_image_set(args.dataset, "test").fingerprint}) if there else set()
    if saved.get("dataset") == args.dataset or here & there:
        raise UserError(f"{other} is a study of the same data set as this one{given}; an interaction needs a study "
                        "on another --dataset")


def data_fingerprints(folder: Path) -> set[str]:
    """The fingerprints of the data a study folder's evaluations read (its own ``eval/``, not ``--also-eval``'s)."""
    records = (json.loads(path.read_text(encoding="utf-8")) for path in folder.glob(f"eval/*/{RESULTS_FILE}"))
    return {found[0] for found in map(evaluated_images, records) if found is not None and found[0] is not None}


def merge_model_kwargs(argv: Sequence[str], extra: Sequence[str]) -> list[str]:
    """``argv`` with its ``--model-kwargs`` lists and ``extra`` merged into one trailing ``--model-kwargs``: timm's
    ``ParseKwargs`` keeps only the last occurrence. A key of ``extra`` overrides the same key of ``argv``."""
    rest: list[str] = []
    pairs: list[str] = []
    collecting = False
    for token in argv:
        if token == "--model-kwargs":
            collecting = True
        elif token.startswith("--model-kwargs="):
            pairs.append(token.split("=", 1)[1])
            collecting = False
        elif collecting and not token.startswith("-"):
            pairs.append(token)
        else:
            collecting = False
            rest.append(token)
    merged = {pair.split("=", 1)[0]: pair for pair in [*pairs, *extra]}
    return [*rest, "--model-kwargs", *merged.values()] if merged else rest


def train_runs(args: argparse.Namespace, arm: str, seeds: Sequence[int], runs: dict[tuple[str, int], Path]) -> None:
    """Train the runs of ``arm`` for ``seeds`` in one trainer process (``--seed`` several, data loaded once), or
    resume them; finished runs (summary.json) are left alone."""
    todo = [seed for seed in seeds if not (runs[arm, seed] / SUMMARY_FILE).exists()]
    for seed in (s for s in seeds if s not in todo):
        print(f"= {runs[arm, seed]} finished, skipped")
    if not todo:
        return
    output = str(runs[arm, todo[0]].parent / f"{arm}-s{{seed}}")
    _run([sys.executable, "-m", "timm_rollout.train", *train_command(args, arm, todo, output)], args.threads)


def eval_run(args: argparse.Namespace, model: str, seed: int, run: Path, folder: Path, pool: str | None = None,
             dataset: str | None = None) -> None:
    """Evaluate one finished run (read out with ``pool``, default its own) unless ``folder`` already holds results
    for these exact weights (then only what ``harness.diagnose`` adds is added, when it is missing). ``dataset``: on
    that data set's test split instead of the study's (``--also-eval``: no k-NN bank, no faithfulness)."""
    results = folder / RESULTS_FILE
    if results.exists():
        saved = json.loads(results.read_text(encoding="utf-8"))
        if saved["model"].get("sha256") == sha256_file(run / WEIGHTS_FILE):
            if outdated(saved):  # evaluated before the diagnostics, mask metrics or content hashes: add just those
                _run([sys.executable, "-m", "harness.diagnose", str(folder), "--device", args.device], args.threads)
            print(f"= {folder} evaluated, skipped")
            return
    cmd = [sys.executable, "-m", "harness.eval", "--model", model, "--checkpoint", str(run), "--dataset",
           dataset or args.dataset, "--output", str(folder), "--seed", str(seed), "--device", args.device]
    if pool:
        cmd += ["--pool", pool]
    if args.eval_per_class is not None:
        cmd += ["--per-class", str(args.eval_per_class)]
    if dataset is None:
        cmd += ["--bank-split", "train"]
        if args.bank_per_class is not None:
            cmd += ["--bank-per-class", str(args.bank_per_class)]
        if args.faithfulness_images:
            cmd += ["--faithfulness", "--faithfulness-images", str(args.faithfulness_images)]
    _run(cmd, args.threads)


def _git(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True, check=False)


def check_commit(out: Path) -> None:
    """``--commit`` needs ``out`` inside a git work tree whose ``.gitignore`` lets the run weights in."""
    probe = out.resolve()
    while not probe.exists():
        probe = probe.parent
    inside = _git(probe, "rev-parse", "--is-inside-work-tree")
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        raise UserError(f"--commit needs --output inside a git work tree, and {out} is not; use a folder of the "
                        "repository such as results/cifar10-cpu")
    weights = out.resolve() / "runs" / "cls-s0" / WEIGHTS_FILE
    if _git(probe, "check-ignore", "-q", str(weights)).returncode == 0:
        raise UserError(f"git ignores the weights written under {out} (.gitignore); use --output results/<name>")


def commit_paths(paths: Sequence[Path], message: str, *, attempts: int = 60, wait: float = 10.0) -> bool:
    """``git add`` and commit exactly ``paths`` (other staged changes stay staged); False when nothing changed.

    A repository busy with other work (another process's index lock, a merge in progress) is waited for, up to
    ``attempts`` tries ``wait`` seconds apart, so a long study never dies of a concurrent ``git commit``.
    """
    files = [str(p.resolve()) for p in paths]
    cwd = Path(files[0]).parent
    for attempt in range(attempts):
        with _GIT:
            added = _git(cwd, "add", "--", *files)
            if added.returncode == 0 and _git(cwd, "diff", "--cached", "--quiet", "--", *files).returncode == 0:
                return False
            done = added if added.returncode else _git(cwd, "commit", "--quiet", "-m", message, "--only", "--", *files)
        error = (done.stderr or done.stdout).strip()
        if done.returncode == 0 or not any(s in error for s in _GIT_BUSY) or attempt == attempts - 1:
            break
        time.sleep(wait)
    if done.returncode != 0:
        raise UserError(f"git could not commit {', '.join(files)}: {error}; fix the repository and re-run the study "
                        "command, finished runs are kept")
    print(f"+ git commit: {message}\n", end="", flush=True)
    return True


def _commit_message(arm: str, seed: int, folder: Path, posthoc: Sequence[str]) -> str:
    metrics = json.loads((folder / RESULTS_FILE).read_text(encoding="utf-8"))["metrics"]
    shown = ", ".join(f"{m} {metrics[m]:.4f}" for m in COMMIT_METRICS if metrics.get(m) is not None)
    extra = f"; post-hoc readouts {', '.join(posthoc)}" if posthoc else ""
    return f"study: {arm} seed {seed} ({shown}{extra})"


def run_arm(args: argparse.Namespace, arm: str, seeds: Sequence[int], runs: dict[tuple[str, int], Path],
            evals: dict[tuple[str, int], Path]) -> None:
    """Train one or more runs of ``arm`` (one trainer process), then evaluate each (for ``cls`` also its post-hoc
    readouts) and commit each on its own when asked."""
    train_runs(args, arm, seeds, runs)
    model = arm_model(args.model, arm)[0]
    for seed in seeds:
        run = runs[arm, seed]
        (run / RESUME_FILE).unlink(missing_ok=True)  # a finished run never resumes: its state would weigh on git
        eval_run(args, model, seed, run, evals[arm, seed])
        posthoc = [name for name in POSTHOC if arm == "cls"]
        for name in posthoc:
            eval_run(args, model, seed, run, evals[name, seed], pool=POSTHOC[name])
        also = [(name, dataset, also_folder(dataset, args.output, name, seed)) for dataset in args.also_eval or ()
                for name in (arm, *posthoc)]
        for name, dataset, folder in also:
            eval_run(args, model, seed, run, folder, pool=POSTHOC.get(name), dataset=dataset)
        if args.commit:
            commit_paths([run, evals[arm, seed], *(evals[name, seed] for name in posthoc), *(f for *_, f in also)],
                         _commit_message(arm, seed, evals[arm, seed], [POSTHOC[name] for name in posthoc]))


def also_folder(dataset: str, output: str | Path, arm: str, seed: int) -> Path:
    """Where ``--also-eval`` puts the evaluation of ``arm``'s seed on ``dataset``:
    ``<output>/eval-<data set folder name>/<arm>-s<seed>``."""
    return Path(output) / f"eval-{Path(dataset).name}" / f"{arm}-s{seed}"


def packed(todo: Sequence[tuple[str, int]], pack: int) -> list[tuple[str, list[int]]]:
    """``todo`` (arm, seed) as jobs of up to ``pack`` seeds of one arm, in the order of each job's first run."""
    jobs: list[tuple[str, list[int]]] = []
    for arm, seed in todo:
        open_job = next((j for j in jobs if j[0] == arm and len(j[1]) < pack), None)
        if open_job is None:
            jobs.append((arm, [seed]))
        else:
            open_job[1].append(seed)
    return jobs


def run_all(args: argparse.Namespace, todo: Sequence[tuple[str, int]], runs: dict[tuple[str, int], Path],
            evals: dict[tuple[str, int], Path]) -> None:
    """Run ``todo`` (arm, seed) in order, as jobs of up to ``--pack`` seeds of one arm, ``--jobs`` side by side; a
    job holds one device of :func:`job_devices` while it runs, so with several GPUs no two jobs share one."""
    slots: queue.Queue[str] = queue.Queue()
    for device in job_devices(args.device, args.jobs):
        slots.put(device)

    def job(arm: str, seeds: list[int]) -> None:
        device = slots.get()
        try:
            run_arm(argparse.Namespace(**{**vars(args), "device": device}), arm, seeds, runs, evals)
        finally:
            slots.put(device)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda pair: job(*pair), packed(todo, args.pack)))


def means_table(groups: dict[str, Group], metrics: Sequence[str]) -> str:
    """Markdown table: each metric's mean ± sample std over seeds, one column per arm."""
    lines = ["| metric | " + " | ".join(f"{arm} (n={g.n})" for arm, g in groups.items()) + " |",
             "|---|" + "---:|" * len(groups)]
    for m in metrics:
        if all(g.mean.get(m) is None for g in groups.values()):
            continue
        cells = ["-" if g.mean.get(m) is None else f"{g.mean[m]:.4f}" if g.std.get(m) is None
                 else f"{g.mean[m]:.4f} ± {g.std[m]:.4f}" for g in groups.values()]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def delta_tables(groups: dict[str, Group], metrics: Sequence[str], primary: tuple[str, str] | None = None,
                 primary_metric: str = PRIMARY) -> str:
    """Paired statistics of every arm against each of ``REFERENCES`` the study has (``cls``, ``gap``,
    ``rollout``), one table per comparison; a pair already shown against an earlier reference is not repeated.
    ``primary`` (base, arm): that comparison first, the only one whose top-1 is marked primary (the others' top-1
    rows read "uncorrected"). ``primary_metric``: the metric of the primary test (top-1, or the dose contrast)."""
    pairs = [(ref, arm) for ref in REFERENCES if ref in groups for arm in groups
             if arm not in REFERENCES[: REFERENCES.index(ref) + 1]]
    if primary is not None and all(a in groups for a in primary):
        pairs = [primary, *[p for p in pairs if p != primary and p != primary[::-1]]]
    parts = []
    for base, arm in pairs:
        first = primary is not None and (base, arm) == primary
        label = "primary" if primary is None or first else "uncorrected"
        parts += [f"### {arm} - {base}" + (" (the primary comparison)" if first else ""), "",
                  render_comparison(compare_groups(groups[base], groups[arm], metrics, primary=primary_metric),
                                    primary=primary_metric, primary_label=label), ""]
    return "\n".join(parts)


CURVE_PANELS = {  # log.csv column -> (y label, title); the last only when some run logged it (rollout pooling)
    "train_loss": ("train cross-entropy loss", "Training loss"),
    "eval_top1": ("eval top-1 accuracy (%)", "Eval top-1 accuracy"),
    "rollout_effective_patches": ("effective patches of the rollout weights", "Rollout pooling: effective patches"),
}


def plot_training_curves(logs: dict[str, dict[int, list[dict[str, float]]]], path: Path, title: str) -> Path:
    """Train loss, eval top-1 and (rollout-pooled arms) the effective patches of their pooling weights per epoch:
    one colour per arm, a thin line per seed and a bold mean over seeds (an arm of one seed: its one bold line),
    one legend entry per arm below the axes (readable with any number of seeds), ticks on whole epochs."""
    keys = [k for k in CURVE_PANELS if k != "rollout_effective_patches"
            or any(k in r for per_seed in logs.values() for rows in per_seed.values() for r in rows)]
    fig = Figure(figsize=(5.5 * len(keys), 4.6))
    axes = dict(zip(keys, fig.subplots(1, len(keys)), strict=True))
    for arm, (short, per_seed) in enumerate(logs.items()):
        colour = f"C{arm}"  # one colour per arm, any number of arms
        runs = [rows for _, rows in sorted(per_seed.items())]
        for key, ax in axes.items():
            logged = [[r for r in rows if key in r] for rows in runs]
            length = min(len(rows) for rows in logged)
            if length == 0:
                continue
            for rows in logged if len(runs) > 1 else []:
                ax.plot([r["epoch"] for r in rows], [r[key] for r in rows], color=colour, lw=0.8, alpha=0.35)
            columns = zip(*[[r[key] for r in rows[:length]] for rows in logged], strict=True)
            mean = [sum(col) / len(col) for col in columns]
            ax.plot([r["epoch"] for r in logged[0][:length]], mean, color=colour, lw=2,
                    label=f"{short} ({'mean of ' if len(runs) > 1 else ''}{seeds_phrase(len(runs))})")
    for key, ax in axes.items():
        ax.set(ylabel=CURVE_PANELS[key][0], title=CURVE_PANELS[key][1])
        epoch_axis(ax)
        ax.grid(alpha=0.3)
    handles, labels = axes["eval_top1"].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8, frameon=False)
    several = any(len(per_seed) > 1 for per_seed in logs.values())
    fig.suptitle(f"{title} (thin lines: single seeds)" if several else title)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return save_figure(fig, path)


def plot_side_by_side(args: argparse.Namespace, panels: dict[str, tuple[str, Path, str | None]], seed: int,
                      path: Path) -> Path:
    """The same test images under every arm (``arm -> (model, run folder, pooling or None for its own)``): the
    attention rollout and gradient-weighted rollout of the readout the arm classifies from, as weight x number of
    patches (1 = uniform) with one colour range for the whole grid."""
    data = load_image_set(args.dataset, "test", boxes=True)
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(data.labels), generator=gen)[: args.heatmaps].sort().values
    images, labels = data.images[pick], data.labels[pick]
    found = {}
    for short, (name, run, pool) in panels.items():
        model, info = load_model(name, run)
        set_pool(model, pool)
        found[short] = saliency_maps(model, normalize(images, info["mean"], info["std"]), device=torch.device("cpu"))
    names = data.class_names
    maps, preds = {}, {}
    for short, key in ((short, key) for short in panels for key in ("rollout", "gradient_rollout")):
        column = f"{short}: {MAP_LABELS[key]} (readout {found[short].readout})"
        maps[column] = found[short].maps[key]
        preds[column] = [names[int(j)] for j in found[short].logits.argmax(dim=1)]
    return plot_heatmaps(images, maps, [names[int(y)] for y in labels], preds, path,
                         f"Same test images under every arm, maps of each arm's own readout (seed {seed})",
                         data.boxes[pick] if data.boxes is not None else None, grid=next(iter(found.values())).grid)


def tested_metrics(extra: Sequence[str]) -> list[str]:
    """The metrics the paired tables test: the harness metrics, ``extra`` and the localisation scores; the
    random-order baseline (no hypothesis), the pooling diagnostics (they describe the weights), the chance levels
    and the descriptive localisation rows are shown, not tested."""
    tested = [m for m in (*METRICS, *extra) if not m.startswith("random ")]
    return tested + [m for m in LOCALISATION if m not in (*CHANCE_LEVELS, *DESCRIPTIVE)]


def _report_tables(groups: dict[str, Group], extra: list[str], primary: tuple[str, str] | None,
                   primary_metric: str = PRIMARY) -> list[str]:
    """The report's statistics: means per arm, paired differences, and the original study's geometry."""
    shown = [*METRICS, *POOLING_DIAGNOSTICS, *extra]
    tested = tested_metrics(extra)
    lines = ["## Metrics per arm", "", "Mean ± sample std over seeds. Learning-curve rows come from each run's "
             "`log.csv` (eval top-1 on the test split after every epoch; trained arms only): its mean over all "
             "epochs (the area under the curve, higher = learns faster) and its value after a quarter of the epochs. "
             "Faithfulness rows are `<map> <quantity>` from "
             "`results.json[\"faithfulness\"]` (deletion AUC: lower is better; insertion AUC: higher is better; "
             "`random` is the random-order baseline, shown but not tested). `rollout_effective_patches` and "
             "`rollout_cosine_to_mean` describe each backbone's rollout pooling weights (see Pooling diagnostics); "
             "they are shown, not tested.", "", means_table(groups, shown), ""]
    if len(groups) > 1:
        named = "" if primary is None else (
            f" The primary comparison, named before the runs, is {primary[1]} - {primary[0]} in {primary_metric} (the "
            f"first table); the {primary_metric} rows of the other comparisons are secondary, and uncorrected too.")
        if primary_metric != PRIMARY:
            named += f" With several --also-eval data sets the primary metric is {primary_metric}, not {PRIMARY}."
        lines += ["## Paired differences", "", STATISTICS_NOTE + named, "",
                  delta_tables(groups, tested, primary, primary_metric)]
    if any(g.mean.get(m) is not None for g in groups.values() for m in ORIGINAL_METRICS):
        lines += ["## The original study's geometry", "",
                  "Its mixed units (Euclidean intra, cosine-distance inter), only to set these runs beside its table; "
                  "the ratio shrinks when a layout shrinks, so it is not tested.", "",
                  means_table(groups, ORIGINAL_METRICS), "", ORIGINAL_STUDY, ""]
    return lines


POOLING_NOTE = (
    "Per image, the rollout pooling weights of each arm's backbone (the [CLS] row of the attention rollout over "
    "the patches, renormalised; with the arm's own rollout options, and for arms that do not pool by rollout the "
    "weights rollout pooling would use post hoc): top, the distribution of their effective number of patches "
    "exp(entropy) over the test images of all seeds (equal to the number of patches for uniform weights, the "
    "plain patch mean, and 1 for a single patch); bottom, the weights averaged over the images, as weight x "
    "number of patches (1 = uniform), one colour range. Rollout-pooled runs log both diagnostics per epoch in "
    "their `log.csv`.")


def pooling_table(results: dict[tuple[str, int], dict[str, Any]], arms: Sequence[str], seeds: Sequence[int]) -> str:
    """Where the uniformity comes from, per trained arm (mean ± std over seeds of the per-image means): the
    effective patches of the arm's rollout pooling weights, of the sharper rollout variants on the same
    attention, and of each layer's own [CLS] attention over the patches."""
    records = {a: [results[a, s]["pooling_diagnostics"] for s in seeds] for a in arms}
    records = {a: r for a, r in records.items() if all(x and "layer_effective_patches" in x for x in r)}
    if not records:
        return ""
    first = next(iter(records.values()))[0]
    variants, depth = list(first["rollout_variants"]), len(first["layer_effective_patches"])
    head = ["arm", "rollout", *[f"rollout {v}" for v in variants], *[f"layer {i + 1} [CLS]" for i in range(depth)]]

    def cell(values: Sequence[float]) -> str:
        return f"{np.mean(values):.1f} ± {np.std(values, ddof=1):.1f}" if len(values) > 1 else f"{values[0]:.1f}"

    rows = []
    for arm, recs in records.items():
        own = [results[arm, s]["metrics"]["rollout_effective_patches"] for s in seeds]
        rows.append([arm, cell(own), *[cell([r["rollout_variants"][v] for r in recs]) for v in variants],
                     *[cell([r["layer_effective_patches"][i] for r in recs]) for i in range(depth)]])
    return "\n".join("| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *rows])


LAYERS_NOTE = (
    "Effective patches (out of the number of patches) of each arm's rollout pooling weights (`rollout`: its "
    "own options), of sharper rollouts of the same attention (`max`/`min`: head fusion, `discard0.9`: the weakest "
    "90% of patch-to-patch attention zeroed) and of each layer's own [CLS] attention over the patches (mean over "
    "heads, renormalised). Mean ± std over seeds of the means over the test images (`results.json`'s "
    "`pooling_diagnostics`).")


def backbone(arm: str) -> str:
    """The trained arm whose run ``arm`` reads: itself, or ``cls`` for a post-hoc readout."""
    return arm if arm in ARMS else "cls"


def report_scope(named: Sequence[str], arms: Sequence[str], seeds: Sequence[int],
                 evals: dict[tuple[str, int], Path]) -> tuple[list[str], list[int]]:
    """The report's seeds: those every ``named`` arm (the command's ``--arms``) has finished, post-hoc readouts
    of ``cls`` included; and its arms: the named ones plus every other arm of the folder finished for all those
    seeds. So ``--arms cls gap rollout`` reports on those three while a fourth arm of the folder is unfinished."""
    def with_posthoc(trained: Sequence[str]) -> list[str]:
        return [a for a in ARMS if a in trained] + [a for a in POSTHOC if "cls" in trained]

    done = [s for s in seeds if all((evals[a, s] / RESULTS_FILE).exists() for a in with_posthoc(named))]
    shown = [a for a in with_posthoc(arms) if all((evals[a, s] / RESULTS_FILE).exists() for s in done)]
    return shown, done


def _figures(args: argparse.Namespace, out: Path, arms: list[str], seeds: list[int],
             runs: dict[tuple[str, int], Path], results: dict[tuple[str, int], dict[str, Any]]) -> bool:
    """Training curves of the trained arms, their pooling diagnostics (when every seed's evaluation has them;
    returns whether that figure was drawn) and the heatmap grid of every arm, on the first seed's test images."""
    trained = [a for a in arms if a in ARMS]
    logs = {a: {seed: read_log(runs[a, seed] / LOG_FILE) for seed in seeds} for a in trained}
    plot_training_curves(logs, out / CURVES_FILE, f"Training on {args.dataset}, {args.epochs} epochs")
    records = {a: [results[a, s].get("pooling_diagnostics") for s in seeds] for a in trained}
    records = {a: r for a, r in records.items() if all(r)}
    if records:
        plot_pooling_diagnostics(records, out / POOLING_FILE, f"Rollout pooling weights of each arm's backbone "
                                 f"({args.dataset} test split; for non-rollout arms, the weights rollout would pool "
                                 "with post hoc)")
    first = seeds[0]
    if args.heatmaps:
        panels = {a: (arm_model(args.model, backbone(a))[0], runs[backbone(a), first], POSTHOC.get(a)) for a in arms}
        plot_side_by_side(args, panels, first, out / HEATMAPS_FILE)
    else:  # --heatmaps 0: no grid, and none left from an earlier render
        (out / HEATMAPS_FILE).unlink(missing_ok=True)
    return bool(records)


def pick_seed(logs: dict[int, list[dict[str, float]]]) -> int:
    """The seed whose run ended with the lowest training loss (last ``log.csv`` row; ties: the lowest seed): a
    pick that never looks at the test set."""
    return min(sorted(logs), key=lambda seed: logs[seed][-1]["train_loss"])


PICK_RULE = "the lowest final training loss (last epoch of log.csv); the test set played no part in the pick"


def export_picked(args: argparse.Namespace, out: Path, arms: Sequence[str], seeds: Sequence[int],
                  runs: dict[tuple[str, int], Path], evals: dict[tuple[str, int], Path]) -> dict[str, int]:
    """One seed of each trained arm (:func:`pick_seed`) as a Hub upload folder ``hub/<arm>`` with its model card,
    which states the rule, as ``scripts/push_to_hub.py --dry-run`` writes it. Returns arm -> exported seed."""
    picked = {}
    for arm in (a for a in arms if a in ARMS):
        picked[arm] = seed = pick_seed({s: read_log(runs[arm, s] / LOG_FILE) for s in seeds})
        selection = f"seed {seed} of seeds {', '.join(map(str, seeds))} of this study arm, the one with {PICK_RULE}"
        write_upload_folder(runs[arm, seed], out / HUB_DIR / arm, hub_repo_id(args, arm), evals[arm, seed],
                            selection=selection)
    return picked


def hub_repo_id(args: argparse.Namespace, arm: str) -> str:
    """Repo id in the exported model card: ``<org>/vit-tiny-<data set folder name>-<arm>``."""
    return f"{args.hub_org}/vit-tiny-{Path(args.dataset).name}-{arm}"


def write_report(args: argparse.Namespace, out: Path, scope: tuple[list[str], list[int]], commands: list[str],
                 runs: dict[tuple[str, int], Path], evals: dict[tuple[str, int], Path]) -> Path:
    """report.md over the folder's arms and the seeds all of them finished (including runs of earlier commands):
    statistics, curves, cosine matrices, side-by-side heatmaps and the exported checkpoints."""
    arms, seeds = scope
    pairs = [(a, s) for a in arms for s in seeds]
    loaded = load_results([evals[pair] for pair in pairs])
    added = [{**(curve_metrics(runs[pair], args.epochs) if pair[0] in ARMS else {}), **faithfulness_metrics(r),
              **also_metrics(args, *pair, r)} for pair, r in zip(pairs, loaded, strict=True)]
    results = [{**r, "metrics": {**r["metrics"], **more}} for r, more in zip(loaded, added, strict=True)]
    extra = list(dict.fromkeys(m for more in added for m in more))
    shown = [*METRICS, *POOLING_DIAGNOSTICS, *LOCALISATION, *extra, *ORIGINAL_METRICS]
    groups = {g.label: g for g in summarise(results, shown, label=lambda r: run_short(r["path"]))}
    pooling = _figures(args, out, arms, seeds, runs, dict(zip(pairs, loaded, strict=True)))
    exported = export_picked(args, out, arms, seeds, runs, evals)
    trained = [(a, s) for a in arms if a in ARMS for s in seeds]
    minutes = sum(float(json.loads((runs[k] / SUMMARY_FILE).read_text(encoding="utf-8"))["wall_seconds"])
                  for k in trained) / 60
    lines = [
        f"# Pooling arms ({', '.join(arms)}) on {args.dataset}", "",
        "Commands run on this folder:", "", *[f"- `{c}`" for c in commands], "",
        f"{len(seeds)} seed(s) ({', '.join(map(str, seeds))}), {args.epochs} epoch(s) per run, the same "
        f"recipe for every arm (only the pooling differs); {minutes:.1f} training minutes in all. "
        "`cls-posthoc-*` are the `cls` runs read out with another pooling, untrained (`harness.eval --pool`). "
        "Metrics are from `python -m harness.eval` on the test split with the train split as k-NN bank and "
        "linear-probe training set (definitions in harness/README.md).", "",
        *data_section(args, out),
        *notes_section(out),
        *_report_tables(groups, extra, args.primary, primary_metric(args)),
        *localisation_section(out, groups, seeds, results),
        *dose_report(args, seeds),
        *interaction_section(args, out, dict(zip(pairs, results, strict=True)), tested_metrics(extra)),
        "## Training curves", "", "![training curves](curves.png)", "",
        *(["## Pooling diagnostics", "", POOLING_NOTE, "", f"![pooling diagnostics]({POOLING_FILE})", "",
           LAYERS_NOTE, "", pooling_table(dict(zip(pairs, loaded, strict=True)), [a for a in arms if a in ARMS],
                                          seeds), ""]
          if pooling else []),
        f"## Cosine similarity of class centroids (seed {seeds[0]})", "",
        *[f"![{a}]({evals[a, seeds[0]].relative_to(out)}/cosine_matrix.png)" for a in arms], "",
        *(["## The same test images under every arm", "", "![heatmaps](heatmaps.png)", ""] if args.heatmaps else []),
        "## Shareable checkpoints", "",
        f"One seed of each trained arm, the one with {PICK_RULE}, as a Hub upload folder with its model card "
        "(`scripts/push_to_hub.py --dry-run`); `timm.create_model(\"local-dir:<folder>\", pretrained=True)` "
        "loads it, `scripts/push_to_hub.py <run> --repo-id <id> --eval <eval>` uploads it.", "",
        *[f"- {arm}: `{HUB_DIR}/{arm}` (seed {seed}, repo id `{hub_repo_id(args, arm)}`)"
          for arm, seed in exported.items()], "",
        "## Runs", "",
        "Each run's folders, wall time and the machine and precision it ran on, as its `summary.json` (epochs "
        "trained on each machine: a resumed run may change machines) and `results.json` recorded them.", "",
        *[run_line(args, out, arm, seed, runs[backbone(arm), seed], evals[arm, seed], r) for (arm, seed), r in
          zip(pairs, loaded, strict=True)],
    ]
    return write_text(out / REPORT_FILE, "\n".join(lines) + "\n")


def primary_metric(args: argparse.Namespace) -> str:
    """The metric of the primary test: the dose contrast with several ``--also-eval`` data sets, else top-1."""
    names = [Path(d).name for d in args.also_eval or ()]
    return contrast_metric(names) if len(names) > 1 and args.primary else PRIMARY


def dose_report(args: argparse.Namespace, seeds: Sequence[int]) -> list[str]:
    """The dose section (:mod:`harness.dose`) over the seeds whose primary arms were evaluated on every
    ``--also-eval`` data set; nothing with fewer than two data sets or without ``--primary``."""
    names = [Path(d).name for d in args.also_eval or ()]
    if len(names) < 2 or not args.primary:
        return []
    folders = {(a, s, Path(d).name): also_folder(d, args.output, a, s) for a in args.primary for s in seeds
               for d in args.also_eval}
    done = [s for s in seeds if all((folders[a, s, n] / RESULTS_FILE).is_file() for a in args.primary for n in names)]
    if not done:
        return []
    keys = [k for k in folders if k[1] in done]
    results = dict(zip(keys, load_results([folders[k] for k in keys]), strict=True))
    found = {k: read_predictions(folders[k]) for k in keys}
    same = all(f is not None and (f["index"], f["label"]) == (found[keys[0]]["index"], found[keys[0]]["label"])
               for f in found.values())  # image-level needs every model on the same images, in one order
    hits = {k: (np.asarray(f["predicted"]["top1"]) == np.asarray(f["label"])).astype(np.float64)
            for k, f in found.items()} if same else None
    return dose_section(*args.primary, names, done, results, hits)


def data_section(args: argparse.Namespace, out: Path) -> list[str]:
    """The data sets' cards (a folder's README.md, as scripts/make_cluttered.py writes it): title, and a copy in
    ``out/data/`` (committed with the report: the data sets themselves are not, and are made again from it)."""
    lines = []
    for role, dataset in (("trained and evaluated on", args.dataset),
                          *(("also evaluated on", d) for d in args.also_eval or ())):
        title = data_card_title(dataset) if dataset else None
        if title is not None:
            copy = write_text(out / DATA_DIR / f"{Path(dataset).name}.md",
                              (Path(dataset) / CARD_FILE).read_text(encoding="utf-8"))
            lines.append(f"- {role} `{dataset}` ({title}): its data card, as made, in "
                         f"[`{DATA_DIR}/{copy.name}`]({DATA_DIR}/{copy.name})")
    return ["## Data", "", *lines, ""] if lines else []


def also_metrics(args: argparse.Namespace, arm: str, seed: int, result: dict[str, Any]) -> dict[str, float]:
    """``--also-eval``: the run's top-1 on each other data set's test split and its paired change from the study's
    (e.g. the top-1 a model loses to clutter, when the other set holds the same objects without it); with several,
    also the last minus the first (:func:`harness.dose.contrast_metric`: its paired comparison is the dose
    interaction)."""
    top1 = {folder.parent.name.removeprefix("eval-"): r["metrics"]["top1"]
            for folder, r in zip(*also_results(args, arm, seed), strict=True)}
    found = {f"top1 on {name}": v for name, v in top1.items()}
    found |= {f"top1 on {name} - top1": v - result["metrics"]["top1"] for name, v in top1.items()}
    names = [Path(d).name for d in args.also_eval or ()]
    if len(names) > 1 and names[0] in top1 and names[-1] in top1:
        found[contrast_metric(names)] = top1[names[-1]] - top1[names[0]]
    return found


LOCALISATION_NOTE = (
    "Where each arm pools, against the object's box (`harness.eval` on a data set with a `bbox` column; "
    "definitions in harness/README.md): `pooling_object_mass` is the share of the pooling weights on the box "
    "(mean over the test images of sum_p w_p c_p, c_p the fraction of patch p the box covers), against the chance "
    "level `object_area_fraction` (the same sum for uniform weights); `pooling_weight_inside`/`_outside` the mean "
    "weight x number of patches over the box and over the rest (1 = uniform). The weights are those the arm pools "
    "with: its own rollout weights, the attention of the learned pool (map, mean over heads), uniform for gap, "
    "and the post-hoc rollout row for cls. `<map>_box_mass` and `<map>_pointing` score each saliency map: its mass "
    "on the box and the pointing-game hit rate (its maximum patch inside the box). Where the data set has content "
    "masks (a `mask` column: fill, clutter, object per pixel), `pooling_fill_mass` and `<map>_fill_mass` are the "
    "weight on flat fill, and `content_chance` the object mass of weights that only avoid the fill (each patch by "
    "its share of non-fill pixels): weights that pick the object out of clutter beat `content_chance`, not just "
    "`object_area_fraction`; `pooling_object_share` and `<map>_object_share` are the weight on the object over the "
    "weight on object and clutter, against `object_content_fraction`, the same share for the fill-avoiding weights; "
    "`context_top1` the top-1 with each object replaced by clutter of its own class's canvases (chance: a model "
    "that reads the object, not the context). "
    "The paired tables above test the arms' masses, shares and pointing; the chance levels, the inside/outside "
    "weights (which restate the object mass) and `pooling_effective_patches` are shown, not tested; gap pools with "
    "uniform weights, so an arm's `pooling_object_mass` against gap is its excess over uniform weights, with its "
    "interval. A map explains the arm's own readout, so the maps of patch-mean and rollout readouts start from "
    "near-uniform weights over the patches (gradient-weighted rollout most of all): their box mass compares "
    "readouts as much as localisation.")


# the same for every arm: shown, not tested
CHANCE_LEVELS = ("object_area_fraction", "content_chance", "position_prior_mass", "object_content_fraction",
                 "pointing_chance")
# restate the object mass (the mean weight over the box and over the rest) or describe the weights: shown only
DESCRIPTIVE = ("pooling_weight_inside", "pooling_weight_outside", "pooling_effective_patches")


def localisation_section(out: Path, groups: dict[str, Group], seeds: Sequence[int],
                         results: Sequence[dict[str, Any]]) -> list[str]:
    """The localisation table and figure (pooling weight inside against outside the box), when the evaluations
    scored boxes."""
    if not any(r["metrics"].get("pooling_object_mass") is not None for r in results):
        return []
    values = {arm: [(i, o) for i, o in zip(g.values.get("pooling_weight_inside", []),
                                           g.values.get("pooling_weight_outside", []), strict=True)
                    if i is not None and o is not None] for arm, g in groups.items()}
    plot_object_weights(values, out / LOCALISATION_FILE, f"Pooling weight on the object's box against the rest "
                        f"(test split, seeds {' '.join(map(str, seeds))})")
    return ["## Localisation", "", LOCALISATION_NOTE, "", means_table(groups, LOCALISATION), "",
            *null_excess_table(groups), f"![pooling weight inside and outside the box]({LOCALISATION_FILE})", ""]


# (arm's metric, its null): does an arm's weight on the object beat weights that only avoid the empty canvas?
NULL_EXCESS = (("pooling_object_mass", "content_chance"), ("pooling_object_share", "object_content_fraction"))


def null_excess_table(groups: dict[str, Group]) -> list[str]:
    """Per arm, each of :data:`NULL_EXCESS` minus its null, per seed (both from the same evaluation): mean with
    its 95% t-interval over the seeds; nothing where no evaluation has content masks."""
    rows = []
    for arm, g in groups.items():
        cells = []
        for metric, null in NULL_EXCESS:
            none = [None] * len(g.runs)
            diffs = [v - c for v, c in zip(g.values.get(metric, none), g.values.get(null, none), strict=True)
                     if v is not None and c is not None]
            cells.append(stats.t_interval(diffs) if diffs else None)
        if any(cells):
            shown = [f"{d.mean:+.4f} | {format_ci(d)}" if d else "- | -" for d in cells]
            rows.append(f"| {arm} | {max(d.n for d in cells if d)} | {' | '.join(shown)} |")
    if not rows:
        return []
    head = " | ".join(f"{m} - {n} | 95% CI" for m, n in NULL_EXCESS)
    return ["Against the null of weights that only avoid flat fill (per seed, the arm's value minus the null of "
            "the same evaluation; mean over seeds, 95% t-interval): an interval above 0 picks the object out of "
            "clutter.", "", f"| arm | seeds | {head} |", "|---|---:|---:|---|---:|---|", *rows, ""]


INTERACTION_NOTE = (
    "Whether the primary comparison depends on the data set: per seed, ({arm} - {base} in this study) - ({arm} - "
    "{base} in the other), the same recipe trained and evaluated on the other study's data set; the mean over the "
    "seeds whose {base} and {arm} both studies evaluated (those with the metric), 95% t-interval, p and MDE as in the "
    "paired tables. Secondary, like every comparison but the primary one: the {primary} row is uncorrected, the "
    "p-values of the other metrics are Holm-adjusted together.")


def interaction_section(args: argparse.Namespace, out: Path, here: dict[tuple[str, int], dict[str, Any]],
                        metrics: Sequence[str]) -> list[str]:
    """``--interaction``: the primary comparison here against the same comparison in the other study, per
    metric, paired by seed. ``here``: this study's results (with the metrics the report adds) by (arm, seed)."""
    if args.interaction is None:
        return []
    (base, arm), other = args.primary, Path(args.interaction)
    there = other_results(args, other, [(a, s) for a, s in here if a in (base, arm)])
    seeds = sorted({s for _, s in here if all((a, s) in here and (a, s) in there for a in (base, arm))})
    link = Path(os.path.relpath(other / REPORT_FILE, out)).as_posix()
    lines = [f"## Interaction with `{other}`", "",
             INTERACTION_NOTE.format(arm=arm, base=base, primary=PRIMARY) + f" Its report: [{link}]({link}).", ""]
    same = [f"{a} seed {s}" for a in (base, arm) for s in seeds
            if None not in (found := [evaluated_images(r[a, s]) for r in (here, there)]) and same_images(*found)[0]]
    if not seeds or same:
        return [*lines, f"Not computed: {', '.join(same)} read the same data in both studies; name a study on "
                        "another data set." if same else f"No seed has {base} and {arm} evaluated in both studies "
                        "yet.", ""]
    rows = []
    for metric in metrics:
        value = {(k, r): v[k]["metrics"].get(metric) for r, v in (("here", here), ("there", there)) for k in v}
        paired = [s for s in seeds if all(value.get(((a, s), r)) is not None for a in (base, arm)
                                          for r in ("here", "there"))]
        if paired:
            d_here, d_there = ([value[(arm, s), r] - value[(base, s), r] for s in paired] for r in ("here", "there"))
            rows.append((metric, np.mean(d_here), np.mean(d_there), stats.paired_delta(d_there, d_here)))
    adjusted = iter(stats.holm([d.p for metric, *_, d in rows if metric != PRIMARY]))
    lines += [f"| metric | seeds | {arm} - {base} here | there | interaction | 95% CI | p | p Holm | MDE |",
              "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for metric, d_here, d_there, d in rows:
        holm = "uncorrected" if metric == PRIMARY else format_p(next(adjusted))
        lines.append(f"| {metric} | {d.n} | {d_here:+.4f} | {d_there:+.4f} | {d.mean:+.4f} | {format_ci(d)} | "
                     f"{format_p(d.p)} | {holm} | {format_number(d.mde)} |")
    return [*lines, "", *arm_change_table((base, arm), seeds, here, there)]


CHANGE_METRICS = ("top1", "linear_probe", "knn_bank")  # what the other data set changes in each arm


def arm_change_table(arms: Sequence[str], seeds: Sequence[int], here: dict[tuple[str, int], dict[str, Any]],
                     there: dict[tuple[str, int], dict[str, Any]]) -> list[str]:
    """Per arm and metric of :data:`CHANGE_METRICS`, the other study's value minus this one's, paired by seed
    (each model tested on its own study's data): what this study's data set costs each arm, with its interval."""
    lines = ["Each arm in the other study minus the same arm here, per seed (each trained and tested on its own "
             "study's data; with this study the cluttered one, what clutter costs the arm), mean with 95% "
             "t-interval; secondary, uncorrected.", "",
             "| arm | metric | seeds | here | there | there - here | 95% CI | p | MDE |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for arm in arms:
        for metric in CHANGE_METRICS:
            pairs = [(h, t) for s in seeds if (h := here[arm, s]["metrics"].get(metric)) is not None
                     and (t := there[arm, s]["metrics"].get(metric)) is not None]
            if pairs:
                d = stats.paired_delta(*zip(*pairs, strict=True))
                lines.append(f"| {arm} | {metric} | {d.n} | {np.mean([h for h, _ in pairs]):.4f} | "
                             f"{np.mean([t for _, t in pairs]):.4f} | {d.mean:+.4f} | {format_ci(d)} | "
                             f"{format_p(d.p)} | {format_number(d.mde)} |")
    return [*lines, ""]


def other_results(args: argparse.Namespace, other: Path, pairs: Sequence[tuple[str, int]]
                  ) -> dict[tuple[str, int], dict[str, Any]]:
    """The other study's evaluations of ``pairs`` (arm, seed) that exist, with the metrics this report adds to its
    own (learning curves, faithfulness)."""
    found = {}
    for arm, seed in pairs:
        folder, run = other / "eval" / f"{arm}-s{seed}", other / "runs" / f"{backbone(arm)}-s{seed}"
        if (folder / RESULTS_FILE).is_file():
            result = load_results([folder])[0]
            added = {**(curve_metrics(run, args.epochs) if arm in ARMS and (run / LOG_FILE).is_file() else {}),
                     **faithfulness_metrics(result)}
            found[arm, seed] = {**result, "metrics": {**result["metrics"], **added}}
    return found


def notes_section(out: Path) -> list[str]:
    """The study folder's hand-written ``notes.md`` (what the numbers mean, limits) as the report's "Notes"
    section, or nothing: report.md is rewritten on every render, so prose kept there would be lost."""
    path = out / NOTES_FILE
    return ["## Notes", "", path.read_text(encoding="utf-8").strip(), ""] if path.is_file() else []


def run_line(args: argparse.Namespace, out: Path, arm: str, seed: int, run: Path, evaluation: Path,
             result: dict[str, Any]) -> str:
    """The report's line for one run: its folders, wall times and machines (runs from before machines were
    recorded say so), of training and of each evaluation (the study's, then ``--also-eval``'s)."""
    summary = json.loads((run / SUMMARY_FILE).read_text(encoding="utf-8"))
    machines = "; ".join(f"{m}: {n} epoch{'s' if n != 1 else ''}" for m, n in summary.get("machines", {}).items())
    trained = (f"{summary['wall_seconds'] / 60:.1f} min, {machines or 'machine not recorded'}" if arm in ARMS
               else f"the `{backbone(arm)}` run")
    folders, found = also_results(args, arm, seed)
    evaluated = []
    for folder, record in zip([evaluation, *folders], [result, *found], strict=True):
        env = record["environment"]
        evaluated.append(f"`{folder.relative_to(out)}` ({record['timing']['total'] / 60:.1f} min, "
                         f"{env.get('machine', env['device'])}, {env['dtype']})")
    return (f"- {arm}, seed {seed}: training `{run.relative_to(out)}` ({trained}); evaluation "
            + ", ".join(evaluated))


def also_results(args: argparse.Namespace, arm: str, seed: int) -> tuple[list[Path], list[dict[str, Any]]]:
    """The ``--also-eval`` evaluations of ``arm``'s seed that exist, in the order of the data sets: (folders,
    results)."""
    folders = [also_folder(d, args.output, arm, seed) for d in args.also_eval or ()]
    folders = [f for f in folders if (f / RESULTS_FILE).is_file()]
    return folders, load_results(folders) if folders else []


def run_short(path: str) -> str:
    """Arm of a run or evaluation folder named ``<arm>-s<seed>``."""
    return Path(path).name.rsplit("-s", 1)[0]


def curve_metrics(run: Path, epochs: int) -> dict[str, float]:
    """How fast a trained run learned, from its ``log.csv``: eval top-1 (fraction) averaged over all epochs, and
    after a quarter of them (a post-hoc readout has none: its backbone is a ``cls`` run)."""
    top1 = {int(r["epoch"]): r["eval_top1"] / 100 for r in read_log(run / LOG_FILE)}
    quarter = max(1, round(epochs / 4))
    return {"learning curve mean top-1": sum(top1.values()) / len(top1),
            f"eval top-1 at epoch {quarter}": top1[quarter]}


def faithfulness_metrics(result: dict[str, Any]) -> dict[str, float]:
    """Each saliency map's deletion/insertion AUC and paired score, per removal (``mean`` fill, token ``drop``), as
    metrics of its run (e.g. ``rollout deletion paired (drop)``), averaged and tested like the other metrics."""
    fills = (result.get("faithfulness") or {}).get("fills", {})
    out: dict[str, float] = {}
    for fill, block in fills.items():
        for name, quantities in block["maps"].items():
            for kind in ("deletion", "insertion"):
                out[f"{name} {kind} AUC ({fill})"] = float(quantities[f"{kind}_auc"])
        for name, kinds in block["paired"].items():
            for kind, score in kinds.items():
                if score["mean"] is not None:
                    out[f"{name} {kind} paired ({fill})"] = float(score["mean"])
    return out


def main(argv: list[str] | None = None) -> Path | None:
    args = build_parser().parse_args(argv)
    args.command = shlex.join(["python", "scripts/study.py", *(sys.argv[1:] if argv is None else argv)])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    args.threads = None if args.jobs == 1 else max(1, cores // args.jobs)
    out = Path(args.output)
    if args.commit:
        check_commit(out)
    arms, seeds, commands = _check_identity(args, out)
    if args.commit:  # on its own, before any run: the settings (and a named --primary) precede the results
        commit_paths([out / STUDY_FILE], f"study: settings and commands of {out.name} ({STUDY_FILE})")
    runs = {(arm, seed): out / "runs" / f"{arm}-s{seed}" for seed in seeds for arm in ARMS}
    evals = {(arm, seed): out / "eval" / f"{arm}-s{seed}" for seed in seeds for arm in (*ARMS, *POSTHOC)}
    # Seed by seed, so the arms of a seed finish close together and pair up early.
    todo = [] if args.report_only else [(arm, seed) for seed in args.seeds for arm in ARMS if arm in args.arms]
    run_all(args, todo, runs, evals)
    scope = report_scope(args.arms, arms, seeds, evals)
    if not scope[1]:
        raise UserError(f"no seed of {out} is finished by every arm of --arms ({' '.join(args.arms)}) yet: run the "
                        "study command without --report-only to train what is missing")
    report = write_report(args, out, scope, commands, runs, evals)
    if args.commit:
        names = (STUDY_FILE, REPORT_FILE, CURVES_FILE, HEATMAPS_FILE, POOLING_FILE, LOCALISATION_FILE, HUB_DIR,
                 DATA_DIR)
        commit_paths([out / name for name in names if (out / name).exists()],
                     f"study: report ({', '.join(scope[0])}; seeds {' '.join(map(str, scope[1]))})")
    print(f"study finished: {len(todo)} runs trained or checked on {args.dataset}; report over seeds "
          f"{' '.join(map(str, scope[1]))} at {report}")
    return report


if __name__ == "__main__":
    run_cli(main)
