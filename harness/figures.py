"""Every PNG figure of the harness and the study: cosine matrix, heatmaps, explanations, faithfulness, comparisons.

Each function that draws imports matplotlib itself, so that a command's ``--help`` loads none."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from harness import stats
from timm_rollout.atomic import save_figure
from timm_rollout.curves import draw_seeds, epoch_axis, seeds_phrase
from timm_rollout.explain import Explanation

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["BOX_NOTE", "MAP_CMAP", "UNIFORM_SCALE_LABEL", "draw_box", "draw_map", "plot_comparison",
           "plot_cosine_matrix", "plot_dose", "plot_explanation", "plot_faithfulness", "plot_heatmaps",
           "plot_object_weights", "plot_pooling_diagnostics", "plot_training_curves", "recorded_grid",
           "relative_to_uniform", "shared_range", "upsample_patch_map"]

# Colour-bar label of maps drawn on the scale of relative_to_uniform.
UNIFORM_SCALE_LABEL = "weight x number of patches (1 = uniform)"


def plot_cosine_matrix(matrix: np.ndarray, class_names: Sequence[str], path: str | Path, title: str) -> Path:
    """Class-by-class cosine similarity of centroids, annotated when there are at most 20 classes."""
    from matplotlib.figure import Figure

    c = len(class_names)
    size = min(20.0, max(4.0, 0.45 * c + 2.0))
    fig = Figure(figsize=(size + 1.0, size))
    ax = fig.subplots()
    im = ax.imshow(matrix, cmap="viridis", vmin=min(0.0, float(matrix.min())), vmax=1.0)
    ticks = range(c)
    fontsize = 9 if c <= 20 else 6
    ax.set_xticks(ticks, class_names, rotation=90 if c > 10 else 45, ha="right" if c <= 10 else "center",
                  fontsize=fontsize)
    ax.set_yticks(ticks, class_names, fontsize=fontsize)
    ax.set_xlabel("class")
    ax.set_ylabel("class")
    if c <= 20:
        for i in range(c):
            for j in range(c):
                ax.text(j, i, f"{matrix[i, j]:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if matrix[i, j] < 0.6 else "black")
    fig.colorbar(im, ax=ax, label="cosine similarity of class centroids")
    ax.set_title(title)
    return save_figure(fig, path)


def relative_to_uniform(maps: torch.Tensor) -> torch.Tensor:
    """(..., P) patch maps as each patch's share of its map's total times P: 1 is the uniform share, 2 twice it.

    For pooling weights (which sum to 1) this is weight x P; on this scale near-uniform weights look near-uniform
    (a map stretched to its own range would not)."""
    m = maps.float()
    return m / m.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) * m.shape[-1]


def shared_range(maps: Sequence[torch.Tensor]) -> tuple[float, float]:
    """One colour range for maps on the :func:`relative_to_uniform` scale: 0 to their largest value (at least 2, so
    near-uniform maps stay near one colour)."""
    return 0.0, max(2.0, *(float(m.max()) for m in maps))


def upsample_patch_map(values: torch.Tensor, grid: Sequence[int], size: Sequence[int]) -> np.ndarray:
    """(P,) patch values, row-major over a (rows, cols) ``grid`` as timm orders patch tokens -> (H, W) float32 map
    of ``size`` in which each patch fills exactly the block of pixels it covers: how every figure draws patches."""
    rows, cols = (int(g) for g in grid)
    if values.numel() != rows * cols:
        raise ValueError(f"{values.numel()} patch values do not fill a {rows}x{cols} patch grid")
    h, w = (int(s) for s in size)
    at_row, at_col = torch.arange(h) * rows // h, torch.arange(w) * cols // w
    return values.detach().float().cpu().reshape(rows, cols)[at_row[:, None], at_col[None, :]].numpy()


def recorded_grid(record: Mapping) -> tuple[int, int]:
    """The (rows, cols) patch grid of a results.json ``pooling_diagnostics`` record; records written before it was
    recorded held square grids (8x8 for every committed study)."""
    if record.get("grid"):
        return tuple(int(g) for g in record["grid"])
    p = int(record["num_patches"])
    side = math.isqrt(p)
    if side * side != p:
        raise ValueError(f"a pooling_diagnostics record of {p} patches without its grid; re-evaluate it with this "
                         "version of python -m harness.eval")
    return side, side


MAP_CMAP = "inferno"


def draw_map(ax, values: np.ndarray, vrange: tuple[float, float], **imshow: object):
    """Draw an (H, W) map on its own, opaque, on the colour range ``vrange``, each cell as its own block: every
    colour is the colour bar's for its value. Returns the ``AxesImage``."""
    return ax.imshow(values, cmap=MAP_CMAP, vmin=vrange[0], vmax=vrange[1], **{"interpolation": "nearest", **imshow})


