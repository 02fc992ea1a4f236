"""Compare evaluation runs: per-group means, and paired statistics of each group against the first.

    python -m harness.compare eval/c10-cls-s0 eval/c10-cls-s1 eval/c10-rollout-s0 eval/c10-rollout-s1 --output report/

Grouping, pairing by training seed, the statistics (:mod:`harness.stats`) and the refusals: harness/README.md,
"Compare runs". A ``local-dir:RUN`` model is named as the architecture it was trained as and paired by RUN's seed.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness import stats
from harness.figures import plot_comparison
from harness.metrics import ACCURACIES, LOCALISATION, POOLING_DIAGNOSTICS
from harness.record import load_results, read_predictions
from timm_rollout.atomic import write_text
from timm_rollout.cli import CliParser, output_dir, run_cli
from timm_rollout.errors import UserError
from timm_rollout.pooling import OPTIONS, POOL_ARG, POOLED_ARCHITECTURE, STOCK_ARCHITECTURE, pool_name
from timm_rollout.records import ARGS_FILE, COMPARISON_FILE, REPORT_FILE, code_label, code_labels

__all__ = [
    "METRICS",
    "ORIGINAL_METRICS",
    "PRIMARY",
    "Group",
    "MetricComparison",
    "check_distinct",
    "ci_half_widths",
    "compare_groups",
    "correct_per_image",
    "evaluated_images",
    "format_ci",
    "format_mean",
    "format_number",
    "format_p",
    "group_labels",
    "main",
    "render_comparison",
    "render_markdown",
    "run_fields",
    "run_folder",
    "run_label",
    "run_seed",
    "same_images",
    "summarise",
]

METRICS = ("top1", "top5", "linear_probe", "knn_loo", "knn_bank", "intra", "inter", "ratio", "silhouette")
# the original study's definitions
ORIGINAL_METRICS = ("intra_original", "inter_original", "ratio_original", "knn_original")
PRIMARY = "top1"
SHOWABLE = METRICS + POOLING_DIAGNOSTICS + LOCALISATION + ORIGINAL_METRICS  # what --metrics may name
# run_fields that say how a model pools (model arguments included)
POOLING_FIELDS = {"pooling", "readout", "global_pool", POOL_ARG, *(attr for attr, _ in OPTIONS.values())}
SHOWN_AS = {"rollout_head_fusion": "head_fusion", "rollout_discard_ratio": "discard_ratio"}  # in group labels
MIXED = "(differs between its runs)"  # a field of a group whose runs differ in it (a caller's own grouping)


@dataclass
class Group:
    """Runs sharing a label: their folders, training seeds and per-run values, with per-metric mean and sample
    std (None when no run has the metric; std None with one run)."""

    label: str
    runs: list[str] = field(default_factory=list)
    seeds: list[int | None] = field(default_factory=list)
    images: list[tuple | None] = field(default_factory=list)  # (evaluated subset, bank) fingerprints per run
    values: dict[str, list[float | None]] = field(default_factory=dict)
    mean: dict[str, float | None] = field(default_factory=dict)
    std: dict[str, float | None] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)
    fields: dict[str, str | None] = field(default_factory=dict)  # run_fields of its runs (MIXED where they differ)

    @property
    def n(self) -> int:
        return len(self.runs)


@dataclass(frozen=True)
class MetricComparison:
    """One metric of one group against a base group: the seed-paired delta and, for accuracies, the per-image
    McNemar test pooled over those seeds; ``*_holm`` are Holm-adjusted (None for the primary metric)."""

    metric: str
    seeds: list[int]
    delta: stats.TInterval | None
    p_holm: float | None = None
    per_image: stats.McNemar | None = None
    per_image_p_holm: float | None = None


@functools.cache
def _built(name: str | None) -> tuple[str, tuple] | None:
    """The ``global_pool`` and parameter shapes of a registered model built by default (on the meta device); None
    where that cannot tell (``hf-hub:``, ``local-dir:``, a model that needs arguments or a real device)."""
    import timm  # here, so that --help loads no timm

    if not name or not timm.is_model(name):
        return None
    try:
        with torch.device("meta"):
            model = timm.create_model(name)
    except (RuntimeError, NotImplementedError, ValueError):  # a meta-device-only failure, or a required argument
        return None
    return pool_name(model), tuple((k, tuple(v.shape)) for k, v in model.state_dict().items())


def default_pool(name: str) -> str | None:
    """The ``global_pool`` a registered model is built with by default; None where that cannot tell."""
    return (_built(name) or (None,))[0]


def _model_name(model: dict[str, Any]) -> str:
    """The model's name in a label: for ``local-dir:RUN``, the architecture its weights were trained as (a rollout-
    pooled stock ViT's stock name), as ``--model ARCH --checkpoint RUN`` names it, so both group alike."""
    name, trained = model["name"], model.get("checkpoint_architecture")
    if not name.startswith("local-dir:") or not trained:
        return name
    return (model.get("model_args") or {}).get(STOCK_ARCHITECTURE, trained) if trained == POOLED_ARCHITECTURE \
        else trained


