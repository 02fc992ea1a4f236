"""Batched augmentation of uint8 image tensors on the training device (no per-image PIL work).

Random crop with zero padding and horizontal flip, as torchvision's ``RandomCrop(size, padding)`` +
``RandomHorizontalFlip`` do per image, done for a whole (B, C, H, W) batch with one ``gather``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def crop_flip_draws(b: int, padding: int, hflip: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """The random numbers of one batch's crop and flip, (3, B) int64 on the CPU: row offset, column offset, flip.
    Drawn on the CPU from ``generator``, so seeded runs are reproducible across devices."""
    offsets = torch.randint(0, 2 * padding + 1, (2, b), generator=generator)
    flips = torch.rand(b, generator=generator) < hflip
    return torch.cat([offsets, flips[None].long()])


def crop_flip(images: torch.Tensor, draws: torch.Tensor, padding: int) -> torch.Tensor:
    """Pad each image of (B, C, H, W) by ``padding`` zero pixels and crop it back to (H, W) at its drawn offset,
    flipped where drawn; ``draws`` (3, B) on the images' device. One ``gather``, no host work."""
    b, c, h, w = images.shape
    row_off, col_off, flip = draws
    padded = F.pad(images, (padding, padding, padding, padding)) if padding else images
    rows = row_off[:, None] + torch.arange(h, device=images.device)  # (B, H)
    cols = torch.arange(w, device=images.device).expand(b, w)
    cols = torch.where(flip[:, None].bool(), cols.flip(1), cols) + col_off[:, None]  # (B, W)
    index = (rows[:, :, None] * (w + 2 * padding) + cols[:, None, :]).view(b, 1, h * w).expand(b, c, h * w)
    return padded.reshape(b, c, -1).gather(2, index).view(b, c, h, w)


def random_crop_flip(
    images: torch.Tensor, padding: int = 4, hflip: float = 0.5, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Pad each image of (B, C, H, W) by ``padding`` zero pixels, crop it back at a random offset, flip with prob
    ``hflip``; the draws reach a GPU in one pinned, non-blocking copy (the host never waits here)."""
    draws = crop_flip_draws(images.shape[0], padding, hflip, generator)
    if images.device.type == "cuda":
        draws = draws.pin_memory()
    return crop_flip(images, draws.to(images.device, non_blocking=True), padding)
