"""Record attention probabilities of timm ViT-family models with forward hooks.

timm's attention modules (``timm.layers.Attention`` and its relatives) compute
``softmax(q k^T)`` explicitly when ``fused_attn`` is off and pass it to ``attn_drop``. A forward
hook on ``attn_drop`` therefore sees the attention probabilities *before* dropout. Hooks store what
they see into the sinks open on the ``attn_drop`` module they are attached to (never in a closure over a
model), so a deep copy of a model (e.g. ``timm.utils.ModelEmaV3``) records its own attention. One hook and
one sink mechanism serve both users, and each *holds* the model on the explicit path with the hooks installed
(:func:`hold_explicit`) for as long as it needs them: :func:`capture_attention` (public) for the duration of a
``with`` block, rollout pooling while the model is rollout-pooled; :func:`record_attention` opens a sink on those
hooks for one forward pass and hands that pass's attention over on exit. A hook with no sink open records nothing.
"""

from __future__ import annotations

import itertools
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
    "hold_explicit",
    "record_attention",
    "release_explicit",
    "restore_fused_attention",
    "set_fused_attention",
]

SINKS = "_attention_sinks"  # on each attn_drop: the dicts (attn_drop -> attention) open on it
HOLDS = "_explicit_holds"  # on each fused-attention module: who holds it on the explicit path (hold_explicit)
FUSED_BEFORE = "_fused_before_hold"  # its own fused setting meanwhile, given back by the last release
_CAPTURES = itertools.count()  # capture_attention's hold names


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


def _fused_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "fused_attn")]


def _swap_own(module: nn.Module, fused: bool) -> bool:
    """Set a module's own fused setting and return the previous one; a held module keeps the explicit path and
    takes its own setting back when its last hold is released (:func:`release_explicit`)."""
    if module.__dict__.get(HOLDS):
        before, module.__dict__[FUSED_BEFORE] = module.__dict__[FUSED_BEFORE], bool(fused)
        return before
    before, module.fused_attn = bool(module.fused_attn), bool(fused)
    return before


def set_fused_attention(model: nn.Module, fused: bool) -> list[bool]:
    """Switch every timm attention module of ``model`` to the fused (SDPA) or explicit path; returns each module's
    previous setting, for :func:`restore_fused_attention`.

    A module held on the explicit path (an open :func:`capture_attention`, rollout pooling) stays on it: the
    setting asked is the one it takes when the last hold is released.
    """
    return [_swap_own(m, fused) for m in _fused_modules(model)]


def restore_fused_attention(model: nn.Module, before: list[bool]) -> None:
    """Give each timm attention module of ``model`` back the setting :func:`set_fused_attention` returned."""
    for m, was in zip(_fused_modules(model), before, strict=True):
        _swap_own(m, was)


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


def hold_explicit(model: nn.Module, holder: str) -> None:
    """Hold ``model`` on the explicit attention path, with the recorder hook on every ``attn_drop``, for ``holder``
    (an open :func:`capture_attention`, rollout pooling) until :func:`release_explicit`.

    Holds of several holders nest in any order: the model stays explicit and recording while any holds it, and the
    last release gives back each module's own fused setting and removes the hooks. The hook stays installed while
    held so that compiled models (``torch.compile``) do not break their graph on hook registration in every pass.
    """
    for m in _fused_modules(model):
        holds = m.__dict__.setdefault(HOLDS, [])
        if not holds:
            m.__dict__[FUSED_BEFORE] = bool(m.fused_attn)
        m.fused_attn = False
        drop = getattr(m, "attn_drop", None)
        if isinstance(drop, nn.Module) and not _has_recorder(drop):
            drop.register_forward_hook(_record)
        if holder not in holds:
            holds.append(holder)


def release_explicit(model: nn.Module, holder: str) -> None:
    """Release ``holder``'s hold (:func:`hold_explicit`); the last one leaves each module as it was before the
    first: its own fused setting, no recorder hook, no sink list."""
    for m in _fused_modules(model):
        holds = m.__dict__.get(HOLDS)
        if holds is None:
            continue
        if holder in holds:
            holds.remove(holder)
        if holds:
            continue
        del m.__dict__[HOLDS]
        m.fused_attn = m.__dict__.pop(FUSED_BEFORE)
        drop = getattr(m, "attn_drop", None)
        if isinstance(drop, nn.Module):
            hooks = drop._forward_hooks
            for key in [k for k, hook in hooks.items() if hook is _record]:
                del hooks[key]
            _drop_empty_sinks(drop)


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
    """Open a sink on the recorder of :func:`hold_explicit` for the ``with`` body of one forward pass.

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

    Fused attention is switched off while recording (a hold, :func:`hold_explicit`) and hooks are added; on exit
    the capture releases its hold, restoring only what it changed: a model made rollout-pooled inside the ``with``
    block stays on its explicit path, one switched back to a timm pooling inside it gets the fused setting it had
    before rollout pooling. The model's outputs are unchanged up to float rounding::

        with timm_rollout.capture_attention(model) as cap:
            logits = model(x)
        attentions = cap.attentions  # list, block order
    """
    modules = attention_modules(model)
    drops = [m.attn_drop for m in modules]
    holder = f"capture {next(_CAPTURES)}"
    hold_explicit(model, holder)
    try:
        with _open_sink(drops) as sink:
            capture = AttentionCapture(modules, int(getattr(model, "num_prefix_tokens", 1)), sink)
            yield capture
            found = [sink.get(d) for d in drops]
            capture._frozen = found if all(a is not None for a in found) else []
    finally:
        release_explicit(model, holder)
