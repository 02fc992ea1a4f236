"""Faithfulness of saliency maps: patch-level deletion and insertion curves and their areas.

For each image, patches are ranked by a map (most salient first). The *deletion* curve removes the top
k patches, the *insertion* curve removes all but the top k, for k = 0, 10%, ..., 100% of the patches
(``round(i * P / 10)``). A removed patch is filled with the model's per-channel mean colour (its
normalisation mean, the data set mean it was trained with), i.e. exactly 0 after normalisation. Each
point is the softmax probability of the class the model predicted on the intact image; each curve is
summarised by its area (trapezoid over the fraction of patches, 0..1), averaged over images. A faithful
map has a *lower* deletion AUC and a *higher* insertion AUC than a random order.

Maps: the rollout pooling weights (mean head fusion, no discard: the rollout model's own pooling weights,
a post-hoc readout for other models), last-layer [CLS] attention (mean of heads), Chefer's
gradient-weighted rollout for the predicted class, and random orders (mean and std over seeds).

Forward passes: the maps and the original prediction come from one forward + backward per image. The 0%
and 100% points are shared by every order (the intact image; the all-mean image, one pass for all
images), so each order costs 9 passes per curve. A random order's insertion curve is read from the
deletion passes of the same permutation, reversed (the reverse of a uniform random order is one too, and
revealing its top k is deleting the top P - k of the original), so each seed costs 9 passes per image.
That insertion curve is the deletion curve mirrored, so a seed's random deletion and insertion AUCs are
equal by construction (in expectation they are equal for random orders anyway).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import nn
from tqdm.auto import tqdm

from timm_rollout.atomic import atomic_path
from timm_rollout.data import normalize
from timm_rollout.device import autocast
from timm_rollout.explain import cls_attention, gradient_pass, gradient_rollout, rollout_map

__all__ = [
    "MAP_LABELS",
    "evaluate_faithfulness",
    "faithfulness_curves",
    "perturbation_probabilities",
    "plot_faithfulness",
    "ranks",
    "step_counts",
]

STEPS = 10
MAP_LABELS = {
    "rollout_weights": "rollout pooling weights",
    "last_cls_attention": "last-layer [CLS] attention",
    "gradient_rollout": "gradient-weighted rollout",
    "random": "random order",
}


def step_counts(num_patches: int, steps: int = STEPS) -> list[int]:
    """Patches removed (or revealed) at each of the ``steps + 1`` points: ``round(i * P / steps)``."""
    return [round(i * num_patches / steps) for i in range(steps + 1)]


def ranks(scores: torch.Tensor) -> torch.Tensor:
    """(B, P) rank of each patch, 0 = most salient; ties keep patch order (stable sort)."""
    order = scores.float().argsort(dim=1, descending=True, stable=True)
    out = torch.empty_like(order)
    return out.scatter_(1, order, torch.arange(order.shape[1]).expand_as(order).contiguous())


def _random_ranks(num_images: int, num_patches: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return ranks(torch.rand(num_images, num_patches, generator=gen))


def _mask_images(x: torch.Tensor, removed: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Zero (= mean colour after normalisation) the removed patches: x (M, 3, H, W), removed (M, P) bool."""
    m, _, h, w = x.shape
    keep = (~removed).view(m, 1, grid[0], grid[1]).to(x.dtype)
    keep = keep.repeat_interleave(h // grid[0], dim=2).repeat_interleave(w // grid[1], dim=3)
    return x * keep


@contextmanager
def _fused_attention(model: nn.Module) -> Iterator[bool]:
    """Use torch's fused attention for the duration unless the model pools by its recorded attention.

    The explicit path (softmax materialised) is only needed by rollout pooling; fused attention gives the
    same outputs up to float rounding and is ~1.4x faster for the tiny CLS ViT on CPU. Yields whether fused.
    """
    modules = [m for m in model.modules() if hasattr(m, "fused_attn")]
    if getattr(model, "global_pool", None) == "rollout" or not modules:
        yield False
        return
    before = [m.fused_attn for m in modules]
    try:
        for m in modules:
            m.fused_attn = True
        yield True
    finally:
        for m, was in zip(modules, before, strict=True):
            m.fused_attn = was


@torch.inference_mode()
def perturbation_probabilities(
    model: nn.Module,
    x: torch.Tensor,
    removed: torch.Tensor,
    grid: tuple[int, int],
    target: torch.Tensor,
    *,
    batch_size: int = 512,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    desc: str = "perturbed inputs",
) -> torch.Tensor:
    """Probability of ``target`` (B,) for each of S perturbations of each image: (B, S).

    ``x`` (B, 3, H, W) normalised images; ``removed`` (B, S, P) bool masks of the patches to fill with the
    mean colour. Perturbed inputs are built batch by batch across images and perturbations; attention runs
    fused unless the model pools by attention rollout.
    """
    device = torch.device(device)
    b, s, p = removed.shape
    if (x.shape[-2] % grid[0]) or (x.shape[-1] % grid[1]) or grid[0] * grid[1] != p:
        raise ValueError(f"images {tuple(x.shape[-2:])} do not split into a {grid} grid of {p} patches")
    flat = removed.reshape(b * s, p)
    out = torch.empty(b * s, dtype=torch.float32)
    model.eval()
    with _fused_attention(model), tqdm(total=b * s, desc=desc, unit="img", leave=False) as bar:
        for start in range(0, b * s, batch_size):
            idx = torch.arange(start, min(start + batch_size, b * s))
            image = idx // s
            xb = _mask_images(x[image].to(device), flat[idx].to(device), grid)
            with autocast(device, dtype):
                logits = model(xb)
            probs = logits.float().softmax(dim=1)
            out[idx] = probs.gather(1, target[image].to(device)[:, None]).squeeze(1).cpu()
            bar.update(len(idx))
    return out.view(b, s)


def _maps(model: nn.Module, x: torch.Tensor, *, batch_size: int, device: torch.device, dtype: torch.dtype | None):
    """Original logits and the three maps, (B, C) and name -> (B, P), from forward + backward passes."""
    logits, maps, grid = [], {name: [] for name in MAP_LABELS if name != "random"}, None
    for start in tqdm(range(0, len(x), batch_size), desc="maps (forward + backward)", leave=False):
        with autocast(device, dtype):
            p = gradient_pass(model, x[start:start + batch_size].to(device))
        grid = p.grid
        logits.append(p.logits.cpu())
        maps["rollout_weights"].append(rollout_map(p, "mean").cpu())
        maps["last_cls_attention"].append(cls_attention(p, -1).cpu())
        maps["gradient_rollout"].append(gradient_rollout(p).cpu())
    return torch.cat(logits), {k: torch.cat(v) for k, v in maps.items()}, grid


def _auc(curves: torch.Tensor, fractions: np.ndarray) -> np.ndarray:
    """Trapezoid area under each (B, steps + 1) curve over the fractions of patches."""
    return np.trapezoid(curves.double().numpy(), fractions, axis=1)


def _summary(deletion: torch.Tensor, insertion: torch.Tensor, fractions: np.ndarray) -> dict[str, Any]:
    return {
        "deletion_auc": round(float(_auc(deletion, fractions).mean()), 5),
        "insertion_auc": round(float(_auc(insertion, fractions).mean()), 5),
        "deletion_curve": [round(v, 5) for v in deletion.mean(dim=0).tolist()],
        "insertion_curve": [round(v, 5) for v in insertion.mean(dim=0).tolist()],
    }


def _curve(first: torch.Tensor, middle: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    return torch.cat([first[:, None], middle, last[:, None]], dim=1)


def faithfulness_curves(
    model: nn.Module,
    x: torch.Tensor,
    logits: torch.Tensor,
    maps: Mapping[str, torch.Tensor],
    grid: tuple[int, int],
    *,
    seeds: Sequence[int] = (0, 1, 2),
    batch_size: int = 512,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Deletion/insertion curves and AUCs for named (B, P) ``maps`` and random orders (one per seed).

    ``x``: normalised images (B, 3, H, W); ``logits``: the model's logits on them, which fix the class
    tracked and the 0%/100% points.
    """
    if not seeds:
        raise ValueError("give at least one seed for the random baseline")
    device = torch.device(device)
    n, p = len(x), grid[0] * grid[1]
    pred = logits.argmax(dim=1).cpu()
    clean = logits.float().softmax(dim=1).cpu().gather(1, pred[:, None]).squeeze(1)
    with torch.inference_mode(), autocast(device, dtype):
        empty_probs = model(torch.zeros(1, *x.shape[1:], device=device)).float().softmax(dim=1)[0].cpu()
    empty = empty_probs[pred]

    counts = step_counts(p)
    inner = counts[1:-1]
    random_counts = sorted(set(inner) | {p - k for k in inner})
    kinds: list[tuple[str, str, list[int]]] = []  # (name, curve, counts), in the order of the masks
    masks = []
    k_inner = torch.tensor(inner)
    for name, scores in maps.items():
        r = ranks(scores.cpu())[:, None, :]
        masks += [r < k_inner[None, :, None], r >= k_inner[None, :, None]]
        kinds += [(name, "deletion", inner), (name, "insertion", inner)]
    k_random = torch.tensor(random_counts)
    for seed in seeds:
        masks.append(_random_ranks(n, p, seed)[:, None, :] < k_random[None, :, None])
        kinds.append((f"random_{seed}", "deletion", random_counts))
    removed = torch.cat(masks, dim=1)
    probs = perturbation_probabilities(model, x, removed, grid, pred, batch_size=batch_size, device=device,
                                       dtype=dtype, desc=f"faithfulness ({n} images x {removed.shape[1]})")
    chunks = dict(zip([(name, curve) for name, curve, _ in kinds],
                      probs.split([len(c) for _, _, c in kinds], dim=1), strict=True))

    fractions = np.array(counts, dtype=np.float64) / p
    results: dict[str, Any] = {}
    for name in maps:
        results[name] = _summary(_curve(clean, chunks[name, "deletion"], empty),
                                 _curve(empty, chunks[name, "insertion"], clean), fractions)
    per_seed = []
    for seed in seeds:
        by_count = dict(zip(random_counts, chunks[f"random_{seed}", "deletion"].unbind(1), strict=True))
        deletion = _curve(clean, torch.stack([by_count[k] for k in inner], dim=1), empty)
        insertion = _curve(empty, torch.stack([by_count[p - k] for k in inner], dim=1), clean)
        per_seed.append(_summary(deletion, insertion, fractions))
    results["random"] = _random_summary(per_seed, seeds)
    rand = results["random"]
    vs_random = {
        name: {
            "deletion_auc_lower_by": round(rand["deletion_auc"] - results[name]["deletion_auc"], 5),
            "insertion_auc_higher_by": round(results[name]["insertion_auc"] - rand["insertion_auc"], 5),
        }
        for name in maps
    }
    perturbed = int(removed.shape[0] * removed.shape[1])
    return {
        "num_images": n,
        "num_patches": p,
        "grid": list(grid),
        "patch_counts": counts,
        "fractions": [round(f, 5) for f in fractions.tolist()],
        "score": "softmax probability of the class predicted on the intact image",
        "fill": "model mean colour per channel (0 after normalisation)",
        "original_probability": round(float(clean.mean()), 5),
        "all_removed_probability": round(float(empty.mean()), 5),
        "maps": results,
        "vs_random": vs_random,
        "labels": {name: MAP_LABELS.get(name, name) for name in [*maps, "random"]},
        "forward_passes": {"perturbed": perturbed, "all_removed": 1},
        "seeds": list(seeds),
    }


def evaluate_faithfulness(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    *,
    batch_size: int = 512,
    map_batch_size: int = 128,
    seeds: Sequence[int] = (0, 1, 2),
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Deletion/insertion curves and AUCs of the three maps and random orders for uint8 ``images`` (N, 3, H, W).

    ``mean``/``std`` are the model's normalisation (removed patches get the mean colour). ``labels`` only
    give the accuracy of the original predictions, for context. Returns a JSON-ready dict with wall time and
    the number of forward passes.
    """
    if len(images) == 0:
        raise ValueError("no images to score")
    start_time = time.perf_counter()
    device = torch.device(device)
    model.eval()
    x = normalize(images, mean, std)
    logits, maps, grid = _maps(model, x, batch_size=map_batch_size, device=device, dtype=dtype)
    result = faithfulness_curves(model, x, logits, maps, grid, seeds=seeds, batch_size=batch_size,
                                 device=device, dtype=dtype)
    seconds = time.perf_counter() - start_time
    n = len(x)
    total = n + result["forward_passes"]["perturbed"] + 1
    result["original_top1"] = round(float((logits.argmax(dim=1) == labels.cpu()).float().mean()), 5)
    result["forward_passes"].update({"forward_backward": n, "total_forward": total})
    result["wall_time_s"] = round(seconds, 2)
    result["forward_passes_per_second"] = round(total / seconds, 1)
    return result


def _random_summary(per_seed: list[dict[str, Any]], seeds: Sequence[int]) -> dict[str, Any]:
    """Mean and (population) std over seeds of the random orders' AUCs and mean curves."""
    out: dict[str, Any] = {}
    for key in ("deletion_auc", "insertion_auc"):
        values = np.array([s[key] for s in per_seed])
        out[key] = round(float(values.mean()), 5)
        out[f"{key}_std"] = round(float(values.std()), 5)
    for key in ("deletion_curve", "insertion_curve"):
        values = np.array([s[key] for s in per_seed])
        out[key] = [round(v, 5) for v in values.mean(axis=0).tolist()]
        out[f"{key}_std"] = [round(v, 5) for v in values.std(axis=0).tolist()]
    out["per_seed"] = {str(seed): {k: s[k] for k in ("deletion_auc", "insertion_auc")}
                       for seed, s in zip(seeds, per_seed, strict=True)}
    return out


def plot_faithfulness(result: Mapping[str, Any], path: str | Path, title: str = "Faithfulness") -> Path:
    """Deletion and insertion curves side by side (random: mean ± std over seeds), AUCs in the legend."""
    fractions = np.array(result["fractions"]) * 100
    fig = Figure(figsize=(11, 4.4))
    axes = fig.subplots(1, 2)
    for ax, curve, verb in zip(axes, ("deletion", "insertion"), ("removed", "revealed"), strict=True):
        for name, summary in result["maps"].items():
            mean = np.array(summary[f"{curve}_curve"])
            label = f"{MAP_LABELS.get(name, name)} (AUC {summary[f'{curve}_auc']:.3f})"
            style = "--" if name == "random" else "-"
            ax.plot(fractions, mean, style, marker="o", markersize=3, label=label)
            if name == "random":
                spread = np.array(summary[f"{curve}_curve_std"])
                ax.fill_between(fractions, mean - spread, mean + spread, alpha=0.25, color=ax.lines[-1].get_color())
        better = "lower" if curve == "deletion" else "higher"
        ax.set_title(f"{curve} ({better} AUC is better)")
        ax.set_xlabel(f"patches {verb} (%, most salient first)")
        ax.set_ylabel("probability of the original prediction")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    timing = f", {result['wall_time_s']:.0f} s" if "wall_time_s" in result else ""
    fig.suptitle(f"{title}: {result['num_images']} images, {result['num_patches']} patches{timing}")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
    return Path(path)
