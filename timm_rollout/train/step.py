"""One training step, shared by the training loop and ``scripts/bench_train.py``: batch building and update."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..augment import random_crop_flip
from ..data import normalize
from ..device import autocast


@dataclass
class Batches:
    """Training batches from uint8 images held on the training device: crop+flip, normalise, optional mixup."""

    images: torch.Tensor
    labels: torch.Tensor
    mean: Sequence[float]
    std: Sequence[float]
    padding: int = 4
    hflip: float = 0.5
    mixup: Callable | None = None

    def __call__(self, idx: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = normalize(random_crop_flip(self.images[idx], self.padding, self.hflip, generator), self.mean, self.std)
        y = self.labels[idx]
        if self.mixup is not None:
            x, y = self.mixup(x, y)
        return x, y


def optimizer_step(
    net: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    criterion: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    scaler: torch.amp.GradScaler | None = None,
    clip_grad: float | None = None,
) -> torch.Tensor:
    """Forward in autocast, backward (scaled for fp16), optional grad-norm clipping, step; returns the loss."""
    with autocast(device, amp_dtype):
        loss = criterion(net(x), y)
    optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    else:
        loss.backward()
    if clip_grad:
        nn.utils.clip_grad_norm_(net.parameters(), clip_grad)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return loss.detach()
