"""The report's tables as markdown: means per arm, paired differences, the pooling diagnostics, localisation
against its nulls, and the interaction of two studies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from harness import stats
from harness.compare import (
    METRICS,
    PRIMARY,
    STATISTICS_NOTE,
    Group,
    compare_groups,
    format_ci,
    format_mean,
    format_number,
    format_p,
    render_comparison,
)
from harness.metrics import LOCALISATION, POOLING_DIAGNOSTICS

from .plan import REFERENCES


def means_table(groups: dict[str, Group], metrics: Sequence[str]) -> str:
    """Markdown table: each metric's mean ± sample std over seeds, one column per arm."""
    lines = ["| metric | " + " | ".join(f"{arm} (n={g.n})" for arm, g in groups.items()) + " |",
             "|---|" + "---:|" * len(groups)]
    for m in metrics:
        if all(g.mean.get(m) is None for g in groups.values()):
            continue
        lines.append(f"| {m} | " + " | ".join(format_mean(g, m) for g in groups.values()) + " |")
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


def tested_metrics(extra: Sequence[str]) -> list[str]:
    """The metrics the paired tables test: the harness metrics, ``extra`` and the localisation scores; the
    random-order baseline (no hypothesis), the pooling diagnostics (they describe the weights), the chance levels
    and the descriptive localisation rows are shown, not tested."""
    tested = [m for m in (*METRICS, *extra) if not m.startswith("random ")]
    return tested + [m for m in LOCALISATION if m not in (*CHANCE_LEVELS, *DESCRIPTIVE)]


def report_tables(groups: dict[str, Group], extra: list[str], primary: tuple[str, str] | None,
                   primary_metric: str = PRIMARY) -> list[str]:
    """The report's statistics: means per arm and paired differences."""
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
