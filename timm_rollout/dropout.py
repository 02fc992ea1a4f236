"""Dropout that is cheap on CPU: the keep-mask comes from random bytes instead of one RNG draw per element.

Each 64-bit draw gives four 16-bit thresholds, so the drop probability realised is
``p_eff = 1 - round((1 - p) * 65536) / 65536`` (p=0.1 -> 0.1000061), kept values scaled by ``1 / (1 - p_eff)``.
In eval mode, on CUDA, and for in-place dropout it is ``nn.Dropout`` itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Literals below, not module constants, because TorchScript compiles these functions: 65536 = 2**16
# thresholds per 16-bit slice, -9223372036854775807 - 1 = the lowest int64 (full 64-bit draws).


def _keep_threshold(p: float) -> int:
    """Number of the 65536 16-bit values that keep an element."""
    return int(round((1.0 - p) * 65536))  # noqa: RUF046 (TorchScript round() gives a float)


def _keep_mask(x: torch.Tensor, keep: int) -> torch.Tensor:
    """Boolean keep-mask shaped like ``x``: each int64 draw read as four int16 slices ``s``, kept when
    ``s + 32768 < keep`` (under TorchScript, which has no dtype view, the same slices come from shifts)."""
    n = x.numel()
    bits = torch.empty([(n + 3) // 4], dtype=torch.int64, device=x.device).random_(-9223372036854775807 - 1, None)
    if torch.jit.is_scripting():
        shifts = torch.tensor([0, 16, 32, 48], dtype=torch.int64, device=x.device)
        offset = ((bits.unsqueeze(-1) >> shifts) & 0xFFFF) ^ 0x8000  # = int16 slice + 32768 (little-endian order)
        return (offset < keep).flatten()[:n].view(x.shape)
    return bits.view(torch.int16)[:n].view(x.shape) < keep - 32768


class FastDropout(nn.Dropout):
    """``nn.Dropout`` with a cheap CPU keep-mask; scripted and traced models (an FX leaf, registered by
    :mod:`timm_rollout.models`) draw the eager masks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p <= 0.0 or self.p >= 1.0 or self.inplace or x.device.type != "cpu":
            return F.dropout(x, self.p, self.training, self.inplace)
        keep = _keep_threshold(self.p)
        if keep == 65536:
            return x
        # where + in-place scale: autograd keeps only the bool mask; the scale is applied in float as F.dropout does
        return torch.where(_keep_mask(x, keep), x, 0.0).mul_(65536 / keep)


def use_fast_dropout(model: nn.Module) -> int:
    """Turn every ``nn.Dropout`` with ``p > 0`` in ``model`` into a :class:`FastDropout` by swapping its class
    (hooks, attributes and state dicts untouched); returns the count."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Dropout and module.p > 0:
            module.__class__ = FastDropout
            count += 1
    return count
