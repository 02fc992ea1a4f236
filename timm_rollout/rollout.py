"""Attention rollout (Abnar & Zuidema, 2020) as pure, batched tensor functions, and its diagnostics.

``R = Â_L @ ... @ Â_1`` with ``Â_l = (A_l + I) / rowsum(A_l + I)`` of each layer's head-fused attention, all in
float32 with autocast off (a bf16 matmul would put ~0.2% error into the weights). The diagnostics say how far
pooling weights (B, P) are from the patch mean: effective patches and cosine to the mean-pooled tokens.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Sequence

import torch
from torch import nn

HEAD_FUSIONS = ("mean", "max", "min")


def _fp32(fn: Callable) -> Callable:
    """Run ``fn(attentions, ...)`` with autocast off on the device of its attention (float32 maths)."""

    @functools.wraps(fn)
    def wrapper(attentions: Sequence[torch.Tensor] | torch.Tensor, *args, **kwargs) -> torch.Tensor:
        first = attentions if isinstance(attentions, torch.Tensor) else next(iter(attentions), None)
        device = first.device.type if first is not None else "cpu"
        if not torch.amp.is_autocast_available(device):  # e.g. the meta device
            return fn(attentions, *args, **kwargs)
        with torch.autocast(device, enabled=False):
            return fn(attentions, *args, **kwargs)

    return wrapper


def check_options(head_fusion: str, discard_ratio: float) -> None:
    """One-line ValueError unless ``head_fusion`` is in :data:`HEAD_FUSIONS` and ``discard_ratio`` in [0, 1)."""
    if not isinstance(head_fusion, str) or head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"unknown head_fusion {head_fusion!r}; use one of {', '.join(HEAD_FUSIONS)}")
    if not isinstance(discard_ratio, numbers.Real) or isinstance(discard_ratio, bool):
        raise ValueError(f"discard_ratio must be a number in [0, 1), got {discard_ratio!r}; e.g. discard_ratio=0.9")
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}")


@_fp32
def fuse_heads(attn: torch.Tensor, head_fusion: str = "mean") -> torch.Tensor:
    """Fuse (B, heads, N, N) attention over heads into (B, N, N), in float32."""
    check_options(head_fusion, 0.0)
    if attn.dim() != 4:
        raise ValueError(f"attention must be (B, heads, N, N), got shape {tuple(attn.shape)}")
    attn = attn.float()
    if head_fusion == "mean":
        return attn.mean(dim=1)
    if head_fusion == "max":
        return attn.amax(dim=1)
    return attn.amin(dim=1)


def _discard_lowest(fused: torch.Tensor, discard_ratio: float, num_prefix_tokens: int) -> torch.Tensor:
    """Zero the lowest ``discard_ratio`` of each image's patch-to-patch, off-diagonal entries: exactly
    ``int(count * discard_ratio)``, ties dropped in row-major order (deterministic on every device). The threshold
    is a top-k of the few kept entries (of the many dropped ones, it was a CPU step's costliest op)."""
    p = num_prefix_tokens
    block = fused[:, p:, p:]
    m = block.shape[-1]
    k = int(m * (m - 1) * discard_ratio)
    if k == 0:
        return fused
    # the diagonal is never dropped: +inf puts it among the kept entries
    scores = (block.detach() + torch.full((m,), torch.inf, device=fused.device).diag()).flatten(1)
    threshold = scores.topk(m * m - k + 1, dim=1).values[:, -1:]  # the k-th lowest off-diagonal entry
    below = scores < threshold
    tied = scores == threshold
    drop = below | (tied & (tied.cumsum(dim=1) <= k - below.sum(dim=1, keepdim=True)))
    out = fused.clone()
    out[:, p:, p:] = block.masked_fill(drop.view_as(block), 0.0)
    return out


def fuse_and_discard(attn: torch.Tensor, head_fusion: str, discard_ratio: float, prefix: int) -> torch.Tensor:
    """(B, heads, N, N) attention fused over heads, its lowest ``discard_ratio`` dropped (:func:`_discard_lowest`)."""
    fused = fuse_heads(attn, head_fusion)
    return _discard_lowest(fused, discard_ratio, prefix) if discard_ratio > 0 else fused


@_fp32
def rollout_layers(
    attentions: Sequence[torch.Tensor],
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    num_prefix_tokens: int = 1,
) -> list[torch.Tensor]:
    """Per-layer residual-corrected, row-normalised attention ``Â_l`` (B, N, N) in float32."""
    check_options(head_fusion, discard_ratio)
    if len(attentions) == 0:
        raise ValueError("attention rollout needs at least one layer of attention")
    layers = []
    for attn in attentions:
        fused = fuse_and_discard(attn, head_fusion, discard_ratio, num_prefix_tokens)
        eye = torch.eye(fused.shape[-1], dtype=fused.dtype, device=fused.device)
        a = fused + eye
        layers.append(a / a.sum(dim=-1, keepdim=True))
    return layers


@_fp32
def attention_rollout(
    attentions: Sequence[torch.Tensor],
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    num_prefix_tokens: int = 1,
) -> torch.Tensor:
    """Full batched rollout ``Â_L @ ... @ Â_1`` (B, N, N) from per-layer (B, heads, N, N) attention;
    ``discard_ratio``: :func:`_discard_lowest` before the identity is added."""
    layers = rollout_layers(attentions, head_fusion, discard_ratio, num_prefix_tokens)
    result = layers[0]
    for a in layers[1:]:
        result = a @ result
    return result


@_fp32
def rollout_row(
    attentions: Sequence[torch.Tensor],
    row: torch.Tensor,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    num_prefix_tokens: int = 1,
) -> torch.Tensor:
    """``row @ Â_L @ ... @ Â_1`` (B, N) for a readout ``row`` (B, N) or (N,) by vector-matrix products, O(L * N^2)
    per image: the one rollout product of the package (pooling weights, diagnostics, maps)."""
    check_options(head_fusion, discard_ratio)
    if len(attentions) == 0:
        raise ValueError("attention rollout needs at least one layer of attention")
    first = attentions[-1]
    out = row.float().to(first.device).expand(first.shape[0], first.shape[-1]).unsqueeze(1)
    for attn in reversed(attentions):
        # out @ D^-1 (A + I), with D the row sums of A + I
        if head_fusion == "mean" and discard_ratio == 0:
            # mean over heads commutes with the product: one batched matmul, no fused (B, N, N) copy
            attn = attn.float()
            scaled = out / (attn.sum(dim=-1).mean(dim=1) + 1.0).unsqueeze(1)
            out = (scaled.unsqueeze(1) @ attn).mean(dim=1) + scaled
        else:
            fused = fuse_and_discard(attn, head_fusion, discard_ratio, num_prefix_tokens)
            scaled = out / (fused.sum(dim=-1) + 1.0).unsqueeze(1)
            out = scaled @ fused + scaled
    return out.squeeze(1)


def rollout_cls_row(
    attentions: Sequence[torch.Tensor],
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    num_prefix_tokens: int = 1,
) -> torch.Tensor:
    """The [CLS] row of the rollout, (B, N): ``attention_rollout(...)[:, 0]`` without any N x N product."""
    if len(attentions) == 0:
        raise ValueError("attention rollout needs at least one layer of attention")
    onehot = torch.zeros(attentions[-1].shape[-1], device=attentions[-1].device)
    onehot.narrow(0, 0, 1).fill_(1.0)  # a fill kernel: ``onehot[0] = 1.0`` copies a host scalar, which a CUDA graph
    # cannot record
    return rollout_row(attentions, onehot, head_fusion, discard_ratio, num_prefix_tokens)


def patch_weights(row: torch.Tensor, num_prefix_tokens: int = 1) -> torch.Tensor:
    """Drop the prefix-token columns of a rollout row (B, N) and renormalise to sum 1: (B, N - prefix)."""
    w = row[:, num_prefix_tokens:]
    return w / w.sum(dim=-1, keepdim=True)


# (head fusion, discard ratio) of the sharper rollouts measured beside a model's own: max fusion keeps each
# position's most focused head, discarding drops the weakest 90% of patch-to-patch attention.
ROLLOUT_VARIANTS = (("max", 0.0), ("min", 0.0), ("mean", 0.9), ("max", 0.9))


def variant_name(head_fusion: str, discard_ratio: float) -> str:
    """``'max'``, ``'max-discard0.9'``: a rollout variant's name, as in the study's arm names."""
    return head_fusion if discard_ratio == 0 else f"{head_fusion}-discard{discard_ratio:g}"


def rollout_options(model: nn.Module) -> tuple[str, float]:
    """(head fusion, discard ratio) with which ``model`` pools, or would pool post hoc, by rollout."""
    return str(getattr(model, "rollout_head_fusion", "mean")), float(getattr(model, "rollout_discard_ratio", 0.0))


def pooling_weights(attentions: Sequence[torch.Tensor], num_prefix_tokens: int, head_fusion: str = "mean",
                    discard_ratio: float = 0.0) -> torch.Tensor:
    """Rollout pooling weights (B, P) of one pass's attention: the [CLS] rollout row over the patches, renormalised."""
    row = rollout_cls_row(attentions, head_fusion, discard_ratio, num_prefix_tokens)
    return patch_weights(row, num_prefix_tokens)


def layer_effective_patches(attentions: Sequence[torch.Tensor], num_prefix_tokens: int) -> torch.Tensor:
    """Effective patches (B, L) of each layer's own [CLS] attention over the patches (mean over heads,
    renormalised over the patch columns): how focused the attention is that rollout composes."""
    rows = [a.float().mean(dim=1)[:, 0, num_prefix_tokens:] for a in attentions]
    return torch.stack([effective_patches(r / r.sum(dim=-1, keepdim=True)) for r in rows], dim=1)


def effective_patches(weights: torch.Tensor) -> torch.Tensor:
    """``exp(-sum_p w_p log w_p)`` per row of (B, P) weights that sum to 1 (``0 log 0 = 0``), in float32: (B,)."""
    w = weights.float()
    return torch.exp(-torch.special.xlogy(w, w).sum(dim=-1))


def cosine_to_mean(tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Cosine between the ``weights``-pooled and the mean-pooled (B, P, D) ``tokens``, in float32: (B,) (a product
    and a sum, not a matmul, so that autocast keeps it in float32)."""
    t = tokens.float()
    pooled = (weights.float().unsqueeze(-1) * t).sum(dim=1)
    return torch.nn.functional.cosine_similarity(pooled, t.mean(dim=1), dim=-1)
