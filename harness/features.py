"""Forward passes for evaluation: pooled features + logits in batches, and the saliency maps of the harness.

Features are ``forward_head(forward_features(x), pre_logits=True)`` and the logits the classifier on those same
features: one pass, so a rollout-pooled model pools by the attention of that pass. Both follow the model's current
``global_pool`` (``harness.eval --pool`` sets it for a post-hoc readout).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from harness.localisation import context_only
from timm_rollout.atomic import atomic_path
from timm_rollout.capture import capture_attention
from timm_rollout.data import ImageSet, normalize
from timm_rollout.device import autocast, inference_batch_size
from timm_rollout.explain import READOUTS, AttentionPass, gradient_pass, patch_grid, readout_maps
from timm_rollout.progress import progress
from timm_rollout.records import recorded_data
from timm_rollout.rollout import (
    ROLLOUT_VARIANTS,
    cosine_to_mean,
    effective_patches,
    layer_effective_patches,
    patch_weights,
    pooling_weights,
    rollout_options,
    variant_name,
)

__all__ = ["PoolingDiagnostics", "SaliencyMaps", "batched", "context_hits", "extract", "patch_pooling_weights",
           "pooling_diagnostics", "saliency_maps", "save_features"]


def batched(step: Callable[[torch.Tensor], dict[str, torch.Tensor]], images: torch.Tensor, *, device: torch.device,
            batch_size: int, desc: str, mean: Sequence[float] | None = None,
            std: Sequence[float] | None = None) -> dict[str, torch.Tensor]:
    """The harness's one batched pass: ``step`` on each batch of ``images`` moved to ``device`` (uint8 ones normalised
    there with ``mean``/``std``: the float copy of the whole set never exists), each of its outputs (batch first)
    gathered float32 on CPU. ``step`` sets its own autocast and grad mode."""
    found: dict[str, list[torch.Tensor]] = {}
    with progress(total=len(images), desc=desc, unit="img", leave=False) as bar:
        for start in range(0, len(images), batch_size):
            x = images[start:start + batch_size].to(device, non_blocking=True)
            for name, value in step(x if mean is None else normalize(x, mean, std).contiguous()).items():
                found.setdefault(name, []).append(value.float().cpu())
            bar.update(len(x))
    if not found:
        raise ValueError(f"no images for {desc}")
    return {name: torch.cat(values) for name, values in found.items()}


def extract(model: nn.Module, images: torch.Tensor, mean: Sequence[float], std: Sequence[float], *,
            device: torch.device, amp_dtype: torch.dtype | None = None, batch_size: int | None = None,
            desc: str = "features") -> tuple[torch.Tensor, torch.Tensor]:
    """Pooled features (N, D) and logits (N, C), float32 on CPU, for uint8 (N, 3, H, W) ``images``."""
    model.eval()

    @torch.inference_mode()
    def step(x: torch.Tensor) -> dict[str, torch.Tensor]:
        with autocast(device, amp_dtype):
            pooled = model.forward_head(model.forward_features(x), pre_logits=True)
            return {"features": pooled, "logits": model.get_classifier()(pooled)}

    out = batched(step, images, device=device, batch_size=batch_size or inference_batch_size(device), desc=desc,
                  mean=mean, std=std)
    return out["features"], out["logits"]


@dataclass
class SaliencyMaps:
    """The harness's maps (keys of :data:`timm_rollout.explain.MAP_LABELS`), the logits of the same passes and the
    weights with which the model pools its patch tokens in them (:func:`patch_pooling_weights`)."""

    maps: dict[str, torch.Tensor]  # name -> (B, P), float32 on CPU
    logits: torch.Tensor  # (B, C), float32 on CPU
    grid: tuple[int, int]
    readout: str
    pooling: torch.Tensor  # (B, P), float32 on CPU, rows sum to 1

    def take(self, index: torch.Tensor) -> SaliencyMaps:
        """The maps of the images at ``index``."""
        return SaliencyMaps({k: v[index] for k, v in self.maps.items()}, self.logits[index], self.grid, self.readout,
                            self.pooling[index])


def patch_pooling_weights(model: nn.Module, p: AttentionPass) -> torch.Tensor:
    """(B, P) weights with which ``model`` pools its patch tokens in the pass ``p``, summing to 1: the readout over
    the patches, renormalised; for [CLS] pooling, which reads no patch, the post-hoc rollout pooling weights."""
    if p.readout_name == READOUTS["token"]:
        return pooling_weights(p.attentions, p.num_prefix_tokens, *rollout_options(model))
    return patch_weights(p.readout, p.num_prefix_tokens)


def saliency_maps(model: nn.Module, x: torch.Tensor, *, device: torch.device, amp_dtype: torch.dtype | None = None,
                  batch_size: int = 128, mean: Sequence[float] | None = None,
                  std: Sequence[float] | None = None) -> SaliencyMaps:
    """:func:`timm_rollout.explain.readout_maps` of normalised images ``x`` (B, 3, H, W) (uint8 ones with ``mean``
    and ``std``), one forward + backward per batch: every map explains the model's own readout (its current
    ``global_pool``)."""
    model.eval()
    last: list[AttentionPass] = []

    def step(batch: torch.Tensor) -> dict[str, torch.Tensor]:
        with autocast(device, amp_dtype):
            p = gradient_pass(model, batch)
        last[:] = [p]
        return {"logits": p.logits, "pooling": patch_pooling_weights(model, p),
                **{f"map/{name}": values for name, values in readout_maps(p).items()}}

    out = batched(step, x, device=device, batch_size=batch_size, desc="maps (forward + backward)", mean=mean, std=std)
    maps = {name[4:]: values for name, values in out.items() if name.startswith("map/")}
    return SaliencyMaps(maps, out["logits"], last[0].grid, last[0].readout_name, out["pooling"])


def context_hits(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, masks: torch.Tensor,
                 mean: Sequence[float], std: Sequence[float], *, device: torch.device,
                 amp_dtype: torch.dtype | None = None, batch_size: int = 128) -> torch.Tensor | None:
    """(N,) float64 top-1 hits of ``model`` (any classifier) on uint8 ``images`` with their objects taken out
    (:func:`~harness.localisation.context_only` with (N, H, W) ``masks``); None, with no pass over the images,
    unless every object could be taken out."""
    context, whole = context_only(images, labels, masks)
    if not whole.all():
        return None
    _, logits = extract(model, context, mean, std, device=device, amp_dtype=amp_dtype, batch_size=batch_size,
                        desc="objects taken out")
    return (logits.argmax(dim=1) == labels.cpu()).double()


@dataclass
class PoolingDiagnostics:
    """Per image: effective patches and cosine to the mean of the rollout pooling weights; their mean map; the
    effective patches of each layer's own [CLS] attention and of the sharper rollouts of
    :data:`~timm_rollout.rollout.ROLLOUT_VARIANTS`."""

    effective_patches: torch.Tensor  # (N,)
    cosine_to_mean: torch.Tensor  # (N,)
    mean_weights: torch.Tensor  # (P,): the weights averaged over the images
    head_fusion: str
    discard_ratio: float
    layer_patches: torch.Tensor  # (N, L)
    variant_patches: dict[str, torch.Tensor]  # variant name -> (N,)
    grid: tuple[int, int]  # (rows, cols) of the patches, mean_weights' layout

    def metrics(self) -> dict[str, float]:
        """results.json's pooling diagnostics (:data:`harness.metrics.POOLING_DIAGNOSTICS`): means over the images."""
        return {"rollout_effective_patches": float(self.effective_patches.double().mean()),
                "rollout_cosine_to_mean": float(self.cosine_to_mean.double().mean())}

    def record(self) -> dict:
        """results.json's ``pooling_diagnostics``: the rollout options, the mean weight map and a histogram of
        effective patches over bins a quarter patch wide from 1 to P (what the study's figure draws)."""
        p = self.mean_weights.numel()
        counts, edges = np.histogram(self.effective_patches.numpy(), bins=np.linspace(1.0, p, 4 * (p - 1) + 1))
        return {"head_fusion": self.head_fusion, "discard_ratio": self.discard_ratio,
                "num_images": int(self.effective_patches.numel()), "num_patches": p, "grid": list(self.grid),
                "mean_weights": [round(float(v), 7) for v in self.mean_weights],
                "effective_patches_histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
                "layer_effective_patches": [round(float(v), 4) for v in self.layer_patches.double().mean(dim=0)],
                "rollout_variants": {k: round(float(v.double().mean()), 4) for k, v in self.variant_patches.items()}}


