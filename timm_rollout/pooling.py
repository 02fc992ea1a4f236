"""Rollout pooling for any timm VisionTransformer-family model, and :func:`set_pooling` to switch to and from it.

``set_pooling(model, 'rollout')`` swaps the model's class for a subclass that mixes in :class:`RolloutPooling`
(object identity and parameters untouched, as ``use_fast_dropout`` does for dropout): it runs timm's explicit
attention path with a recorder hook on each ``attn_drop``, turns one pass's attention into (B, num_patches)
pooling weights at the end of ``forward_features`` (or ``forward_intermediates``) and releases the attention.

The weights are tied to the tokens that pass returned: ``forward_head(tokens)`` pools ``tokens`` with the
weights of the pass that produced them (looked up by the tensor's identity, weakly referenced, and refused
when the tokens were changed in place since), and raises for any other tensor. So no order of
``forward_features``, ``forward_intermediates``, ``forward_head`` and ``model(x)`` calls pools one pass's
tokens with another pass's attention. ``set_pooling(model, <timm pooling>)`` gives the stock model back: its
class, its fused-attention setting, no hooks, no state.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from .capture import (
    attention_modules,
    record_attention,
    restore_fused_attention,
    set_attention_recorder,
    set_fused_attention,
)
from .rollout import check_options, patch_weights, rollout_cls_row

__all__ = [
    "CONFIG_KEY",
    "ROLLOUT",
    "TIMM_POOLS",
    "RolloutPooling",
    "config_entries",
    "option_model_args",
    "register_pooled_class",
    "rollout_pooled_class",
    "set_pooling",
    "switch_pooling_class",
]

ROLLOUT = "rollout"
TIMM_POOLS = ("", "avg", "avgmax", "max", "token", "map")  # timm VisionTransformer poolings (global_pool)
OPTIONS = {"head_fusion": ("rollout_head_fusion", "mean"), "discard_ratio": ("rollout_discard_ratio", 0.0),
           "grad": ("rollout_grad", False)}  # set_pooling option -> model attribute, default
_PASSES = "_rollout_passes"  # {id(tokens): (weakref to tokens, their _version, (B, P) weights)} of live passes
_FUSED = "_stock_fused_attn"  # each attention module's fused_attn before rollout pooling
_STOCK_POOL = "_stock_global_pool"  # the timm pooling the model had before rollout pooling
CONFIG_KEY = "rollout_pooling"  # config.json entry of a stock timm ViT saved while rollout-pooled


class RolloutPooling:
    """Mixin of a rollout-pooled timm ViT (made by :func:`set_pooling`, never built): pooling by the [CLS] row of
    the attention rollout over the patch tokens, with the model's ``rollout_head_fusion``,
    ``rollout_discard_ratio`` and ``rollout_grad``; prefix tokens (class, registers) are never pooled."""

    _stock_class: type[nn.Module]

    def forward_features(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        with record_attention(self) as attentions:
            tokens = super().forward_features(x, *args, **kwargs)
        self.keep_rollout_weights(attentions, tokens)
        return tokens

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """timm's ``forward``; keeps nothing: the pass's weights are dropped once its head has pooled."""
        tokens = self.forward_features(x, *args, **kwargs)
        try:
            return self.forward_head(tokens)
        finally:
            self.__dict__[_PASSES].pop(id(tokens), None)

    def forward_intermediates(self, x: torch.Tensor, *args, **kwargs) -> Any:
        """timm's ``forward_intermediates``; the final tokens it returns (unless ``intermediates_only``) carry
        this pass's pooling weights for ``forward_head``."""
        with record_attention(self) as attentions:
            out = super().forward_intermediates(x, *args, **kwargs)
        if isinstance(out, tuple) and isinstance(out[0], torch.Tensor):
            self.keep_rollout_weights(attentions, out[0])
        return out

    def keep_rollout_weights(self, attentions: list[torch.Tensor | None], tokens: torch.Tensor) -> None:
        """Tie the pooling weights of one pass's recorded attention to the ``tokens`` that pass produced.

        ``forward_features`` calls it; so does code that runs the blocks itself inside
        :func:`~timm_rollout.capture.record_attention` (e.g. on a shortened token sequence). Nothing is kept
        when some block did not run (``stop_early``): ``forward_head`` then refuses those tokens. Passes are
        entries of their own (one dict operation each), so threads sharing a model never drop each other's.
        """
        passes = self.__dict__.setdefault(_PASSES, {})
        for key, (ref, _, _) in list(passes.items()):
            if ref() is None:
                passes.pop(key, None)
        if all(a is not None for a in attentions):
            if not self.rollout_grad:
                attentions = [a.detach() for a in attentions]
            row = rollout_cls_row(attentions, self.rollout_head_fusion, self.rollout_discard_ratio,
                                  self.num_prefix_tokens)
            passes[id(tokens)] = (weakref.ref(tokens), _version(tokens), patch_weights(row, self.num_prefix_tokens))

    def rollout_weights(self, tokens: torch.Tensor) -> torch.Tensor:
        """Pooling weights (B, num_patches) of the pass that returned ``tokens`` (``forward_features`` or
        ``forward_intermediates``); ``model(x)`` keeps none. A one-line RuntimeError for any other tensor."""
        ref, version, weights = self.__dict__.get(_PASSES, {}).get(id(tokens), (lambda: None, None, None))
        if ref() is tokens:
            if _version(tokens) != version:
                raise RuntimeError("these tokens were changed in place after forward_features; pool the "
                                   "unchanged output of forward_features, or run it again")
            return weights
        raise RuntimeError(
            "forward_head on a rollout-pooled model takes the very tensor its forward_features (or "
            "forward_intermediates) returned, whose pass's attention it pools with; pass that output, not a "
            "copy, slice or another model's tokens"
        )

    def pool(self, x: torch.Tensor, pool_type: str | None = None) -> torch.Tensor:
        pool_type = self.global_pool if pool_type is None else pool_type
        if pool_type != ROLLOUT:
            return super().pool(x, pool_type)
        weights = self.rollout_weights(x)
        return torch.bmm(weights.to(x.dtype).unsqueeze(1), x[:, self.num_prefix_tokens:]).squeeze(1)

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name == "global_pool" and value != ROLLOUT:
            switch_pooling_class(self, rollout=False)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, e.g. an EMA model) starts with no pass of its own."""
        state = super().__getstate__()
        return {k: v for k, v in state.items() if k != _PASSES}

    def __prepare_scriptable__(self) -> nn.Module:
        raise RuntimeError(
            "a rollout-pooled model cannot be TorchScript-compiled: its pooling reads the attention that forward "
            "hooks record, which TorchScript does not run; use torch.compile, or script it with a timm pooling "
            "(timm_rollout.set_pooling(model, 'avg'))"
        )


def _version(tokens: torch.Tensor) -> int | None:
    """In-place changes counted by autograd; inference tensors have no counter (and no in-place use outside
    ``torch.inference_mode``)."""
    return None if tokens.is_inference() else tokens._version


_CLASSES: dict[type, type] = {}


def register_pooled_class(pooled: type[RolloutPooling]) -> type[RolloutPooling]:
    """Class decorator: ``pooled`` (with its ``_stock_class``) is the rollout-pooled class of that stock class."""
    _CLASSES[pooled._stock_class] = pooled
    return pooled


def rollout_pooled_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The rollout-pooled subclass of a timm ViT class (made once per class)."""
    if issubclass(cls, RolloutPooling):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"RolloutPooled{cls.__name__}", (RolloutPooling, cls),
                             {"_stock_class": cls, "__module__": __name__})
    return _CLASSES[cls]


