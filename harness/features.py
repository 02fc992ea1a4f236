"""Forward passes for evaluation: pooled features + logits in batches, and per-layer attention maps.

Features are the model's pooled representation, ``forward_head(forward_features(x), pre_logits=True)``;
logits are its classifier applied to those same features (one forward pass, which matters for the rollout
model: its pooling consumes the attention recorded during ``forward_features``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from timm_rollout import capture_attention, patch_weights, rollout_cls_row
from timm_rollout.data import normalize
from timm_rollout.device import autocast

__all__ = ["AttentionMaps", "attention_maps", "extract"]


def _forward(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pooled = model.forward_head(model.forward_features(x), pre_logits=True)
    return pooled, model.get_classifier()(pooled)


@torch.inference_mode()
def extract(
    model: nn.Module,
    images: torch.Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    *,
    device: torch.device,
    amp_dtype: torch.dtype | None = None,
    batch_size: int = 512,
    desc: str = "features",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooled features (N, D) and logits (N, C), float32 on CPU, for uint8 (N, 3, H, W) ``images``.

    Images are normalised batch by batch on ``device`` with the model's mean/std, so the float copy of the
    whole set never exists.
    """
    model.eval()
    n = images.shape[0]
    features = logits = None
    with tqdm(total=n, desc=desc, unit="img", leave=False) as bar:
        for start in range(0, n, batch_size):
            batch = images[start:start + batch_size].to(device, non_blocking=True)
            x = normalize(batch, mean, std).contiguous()
            with autocast(device, amp_dtype):
                pooled, out = _forward(model, x)
            if features is None:
                features = torch.empty(n, pooled.shape[1], dtype=torch.float32)
                logits = torch.empty(n, out.shape[1], dtype=torch.float32)
            features[start:start + len(batch)] = pooled.float().cpu()
            logits[start:start + len(batch)] = out.float().cpu()
            bar.update(len(batch))
    if features is None:
        raise ValueError("no images to extract features from")
    return features, logits


@dataclass
class AttentionMaps:
    """Per-image maps over the patch grid, from one real forward pass.

    ``rollout``: the [CLS] row of the attention rollout over every layer's recorded attention, patch columns
    renormalised to sum 1 (the rollout model's pooling weights; a post-hoc readout for a [CLS] model).
    ``last_cls``: the last layer's raw [CLS]-to-patch attention, mean over heads (not renormalised).
    """

    rollout: torch.Tensor  # (B, P)
    last_cls: torch.Tensor  # (B, P)
    features: torch.Tensor  # (B, D)
    logits: torch.Tensor  # (B, C)


@torch.inference_mode()
def attention_maps(
    model: nn.Module,
    images: torch.Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    *,
    device: torch.device,
    amp_dtype: torch.dtype | None = None,
) -> AttentionMaps:
    """Rollout and last-layer [CLS] attention maps for a small batch of uint8 images."""
    model.eval()
    x = normalize(images.to(device), mean, std).contiguous()
    with capture_attention(model) as cap, autocast(device, amp_dtype):
        pooled, logits = _forward(model, x)
    attentions = cap.attentions
    prefix = cap.num_prefix_tokens
    rollout = patch_weights(rollout_cls_row(attentions, num_prefix_tokens=prefix), prefix)
    last_cls = attentions[-1].float().mean(dim=1)[:, 0, prefix:]
    return AttentionMaps(rollout.cpu(), last_cls.cpu(), pooled.float().cpu(), logits.float().cpu())
