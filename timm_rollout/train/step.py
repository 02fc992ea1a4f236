"""One training step and the batches it takes, shared by the training loop and ``scripts/bench_train.py``."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..augment import random_crop_flip
from ..data import normalize
from ..device import autocast


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every GPU), numpy and Python's ``random``, as a run does at the start of each epoch."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed derived from ``parts`` (numpy SeedSequence): independent streams per epoch and rank."""
    return int(np.random.SeedSequence([p & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint64)[0] >> 1)


@dataclass
class Loader:
    """A run's training batches from uint8 images held on the training device: each epoch a seeded order of the
    images, this rank's share of it in whole batches, crop+flip, normalise, optional mixup/CutMix."""

    images: torch.Tensor
    labels: torch.Tensor
    mean: Sequence[float]
    std: Sequence[float]
    batch_size: int
    steps: int  # batches per epoch (each rank's)
    seed: int = 0
    padding: int = 4
    hflip: float = 0.5
    mixup: Callable | None = None
    rank: int = 0
    world: int = 1

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Seed the epoch (torch, numpy, ``random``: dropout, mixup), then its ``steps`` batches: the order is the
        same on every rank (each takes its own slice), the augmentation this rank's own."""
        seed_everything(derive_seed(self.seed, epoch, self.rank))
        order = torch.randperm(len(self.labels), generator=torch.Generator().manual_seed(derive_seed(self.seed, epoch)))
        order = order[self.rank::self.world][: self.steps * self.batch_size].to(self.images.device)
        return self._batches(order, torch.Generator().manual_seed(derive_seed(self.seed, epoch, self.rank, 1)))

    def _batches(self, order: torch.Tensor, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for idx in order.reshape(self.steps, self.batch_size):
            x = normalize(random_crop_flip(self.images[idx], self.padding, self.hflip, generator), self.mean, self.std)
            y = self.labels[idx]
            yield self.mixup(x, y) if self.mixup is not None else (x, y)


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