def run_label(result: dict[str, Any], shown: Sequence[str] = ()) -> str:
    """Label of a run: model (:func:`_model_name`), weights' architecture when it differs, its pooling when not the
    model's default (e.g. ``global_pool=map``), a post-hoc readout's pooling, the ``shown`` fields, data set and
    split."""
    model = result["model"]
    label = name = _model_name(model)
    trained_as = model.get("checkpoint_architecture")
    if trained_as and trained_as != model.get("architecture"):
        label += f" ({trained_as} weights)"
    built, pool = model.get("global_pool"), model.get("pool")
    if built is not None and built != default_pool(name):
        label += f" (global_pool={built})"
    if pool is not None and pool != built:
        label += f" (read out with {pool})"
    if shown:
        label += f" ({' '.join(shown)})"
    data = result.get("data", {})
    dataset = Path(str(data.get("argument") or data.get("dataset", "?"))).name
    return f"{label} on {dataset}/{data.get('split', '?')}"


def _stock(name: str | None, args: dict[str, Any]) -> str | None:
    """An architecture's name, that of the stock ViT for :data:`POOLED_ARCHITECTURE`."""
    return args.get(STOCK_ARCHITECTURE, name) if name == POOLED_ARCHITECTURE else name


def run_fields(result: dict[str, Any]) -> dict[str, str | None]:
    """What makes runs of one :func:`run_label` one model on one data split, as text: the architectures of the model
    and of its weights, pooling, readout, every recorded model argument (rollout options at their defaults left out,
    as older records did) and the split's ``content`` hash (else datasets' fingerprint)."""
    model, data = result["model"], result.get("data") or {}
    args = model.get("model_args") or {}
    defaults = dict(OPTIONS.values())
    kept = {k: v for k, v in args.items() if k != STOCK_ARCHITECTURE and (k not in defaults or v != defaults[k])}
    found = {"architecture": _stock(model.get("architecture"), args),
             "weights": _stock(model.get("checkpoint_architecture"), args), "pooling": model.get("global_pool"),
             "readout": model.get("pool"), **kept, "content": data.get("split_content") or data.get("fingerprint"),
             "boxes": data.get("box_content")}
    return {k: v if v is None or isinstance(v, str) else json.dumps(v) for k, v in found.items()}


def group_labels(results: Sequence[dict[str, Any]]) -> list[str]:
    """Each run's group label: :func:`run_label`, with the :func:`run_fields` in which runs of that label differ
    (e.g. ``vit_tiny_cifar_rollout (head_fusion=max discard_ratio=0.9) on cifar10/test``)."""
    labels, fields = [run_label(r) for r in results], [run_fields(r) for r in results]
    named = []
    for result, label, own in zip(results, labels, fields, strict=True):
        peers = [f for other, f in zip(labels, fields, strict=True) if other == label]
        differ = [k for k in dict.fromkeys(k for f in peers for k in f) if len({f.get(k) for f in peers}) > 1]
        named.append(run_label(result, [f"{SHOWN_AS.get(k, k)}={own[k][:8] if k in ('content', 'boxes') else own[k]}"
                                        for k in differ if own.get(k) is not None]))
    return named


def _factor(name: str, a: str | None, b: str | None) -> str:
    """The factor of a field in which two groups differ (values ``a``, ``b``): the pooling or the architecture (two
    architectures that build to the same parameters, as the tiny models' _cls, _gap and _rollout, differ in pooling)."""
    if name in ("architecture", "weights"):
        built = _built(a), _built(b)
        return "pooling" if None not in built and built[0][1] == built[1][1] else "architecture"
    return "pooling" if name in POOLING_FIELDS else "architecture"


