"""Faithfulness of saliency maps: patch-level deletion and insertion curves, paired against random orders.

Definitions (the two removals, the score, the paired score) are in harness/README.md, "Faithfulness". Cost: a
map's insertion curve is the deletion curve of its reversed order; a random order's insertion curve is read from
the deletion passes of the same permutation (its reverse is a uniform random order too), so each seed costs one
set of passes and its deletion and insertion AUCs are equal by construction.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from scipy import stats
from torch import nn

from harness.features import SaliencyMaps, saliency_maps
from timm_rollout.capture import fused_attention, record_attention
from timm_rollout.data import normalize
from timm_rollout.device import autocast, inference_batch_size
from timm_rollout.explain import MAP_LABELS
from timm_rollout.pooling import attention_pool
from timm_rollout.progress import progress, tqdm

__all__ = [
    "FILLS",
    "embed_patches",
    "evaluate_faithfulness",
    "faithfulness_curves",
    "paired_score",
    "random_ranks",
    "ranks",
    "removal_probabilities",
    "step_counts",
]

STEPS = 10
FILLS = {"mean": "mean colour fill (0 after normalisation)", "drop": "patch tokens dropped from the sequence"}
LABELS = {**MAP_LABELS, "random": "random order"}


def step_counts(num_patches: int, steps: int = STEPS) -> list[int]:
    """Patches removed (or revealed) at each of the ``steps + 1`` points: ``round(i * P / steps)``."""
    return [round(i * num_patches / steps) for i in range(steps + 1)]


def ranks(scores: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """(B, P) rank of each patch, 0 = most salient, on ``scores``' device; equal scores in a seeded random order."""
    b, p = scores.shape
    keys = torch.rand(b, p, generator=torch.Generator().manual_seed(seed)).argsort(dim=1).to(scores.device)
    shuffled = scores.float().gather(1, keys)  # a random permutation of each row, then a stable sort
    order = keys.gather(1, shuffled.argsort(dim=1, descending=True, stable=True))
    out = torch.empty_like(order)
    return out.scatter_(1, order, torch.arange(p, device=scores.device).expand(b, p).contiguous())


def random_ranks(num_images: int, num_patches: int, seed: int) -> torch.Tensor:
    """A uniform random order per image: the ranks of an all-equal map."""
    return ranks(torch.zeros(num_images, num_patches), seed)


def _check_vit(model: nn.Module) -> None:
    missing = [a for a in ("patch_embed", "_pos_embed", "norm_pre", "blocks", "norm", "forward_head")
               if not hasattr(model, a)]
    if missing or getattr(model, "dynamic_img_size", False):
        raise ValueError(f"{type(model).__name__} is not a timm VisionTransformer with fixed-size (B, P, D) patch "
                         "tokens; faithfulness perturbs its patch tokens")


