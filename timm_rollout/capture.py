"""Record attention probabilities of timm ViT-family models with forward hooks.

timm's attention modules (``timm.layers.Attention`` and its relatives) compute
``softmax(q k^T)`` explicitly when ``fused_attn`` is off and pass it to ``attn_drop``. A forward
hook on ``attn_drop`` therefore sees the attention probabilities *before* dropout. Hooks store what
they see into the sinks open on the ``attn_drop`` module they are attached to (never in a closure over a
model), so a deep copy of a model (e.g. ``timm.utils.ModelEmaV3``) records its own attention. One hook and
one sink mechanism serve both users: :func:`capture_attention` (public) hooks a model for the duration of a
``with`` block; :func:`record_attention` opens a sink on the rollout-pooled model's permanent hooks for one
forward pass and hands that pass's attention over on exit. A hook with no sink open records nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "AttentionCapture",
    "attention_modules",
    "capture_attention",
    "fused_attention",
    "record_attention",
    "restore_fused_attention",
    "set_attention_recorder",
    "set_fused_attention",
]

SINKS = "_attention_sinks"  # on each attn_drop: the dicts (attn_drop -> attention) open on it


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


def set_fused_attention(model: nn.Module, fused: bool) -> list[bool]:
    """Switch every timm attention module of ``model`` to the fused (SDPA) or explicit path; returns each module's
    previous setting, for :func:`restore_fused_attention`.

    A rollout-pooled model keeps the explicit path whatever is asked: its pooling reads the attention.
    """
    modules = [m for m in model.modules() if hasattr(m, "fused_attn")]
    keep_explicit = getattr(model, "global_pool", None) == "rollout"
    before = [bool(m.fused_attn) for m in modules]
    for m in modules:
        m.fused_attn = fused and not keep_explicit
    return before


def restore_fused_attention(model: nn.Module, before: list[bool]) -> None:
    """Give each timm attention module of ``model`` back the setting :func:`set_fused_attention` returned."""
    for m, was in zip([m for m in model.modules() if hasattr(m, "fused_attn")], before, strict=True):
        m.fused_attn = was


@contextmanager
def fused_attention(model: nn.Module, fused: bool) -> Iterator[None]:
    """:func:`set_fused_attention` for the ``with`` body, each module's own setting restored after."""
    before = set_fused_attention(model, fused)
    try:
        yield
    finally:
        restore_fused_attention(model, before)


class _Sink(dict):
    """One pass's attention (attn_drop -> tensor), recorded only by the thread that opened it: threads running
    one model at once never record into each other's pass."""

    __eq__, __hash__ = object.__eq__, object.__hash__  # one sink is itself only (list.remove finds it alone)

    def __init__(self) -> None:
        super().__init__()
        self.thread = None if torch.compiler.is_compiling() else threading.get_ident()  # None: any thread


def _record(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    """The one attention hook: hand the pre-dropout attention to every sink this thread has open on this
    ``attn_drop``."""
    # torch.compile cannot trace the thread check (a graph break per block): a compiled model runs one pass at a time
    thread = None if torch.compiler.is_compiling() else threading.get_ident()
    for sink in tuple(module.__dict__.get(SINKS, ())):  # a snapshot: other threads open and close theirs
        if thread is None or sink.thread in (None, thread):
            sink[module] = args[0]


def _has_recorder(drop: nn.Module) -> bool:
    return any(hook is _record for hook in drop._forward_hooks.values())


def set_attention_recorder(model: nn.Module, on: bool) -> None:
    """Install (``on``) or remove the rollout model's permanent recorder: the hook on every ``attn_drop``.

    It records only into sinks that :func:`record_attention` opens; it stays installed so that compiled models
    (``torch.compile``) do not break their graph on hook registration in every forward pass.
    """
    for m in attention_modules(model):
        hooks = m.attn_drop._forward_hooks
        for key in [k for k, hook in hooks.items() if hook is _record]:
            del hooks[key]
        if on:
            m.attn_drop.register_forward_hook(_record)
        else:
            _drop_empty_sinks(m.attn_drop)


def _drop_empty_sinks(drop: nn.Module) -> None:
    """Remove the (empty) sink list of an ``attn_drop`` whose recorder is gone: the stock module, no leftovers."""
    if not drop.__dict__.get(SINKS, True):
        del drop.__dict__[SINKS]


@contextmanager
def _open_sink(drops: list[nn.Module]) -> Iterator[dict[nn.Module, torch.Tensor]]:
    """A sink open on every module of ``drops`` for the ``with`` body, closed (removed) on exit; one list
    operation each, so passes of other threads opening and closing theirs meanwhile keep them."""
    sink = _Sink()
    for drop in drops:
        drop.__dict__.setdefault(SINKS, []).append(sink)
    try:
        yield sink
    finally:
        for drop in drops:
            drop.__dict__[SINKS].remove(sink)


@contextmanager
def record_attention(model: nn.Module) -> Iterator[list[torch.Tensor | None]]:
    """Open a sink on the recorder of :func:`set_attention_recorder` for the ``with`` body of one forward pass.

    Yields a list that is filled on exit with each block's pre-dropout attention (block order; None for a block
    that did not run) and closes the sink, so nothing stays on the model. Blocks re-run by gradient checkpointing
    in backward find no sink open and record nothing.
    """
    drops = [m.attn_drop for m in attention_modules(model)]
    found: list[torch.Tensor | None] = []
    with _open_sink(drops) as sink:
        try:
            yield found
        finally:
            found.extend(sink.get(drop) for drop in drops)


@dataclass
class AttentionCapture:
    """Attention recorded by :func:`capture_attention`: one (B, heads, N, N) tensor per block.

    Holds the most recent forward pass. Tensors keep their autograd graph when recorded with
    gradients enabled, so gradient-weighted maps can differentiate through them.
    """

    modules: list[nn.Module]
    num_prefix_tokens: int
    _sink: dict[nn.Module, torch.Tensor] = field(default_factory=dict, repr=False)
    _frozen: list[torch.Tensor] | None = field(default=None, repr=False)

    @property
    def attentions(self) -> list[torch.Tensor]:
        if self._frozen is not None:
            return self._frozen
        found = [self._sink.get(m.attn_drop) for m in self.modules]
        if any(a is None for a in found):
            raise RuntimeError("no attention recorded yet: run a forward pass inside capture_attention()")
        return found


@contextmanager
def capture_attention(model: nn.Module) -> Iterator[AttentionCapture]:
    """Record every block's attention probabilities (B, heads, N, N), before attention dropout.

    Fused attention is switched off while recording and restored afterwards; hooks it added are removed on
    exit. The model's outputs are unchanged up to float rounding::

        with timm_rollout.capture_attention(model) as cap:
            logits = model(x)
        attentions = cap.attentions  # list, block order
    """
    modules = attention_modules(model)
    drops = [m.attn_drop for m in modules]
    handles = [d.register_forward_hook(_record) for d in drops if not _has_recorder(d)]
    try:
        with fused_attention(model, False), _open_sink(drops) as sink:
            capture = AttentionCapture(modules, int(getattr(model, "num_prefix_tokens", 1)), sink)
            yield capture
            found = [sink.get(d) for d in drops]
            capture._frozen = found if all(a is not None for a in found) else []
    finally:
        for handle in handles:
            handle.remove()
        for drop in drops:
            if not _has_recorder(drop):
                _drop_empty_sinks(drop)
