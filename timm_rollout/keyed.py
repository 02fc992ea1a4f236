"""Keyed dropout: masks as a pure function of (run, site, update), not of a random generator's state.

``train --dropout-draws keyed``. Each dropout and drop-path site of a run holds a key (from the run's seed and the
site's place in the model) and a counter: at each epoch's start a block of its own for the epoch and process
(rank), then advanced by each draw, so no two draws of a site share it. Its
mask is SplitMix64 (Steele, Lea and Flood 2014) seeded by the key and counter, one 64-bit output per element (per
sample for drop path), whose low 16 bits are compared with the threshold :class:`~timm_rollout.dropout.FastDropout`
uses: the same keep probability, quantised to 1/65536, and the same scaling. No generator is involved, so a
stacked pass (``--stack``: ``vmap`` over the runs' stacked keys and counters) draws every run's masks in one
batched operation, exactly the masks its separate run draws, and a CUDA graph records and replays the draw
(``--stack --capture``). The integer hash gives the same masks on any device. Key and counter are non-persistent
buffers, so checkpoints and exported weights are unchanged.
"""

from __future__ import annotations

import torch
from timm.layers import DropPath
from torch import nn

from .dropout import _keep_threshold

__all__ = ["KeyedDropPath", "KeyedDropout", "set_draw_counters", "splitmix64", "use_keyed_draws"]

_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # SplitMix64's increment and multipliers, as int64 (two's complement)
_M1 = 0xBF58476D1CE4E5B9 - 2**64
_M2 = 0x94D049BB133111EB - 2**64


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def splitmix64(seed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` outputs of SplitMix64 from int64 ``seed`` (any shape S; returns S + (n,)), in int64 with
    wrapping arithmetic: output i mixes ``seed + (i + 1) * golden``."""
    steps = torch.arange(1, n + 1, device=seed.device, dtype=torch.int64) * _GOLDEN
    return _mix(seed.unsqueeze(-1) + steps)


def _stream(key: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """The seed of one draw: the site's key mixed with the pass counter."""
    return _mix(key + _mix(counter))


def _keep(key: torch.Tensor, counter: torch.Tensor, n: int, p: float) -> tuple[torch.Tensor, float]:
    """Keep-mask (n,) of a draw and the scale of kept values (0 when nothing can be kept)."""
    keep = _keep_threshold(p)
    return (splitmix64(_stream(key, counter), n) & 0xFFFF) < keep, 65536 / keep if keep else 0.0


class KeyedDropout(nn.Dropout):
    """``nn.Dropout`` whose training mask is keyed (see the module docstring); eval mode is the identity."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or _keep_threshold(self.p) == 65536:  # p too small to drop at 1/65536 steps
            return x
        if self.p >= 1.0:
            return x * 0.0  # all dropped, nothing drawn
        mask, scale = _keep(self.draw_key, self.draw_counter, x.numel(), self.p)
        self.draw_counter.add_(1)
        return torch.where(mask.view(x.shape), x, 0.0).mul_(scale)


class KeyedDropPath(DropPath):
    """timm's ``DropPath`` (stochastic depth) with a keyed draw per sample."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep, scale = _keep(self.draw_key, self.draw_counter, x.shape[0], self.drop_prob)
        self.draw_counter.add_(1)
        keep = keep.view(x.shape[0], *[1] * (x.dim() - 1)).to(x.dtype)
        return x * (keep * scale if self.scale_by_keep else keep)


def use_keyed_draws(model: nn.Module, seed: int) -> int:
    """Turn every dropout (``p > 0``) and drop-path site of ``model`` keyed, in place (classes change, modules and
    hooks stay), each site keyed by ``seed`` and its place in ``model.modules()``. Returns the count."""
    count = 0
    for site, module in enumerate(model.modules()):
        if isinstance(module, nn.Dropout) and module.p > 0:
            module.__class__ = KeyedDropout
        elif isinstance(module, DropPath) and module.drop_prob > 0:
            module.__class__ = KeyedDropPath
        else:
            continue
        key = _mix(torch.tensor(seed, dtype=torch.int64) * _GOLDEN + site)
        module.register_buffer("draw_key", key, persistent=False)
        module.register_buffer("draw_counter", torch.zeros((), dtype=torch.int64), persistent=False)
        count += 1
    return count


@torch.no_grad()
def set_draw_counters(buffers: dict[str, torch.Tensor], value: int) -> None:
    """Set every keyed site's counter among ``buffers`` (a model's ``dict(named_buffers())``, or a stack's stacked
    buffers) to ``value``: the first pass of an epoch draws with it, whatever ran before (a resume included)."""
    for name, buffer in buffers.items():
        if name.endswith("draw_counter"):
            buffer.fill_(value)