def _map_panel(fig: Figure, ax, values: torch.Tensor, grid: Sequence[int], size: Sequence[int],
               vrange: tuple[float, float], title: str, fontsize: int = 8) -> None:
    """One (P,) patch map drawn by :func:`draw_map` on ``size`` pixels, titled, with its own colour bar."""
    im = draw_map(ax, upsample_patch_map(values, grid, size), vrange)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04).set_label(UNIFORM_SCALE_LABEL, fontsize=7)
    ax.set_title(title, fontsize=fontsize)


BOX_COLOUR = "cyan"
BOX_NOTE = f"{BOX_COLOUR} outline: the object's box"


def draw_box(ax, box: Sequence[float] | torch.Tensor) -> None:
    """Outline an object box ``[x, y, w, h]`` in pixels (COCO order) on an ``imshow`` axis: pixel ``x`` spans
    ``x - 0.5 .. x + 0.5`` there, so the outline runs along the box's outer pixel edges."""
    from matplotlib.patches import Rectangle

    x, y, w, h = (float(v) for v in box)
    ax.add_patch(Rectangle((x - 0.5, y - 0.5), w, h, fill=False, edgecolor=BOX_COLOUR, linewidth=1.2))


def plot_heatmaps(
    images: torch.Tensor,
    maps: Mapping[str, torch.Tensor],
    true_names: Sequence[str],
    pred_names: Sequence[str] | Mapping[str, Sequence[str]],
    path: str | Path,
    title: str,
    boxes: torch.Tensor | None = None,
    *,
    grid: Sequence[int],
) -> Path:
    """One row per uint8 (3, H, W) image: the image, then each named (B, P) map over the patch ``grid`` beside it,
    on the :func:`relative_to_uniform` scale, each column on its own colour range (:func:`shared_range` of its maps)
    with its own colour bar below it. ``pred_names``: one prediction per image, or per map name when the columns
    come from different models; ``boxes``: (B, 4) ``[x, y, w, h]`` outlined on every panel of their row. The layout
    is fixed in inches (no tight_layout over dozens of axes)."""
    from matplotlib.figure import Figure

    per_column = isinstance(pred_names, Mapping)
    maps = {name: relative_to_uniform(values) for name, values in maps.items()}
    b, _, h, w = images.shape
    cols = len(maps) + 1
    heads = {name: "\n".join(textwrap.fill(line, 26) for line in name.split("\n")) for name in maps}  # fit a panel
    header = 0.16 * (max(head.count("\n") for head in heads.values()) + 3)  # column names + the first row's titles
    panel, gap_w, gap_h, left, right, bottom, top = 1.9, 0.25, 0.45, 0.6, 0.2, 1.05, 0.45 + header  # inches
    tall = panel * min(h / w, 2)  # a panel's height: the images' aspect (up to 2:1), no empty bands above and below
    fig_w, fig_h = left + cols * panel + (cols - 1) * gap_w + right, bottom + b * tall + (b - 1) * gap_h + top
    fig = Figure(figsize=(fig_w, fig_h))
    axes = fig.subplots(b, cols, squeeze=False, sharex=True, sharey=True)
    fig.subplots_adjust(left=left / fig_w, right=1 - right / fig_w, bottom=bottom / fig_h, top=1 - top / fig_h,
                        wspace=gap_w / panel, hspace=gap_h / tall)
    drawn = {}
    for i in range(b):
        axes[i, 0].imshow(images[i].permute(1, 2, 0).numpy(), interpolation="nearest")
        axes[i, 0].set_title(f"true: {true_names[i]}" + ("" if per_column else f"\npred: {pred_names[i]}"), fontsize=9)
        for ax, (name, values) in zip(axes[i, 1:], maps.items(), strict=True):
            drawn[name] = draw_map(ax, upsample_patch_map(values[i], grid, (h, w)), shared_range([values]))
            pred = f"pred: {pred_names[name][i]}" if per_column else ""
            ax.set_title(f"{heads[name]}\n{pred}" if i == 0 else pred, fontsize=9)
        if boxes is not None:
            for ax in axes[i]:
                draw_box(ax, boxes[i])
    for ax in axes[-1]:
        ax.set_xlabel("x (pixels)", fontsize=7)
    for ax in axes[:, 0]:
        ax.set_ylabel("y (pixels)", fontsize=7)
    for ax in axes.flat:
        ax.tick_params(labelsize=6)
    for ax, im in zip(axes[-1, 1:], drawn.values(), strict=True):  # each column's colour bar, below it
        at = ax.get_position()
        bar = fig.add_axes((at.x0, 0.3 / fig_h, at.width, 0.1 / fig_h))
        fig.colorbar(im, cax=bar, orientation="horizontal").set_label(UNIFORM_SCALE_LABEL, fontsize=7)
        bar.tick_params(labelsize=6)
    fig.suptitle(title + (f" ({BOX_NOTE})" if boxes is not None else ""), y=1 - 0.2 / fig_h, va="top")
    return save_figure(fig, path)