def switch_pooling_class(model: nn.Module, rollout: bool) -> None:
    """Swap ``model`` to its rollout-pooled class (explicit attention path, recorder hooks) or back to its stock
    class (the fused-attention setting it had, no hooks, no kept passes); nothing when it is there already."""
    if isinstance(model, RolloutPooling) == rollout:
        return
    if rollout:
        model.__dict__[_STOCK_POOL] = model.global_pool
        model.__dict__[_FUSED] = set_fused_attention(model, False)
        set_attention_recorder(model, True)
        model.__class__ = rollout_pooled_class(type(model))
        return
    model.__class__ = model._stock_class
    restore_fused_attention(model, model.__dict__.pop(_FUSED))
    set_attention_recorder(model, False)
    model.__dict__.pop(_PASSES, None)
    model.__dict__.pop(_STOCK_POOL, None)


def _check_pool(model: nn.Module, pool: str) -> None:
    if not hasattr(model, "global_pool") or not hasattr(model, "num_prefix_tokens"):
        raise ValueError(f"{type(model).__name__} is not a timm VisionTransformer-family model (no global_pool)")
    attention_modules(model)  # raises for models without timm attention blocks
    if pool not in (*TIMM_POOLS, ROLLOUT):
        raise ValueError(f"unknown pooling {pool!r}; use one of {', '.join(map(repr, (*TIMM_POOLS, ROLLOUT)))}")
    has_cls = getattr(model, "cls_token", None) is not None
    if pool in ("token", ROLLOUT) and not has_cls:
        raise ValueError(f"{pool} pooling needs a class token, and {type(model).__name__} has none "
                         "(built with class_token=False); use 'avg' or 'map'")
    attn_pool = getattr(model, "attn_pool", None)
    if pool == "map" and attn_pool is None:
        raise ValueError("timm cannot add learned attention pooling to a built model; create it with global_pool='map'")
    if attn_pool is not None and pool not in ("map", ROLLOUT):
        raise ValueError("this model pools with its learned attention pool (global_pool='map'), which timm applies "
                         "whatever global_pool says; switch it to 'map' or 'rollout' only")


