"""Compare arms across a sweep of one training hyperparameter (e.g. the learning rate), paired by seed.

    python -m harness.sweep results/cifar10-gpu-lr/lr*/eval/{cls,gap,rollout}-s* --param lr \\
        --output results/cifar10-gpu-lr

Each evaluation is one run of an arm (:func:`harness.compare.run_label`) at its value of ``--param`` (its run's
``train_args.json``); the report and figure are described in harness/README.md, "Sweep a training argument".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from harness.compare import (
    METRICS,
    PRIMARY,
    STATISTICS_NOTE,
    Group,
    check_distinct,
    ci_half_widths,
    compare_groups,
    format_mean,
    load_results,
    render_comparison,
    run_folder,
    run_label,
    summarise,
    train_args,
)
from timm_rollout.atomic import save_figure, write_text
from timm_rollout.cli import CliParser, existing_path, output_dir, run_cli
from timm_rollout.errors import UserError
from timm_rollout.records import ARGS_FILE, REPORT_FILE

__all__ = ["best_values", "main", "render_sweep", "sweep_groups", "train_arg"]

SWEEP_FIGURE = "sweep.png"


def train_arg(result: dict[str, Any], key: str, runs: Sequence[str | Path] = ()) -> Any:
    """The training argument ``key`` of an evaluated run (:func:`harness.compare.train_args`)."""
    saved, folder = train_args(result, runs), run_folder(result, runs)
    if saved is None:
        raise UserError(f"{result.get('path')}: no readable {ARGS_FILE} in its run folder {folder}; run from the "
                        "directory the evaluation ran in, or pass --runs FOLDER holding the run folders")
    if key not in saved:
        raise UserError(f"{folder / ARGS_FILE} has no training argument {key!r}; pass --param with a key it has "
                        f"(e.g. lr, weight_decay, batch_size)")
    return saved[key]


def sweep_groups(results: Sequence[dict[str, Any]], param: str, metrics: Sequence[str] = METRICS,
                 runs: Sequence[str | Path] = ()) -> dict[str, dict[Any, Group]]:
    """arm label -> swept value (ascending) -> its :class:`Group` of runs (one per seed); ``runs``: folders
    holding run folders moved since their evaluation (:func:`harness.compare.run_folder`)."""
    keys = {id(r): (run_label(r), train_arg(r, param, runs)) for r in results}
    check_distinct(results, label=lambda r: f"{keys[id(r)][0]} at {param}={keys[id(r)][1]}", runs=runs)
    cells = {repr(key): key for key in keys.values()}
    by_arm: dict[str, dict[Any, Group]] = {}
    for group in summarise(results, metrics, label=lambda r: repr(keys[id(r)]), runs=runs):
        arm, value = cells[group.label]
        group.label = arm
        by_arm.setdefault(arm, {})[value] = group
    return {arm: dict(sorted(groups.items(), key=lambda item: _order(item[0]))) for arm, groups in by_arm.items()}


def best_values(arms: dict[str, dict[Any, Group]], metric: str = PRIMARY) -> dict[str, Any]:
    """Each arm's value with the highest mean of ``metric`` (the lower value on a tie)."""
    best = {}
    for arm, cells in arms.items():
        scored = [(v, g.mean.get(metric)) for v, g in cells.items() if g.mean.get(metric) is not None]
        if not scored:
            raise UserError(f"no run of {arm} has the metric {metric}; pick another --select")
        best[arm] = max(scored, key=lambda vs: (vs[1], -_order(vs[0])))[0]
    return best