def _check_like(base: Group, other: Group) -> None:
    """Refuse pairing groups that differ in more than one factor (the pooling, the architecture), naming what
    differs; fields that differ within a group, and the data (checked per seed), are left out."""
    a, b = base.fields, other.fields
    if MIXED not in (a.get("boxes"), b.get("boxes")) and a.get("boxes") != b.get("boxes"):
        raise UserError(f"{other.label} and {base.label} were scored on other object boxes (box_content "
                        f"{str(b.get('boxes'))[:8]} vs {str(a.get('boxes'))[:8]}): evaluate both on the same boxes, "
                        "read with the same --bbox-format")
    factors: dict[str, list[str]] = {}
    for k in dict.fromkeys([*a, *b]):
        if k not in ("content", "boxes") and MIXED not in (a.get(k), b.get(k)) and a.get(k) != b.get(k):
            factors.setdefault(_factor(k, a.get(k), b.get(k)), []).append(f"{k} {a.get(k)} vs {b.get(k)}")
    if len(factors) > 1:
        raise UserError(f"{other.label} and {base.label} differ in " + " and in ".join(
            f"the {f} ({', '.join(d)})" for f, d in factors.items()) + "; a paired difference compares one factor: "
            "compare runs that differ only in the pooling, or only in the architecture")


def _checkpoint(result: dict[str, Any]) -> str | None:
    """The evaluated checkpoint: ``results["model"]["checkpoint"]``, else the folder of a ``local-dir:`` model."""
    model = result.get("model", {})
    name = str(model.get("name", ""))
    return model.get("checkpoint") or (name.removeprefix("local-dir:") if name.startswith("local-dir:") else None)


def run_folder(result: dict[str, Any]) -> Path | None:
    """The training run folder of an evaluated checkpoint (:func:`_checkpoint`): the recorded one when it holds
    ``train_args.json``, else the one of that name in the study layout (``<evaluation>/../../runs/<name>``) when it
    does; the recorded folder when neither does, None when no checkpoint is recorded."""
    checkpoint = _checkpoint(result)
    if not checkpoint:
        return None
    path = Path(checkpoint)
    recorded = path.parent if path.suffix in {".safetensors", ".pth", ".pt", ".bin"} or path.is_file() else path
    if (recorded / ARGS_FILE).is_file():
        return recorded
    beside = Path(result["path"]).absolute().parent.parent / "runs" / recorded.name if result.get("path") else None
    return beside if beside is not None and (beside / ARGS_FILE).is_file() else recorded


def run_seed(result: dict[str, Any]) -> int | None:
    """Training seed of a run: ``seed`` in the ``train_args.json`` of its run folder (:func:`run_folder`) where
    that is readable, else the eval seed."""
    folder = run_folder(result)
    try:
        saved = json.loads((folder / ARGS_FILE).read_text(encoding="utf-8")) if folder is not None else None
    except (OSError, json.JSONDecodeError):
        saved = None
    seed = saved.get("seed") if isinstance(saved, dict) else None
    return seed if isinstance(seed, int) else result.get("config", {}).get("seed")


def evaluated_images(result: dict[str, Any]) -> tuple | None:
    """What an evaluation read: the fingerprints of its data set split, of the images it scored and of its k-NN
    bank, then the content hashes of the same three (None where not recorded); None for records without them."""
    data = result.get("data") or {}
    if "subset_fingerprint" not in data:
        return None
    bank = data.get("bank") or {}
    return (data.get("fingerprint"), data["subset_fingerprint"], bank.get("fingerprint"), data.get("split_content"),
            data.get("content"), bank.get("content"))


def same_images(a: tuple, b: tuple) -> tuple[bool, bool]:
    """Whether two :func:`evaluated_images` read the same data set split, and the same images and bank: each of the
    two (evaluated images, bank) by content where both records hold it (the same data in another folder or layout is
    the same), else by fingerprint."""
    data = a[3:5] == b[3:5] if a[4] is not None and b[4] is not None else a[:2] == b[:2]
    bank = a[5] == b[5] if a[5] is not None and b[5] is not None else a[2] == b[2]
    split = a[3] == b[3] if a[3] is not None and b[3] is not None else a[0] == b[0]
    return split, data and bank