def plot_comparison(
    groups: Sequence[str],
    metrics: Sequence[str],
    means: Mapping[str, Mapping[str, float | None]],
    errors: Mapping[str, Mapping[str, float | None]],
    path: str | Path,
    title: str,
) -> Path:
    """Grouped bars: one group of bars per metric, one bar per run group; error bars are ``errors`` (the half-widths
    of the 95% t-intervals of the means over runs; none for a single run)."""
    from matplotlib.figure import Figure

    x = np.arange(len(metrics))
    width = 0.8 / max(1, len(groups))
    fig = Figure(figsize=(max(6.0, 1.3 * len(metrics) * max(1, len(groups)) ** 0.5), 4.5))
    ax = fig.subplots()
    for j, group in enumerate(groups):
        vals = [means[group].get(m) for m in metrics]
        errs = [errors[group].get(m) or 0.0 for m in metrics]
        heights = [np.nan if v is None else v for v in vals]
        ax.bar(x + (j - (len(groups) - 1) / 2) * width, heights, width, yerr=errs, capsize=3, label=group)
    ax.set_xticks(x, metrics)
    ax.set_xlabel("metric")
    ax.set_ylabel("value (mean over runs, error bar = 95% CI)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def plot_pooling_diagnostics(records: Mapping[str, Sequence[dict]], path: str | Path, title: str) -> Path:
    """At a glance, per arm (``records``: arm -> the ``pooling_diagnostics`` of results.json, one per seed): the
    distribution of effective patches over the images of all seeds (top) and the mean rollout pooling weight map
    (bottom, weight x number of patches, 1 = uniform, one colour range)."""
    from matplotlib.figure import Figure

    arms = list(records)
    fig = Figure(figsize=(max(8.0, 3.3 * len(arms)), 7.5))
    grid = fig.add_gridspec(2, len(arms), height_ratios=(1.1, 1.0))
    top = fig.add_subplot(grid[0, :])
    means, low = {}, float("inf")
    for j, arm in enumerate(arms):
        seeds = records[arm]
        edges = np.asarray(seeds[0]["effective_patches_histogram"]["edges"])
        if any(r["effective_patches_histogram"]["edges"] != seeds[0]["effective_patches_histogram"]["edges"]
               for r in seeds):
            raise ValueError(f"the seeds of {arm} binned effective patches differently; re-evaluate them with one "
                             "version of python -m harness.eval")
        counts = np.sum([r["effective_patches_histogram"]["counts"] for r in seeds], axis=0)
        top.stairs(counts / counts.sum(), edges, color=f"C{j}", lw=1.6,
                   label=f"{arm} ({len(seeds)} seed(s), {counts.sum()} images)")
        means[arm] = relative_to_uniform(torch.tensor([r["mean_weights"] for r in seeds]).mean(dim=0))
        low = min(low, float(edges[:-1][counts > 0].min()))
    p = len(next(iter(means.values())))
    top.axvline(p, color="grey", ls="--", lw=1, label=f"uniform weights ({p}, the patch mean)")
    top.set(xlabel=f"effective patches exp(entropy) of an image's rollout pooling weights (uniform = {p})",
            ylabel="fraction of images", title="How many patches rollout pooling effectively averages")
    top.set_xlim(max(1.0, math.floor(low) - 2.0), p + 0.5)  # from the sharpest image seen to uniform
    top.grid(alpha=0.3)
    top.legend(fontsize=8, loc="upper left")
    vmin, vmax = shared_range(list(means.values()))
    for j, arm in enumerate(arms):
        ax = fig.add_subplot(grid[1, j])
        patches = recorded_grid(records[arm][0])
        _map_panel(fig, ax, means[arm], patches, patches, (vmin, vmax), f"{arm}\nmean weights over the images", 9)
        ax.set(xlabel="patch column", ylabel="patch row")
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_object_weights(values: Mapping[str, Sequence[tuple[float, float]]], path: str | Path, title: str) -> Path:
    """Where each arm's pooling weights go: per arm (``values``: arm -> per seed (inside, outside), the metrics
    ``pooling_weight_inside`` and ``pooling_weight_outside``) a bar of the mean over seeds of the mean pooling
    weight x P over the object's box and one over the rest of the image, each seed a dot; 1 = uniform (dashed)."""
    from matplotlib.figure import Figure

    arms = list(values)
    x = np.arange(len(arms))
    width = 0.36
    fig = Figure(figsize=(max(5.0, 1.4 * len(arms) + 2.0), 4.5))
    ax = fig.subplots()
    for j, (where, colour) in enumerate((("inside the box", "C3"), ("outside the box", "C0"))):
        offset = (j - 0.5) * width
        seeds = [np.asarray([v[j] for v in values[arm]], dtype=float) for arm in arms]
        ax.bar(x + offset, [s.mean() if len(s) else np.nan for s in seeds], width, color=colour, alpha=0.55,
               label=f"{where} (mean over seeds)")
        for i, s in enumerate(seeds):
            ax.plot(np.full(len(s), x[i] + offset), s, "o", color="black", ms=4, label="one seed" if i == j == 0
                    and len(s) else None)
    ax.axhline(1.0, color="grey", ls="--", lw=1, label="uniform weights (the patch mean)")
    ax.set_xticks(x, arms)
    ax.set_xlabel("arm (pooling)")
    ax.set_ylabel("mean pooling weight x number of patches")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)


