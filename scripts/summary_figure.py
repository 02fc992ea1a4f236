"""The front README's figure from committed study folders: test top-1 per epoch of one study's arms, and the
paired differences in final test top-1 (95% t-intervals) of pairs of arms in every study given.

    python scripts/summary_figure.py --curves results/cifar10-cpu --studies results/cifar10-gpu-10ep \\
        results/cifar10-cpu --pairs cls:gap cls:rollout gap:rollout gap:map --output results/summary.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from harness.compare import Group, compare_groups, summarise
from harness.record import load_results
from harness.study.folder import arm_of
from timm_rollout.atomic import save_figure
from timm_rollout.cli import CliParser, existing_path, run_cli
from timm_rollout.curves import draw_seeds, epoch_axis, seeds_phrase
from timm_rollout.errors import UserError
from timm_rollout.records import LOG_FILE, RESULTS_FILE
from timm_rollout.train.log import read_log

ARM_NAMES = {"cls": "[CLS] token (cls)", "gap": "patch mean (gap)", "rollout": "rollout-weighted patches (rollout)",
             "map": "learned attention pooling (map)", "rollout-max-discard0.9": "sharpened rollout (max, discard 0.9)"}


def study_groups(study: Path) -> dict[str, Group]:
    """Every evaluated arm of a study folder: arm -> its :class:`Group` of top-1 values, one run per seed."""
    folders = sorted(p.parent for p in (study / "eval").glob(f"*-s*/{RESULTS_FILE}"))
    if not folders:
        raise UserError(f"{study} has no eval/<arm>-s<seed>/{RESULTS_FILE}; pass a folder scripts/study.py wrote")
    return {g.label: g for g in summarise(load_results(folders), ["top1"], label=lambda r: arm_of(r["path"]))}


def paired_top1(groups: dict[str, Group], pairs: list[tuple[str, str]]) -> dict[tuple[str, str], tuple]:
    """(base, other) -> (mean, low, high, seeds) of other - base in top-1 points, for the pairs the study has."""
    out = {}
    for base, other in pairs:
        if base in groups and other in groups:
            delta = compare_groups(groups[base], groups[other], ["top1"])[0].delta
            if delta is not None and delta.low is not None:
                out[base, other] = (100 * delta.mean, 100 * delta.low, 100 * delta.high, delta.n)
    return out


def plot_curves(ax, study: Path, arms: list[str]) -> None:
    """Eval top-1 per epoch of each arm: bold mean over seeds, thin single seeds."""
    for i, arm in enumerate(arms):
        logs = [read_log(p) for p in sorted((study / "runs").glob(f"{arm}-s*/{LOG_FILE}")) if arm_of(p.parent) == arm]
        if not logs:
            continue
        draw_seeds(ax, logs, "eval_top1", f"C{i}", f"{ARM_NAMES.get(arm, arm)}, {seeds_phrase(len(logs))}")
    low = [line.get_ydata()[len(line.get_ydata()) // 10] for line in ax.get_lines() if line.get_lw() == 2]
    if low:
        ax.set_ylim(bottom=min(low) - 2)
    epoch_axis(ax)
    ax.set(ylabel="test top-1 accuracy (%)", title=f"CIFAR-10 test accuracy while training\n"
           f"({_epochs(study)} epochs, bold: mean over seeds; thin: single seeds)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)


def plot_differences(ax, studies: list[Path], pairs: list[tuple[str, str]]) -> None:
    """One row per pair, one marker per study: mean paired difference with its 95% t-interval."""
    offsets = np.linspace(0.15, -0.15, len(studies)) if len(studies) > 1 else [0.0]
    for k, (study, offset) in enumerate(zip(studies, offsets, strict=True)):
        found = paired_top1(study_groups(study), pairs)
        rows = [(len(pairs) - 1 - i + offset, found[pair]) for i, pair in enumerate(pairs) if pair in found]
        if not rows:
            continue
        y = [r[0] for r in rows]
        mean, low, high = (np.array([r[1][j] for r in rows]) for j in range(3))
        seeds = sorted({r[1][3] for r in rows})
        ax.errorbar(mean, y, xerr=[mean - low, high - mean], fmt="s" if k == len(studies) - 1 else "o",
                    color="black" if k == len(studies) - 1 else "grey", capsize=4, markersize=7,
                    label=f"{_epochs(study)} epochs, {'/'.join(map(str, seeds))} seeds")
    ax.axvline(0, color="grey", ls="--", lw=1)
    ax.set_yticks(range(len(pairs)), [f"{other} \u2212 {base}" for base, other in reversed(pairs)])
    ax.set(xlabel="difference in test top-1 (percentage points)",
           title="Paired difference in test top-1\n(mean over seeds, 95% t-interval)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="x")


def _epochs(study: Path) -> int | str:
    try:
        return json.loads((study / "study.json").read_text(encoding="utf-8"))["identity"]["epochs"]
    except (OSError, KeyError, json.JSONDecodeError):
        return "?"


def _pair(text: str) -> tuple[str, str]:
    base, sep, other = text.partition(":")
    if not sep or not base or not other:
        raise argparse.ArgumentTypeError(f"{text!r}: give a pair as BASE:OTHER, e.g. cls:gap")
    return base, other


def build_parser() -> CliParser:
    p = CliParser(prog="python scripts/summary_figure.py", description=__doc__.split("\n")[0])
    p.add_argument("--curves", type=existing_path, required=True, help="study folder whose training curves to draw")
    p.add_argument("--studies", type=existing_path, nargs="+", required=True,
                   help="study folders whose paired differences to draw (the last in black)")
    p.add_argument("--pairs", type=_pair, nargs="+", required=True, help="BASE:OTHER pairs of arms, top to bottom")
    p.add_argument("--title", default="Rollout pooling beats the [CLS] token by as much as a plain patch mean, "
                                      "and no more", help="figure title")
    p.add_argument("--output", type=Path, required=True, help="PNG to write")
    return p


def main(argv: list[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    from matplotlib.figure import Figure  # here, so that --help loads no matplotlib

    curve_arms = list(dict.fromkeys(arm for pair in args.pairs for arm in pair))
    fig = Figure(figsize=(12.5, 4.6))
    left, right = fig.subplots(1, 2)
    plot_curves(left, Path(args.curves), curve_arms)
    plot_differences(right, [Path(s) for s in args.studies], args.pairs)
    fig.suptitle(args.title)
    fig.tight_layout()
    path = save_figure(fig, args.output)
    print(f"summary figure of {len(args.studies)} studies and {len(args.pairs)} pairs -> {path}")
    return path


if __name__ == "__main__":
    run_cli(main)
