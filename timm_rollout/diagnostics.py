"""How far a model's rollout pooling weights are from the plain patch mean, as pure batched functions.

``w`` (B, P) are pooling weights over the patches (non-negative, each row summing to 1): the [CLS] row of the
attention rollout over the patch columns, renormalised, as rollout pooling uses it (:func:`pooling_weights`).

- effective patches ``exp(H(w))``, ``H(w) = -sum_p w_p log w_p``: P for uniform weights (the patch mean), 1 when
  all the weight is on one patch (the perplexity of the weights);
- cosine to the mean: ``cos(sum_p w_p t_p, mean_p t_p)`` of the final patch tokens ``t`` (B, P, D): 1 when the
  weighted pooling points where the patch mean does.

Where near-uniform rollout weights come from: :func:`layer_effective_patches` measures each layer's own [CLS]
attention over the patches the same way, and :data:`ROLLOUT_VARIANTS` are the sharper rollout options whose
weights :func:`pooling_weights` gives for comparison.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .rollout import patch_weights, rollout_cls_row

__all__ = ["ROLLOUT_VARIANTS", "cosine_to_mean", "effective_patches", "layer_effective_patches", "pooling_weights",
           "rollout_options", "variant_name"]

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
    """Cosine between the ``weights``-pooled and the mean-pooled (B, P, D) ``tokens``, in float32: (B,).

    A product and a sum, not a matmul, so that autocast (the training log's evaluation pass) keeps it in float32."""
    t = tokens.float()
    pooled = (weights.float().unsqueeze(-1) * t).sum(dim=1)
    return torch.nn.functional.cosine_similarity(pooled, t.mean(dim=1), dim=-1)
