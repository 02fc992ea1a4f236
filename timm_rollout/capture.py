"""Record attention probabilities of timm ViT-family models with forward hooks.

With ``fused_attn`` off, timm's attention modules pass ``softmax(q k^T)`` to ``attn_drop``, so a forward hook there
sees the attention before dropout. The hook writes into the sinks open on its ``attn_drop`` (never a closure over
a model, so a deep copy records its own). :func:`capture_attention` and rollout pooling each *hold* the model on
the explicit path with the hooks (:func:`hold_explicit`); :func:`record_attention` opens a sink for one pass.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

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
    previous setting. A held module (:func:`hold_explicit`) takes the setting when its last hold is released."""
    return [_swap_own(m, fused) for m in _fused_modules(model)]


@contextmanager
def fused_attention(model: nn.Module, fused: bool) -> Iterator[None]:
    """:func:`set_fused_attention` for the ``with`` body, each module's own setting restored after."""
    before = set_fused_attention(model, fused)
    try:
        yield
    finally:
        for m, was in zip(_fused_modules(model), before, strict=True):
            _swap_own(m, was)


class _Sink(dict):
    """One pass's attention (attn_drop -> tensor), recorded only by the thread that opened it: threads running
    one model at once never record into each other's pass."""

    __eq__, __hash__ = object.__eq__, object.__hash__  # one sink is itself only (list.remove finds it alone)

    def __init__(self) -> None:
        super().__init__()
        self.thread = None if torch.compiler.is_compiling() else threading.get_ident()  # None: any thread


def _record(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    """The one attention hook: the pre-dropout attention to every sink this thread has open on ``attn_drop``."""
    # torch.compile cannot trace the thread check (a graph break per block): a compiled model runs one pass at a time
    thread = None if torch.compiler.is_compiling() else threading.get_ident()
    for sink in tuple(module.__dict__.get(SINKS, ())):  # a snapshot: other threads open and close theirs
        if thread is None or sink.thread in (None, thread):
            sink[module] = args[0]


def hold_explicit(model: nn.Module, holder: str) -> None:
    """Hold ``model`` on the explicit attention path, with the recorder hook on every ``attn_drop``, for ``holder``
    until :func:`release_explicit`. Holds nest in any order; the hook stays while held, so compiled models do not
    break their graph on hook registration in every pass."""
    for m in _fused_modules(model):
        holds = m.__dict__.setdefault(HOLDS, [])
        if not holds:
            m.__dict__[FUSED_BEFORE] = bool(m.fused_attn)
        m.fused_attn = False
        drop = getattr(m, "attn_drop", None)
        if isinstance(drop, nn.Module) and _record not in drop._forward_hooks.values():
            drop.register_forward_hook(_record)
        if holder not in holds:
            holds.append(holder)


def release_explicit(model: nn.Module, holder: str) -> None:
    """Release ``holder``'s hold (:func:`hold_explicit`); the last release leaves each module as it was before."""
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
            if not drop.__dict__.get(SINKS, True):  # an empty sink list: no leftovers on the stock module
                del drop.__dict__[SINKS]


@contextmanager
def _open_sink(drops: list[nn.Module]) -> Iterator[dict[nn.Module, torch.Tensor]]:
    """A sink open on every module of ``drops`` for the ``with`` body (one list operation each: thread-safe)."""
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
    """Open a sink on the recorder of :func:`hold_explicit` for the ``with`` body of one forward pass; the yielded
    list is filled on exit with each block's pre-dropout attention (None for a block that did not run)."""
    drops = [m.attn_drop for m in attention_modules(model)]
    found: list[torch.Tensor | None] = []
    with _open_sink(drops) as sink:
        try:
            yield found
        finally:
            found.extend(sink.get(drop) for drop in drops)


@dataclass
class AttentionCapture:
    """Attention of the most recent pass in :func:`capture_attention`: one (B, heads, N, N) tensor per block, with
    its autograd graph when recorded with gradients enabled."""

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
    """Record every block's attention probabilities (B, heads, N, N), before attention dropout, holding the model
    on the explicit path (:func:`hold_explicit`) for the ``with`` body::

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
