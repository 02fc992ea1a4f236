"""``python scripts/study.py``: the study's flags, and the command that trains, evaluates, reports and commits."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from timm_rollout.cli import CliParser, as_type, non_negative_int, number, output_dir, positive_int, seed_arg
from timm_rollout.data import dataset_arg
from timm_rollout.device import AMP_CHOICES, device_arg
from timm_rollout.errors import UserError
from timm_rollout.masks import BOX_FORMATS
from timm_rollout.records import (
    CURVES_FILE,
    DATA_DIR,
    EXPLORE_FILE,
    HEATMAPS_FILE,
    HUB_DIR,
    LOCALISATION_FILE,
    POOLING_FILE,
    REPORT_FILE,
    STUDY_FILE,
)

from . import cluster
from .folder import check_identity, layout
from .jobs import check_commit, commit_paths, run_all
from .plan import ARMS, DEFAULT_ARMS, check_train_args, primary_arg
from .report import report_scope, write_report

DESCRIPTION = ("The study in one command: train every pooling arm per seed with one recipe, evaluate every run, write "
               "a report.")

def build_parser() -> CliParser:
    """The CLI; bad values are one-line errors before anything is recorded in ``study.json``."""
    p = CliParser(prog="python scripts/study.py", description=DESCRIPTION,
                  checks=[_check_required, lambda args: args.status or check_train_args(args)],
                  removed={"--stack": "run seeds side by side as separate processes with --jobs N",
                           "--pack": "run seeds side by side as separate processes with --jobs N",
                           "--capture": "for CUDA graphs pass --train-args '--compile --compile-mode reduce-overhead'"})
    p.add_argument("--dataset", type=as_type(dataset_arg),
                   help="alias (cifar10, cifar100, svhn, cifar10-sample), Hub id or folder (required)")
    p.add_argument("--epochs", type=positive_int, help="training epochs of every run (required)")
    p.add_argument("--model", default=None,
                   help="base timm ViT every arm pools (default: the tiny CIFAR ViT, vit_tiny_cifar_<pooling>); size "
                        "and depth via --train-args '--model-kwargs img_size=32 ...'")
    p.add_argument("--seeds", type=seed_arg, nargs="+", default=[0],
                   help="training seeds; each arm trains once per seed, paired by seed")
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
    p.add_argument("--bbox-format", choices=BOX_FORMATS,
                   help="what the data sets' bbox columns hold, as harness.eval --bbox-format (default: xywh)")
    p.add_argument("--heatmaps", type=non_negative_int, default=6,
                   help="test images in the side-by-side heatmap grid (0: no grid)")
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
    p.add_argument("--executor", choices=("local", "slurm"), default="local",
                   help="local: this machine's pool (--jobs); slurm: one Slurm job array of the missing runs "
                        "(submitit: pip install -e '.[slurm]')")
    p.add_argument("--status", action="store_true", help="print the state of each run of --output and exit")
    s = p.add_argument_group("Slurm (--executor slurm)")
    s.add_argument("--partition", metavar="NAME", help="partition of every task (default: the cluster's)")
    s.add_argument("--time", metavar="MINUTES", type=positive_int, default=240,
                   help="time limit of a task in minutes; a run that needs longer is requeued and resumes")
    s.add_argument("--gpus-per-task", metavar="N", type=non_negative_int, help="GPUs of each task")
    s.add_argument("--cpus-per-task", metavar="N", type=positive_int, help="CPU cores of each task (its torch threads)")
    s.add_argument("--mem", metavar="GB", type=positive_int, help="memory of each task in GB")
    s.add_argument("--array-parallelism", metavar="N", type=positive_int, help="tasks running at once (default: all)")
    s.add_argument("--account", metavar="NAME", help="Slurm account to charge")
    s.add_argument("--qos", metavar="NAME", help="Slurm quality of service")
    s.add_argument("--sbatch-args", metavar="ARGS", type=as_type(cluster.sbatch_options),
                   help="other sbatch options of every task, quoted, e.g. '--constraint=a100 --exclusive'")
    p.add_argument("--eval-amp", choices=AMP_CHOICES,
                   help="autocast dtype of every evaluation (none: fp32); an evaluation recorded at another one is "
                        "redone (default: harness.eval's auto, bf16 only where native, whatever was recorded kept)")
    return p


def _check_required(args: argparse.Namespace) -> None:
    missing = [] if args.status else [f"--{k}" for k in ("dataset", "epochs") if getattr(args, k) is None]
    if missing:
        raise UserError(f"the following arguments are required: {', '.join(missing)}")


def main(argv: list[str] | None = None) -> Path | None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.status:
        extra = ", ".join(f"--{k.replace('_', '-')}" for k in sorted(parser.given - {"status", "output"}))
        if extra:
            raise UserError(f"--status reads the study folder alone: drop {extra}")
        print("\n".join(cluster.status(Path(args.output))))
        return None
    if args.report_only and args.eval_amp:
        raise UserError("--report-only evaluates nothing, so --eval-amp would do nothing; run the study command "
                        "without --report-only to evaluate at that precision")
    cluster.check_slurm(args, parser.given)
    args.command = shlex.join(["python", "scripts/study.py", *(sys.argv[1:] if argv is None else argv)])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    args.threads = args.cpus_per_task if args.executor == "slurm" else None if args.jobs == 1 else \
        max(1, cores // args.jobs)
    out = Path(args.output)
    if args.commit:
        check_commit(out)
    arms, seeds, commands = check_identity(args, out)
    if args.commit:  # on its own, before any run: the settings (and a named --primary) precede the results
        commit_paths([out / STUDY_FILE], f"study: settings and commands of {out.name} ({STUDY_FILE})")
    runs, evals = layout(out, seeds)
    # Seed by seed, so the arms of a seed finish close together and pair up early.
    todo = [] if args.report_only else [(arm, seed) for seed in args.seeds for arm in ARMS if arm in args.arms]
    if args.executor == "local":
        run_all(args, todo, runs, evals)
    elif not cluster.run_slurm(args, todo, runs, evals, render):
        return None  # the report is a job after the array
    return render(args, len(todo), (arms, seeds, commands))


def render(args: argparse.Namespace, trained: int = 0, folder: tuple | None = None) -> Path:
    """Write (and with ``--commit`` commit) ``report.md`` over the seeds every arm of ``--arms`` finished; ``folder``:
    :func:`check_identity`'s arms, seeds and commands, else read again (the report job)."""
    out = Path(args.output)
    arms, seeds, commands = folder or check_identity(args, out)
    runs, evals = layout(out, seeds)
    scope = report_scope(args.arms, arms, seeds, evals)
    if not scope[1]:
        raise UserError(f"no seed of {out} is finished by every arm of --arms ({' '.join(args.arms)}) yet: run the "
                        "study command without --report-only to train what is missing")
    report = write_report(args, out, scope, commands, runs, evals)
    if args.commit:
        names = (STUDY_FILE, REPORT_FILE, CURVES_FILE, HEATMAPS_FILE, EXPLORE_FILE, POOLING_FILE, LOCALISATION_FILE,
                 HUB_DIR, DATA_DIR)
        commit_paths([out / name for name in names if (out / name).exists()],
                     f"study: report ({', '.join(scope[0])}; seeds {' '.join(map(str, scope[1]))})")
    print(f"study finished: {trained} runs trained or checked on {args.dataset}; report over seeds "
          f"{' '.join(map(str, scope[1]))} at {report}")
    return report