def _mean_and_interval(ax, x: np.ndarray, per_x: Sequence[Sequence[float]], style: dict[str, Any], label: str,
                       seeds: bool = False) -> None:
    """Means over seeds joined by a line, with 95% t-interval bars (two seeds or more) and optionally each seed's
    values joined by a thin line (the same models at every x)."""
    found = [stats.t_interval(v) for v in per_x]
    mean = np.array([f.mean for f in found])
    err = np.array([[f.mean - f.low, f.high - f.mean] if f.low is not None else [0.0, 0.0] for f in found]).T
    ax.errorbar(x, mean, yerr=err, capsize=4, marker="o", label=label, **style)
    if seeds:
        for j, values in enumerate(np.asarray(per_x, dtype=float).T):
            ax.plot(x, values, ".-", color="black", alpha=0.35, lw=0.8, ms=5, label="one seed" if j == 0 else None)


MASS_STYLES = ({"color": "C3", "lw": 2}, {"color": "C0", "lw": 1.5}, {"color": "C3", "ls": ":", "lw": 1.2},
               {"color": "grey", "ls": "--", "lw": 1.2}, {"color": "grey", "ls": ":", "lw": 1.2})


def plot_dose(gains: Mapping[str, Sequence[float]], masses: Mapping[str, Mapping[str, Sequence[float]]],
              path: str | Path, title: str, gain_label: str, interest: float) -> Path:
    """The dose figure: left, ``gains`` (dose -> per-seed arm - base top-1) with their means, 95% t-intervals, 0
    and the gain of interest ``interest``; right (when ``masses`` holds any), the object mass of each map (label
    -> dose -> per-seed values) at each dose, the arm's first. Doses in the order given, lowest first."""
    from matplotlib.figure import Figure

    names = list(gains)
    x = np.arange(len(names), dtype=float)
    fig = Figure(figsize=(12.0 if masses else 6.0, 4.8))
    axes = fig.subplots(1, 2 if masses else 1, squeeze=False)[0]
    ax = axes[0]
    _mean_and_interval(ax, x, [gains[n] for n in names], {"color": "C3", "lw": 2}, "mean over seeds, 95% CI",
                       seeds=True)
    ax.axhline(0.0, color="black", lw=0.8)
    ax.axhline(interest, color="grey", ls="--", lw=1, label=f"gain of interest +{interest:g}")
    ax.set_title(f"{gain_label} at each dose", fontsize=10)
    ax.set_ylabel(f"{gain_label}, test top-1 (0.01 = one point)")
    for ax in axes:
        ax.set_xticks(x, names, rotation=15, fontsize=8)
        ax.set_xlabel("test set (same objects in the same places), lowest dose first")
        ax.grid(axis="y", alpha=0.3)
    if masses:
        ax = axes[1]
        for (label, per), style in zip(masses.items(), MASS_STYLES, strict=False):
            _mean_and_interval(ax, x, [per[n] for n in names], style, label)
        ax.set_title("Weight on the object at each dose (mean over seeds, 95% CI of each map alone;\n"
                     "the report's differences are paired by seed)", fontsize=10)
        ax.set_ylabel("object mass (share of the map on the object)")
        ax.set_ylim(0, 1)
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return save_figure(fig, path)


