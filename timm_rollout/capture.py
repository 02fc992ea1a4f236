"""Record attention probabilities of timm ViT-family models with forward hooks.

timm's attention modules (``timm.layers.Attention`` and its relatives) compute
``softmax(q k^T)`` explicitly when ``fused_attn`` is off and pass it to ``attn_drop``. A forward
hook on ``attn_drop`` therefore sees the attention probabilities *before* dropout. Each hook stores
what it sees on the ``attn_drop`` module it is attached to (never in a closure over a model), so a
deep copy of a model (e.g. ``timm.utils.ModelEmaV3``) records its own attention.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["AttentionCapture", "attention_modules", "capture_attention", "install_attention_hook"]

MODEL_SLOT = "_rollout_attn"  # used by the rollout-pooled model itself
CAPTURE_SLOT = "_captured_attn"  # used by capture_attention()


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Attention modules of a timm ViT-family model, in forward (block) order."""
    found = [
        m for m in model.modules()
        if hasattr(m, "fused_attn") and isinstance(getattr(m, "attn_drop", None), nn.Module)
    ]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no timm attention blocks (modules with `fused_attn` and "
            "`attn_drop`); attention capture supports timm VisionTransformer-family models"
        )
    return found


def _store_model_attention(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    setattr(module, MODEL_SLOT, args[0])


def _store_captured_attention(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    setattr(module, CAPTURE_SLOT, args[0])


def install_attention_hook(attn: nn.Module) -> None:
    """Permanently record ``attn``'s pre-dropout probabilities on ``attn.attn_drop`` (explicit path)."""
    attn.fused_attn = False
    drop = attn.attn_drop
    if _store_model_attention not in drop._forward_hooks.values():
        drop.register_forward_hook(_store_model_attention)


def take_model_attention(attn: nn.Module) -> torch.Tensor | None:
    """Return and release the attention that ``install_attention_hook`` recorded last."""
    drop = attn.attn_drop
    value = getattr(drop, MODEL_SLOT, None)
    if value is not None:
        setattr(drop, MODEL_SLOT, None)
    return value


@dataclass
class AttentionCapture:
    """Attention recorded by :func:`capture_attention`: one (B, heads, N, N) tensor per block.

    Holds the most recent forward pass. Tensors keep their autograd graph when recorded with
    gradients enabled, so gradient-weighted maps can differentiate through them.
    """

    modules: list[nn.Module]
    num_prefix_tokens: int
    _frozen: list[torch.Tensor] | None = field(default=None, repr=False)

    @property
    def attentions(self) -> list[torch.Tensor]:
        if self._frozen is not None:
            return self._frozen
        found = [getattr(m.attn_drop, CAPTURE_SLOT, None) for m in self.modules]
        if any(a is None for a in found):
            raise RuntimeError("no attention recorded yet: run a forward pass inside capture_attention()")
        return found


@contextmanager
def capture_attention(model: nn.Module) -> Iterator[AttentionCapture]:
    """Record every block's attention probabilities (B, heads, N, N), before attention dropout.

    Fused attention is switched off while recording and restored afterwards; the hooks are removed
    on exit. The model's outputs are unchanged up to float rounding::

        with timm_rollout.capture_attention(model) as cap:
            logits = model(x)
        attentions = cap.attentions  # list, block order
    """
    modules = attention_modules(model)
    fused = [m.fused_attn for m in modules]
    handles = []
    try:
        for m in modules:
            m.fused_attn = False
            handles.append(m.attn_drop.register_forward_hook(_store_captured_attention))
        capture = AttentionCapture(modules, int(getattr(model, "num_prefix_tokens", 1)))
        yield capture
        found = [getattr(m.attn_drop, CAPTURE_SLOT, None) for m in modules]
        capture._frozen = found if all(a is not None for a in found) else []
    finally:
        for handle in handles:
            handle.remove()
        for m, was_fused in zip(modules, fused, strict=True):
            m.fused_attn = was_fused
            if hasattr(m.attn_drop, CAPTURE_SLOT):
                delattr(m.attn_drop, CAPTURE_SLOT)