def _order(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def shared_value(arms: dict[str, dict[Any, Group]], metric: str = PRIMARY) -> Any:
    """The value every arm was run at whose mean of ``metric`` over the arms is highest."""
    common = set.intersection(*(set(cells) for cells in arms.values()))
    if not common:
        raise UserError("no value of the swept parameter was run for every arm; pass --shared with one")
    mean = {v: np.mean([arms[a][v].mean.get(metric) or -math.inf for a in arms]) for v in common}
    return max(sorted(common, key=_order), key=lambda v: mean[v])


def render_sweep(arms: dict[str, dict[Any, Group]], param: str, metrics: Sequence[str], select: str,
                 shared: Any) -> str:
    """Markdown report: the table of means per arm and value, each arm's best value, and the paired
    statistics of every pair of arms, each at its own best value and both at ``shared``."""
    best = best_values(arms, select)
    values = sorted({v for cells in arms.values() for v in cells}, key=_order)
    lines = [f"# Sweep of {param}", "", f"Mean ± sample std over seeds (n = runs); each arm's best {param} by mean "
             f"{select} in bold.", ""]
    for metric in metrics:
        if all(g.mean.get(metric) is None for cells in arms.values() for g in cells.values()):
            continue
        lines += [f"**{metric}**", "", "| arm | " + " | ".join(f"{param}={v}" for v in values) + " |",
                  "|---|" + "---:|" * len(values)]
        for arm, cells in arms.items():
            row = [_cell(cells.get(v), metric, bold=v == best[arm] and metric == select) for v in values]
            lines.append(f"| {arm} | " + " | ".join(row) + " |")
        lines.append("")
    lines += ["## Paired statistics", "", STATISTICS_NOTE, ""]
    names = list(arms)
    for i, base in enumerate(names):
        for other in names[i + 1:]:
            own = (best[base], best[other])
            settings = [(f"each at its best {param} ({own[0]} vs {own[1]})", own)]
            if own == (shared, shared):
                settings = [(f"both at {param}={shared}, each arm's best", own)]
            else:
                settings.append((f"both at {param}={shared}", (shared, shared)))
            for title, (a, b) in settings:
                lines += [f"### {other} - {base}, {title}", "",
                          render_comparison(compare_groups(arms[base][a], arms[other][b], metrics)), ""]
    lines += ["## Runs", ""]
    for arm, cells in arms.items():
        for v, g in cells.items():
            lines.append(f"- **{arm}**, {param}={v}: " + ", ".join(f"`{r}` (seed {s})"
                                                                   for r, s in zip(g.runs, g.seeds, strict=True)))
    return "\n".join(lines) + "\n"


def _cell(group: Group | None, metric: str, bold: bool) -> str:
    if group is None or group.mean.get(metric) is None:
        return "-"
    text = f"{format_mean(group, metric)} (n={group.count[metric]})"
    return f"**{text}**" if bold else text


def plot_sweep(arms: dict[str, dict[Any, Group]], param: str, metric: str, path: Path) -> Path:
    """``metric`` against the swept value, one line per arm, error bars the 95% t-intervals over seeds."""
    from matplotlib.figure import Figure  # here, so that --help loads no matplotlib

    fig = Figure(figsize=(7.0, 4.5))
    ax = fig.subplots()
    numeric = all(isinstance(v, int | float) and v > 0 for cells in arms.values() for v in cells)
    for arm, cells in arms.items():
        xs = list(cells)
        ys = [np.nan if g.mean.get(metric) is None else g.mean[metric] for g in cells.values()]
        errs = [ci_half_widths(g, [metric])[metric] or 0.0 for g in cells.values()]
        ax.errorbar(xs if numeric else [str(x) for x in xs], ys, yerr=errs, marker="o", capsize=3, label=arm)
    if numeric:
        ax.set_xscale("log")
    ax.set_xlabel(param)
    ax.set_ylabel(f"{metric} (mean over seeds, error bar = 95% CI)")
    ax.set_title(f"{metric} against {param}, per arm")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def build_parser() -> CliParser:
    p = CliParser(prog="python -m harness.sweep", description=__doc__.split("\n")[0])
    p.add_argument("evaluations", nargs="+",
                   help="evaluation folders (each with results.json): every arm at every value, one run per seed")
    p.add_argument("--param", required=True, help="the swept training argument, as in train_args.json (e.g. lr)")
    p.add_argument("--output", required=True, type=output_dir, help="folder for report.md and sweep.png")
    p.add_argument("--metrics", nargs="+", default=list(METRICS), choices=METRICS, help="metrics to show")
    p.add_argument("--runs", nargs="+", type=existing_path, default=[],
                   help="folders holding run folders moved since their evaluation, looked up by the run folder's "
                        "name after the study layout <evaluation>/../../runs (the first that has it)")
    p.add_argument("--select", default=PRIMARY, choices=METRICS, help="metric that picks each arm's best value")
    p.add_argument("--shared", type=float, default=None,
                   help="value at which all arms are also compared (default: the best one over all arms)")
    return p


def main(argv: list[str] | None = None) -> dict[str, dict[Any, Group]]:
    args = build_parser().parse_args(argv)
    results = load_results(args.evaluations)
    metrics = list(dict.fromkeys([*args.metrics, args.select]))  # the selection metric is shown too
    arms = sweep_groups(results, args.param, metrics, args.runs)
    shared = shared_value(arms, args.select) if args.shared is None else args.shared
    if not all(shared in cells for cells in arms.values()):
        raise UserError(f"--shared {shared}: not every arm was run at {args.param}={shared}; pass a value all have")
    out = Path(args.output)
    write_text(out / REPORT_FILE, render_sweep(arms, args.param, metrics, args.select, shared))
    plot_sweep(arms, args.param, args.select, out / SWEEP_FIGURE)
    runs = sum(g.n for cells in arms.values() for g in cells.values())
    print(f"swept {args.param} over {runs} runs of {len(arms)} arms -> {out / REPORT_FILE}")
    return arms


if __name__ == "__main__":
    run_cli(main)