CURVE_PANELS = {  # log.csv column -> (y label, title); the last only when some run logged it (rollout pooling)
    "train_loss": ("train cross-entropy loss", "Training loss"),
    "eval_top1": ("eval top-1 accuracy (%)", "Eval top-1 accuracy"),
    "rollout_effective_patches": ("effective patches of the rollout weights", "Rollout pooling: effective patches"),
}


def plot_training_curves(logs: dict[str, dict[int, list[dict[str, float]]]], path: Path, title: str,
                         marks: Mapping[str, Sequence[tuple[int, float | None]]] | None = None) -> Path:
    """Train loss, eval top-1 and (rollout-pooled arms) the effective patches of their pooling weights per epoch:
    one colour per arm, a thin line per seed and a bold mean over seeds (an arm of one seed: its one bold line),
    one legend entry per arm below the axes (readable with any number of seeds), ticks on whole epochs.
    ``marks``: another study's training losses per arm, (epoch, loss or None), drawn as crosses in the arm's
    colour on a log-scale loss axis, with a dotted line at each of their epochs."""
    from matplotlib.figure import Figure

    keys = [k for k in CURVE_PANELS if k != "rollout_effective_patches"
            or any(k in r for per_seed in logs.values() for rows in per_seed.values() for r in rows)]
    fig = Figure(figsize=(5.5 * len(keys), 4.6))
    axes = dict(zip(keys, fig.subplots(1, len(keys)), strict=True))
    for arm, (short, per_seed) in enumerate(logs.items()):
        colour = f"C{arm}"  # one colour per arm, any number of arms
        runs = [rows for _, rows in sorted(per_seed.items())]
        for key, ax in axes.items():
            draw_seeds(ax, runs, key, colour, f"{short} ({'mean of ' if len(runs) > 1 else ''}"
                                              f"{seeds_phrase(len(runs))})")
    if marks:
        _loss_marks(axes["train_loss"], [*logs], marks)
    for key, ax in axes.items():
        ax.set(ylabel=CURVE_PANELS[key][0], title=CURVE_PANELS[key][1])
        epoch_axis(ax)
        ax.grid(alpha=0.3)
    if "rollout_effective_patches" in axes:  # a count of patches from 0: near-uniform weights do not look like a fall
        axes["rollout_effective_patches"].set_ylim(bottom=0)
    handles, labels = axes["eval_top1"].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8, frameon=False)
    several = any(len(per_seed) > 1 for per_seed in logs.values())
    fig.suptitle(f"{title} (thin lines: single seeds)" if several else title)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return save_figure(fig, path)


def _loss_marks(ax, arms: Sequence[str], marks: Mapping[str, Sequence[tuple[int, float | None]]]) -> None:
    """The write-up's read-off losses on a log axis: a cross per (arm, epoch) with a level, a line per epoch."""
    ax.set_yscale("log")
    for epoch in sorted({e for points in marks.values() for e, _ in points}):
        ax.axvline(epoch, color="0.6", ls=":", lw=1)
    for arm, points in marks.items():
        shown = [(e, v) for e, v in points if v is not None]
        if arm in arms and shown:
            ax.plot(*zip(*shown, strict=True), "x", color=f"C{arms.index(arm)}", ms=9, mew=2,
                    label=f"{arm}: write-up's read-off")
    ax.legend(fontsize=8, loc="upper right")


