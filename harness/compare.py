"""Compare evaluation runs side by side: a markdown table with deltas and a bar chart.

    python -m harness.compare eval/c10-cls eval/c10-rollout ... --output report/

Runs that share a label (model name, the architecture its weights were trained as, data set and split)
are grouped as mean +- std over runs, with the number of runs. Deltas are against the first group.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.figures import plot_comparison
from timm_rollout.atomic import write_text
from timm_rollout.errors import UserError, run_cli

__all__ = ["METRICS", "Group", "load_results", "main", "render_markdown", "run_label", "summarise"]

METRICS = ("top1", "top5", "knn_loo", "knn_bank", "intra", "inter", "ratio", "silhouette")


@dataclass
class Group:
    """Runs sharing a label, with per-metric mean and sample std (None when no run has the metric)."""

    label: str
    runs: list[str] = field(default_factory=list)
    mean: dict[str, float | None] = field(default_factory=dict)
    std: dict[str, float | None] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.runs)


def load_results(folders: Sequence[str | Path]) -> list[dict[str, Any]]:
    """``results.json`` of each evaluation folder (or the file itself), with its path under ``"path"``."""
    loaded = []
    for folder in folders:
        path = Path(folder)
        path = path / "results.json" if path.is_dir() else path
        try:
            result = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(f"no results.json at {path}; pass folders written by python -m harness.eval") from None
        except json.JSONDecodeError as e:
            raise UserError(f"{path} is not valid JSON ({e}); re-run python -m harness.eval for it") from None
        if "metrics" not in result or "model" not in result:
            raise UserError(f"{path} is not a harness.eval results.json (no metrics/model); re-run the evaluation")
        loaded.append({**result, "path": str(path.parent)})
    return loaded


def run_label(result: dict[str, Any]) -> str:
    """Group label of a run: model, weights' architecture when it differs, data set and split."""
    model = result["model"]
    label = model["name"]
    trained_as = model.get("checkpoint_architecture")
    if trained_as and trained_as != model.get("architecture"):
        label += f" ({trained_as} weights)"
    data = result.get("data", {})
    dataset = Path(str(data.get("argument") or data.get("dataset", "?"))).name
    return f"{label} on {dataset}/{data.get('split', '?')}"


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def summarise(results: Sequence[dict[str, Any]], metrics: Sequence[str] = METRICS) -> list[Group]:
    """Group runs by :func:`run_label` (in first-seen order); mean and sample std of each metric."""
    groups: dict[str, Group] = {}
    values: dict[str, dict[str, list[float]]] = {}
    for result in results:
        label = run_label(result)
        group = groups.setdefault(label, Group(label))
        group.runs.append(str(result.get("path", "?")))
        for metric in metrics:
            value = result["metrics"].get(metric)
            if value is not None:
                values.setdefault(label, {}).setdefault(metric, []).append(float(value))
    for label, group in groups.items():
        for metric in metrics:
            found = values.get(label, {}).get(metric, [])
            group.mean[metric], group.std[metric] = _mean_std(found)
            group.count[metric] = len(found)
    return list(groups.values())


def _cell(group: Group, metric: str) -> str:
    mean, std = group.mean.get(metric), group.std.get(metric)
    if mean is None:
        return "-"
    text = f"{mean:.4f}" if std is None else f"{mean:.4f} ± {std:.4f}"
    return f"{text} (n={group.count[metric]})" if group.count[metric] != group.n else text


def _delta(group: Group, base: Group, metric: str) -> str:
    a, b = group.mean.get(metric), base.mean.get(metric)
    return "-" if a is None or b is None else f"{a - b:+.4f}"


def render_markdown(
    groups: Sequence[Group], metrics: Sequence[str] = METRICS, title: str = "Evaluation comparison"
) -> str:
    """Markdown report: metric-by-group table with deltas against the first group, then the runs of each group."""
    if not groups:
        raise ValueError("nothing to render: no groups")
    base = groups[0]
    header = ["metric"] + [f"{g.label} (n={g.n})" for g in groups] + [f"Δ {g.label}" for g in groups[1:]]
    lines = [f"# {title}", "", f"Deltas are against **{base.label}**. Values: mean ± sample std over runs.", ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
    for metric in metrics:
        if all(g.mean.get(metric) is None for g in groups):
            continue
        row = [metric] + [_cell(g, metric) for g in groups] + [_delta(g, base, metric) for g in groups[1:]]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Runs", ""]
    for g in groups:
        lines.append(f"- **{g.label}**: " + ", ".join(f"`{r}`" for r in g.runs))
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness.compare", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="evaluation folders (each with results.json)")
    p.add_argument("--output", required=True, help="folder for report.md and comparison.png")
    p.add_argument("--metrics", nargs="+", default=list(METRICS), choices=METRICS, help="metrics to show")
    return p


def main(argv: list[str] | None = None) -> list[Group]:
    args = build_parser().parse_args(argv)
    groups = summarise(load_results(args.runs), args.metrics)
    out = Path(args.output)
    write_text(out / "report.md", render_markdown(groups, args.metrics))
    shown = [m for m in args.metrics if any(g.mean.get(m) is not None for g in groups)]
    plot_comparison([g.label for g in groups], shown, {g.label: g.mean for g in groups},
                    {g.label: g.std for g in groups}, out / "comparison.png", "Evaluation metrics by run group")
    print(f"compared {sum(g.n for g in groups)} runs in {len(groups)} groups -> {out / 'report.md'}")
    return groups


if __name__ == "__main__":
    run_cli(main)