def set_pooling(model: nn.Module, pool: str, **options: Any) -> nn.Module:
    """Pool ``model`` (any timm VisionTransformer-family model) with ``pool`` from now on; returns ``model``.

    ``pool`` is a timm pooling (``'token'``, ``'avg'``, ``'max'``, ``'avgmax'``, ``''``, ``'map'`` where the model
    was built with it) or ``'rollout'``, with options ``head_fusion`` (``'mean'``, ``'max'``, ``'min'``),
    ``discard_ratio`` (in [0, 1)) and ``grad`` (gradients through the weights; by default a readout), kept on
    the model as ``rollout_head_fusion``, ``rollout_discard_ratio`` and ``rollout_grad`` (the model's own values,
    or the defaults, when not given). A timm pooling gives back the stock model: class, fused attention, no hooks.
    """
    _check_pool(model, pool)
    unknown = set(options) - set(OPTIONS)
    if unknown or (options and pool != ROLLOUT):
        raise ValueError(f"options {sorted(options)} are not rollout options of pooling {pool!r}; rollout takes "
                         f"{', '.join(OPTIONS)}")
    if pool == ROLLOUT:
        values = {attr: options.get(key, getattr(model, attr, default)) for key, (attr, default) in OPTIONS.items()}
        check_options(values["rollout_head_fusion"], values["rollout_discard_ratio"])
        for attr, value in values.items():
            setattr(model, attr, value)
        switch_pooling_class(model, rollout=True)
    elif not getattr(model, "rollout_options_are_model_args", False):  # the stock model exactly: no rollout
        for attr, _ in OPTIONS.values():                                  # attributes left behind
            model.__dict__.pop(attr, None)
    model.global_pool = pool
    return model


def option_model_args(model: nn.Module) -> dict[str, Any]:
    """The rollout options of a model that takes them as model arguments, at their current values (``set_pooling``
    may have changed them since the model was built), for ``config.json``'s ``model_args``; empty otherwise."""
    if not getattr(model, "rollout_options_are_model_args", False):
        return {}
    return {attr: getattr(model, attr) for attr, _ in OPTIONS.values()}


def config_entries(model: nn.Module) -> dict[str, Any]:
    """What timm's ``config.json`` must say of a stock timm ViT that :func:`set_pooling` made rollout-pooled:
    its stock pooling as ``global_pool`` (so ``timm.create_model("local-dir:...")`` builds it) and the rollout
    options under :data:`CONFIG_KEY`, which :func:`timm_rollout.loading.load_model` applies; empty otherwise."""
    if not isinstance(model, RolloutPooling) or getattr(model, "rollout_options_are_model_args", False):
        return {}
    options = {key: getattr(model, attr) for key, (attr, _) in OPTIONS.items()}
    return {"global_pool": model.__dict__[_STOCK_POOL], CONFIG_KEY: options}