EXPLANATION_COLUMNS = 5


def plot_explanation(ex: Explanation, rgb: np.ndarray, title: str, input_title: str, path: str | Path,
                     box: torch.Tensor | None = None) -> Path:
    """One figure: the input, every map of ``ex`` (image 0) and its rollout build-up, each with a colour bar; all
    maps on the scale of :func:`relative_to_uniform`, each on its own colour range (:func:`shared_range`); ``box``
    (the object's ``[x, y, w, h]`` in the input's pixels) outlined on every panel."""
    from matplotlib.figure import Figure

    panels = [(name, values[0]) for name, values in ex.maps.items()]
    panels += [(f"rollout through layer {i + 1}", ex.buildup[0, i]) for i in range(ex.buildup.shape[1])]
    panels = [(name, relative_to_uniform(values.float().cpu())) for name, values in panels]
    rows = -(-(len(panels) + 1) // EXPLANATION_COLUMNS)
    fig = Figure(figsize=(3.2 * EXPLANATION_COLUMNS, 3.0 * rows))
    axes = fig.subplots(rows, EXPLANATION_COLUMNS, squeeze=False).ravel()
    axes[0].imshow(rgb, interpolation="nearest")
    axes[0].set_title(input_title, fontsize=8)
    axes[0].set_xlabel("x (pixels)", fontsize=7)
    axes[0].set_ylabel("y (pixels)", fontsize=7)
    for ax, (name, values) in zip(axes[1:], panels, strict=False):
        _map_panel(fig, ax, values, ex.grid, rgb.shape[:2], shared_range([values]), name)
        ax.set(xticks=[], yticks=[])
    for ax in axes[len(panels) + 1:]:
        ax.axis("off")
    if box is not None:
        for ax in axes[:len(panels) + 1]:
            draw_box(ax, box)
        title += f" ({BOX_NOTE})"
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))  # keep the suptitle clear of the panels
    return save_figure(fig, path)


def _legend(label: str, auc: float, score: Mapping[str, Any] | None) -> str:
    """A curve's legend entry: its AUC and, for a map, its paired score with the 95% interval."""
    if score and score["ci95"]:
        lo, hi = score["ci95"]
        return f"{label} (AUC {auc:.3f}; paired {score['mean']:+.3f} [{lo:+.3f}, {hi:+.3f}])"
    return f"{label} (AUC {auc:.3f})"


def plot_faithfulness(result: Mapping[str, Any], path: str | Path, title: str = "Faithfulness") -> Path:
    """Deletion and insertion curves (random: mean ± std over seeds), one row per fill; AUCs, paired scores."""
    from matplotlib.figure import Figure

    fractions = np.array(result["fractions"]) * 100
    fills = result["fills"]
    fig = Figure(figsize=(12, 4.6 * len(fills)))
    axes = fig.subplots(len(fills), 2, squeeze=False)
    for row, block in zip(axes, fills.values(), strict=True):
        for ax, curve, verb in zip(row, ("deletion", "insertion"), ("removed", "revealed"), strict=True):
            for name, summary in block["maps"].items():
                mean = np.array(summary[f"{curve}_curve"])
                style = "--" if name == "random" else "-"
                ax.plot(fractions, mean, style, marker="o", markersize=3,
                        label=_legend(result["labels"].get(name, name), summary[f"{curve}_auc"],
                                      block["paired"].get(name, {}).get(curve)))
                if name == "random":
                    spread = np.array(summary[f"{curve}_curve_std"])
                    ax.fill_between(fractions, mean - spread, mean + spread, alpha=0.25,
                                    color=ax.lines[-1].get_color())
            better = "lower" if curve == "deletion" else "higher"
            ax.set_title(f"{curve}, {block['fill']}: {better} is better", fontsize=10)
            ax.set_xlabel(f"patches {verb} (%, most salient first)")
            ax.set_ylabel("probability of the original prediction")
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    timing = f", {result['wall_time_s']:.0f} s" if "wall_time_s" in result else ""
    fig.suptitle(f"{title}: {result['num_images']} images, {result['num_patches']} patches{timing}")
    fig.tight_layout()
    return save_figure(fig, path)