def check_distinct(results: Sequence[dict[str, Any]]) -> None:
    """Refuse an evaluation counted twice in a group (:func:`group_labels`): the same folder, the same seed
    (:func:`run_seed`), the same weights of a training checkpoint, or, for a published model without a seed, the
    same weights on the same images (harness/README.md, "Compare runs")."""
    seen: dict[tuple, str] = {}
    for result, label in zip(results, group_labels(results), strict=True):
        path = str(result.get("path", "?"))
        seed, sha = run_seed(result), result["model"].get("sha256")
        keys = [("folder", Path(path).resolve())]
        if seed is not None:
            keys.append(("seed", label, seed))
        if sha is not None and _checkpoint(result):
            keys.append(("weights", label, sha))
        elif sha is not None and seed is None:
            keys.append(("weights", label, sha, evaluated_images(result)))
        for key in keys:
            if key in seen and key[0] == "folder":
                raise UserError(f"{path} is passed twice; pass each evaluation folder once")
            if key in seen:
                what = {"seed": f"seed {seed}", "weights": "the same weights"}[key[0]] + (
                    " on the same images" if len(key) == 4 else "")
                raise UserError(f"{seen[key]} and {path} are both {what} of {key[1]}, so one seed would count twice; "
                                "pass one evaluation per seed")
            seen[key] = path


def summarise(results: Sequence[dict[str, Any]], metrics: Sequence[str] = METRICS,
              label: Callable[[dict[str, Any]], str] | None = None) -> list[Group]:
    """Group runs by ``label`` (default :func:`group_labels`; in first-seen order); per-run values, mean and
    sample std of each metric."""
    groups: dict[str, Group] = {}
    labels = group_labels(results) if label is None else [label(r) for r in results]
    for result, name in zip(results, labels, strict=True):
        group, fields = groups.setdefault(name, Group(name)), run_fields(result)
        group.fields = fields if not group.runs else {k: group.fields.get(k) if group.fields.get(k) == fields.get(k)
                                                      else MIXED for k in dict.fromkeys([*group.fields, *fields])}
        group.runs.append(str(result.get("path", "?")))
        group.seeds.append(run_seed(result))
        group.images.append(evaluated_images(result))
        for metric in metrics:
            value = result["metrics"].get(metric)
            group.values.setdefault(metric, []).append(None if value is None else float(value))
    for group in groups.values():
        for metric in metrics:
            found = [v for v in group.values.get(metric, []) if v is not None]
            group.count[metric] = len(found)
            group.mean[metric] = float(np.mean(found)) if found else None
            group.std[metric] = float(np.std(found, ddof=1)) if len(found) > 1 else None
    return list(groups.values())


def _by_seed(group: Group) -> dict[int, int]:
    """Run position of each seed; a seed evaluated twice cannot be paired."""
    positions: dict[int, int] = {}
    for i, seed in enumerate(group.seeds):
        if seed is None:
            continue
        if seed in positions:
            raise UserError(f"{group.label} has two runs with seed {seed} ({group.runs[positions[seed]]}, "
                            f"{group.runs[i]}); pass one evaluation per seed")
        positions[seed] = i
    return positions


def correct_per_image(folder: str | Path, metric: str) -> dict[int, bool] | None:
    """Per-image correctness of ``metric`` in an evaluation folder's predictions (either format), keyed by split
    index; None when the file or the metric is missing."""
    pred = read_predictions(folder)
    if pred is None:
        return None
    if metric == "top5":
        hits = pred.get("top5_hit")
    else:
        predicted = pred.get("predicted", {}).get(metric)
        hits = None if predicted is None else [p == y for p, y in zip(predicted, pred["label"], strict=True)]
    return None if hits is None else dict(zip(pred["index"], map(bool, hits), strict=True))


def _per_image(base: Group, other: Group, metric: str, pairs: list[tuple[int, int]]) -> stats.McNemar | None:
    """McNemar over the (seed, image) pairs of all paired seeds; None unless every run has predictions."""
    a, b = [], []
    for i, j in pairs:
        x, y = correct_per_image(base.runs[i], metric), correct_per_image(other.runs[j], metric)
        if x is None or y is None:
            return None
        common = sorted(x.keys() & y.keys())
        a += [x[k] for k in common]
        b += [y[k] for k in common]
    return stats.mcnemar(a, b) if a else None


