"""Record attention probabilities of timm ViT-family models with forward hooks.

timm's attention modules (``timm.layers.Attention`` and its relatives) compute
``softmax(q k^T)`` explicitly when ``fused_attn`` is off and pass it to ``attn_drop``. A forward
hook on ``attn_drop`` therefore sees the attention probabilities *before* dropout. Hooks exist only
inside a ``with`` block: :func:`capture_attention` (public) stores what each hook sees on the
``attn_drop`` module it is attached to (never in a closure over a model), so a deep copy of a model
made meanwhile (e.g. ``timm.utils.ModelEmaV3``) records its own attention; :func:`record_attention`
(the rollout-pooled model's own recorder) keeps one pass's attention in a local list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

__all__ = ["AttentionCapture", "attention_modules", "capture_attention", "record_attention"]

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


def _store_captured_attention(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    setattr(module, CAPTURE_SLOT, args[0])


@contextmanager
def _explicit_path_with_hooks(modules: list[nn.Module], hooks: list[Callable]) -> Iterator[None]:
    """Run ``modules`` on the explicit attention path with ``hooks[i]`` on ``modules[i].attn_drop``.

    On exit the hooks are removed and each module's ``fused_attn`` is restored.
    """
    fused = [m.fused_attn for m in modules]
    handles = []
    try:
        for m, hook in zip(modules, hooks, strict=True):
            m.fused_attn = False
            handles.append(m.attn_drop.register_forward_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for m, was_fused in zip(modules, fused, strict=True):
            m.fused_attn = was_fused


@contextmanager
def record_attention(model: nn.Module) -> Iterator[list[torch.Tensor | None]]:
    """Record each block's pre-dropout attention during the ``with`` body into a list, in block order.

    Used by the rollout-pooled model inside ``forward_features``: the list is local to the pass (nothing
    is stored on the model) and the hooks are gone when it ends, so blocks re-run by gradient
    checkpointing in backward record nothing. Entries stay None for blocks that did not run.
    """
    modules = attention_modules(model)
    found: list[torch.Tensor | None] = [None] * len(modules)

    def store(index: int, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        found[index] = args[0]

    with _explicit_path_with_hooks(modules, [partial(store, i) for i in range(len(modules))]):
        yield found


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
    try:
        with _explicit_path_with_hooks(modules, [_store_captured_attention] * len(modules)):
            capture = AttentionCapture(modules, int(getattr(model, "num_prefix_tokens", 1)))
            yield capture
            found = [getattr(m.attn_drop, CAPTURE_SLOT, None) for m in modules]
            capture._frozen = found if all(a is not None for a in found) else []
    finally:
        for m in modules:
            if hasattr(m.attn_drop, CAPTURE_SLOT):
                delattr(m.attn_drop, CAPTURE_SLOT)