def pooling_diagnostics(model: nn.Module, images: torch.Tensor, mean: Sequence[float], std: Sequence[float], *,
                        device: torch.device, amp_dtype: torch.dtype | None = None,
                        batch_size: int | None = None) -> PoolingDiagnostics | None:
    """The rollout diagnostics (:mod:`timm_rollout.rollout`) of uint8 (N, 3, H, W) ``images``: each image's rollout
    pooling weights (the model's own rollout options; post hoc for other poolings) against its final patch tokens.
    None for a model without a class token (no [CLS] row to roll out)."""
    if getattr(model, "cls_token", None) is None:
        return None
    model.eval()
    fusion, ratio = rollout_options(model)
    prefix = int(model.num_prefix_tokens)

    @torch.inference_mode()
    def step(x: torch.Tensor) -> dict[str, torch.Tensor]:
        with autocast(device, amp_dtype), capture_attention(model) as cap:
            tokens = model.forward_features(x)
        attentions = [a.float() for a in cap.attentions]
        weights = pooling_weights(attentions, prefix, fusion, ratio)
        return {"patches": effective_patches(weights), "cosine": cosine_to_mean(tokens[:, prefix:], weights),
                "weights": weights, "layers": layer_effective_patches(attentions, prefix),
                **{variant_name(f, r): effective_patches(pooling_weights(attentions, prefix, f, r))
                   for f, r in ROLLOUT_VARIANTS}}

    out = batched(step, images, device=device, batch_size=batch_size or inference_batch_size(device),
                  desc="pooling diagnostics", mean=mean, std=std)
    return PoolingDiagnostics(out["patches"], out["cosine"], out["weights"].sum(dim=0) / len(images), fusion, ratio,
                              out["layers"], {variant_name(*v): out[variant_name(*v)] for v in ROLLOUT_VARIANTS},
                              patch_grid(model, images.shape[-2:], out["weights"].shape[1]))


def save_features(path: Path, model: str, dataset: str, data: ImageSet, feats: torch.Tensor, bank: ImageSet | None,
                   bank_feats: torch.Tensor | None) -> None:
    """``features.safetensors``: features and labels of the evaluated images and of the bank, if any."""
    tensors = {"features": feats, "labels": data.labels}
    metadata = {"model": model, "dataset": recorded_data(dataset, data.dataset, path.parent), "split": data.split}
    if bank is not None:
        tensors.update(bank_features=bank_feats, bank_labels=bank.labels)
        metadata["bank_split"] = bank.split
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