def compare_groups(base: Group, other: Group, metrics: Sequence[str] = METRICS,
                   primary: str = PRIMARY) -> list[MetricComparison]:
    """Each metric of ``other`` against ``base``, paired by seed (groups that differ in one factor,
    :func:`_check_like`); Holm over the secondary metrics' p-values."""
    _check_like(base, other)
    base_at, other_at = _by_seed(base), _by_seed(other)
    seeds = sorted(base_at.keys() & other_at.keys())
    for s in seeds:  # a paired difference compares two runs on the same images, or it compares the images
        a, b = base.images[base_at[s]] if base.images else None, other.images[other_at[s]] if other.images else None
        same_data, same = same_images(a, b) if a is not None and b is not None else (True, True)
        if not same:
            where = f"seed {s} of {base.label} and of {other.label} was evaluated on different"
            runs = f"({base.runs[base_at[s]]}, {other.runs[other_at[s]]})"
            if not same_data:
                raise UserError(f"{where} data (another data set or split) {runs}; compare evaluations of the "
                                "same --dataset and --split")
            raise UserError(f"{where} images or k-NN banks {runs}; evaluate both with the same --split, --classes, "
                            "--per-class, --bank-split, --bank-per-class and --seed")
    rows = []
    for metric in metrics:
        x, y = base.values.get(metric, [None] * base.n), other.values.get(metric, [None] * other.n)
        paired = [(s, base_at[s], other_at[s]) for s in seeds
                  if x[base_at[s]] is not None and y[other_at[s]] is not None]
        if not paired:
            rows.append(MetricComparison(metric, [], None))
            continue
        delta = stats.paired_delta([x[i] for _, i, _ in paired], [y[j] for _, _, j in paired])
        pairs = [(i, j) for _, i, j in paired]
        per_image = _per_image(base, other, metric, pairs) if metric in ACCURACIES else None
        rows.append(MetricComparison(metric, [s for s, _, _ in paired], delta, per_image=per_image))
    secondary = [i for i, r in enumerate(rows) if r.metric != primary]
    p_holm = stats.holm([rows[i].delta.p if rows[i].delta else None for i in secondary])
    img_holm = stats.holm([rows[i].per_image.p if rows[i].per_image else None for i in secondary])
    for k, i in enumerate(secondary):
        rows[i] = replace(rows[i], p_holm=p_holm[k], per_image_p_holm=img_holm[k])
    return rows


def format_number(x: float | None, signed: bool = False) -> str:
    """A table cell: 4 decimals (``signed``: with its sign), ``-`` for none."""
    return "-" if x is None else f"{x:+.4f}" if signed else f"{x:.4f}"


def format_ci(d: stats.TInterval) -> str:
    """A 95% interval cell, ``-`` without one (one seed)."""
    return "-" if d.low is None else f"[{d.low:+.4f}, {d.high:+.4f}]"


def format_p(x: float | None) -> str:
    """A p-value cell: 3 significant digits, ``-`` for none."""
    return "-" if x is None else f"{x:.3g}"