@torch.inference_mode()
def embed_patches(model: nn.Module, x: torch.Tensor, *, batch_size: int, device: torch.device,
                  dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Patch tokens (B, P, D) of normalised images on ``device``, and those (1, P, D) of an all-mean-colour image."""
    _check_vit(model)
    with autocast(device, dtype):
        tokens = torch.cat([model.patch_embed(x[s:s + batch_size].to(device)) for s in range(0, len(x), batch_size)])
        fill = model.patch_embed(torch.zeros(1, *x.shape[1:], device=device))
    return tokens, fill


def _sequence(model: nn.Module, tokens: torch.Tensor, fill: torch.Tensor, rank: torch.Tensor, k: int,
              mode: str) -> torch.Tensor:
    """Input sequence of the blocks with the patches ranked below ``k`` removed (mean fill or dropped)."""
    if mode == "mean":
        return model._pos_embed(torch.where((rank < k)[..., None], fill, tokens))
    seq = model._pos_embed(tokens)  # position embeddings on every token, then drop the removed patches
    b, prefix = len(seq), model.num_prefix_tokens
    kept = rank.argsort(dim=1)[:, k:].sort(dim=1).values + prefix
    idx = torch.cat([torch.arange(prefix, device=seq.device).expand(b, prefix), kept], dim=1)
    return seq.gather(1, idx[..., None].expand(-1, -1, seq.shape[-1]))


def _empty_pool(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Pooled features (B, D) of no patch token: the empty (weighted) sum, 0; a learned attention pool
    (timm's ``AttentionPoolLatent``) then applies its projection and MLP to that 0, as to any attention output."""
    empty = h.new_zeros(h.shape[0], 1, h.shape[2])
    pool = attention_pool(model)
    if pool is None:
        return empty[:, 0]
    x = pool.proj(empty.expand(-1, pool.latent_len, -1))
    if pool.mlp is not None:
        x = x + pool.mlp(pool.norm(x))
    return x.mean(dim=1) if pool.pool == "avg" else x[:, 0]


def _logits(model: nn.Module, seq: torch.Tensor) -> torch.Tensor:
    """Logits of the blocks' input sequence ``seq``; a rollout-pooled model pools by this pass's attention."""
    rollout = getattr(model, "global_pool", None) == "rollout"
    with record_attention(model) if rollout else nullcontext() as attentions:
        h = model.norm(model.blocks(model.norm_pre(seq)))
    if h.shape[1] == model.num_prefix_tokens and model.global_pool != "token":  # no patch left to pool
        return model.head(model.head_drop(model.fc_norm(_empty_pool(model, h))))
    if rollout:
        model.keep_rollout_weights(attentions, h)
    return model.forward_head(h)


@torch.inference_mode()
def removal_probabilities(
    model: nn.Module,
    tokens: torch.Tensor,
    fill: torch.Tensor,
    orders: Sequence[torch.Tensor],
    counts: Sequence[Sequence[int]],
    target: torch.Tensor,
    *,
    mode: str = "mean",
    batch_size: int = 128,
    dtype: torch.dtype | None = None,
    bar: tqdm | None = None,
) -> list[torch.Tensor]:
    """Probability of ``target`` (B,) with the top-k patches of each order (ranks (B, P)) removed, one (B,
    len(counts[o])) tensor per order ``o``. Work is grouped by k, so a batch's dropped sequences share one length
    and batches stay full across orders and images."""
    if mode not in FILLS:
        raise ValueError(f"unknown fill {mode!r}; use one of {', '.join(FILLS)}")
    model.eval()
    device, b = tokens.device, len(tokens)
    stacked = torch.stack([o.to(device) for o in orders])  # (O, B, P)
    target = target.to(device)
    jobs: dict[int, list[tuple[int, int]]] = {}  # k -> [(order, column)]
    for o, ks in enumerate(counts):
        for j, k in enumerate(ks):
            jobs.setdefault(k, []).append((o, j))
    out = [torch.empty(b, len(ks), dtype=torch.float32, device=device) for ks in counts]
    with fused_attention(model, True):  # faster; same outputs up to float rounding
        for k, where in jobs.items():
            which = torch.tensor([o for o, _ in where], device=device)
            flat = torch.empty(len(where) * b, dtype=torch.float32, device=device)  # job-major, then image
            for s in range(0, len(flat), batch_size):
                rows = torch.arange(s, min(s + batch_size, len(flat)), device=device)
                job, img = rows // b, rows % b
                with autocast(device, dtype):
                    seq = _sequence(model, tokens[img], fill, stacked[which[job], img], k, mode)
                    logits = _logits(model, seq)
                flat[s:s + len(rows)] = logits.float().softmax(dim=1).gather(1, target[img, None]).squeeze(1)
                if bar is not None:
                    bar.update(len(rows))
            for (o, j), values in zip(where, flat.view(len(where), b), strict=True):
                out[o][:, j] = values
    return [t.cpu() for t in out]


def _auc(curves: torch.Tensor, fractions: np.ndarray) -> np.ndarray:
    """Trapezoid area under each (B, steps + 1) curve over the fractions of patches: (B,)."""
    return np.trapezoid(curves.double().numpy(), fractions, axis=1)


def paired_score(map_auc: np.ndarray, random_auc: np.ndarray, p_intact: np.ndarray, p_removed: np.ndarray,
                 min_drop: float = 0.05) -> dict[str, Any]:
    """Mean over images of ``(map_auc - random_auc) / (p_intact - p_removed)`` with a 95% t-interval; images with
    ``p_intact - p_removed < min_drop`` are left out (counted in ``excluded``)."""
    drop = np.asarray(p_intact, dtype=np.float64) - np.asarray(p_removed, dtype=np.float64)
    ok = drop >= min_drop
    v = (np.asarray(map_auc, dtype=np.float64) - np.asarray(random_auc, dtype=np.float64))[ok] / drop[ok]
    n = int(ok.sum())
    out: dict[str, Any] = {"mean": float(v.mean()) if n else None, "ci95": None, "n": n,
                           "excluded": int((~ok).sum())}
    if n > 1:
        half = float(stats.t.ppf(0.975, n - 1) * v.std(ddof=1) / math.sqrt(n))
        out["ci95"] = [float(v.mean()) - half, float(v.mean()) + half]
    return out


def _curves(model, tokens, fill, orders, pred, clean, empty, mode, **kw) -> dict[str, dict[str, torch.Tensor]]:
    """Per-image deletion and insertion curves (B, steps + 1) of every named order (B, P) and random seed."""
    p = tokens.shape[1]
    inner = step_counts(p)[1:-1]
    outer = [p - k for k in inner]
    both = sorted(set(inner) | set(outer))
    runs, counts = [], []  # a map's insertion: deletion of its reversed order; a random order's: its own passes
    for name, rank in orders.items():
        if name.startswith("random_"):
            runs += [rank]
            counts += [both]
        else:
            runs += [rank, p - 1 - rank]
            counts += [inner, outer]
    probs = iter(removal_probabilities(model, tokens, fill, runs, counts, pred, mode=mode, **kw))

    def curve(first: torch.Tensor, middle: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return torch.cat([first[:, None], middle, last[:, None]], dim=1)

    out: dict[str, dict[str, torch.Tensor]] = {}
    for name in orders:
        if name.startswith("random_"):
            by_k = dict(zip(both, next(probs).unbind(1), strict=True))
            deletion = torch.stack([by_k[k] for k in inner], dim=1)
            insertion = torch.stack([by_k[k] for k in outer], dim=1)
        else:
            deletion, insertion = next(probs), next(probs)
        out[name] = {"deletion": curve(clean, deletion, empty), "insertion": curve(empty, insertion, clean)}
    return out


def _fill_summary(curves: dict[str, dict[str, torch.Tensor]], maps: Sequence[str], seeds: Sequence[int],
                  clean: torch.Tensor, empty: torch.Tensor, fractions: np.ndarray, min_drop: float) -> dict[str, Any]:
    """Mean curves and AUCs of every map and of the random orders, and each map's paired score."""
    summary: dict[str, Any] = {"all_removed_probability": float(empty.mean()), "maps": {}, "paired": {}}
    random_auc = {}
    for kind in ("deletion", "insertion"):
        per_seed = np.stack([_auc(curves[f"random_{s}"][kind], fractions) for s in seeds])  # (seeds, B)
        random_auc[kind] = per_seed.mean(axis=0)
        summary["maps"].setdefault("random", {"per_seed": {}})
        rand = summary["maps"]["random"]
        rand[f"{kind}_auc"] = float(per_seed.mean())
        ddof = int(len(seeds) > 1)  # sample std of the seeds (0 for one seed), as everywhere in the harness
        rand[f"{kind}_auc_std"] = float(per_seed.mean(axis=1).std(ddof=ddof))  # spread of the seeds' means
        stacked = torch.stack([curves[f"random_{s}"][kind].mean(dim=0) for s in seeds])
        rand[f"{kind}_curve"] = [round(v, 5) for v in stacked.mean(dim=0).tolist()]
        rand[f"{kind}_curve_std"] = [round(v, 5) for v in stacked.std(dim=0, correction=ddof).tolist()]
        for i, s in enumerate(seeds):
            rand["per_seed"].setdefault(str(s), {})[f"{kind}_auc"] = float(per_seed[i].mean())
    for name in maps:
        entry = summary["maps"][name] = {}
        for kind in ("deletion", "insertion"):
            entry[f"{kind}_auc"] = float(_auc(curves[name][kind], fractions).mean())
            entry[f"{kind}_curve"] = [round(v, 5) for v in curves[name][kind].mean(dim=0).tolist()]
            summary["paired"].setdefault(name, {})[kind] = paired_score(
                _auc(curves[name][kind], fractions), random_auc[kind], clean.numpy(), empty.numpy(), min_drop)
    summary["maps"]["random"] = summary["maps"].pop("random")  # random last, after the maps
    return summary


@torch.inference_mode()
def _all_removed(model: nn.Module, tokens: torch.Tensor, fill: torch.Tensor, mode: str,
                 dtype: torch.dtype | None) -> torch.Tensor:
    """(C,) class probabilities with every patch removed: the same input for every image, one pass."""
    p = tokens.shape[1]
    with fused_attention(model, True), autocast(tokens.device, dtype):
        seq = _sequence(model, tokens[:1], fill, torch.zeros(1, p, dtype=torch.int64, device=tokens.device), p, mode)
        return _logits(model, seq).float().softmax(dim=1)[0].cpu()


def faithfulness_curves(
    model: nn.Module,
    x: torch.Tensor,
    logits: torch.Tensor,
    maps: Mapping[str, torch.Tensor],
    *,
    seeds: Sequence[int] = (1, 2, 3),
    tie_seed: int = 0,
    fills: Sequence[str] = tuple(FILLS),
    min_drop: float = 0.05,
    batch_size: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Deletion/insertion curves, AUCs and paired scores of named (B, P) ``maps`` against random orders (one per
    ``seeds`` entry) for normalised images ``x``; ``logits`` (the model's on ``x``) fix the class tracked and the 0%
    point; map ties are broken with ``tie_seed``."""
    if not seeds:
        raise ValueError("give at least one seed for the random baseline")
    device = torch.device(device)
    batch_size = batch_size or inference_batch_size(device)
    pred = logits.argmax(dim=1).cpu()
    clean = logits.float().softmax(dim=1).cpu().gather(1, pred[:, None]).squeeze(1)
    tokens, fill = embed_patches(model, x, batch_size=batch_size, device=device, dtype=dtype)
    n, p = tokens.shape[:2]
    orders = {name: ranks(scores, tie_seed) for name, scores in maps.items()}
    orders.update({f"random_{s}": random_ranks(n, p, s) for s in seeds})
    inner = len(step_counts(p)) - 2
    per_fill = inner * (2 * len(maps) + len(seeds))
    fractions = np.array(step_counts(p), dtype=np.float64) / p
    result: dict[str, Any] = {}
    with progress(total=n * per_fill * len(fills), desc=f"faithfulness ({n} images)", unit="img", leave=False) as bar:
        for mode in fills:
            empty = _all_removed(model, tokens, fill, mode, dtype)[pred]
            curves = _curves(model, tokens, fill, orders, pred, clean, empty, mode, batch_size=batch_size,
                             dtype=dtype, bar=bar)
            result[mode] = {"fill": FILLS[mode],
                            **_fill_summary(curves, list(maps), seeds, clean, empty, fractions, min_drop)}
    return {
        "num_images": n, "num_patches": p, "patch_counts": step_counts(p),
        "fractions": [round(f, 5) for f in fractions.tolist()],
        "score": "softmax probability of the class predicted on the intact image",
        "paired_score": "per image (AUC_map - mean AUC of the random orders) / (p_intact - p_all_removed); "
                        f"images with p_intact - p_all_removed < {min_drop} left out; mean and 95% t-interval",
        "original_probability": float(clean.mean()),
        "fills": result,
        "labels": {name: LABELS.get(name, name) for name in [*maps, "random"]},
        "forward_passes": {"perturbed": n * per_fill * len(fills), "all_removed": len(fills)},
        "seeds": list(seeds), "tie_seed": tie_seed, "min_drop": min_drop,
    }


def evaluate_faithfulness(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, mean: Sequence[float],
                          std: Sequence[float], *, batch_size: int | None = None, seeds: Sequence[int] = (1, 2, 3),
                          tie_seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                          found: SaliencyMaps | None = None) -> dict[str, Any]:
    """:func:`faithfulness_curves` of the harness's maps for uint8 ``images`` (N, 3, H, W), normalised with the
    model's ``mean``/``std`` (``found``: their maps, if computed already); ``labels`` only give the original top-1,
    for context. JSON-ready, with wall time."""
    if len(images) == 0:
        raise ValueError("no images to score")
    start_time = time.perf_counter()
    device = torch.device(device)
    model.eval()
    x = normalize(images, mean, std)
    found = found or saliency_maps(model, x, device=device, amp_dtype=dtype)
    result = faithfulness_curves(model, x, found.logits, found.maps, seeds=seeds, tie_seed=tie_seed,
                                 batch_size=batch_size, device=device, dtype=dtype)
    seconds = time.perf_counter() - start_time
    n = len(x)
    passes = result["forward_passes"]
    passes.update({"forward_backward": n, "total_forward": n + passes["perturbed"] + passes["all_removed"]})
    result.update({"grid": list(found.grid), "readout": found.readout,
                   "original_top1": round(float((found.logits.argmax(dim=1) == labels.cpu()).float().mean()), 5),
                   "wall_time_s": round(seconds, 2),
                   "forward_passes_per_second": round(passes["total_forward"] / seconds, 1)})
    return result