def render_comparison(rows: Sequence[MetricComparison], primary: str = PRIMARY, primary_label: str = "primary") -> str:
    """Markdown table of :func:`compare_groups` rows (metrics without paired values are left out); the
    ``primary`` metric's Holm cells read ``primary_label`` (it is left out of the correction)."""
    lines = ["| metric | seeds | Δ mean | 95% CI | p | p Holm | MDE | per image: base only / other only | "
             "per-image Δ | per-image p | per-image p Holm |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.delta is None:
            continue
        d, img = r.delta, r.per_image
        holm = primary_label if r.metric == primary else format_p(r.p_holm)
        img_cells = ["-"] * 4 if img is None else [
            f"{img.base_only} / {img.other_only}", format_number(img.delta, True), format_p(img.p),
            primary_label if r.metric == primary else format_p(r.per_image_p_holm)]
        lines.append(f"| {r.metric} | {d.n} | {format_number(d.mean, True)} | {format_ci(d)} | {format_p(d.p)} | "
                     f"{holm} | {format_number(d.mde)} | " + " | ".join(img_cells) + " |")
    return "\n".join(lines)


STATISTICS_NOTE = (
    "Δ = other - base, paired by training seed: mean over paired seeds with a 95% t-interval and a two-sided "
    "p-value (one-sample t on the per-seed differences); MDE: the smallest true Δ that n seeds detect with power "
    "0.8 at level 0.05, from the noncentral t distribution with the observed sd(Δ) (none with one seed). The primary "
    f"metric is {PRIMARY}: its p-value is not corrected, neither within a comparison nor across the comparisons. "
    "Within each comparison (one table: one group against one base), the p-values of all other metrics are "
    "Holm-adjusted together (and so are their per-image p-values); there is no correction across comparisons. Per "
    "image: McNemar's mid-p test on the images each model alone got right, pooled over "
    "the paired seeds (each seed-image pair counts once); it measures test-image noise for these trained models, "
    "not seed-to-seed variation."
)


def format_mean(group: Group, metric: str) -> str:
    """A cell of a group's mean ± sample std of ``metric`` (the mean alone with one run, ``-`` without any)."""
    mean, std = group.mean.get(metric), group.std.get(metric)
    return "-" if mean is None else f"{mean:.4f}" if std is None else f"{mean:.4f} ± {std:.4f}"


def _cell(group: Group, metric: str) -> str:
    text = format_mean(group, metric)
    return f"{text} (n={group.count[metric]})" if text != "-" and group.count[metric] != group.n else text


def _delta(group: Group, base: Group, metric: str) -> str:
    a, b = group.mean.get(metric), base.mean.get(metric)
    return "-" if a is None or b is None else f"{a - b:+.4f}"


def render_markdown(groups: Sequence[Group], metrics: Sequence[str] = METRICS) -> str:
    """Markdown report: metric-by-group means (± sample std) with differences of means against the first group,
    then the paired statistics of every other group against the first, then the runs of each group."""
    base = groups[0]
    header = ["metric"] + [f"{g.label} (n={g.n})" for g in groups] + [f"Δ {g.label}" for g in groups[1:]]
    lines = ["# Evaluation comparison", "",
             f"Differences are against **{base.label}**. Values: mean ± sample std over runs.", ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
    for metric in metrics:
        if all(g.mean.get(metric) is None for g in groups):
            continue
        row = [metric] + [_cell(g, metric) for g in groups] + [_delta(g, base, metric) for g in groups[1:]]
        lines.append("| " + " | ".join(row) + " |")
    if len(groups) > 1:
        lines += ["", "## Paired statistics", "", STATISTICS_NOTE, ""]
        for g in groups[1:]:
            lines += [f"### {g.label} - {base.label}", "", render_comparison(compare_groups(base, g, metrics)), ""]
    lines += ["", "## Runs", ""]
    for g in groups:
        lines.append(f"- **{g.label}**: " + ", ".join(f"`{r}` (seed {s})" for r, s in zip(g.runs, g.seeds,
                                                                                         strict=True)))
    return "\n".join(lines) + "\n"


def ci_half_widths(group: Group, metrics: Sequence[str]) -> dict[str, float | None]:
    """Half-width of the 95% t-interval of each metric's mean over the group's runs (None with one run)."""
    widths: dict[str, float | None] = {}
    for metric in metrics:
        found = [v for v in group.values.get(metric, []) if v is not None]
        t = stats.t_interval(found) if found else None
        widths[metric] = None if t is None or t.high is None else t.high - t.mean
    return widths


def build_parser() -> CliParser:
    p = CliParser(prog="python -m harness.compare", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="evaluation folders (each with results.json)")
    p.add_argument("--output", required=True, type=output_dir, help="folder for report.md and comparison.png")
    p.add_argument("--metrics", nargs="+", default=list(METRICS), choices=SHOWABLE, metavar="METRIC",
                   help="metrics to show (the first listed group is the base; diagnostics, localisation on request), "
                        f"of: {', '.join(SHOWABLE)}")
    return p


def _check_metrics(results: Sequence[dict[str, Any]], asked: Sequence[str]) -> None:
    """Refuse ``--metrics`` that none of the evaluations holds (a value other than null), naming those they hold."""
    held = [m for m in SHOWABLE if any(r["metrics"].get(m) is not None for r in results)]
    lacking = [m for m in asked if m not in held]
    if lacking:
        raise UserError(f"--metrics {' '.join(lacking)}: none of the evaluations has a value for "
                        f"{'it' if len(lacking) == 1 else 'them'}; they have {', '.join(held) or 'none'}")


def main(argv: list[str] | None = None) -> list[Group]:
    parser = build_parser()
    args = parser.parse_args(argv)
    results = load_results(args.runs)
    check_distinct(results)
    if "metrics" in parser.given:
        _check_metrics(results, args.metrics)
    groups = summarise(results, args.metrics)
    out = Path(args.output)
    write_text(out / REPORT_FILE, render_markdown(groups, args.metrics) + f"\nCode: compared with {code_label()}; "
               f"evaluated with {code_labels(results)}.\n")
    shown = [m for m in args.metrics if any(g.mean.get(m) is not None for g in groups)]
    plot_comparison([g.label for g in groups], shown, {g.label: g.mean for g in groups},
                    {g.label: ci_half_widths(g, shown) for g in groups}, out / COMPARISON_FILE,
                    "Evaluation metrics by run group")
    print(f"compared {sum(g.n for g in groups)} runs in {len(groups)} groups -> {out / 'report.md'}")
    return groups


if __name__ == "__main__":
    run_cli(main)
