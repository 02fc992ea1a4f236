"""Rollout pooling for timm ViT-family models, and :func:`set_pooling` to switch to and from it.

``set_pooling(model, 'rollout')`` swaps the model's class for a subclass that mixes in :class:`RolloutPooling`
(identity and parameters untouched): timm's explicit attention path with a recorder hook on each ``attn_drop``,
and pooling weights computed at the end of ``forward_features`` and tied to the very tokens that pass returned.
A timm pooling gives the stock model back. :func:`route_timm_classes` (run by :mod:`timm_rollout.models`, which the
package imports as soon as timm is) makes ``model.global_pool = 'rollout'`` on the accepted timm classes run
``set_pooling``. Behaviour and refusals: ``timm_rollout/README.md``.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, NamedTuple

import torch
from torch import nn

from .capture import attention_modules, hold_explicit, record_attention, release_explicit
from .rollout import check_options, pooling_weights

ROLLOUT = "rollout"
TIMM_POOLS = ("", "avg", "avgmax", "max", "token", "map")  # timm VisionTransformer poolings (global_pool)
POOLS = (*TIMM_POOLS, ROLLOUT)  # every pooling set_pooling takes: the one list of pooling names
OPTIONS = {"head_fusion": ("rollout_head_fusion", "mean"), "discard_ratio": ("rollout_discard_ratio", 0.0),
           "grad": ("rollout_grad", False)}  # set_pooling option -> model attribute, default
OPTION_ARGS = tuple(attr for attr, _ in OPTIONS.values())  # the options as model attributes and model arguments
_PASSES = "_rollout_passes"  # {id(tokens): _Pass} of live passes
_BUILT_POOL = "_built_global_pool"  # the pooling the model was built with (fixes its layout, e.g. fc_norm)
# config.json's architecture for a stock timm ViT saved while pooled otherwise than it was built (registered by
# timm_rollout.models), its model argument naming the stock architecture, and the one naming the pooling it runs
POOLED_ARCHITECTURE = "timm_rollout_pooled"
STOCK_ARCHITECTURE = "stock_architecture"
POOL_ARG = "pool"
POOLED_ARGS = (STOCK_ARCHITECTURE, POOL_ARG, *OPTION_ARGS)  # the model arguments timm_rollout_pooled adds


def stock_architecture(config: dict[str, Any]) -> str | None:
    """The timm architecture a ``config.json`` builds, that of the stock ViT for :data:`POOLED_ARCHITECTURE`."""
    if config.get("architecture") == POOLED_ARCHITECTURE:
        return (config.get("model_args") or {}).get(STOCK_ARCHITECTURE)
    return config.get("architecture")


class _Pass(NamedTuple):
    """One ``forward_features`` (or ``forward_intermediates``) pass whose tokens are alive."""

    ref: weakref.ref  # the tokens it returned
    snapshot: torch.Tensor  # their values then, compared bit for bit when they are pooled
    options: tuple  # the rollout options its weights were computed with
    weights: torch.Tensor  # (B, P) pooling weights


def _while_pooled(method: Any) -> Any:
    """A method bound or compiled while the model was rollout-pooled runs the current class's method once the model
    is switched back. Eager under ``torch.compile``: some torch releases (2.11) do not guard a compiled frame on
    the reassigned class, and would replay the rollout branch."""

    @torch.compiler.disable(recursive=False)
    @functools.wraps(method)
    def run(self: nn.Module, *args, **kwargs) -> Any:
        if isinstance(self, RolloutPooling):
            return method(self, *args, **kwargs)
        return getattr(type(self), method.__name__)(self, *args, **kwargs)

    return run


class RolloutPooling:
    """Mixin of a rollout-pooled timm ViT (made by :func:`set_pooling`, never built): the [CLS] row of the attention
    rollout over the patch tokens weights them, with the model's ``rollout_*`` options."""

    _stock_class: type[nn.Module]

    @_while_pooled
    def forward_features(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        tokens, weights = self._rollout_pass(super().forward_features, x, *args, **kwargs)
        self._keep(tokens, weights)
        return tokens

    @_while_pooled
    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """timm's ``forward_features`` then ``forward_head``, pooled with this pass's weights; keeps nothing."""
        tokens, weights = self._rollout_pass(super().forward_features, x, *args, **kwargs)
        return self._head(tokens, weights, pre_logits=False)

    @_while_pooled
    def forward_intermediates(self, x: torch.Tensor, *args, **kwargs) -> Any:
        """timm's ``forward_intermediates``; the final tokens it returns carry this pass's pooling weights."""
        out, weights = self._rollout_pass(super().forward_intermediates, x, *args, **kwargs)
        if isinstance(out, tuple) and isinstance(out[0], torch.Tensor):
            self._keep(out[0], weights)
        return out

    @_while_pooled
    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Rollout pooling of ``x`` (this model's ``forward_features``), then ``fc_norm``, ``head_drop``, ``head``."""
        return self._head(x, self.rollout_weights(x), pre_logits)

    @_while_pooled
    def pool(self, x: torch.Tensor, pool_type: str | None = None) -> torch.Tensor:
        pool_type = self.global_pool if pool_type is None else pool_type
        if pool_type != ROLLOUT:
            return super().pool(x, pool_type)
        return self._pool(x, self.rollout_weights(x))

    def _pool(self, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.bmm(weights.to(tokens.dtype).unsqueeze(1), tokens[:, self.num_prefix_tokens:]).squeeze(1)

    def _head(self, tokens: torch.Tensor, weights: torch.Tensor, pre_logits: bool) -> torch.Tensor:
        x = self.head_drop(self.fc_norm(self._pool(tokens, weights)))
        return x if pre_logits else self.head(x)

    def _rollout_pass(self, run: Any, *args, **kwargs) -> tuple[Any, torch.Tensor | None]:
        """``run(*args, **kwargs)`` with this pass's attention recorded, and the pooling weights of it."""
        with record_attention(self) as attentions:
            out = run(*args, **kwargs)
        return out, self._weights(attentions)

    def _weights(self, attentions: list[torch.Tensor | None]) -> torch.Tensor | None:
        """(B, P) pooling weights of one pass's attention; None when some block did not run (``stop_early``)."""
        if any(a is None for a in attentions):
            return None
        if not isinstance(self.rollout_grad, bool):  # assigned to the model directly, past set_pooling's check
            raise ValueError(f"rollout_grad must be True or False, got {self.rollout_grad!r}")
        if not self.rollout_grad:
            attentions = [a.detach() for a in attentions]
        return pooling_weights(attentions, self.num_prefix_tokens, self.rollout_head_fusion, self.rollout_discard_ratio)

    def _options(self) -> tuple:
        return tuple(getattr(self, attr) for attr, _ in OPTIONS.values())

    def keep_rollout_weights(self, attentions: list[torch.Tensor | None], tokens: torch.Tensor) -> None:
        """Tie the pooling weights of one pass's recorded attention (:func:`~timm_rollout.capture.record_attention`
        around blocks run by the caller) to the ``tokens`` that pass produced."""
        self._keep(tokens, self._weights(attentions))

    @torch.compiler.disable
    def _keep(self, tokens: torch.Tensor, weights: torch.Tensor | None) -> None:
        """Keep a pass's weights as long as its tokens live (eagerly under ``torch.compile``: the key is the real
        tensor's identity); one dict entry per pass, so threads sharing a model never drop each other's."""
        if weights is None:
            return
        passes = self.__dict__.setdefault(_PASSES, {})
        key = id(tokens)

        def forget(ref: weakref.ref) -> None:
            if getattr(passes.get(key), "ref", None) is ref:
                passes.pop(key, None)

        passes[key] = _Pass(weakref.ref(tokens, forget), tokens.detach().clone(), self._options(), weights)

    def rollout_weights(self, tokens: torch.Tensor) -> torch.Tensor:
        """Pooling weights (B, num_patches) of the pass that returned ``tokens``; a one-line RuntimeError for any
        other tensor, for these tokens changed since, and when the rollout options changed since."""
        found = self.__dict__.get(_PASSES, {}).get(id(tokens))
        if found is None or found.ref() is not tokens:
            raise RuntimeError(
                "forward_head on a rollout-pooled model takes the very tensor its forward_features (or "
                "forward_intermediates) returned, whose pass's attention it pools with, and these tokens are not "
                "one: the stock forward_features made them (called before set_pooling(model, 'rollout'), or bound "
                "or compiled before it: it records no attention), or they are a copy, slice or another model's "
                "tokens; pool what model.forward_features(x) returns now"
            )
        if found.options != self._options():
            raise RuntimeError("the rollout options changed (set_pooling) after forward_features returned these "
                               "tokens; run forward_features again to pool with the new options")
        if not _same_bits(tokens, found.snapshot):
            raise RuntimeError("these tokens were changed in place after forward_features; pool the "
                               "unchanged output of forward_features, or run it again")
        return found.weights

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name == "global_pool" and value != ROLLOUT:
            switch_pooling_class(self, rollout=False)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, e.g. an EMA model, or a pickle) starts with no pass of its own."""
        state = super().__getstate__()
        return {k: v for k, v in state.items() if k != _PASSES}

    def __reduce_ex__(self, protocol: int) -> tuple:
        """Pickled (``torch.save(model)``, ``copy.deepcopy``) as its stock class, made rollout-pooled again on load:
        the rollout-pooled class of a stock timm class is made at run time, so pickle cannot find it by name."""
        return (_new_pooled, (self._stock_class,), *super().__reduce_ex__(protocol)[2:])

    def __prepare_scriptable__(self) -> nn.Module:
        raise RuntimeError(
            "a rollout-pooled model cannot be TorchScript-compiled: its pooling reads the attention that forward "
            "hooks record, which TorchScript does not run; use torch.compile, or script it with a timm pooling "
            "(timm_rollout.set_pooling(model, 'avg'))"
        )


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(tokens: torch.Tensor, snapshot: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN equals itself): catches in-place changes autograd's version counter misses."""
    as_int = _INT_OF_SIZE[tokens.element_size()]
    return torch.equal(tokens.detach().view(as_int), snapshot.view(as_int))


def _new_pooled(stock: type[nn.Module]) -> nn.Module:
    """An empty instance of the rollout-pooled class of ``stock``, for unpickling (its state follows)."""
    cls = rollout_pooled_class(stock)
    return cls.__new__(cls)


_CLASSES: dict[type, type] = {}


def register_pooled_class(pooled: type[RolloutPooling]) -> type[RolloutPooling]:
    """Class decorator: ``pooled`` (with its ``_stock_class``) is the rollout-pooled class of that stock class."""
    _CLASSES[pooled._stock_class] = pooled
    return pooled


def rollout_pooled_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The rollout-pooled subclass of a timm ViT class (made once per class)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"RolloutPooled{cls.__name__}", (RolloutPooling, cls),
                             {"_stock_class": cls, "__module__": __name__})
    return _CLASSES[cls]


def switch_pooling_class(model: nn.Module, rollout: bool) -> None:
    """Swap ``model`` to its rollout-pooled class (held on the explicit attention path) or back to its stock class
    (hold released, no kept passes, no rollout options unless they are model arguments): the one switch behind
    :func:`set_pooling`, assigning ``model.global_pool`` and ``reset_classifier(n, global_pool=...)``."""
    if isinstance(model, RolloutPooling) == rollout:
        return
    if rollout:
        hold_explicit(model, ROLLOUT)
        model.__class__ = rollout_pooled_class(type(model))
        return
    model.__class__ = model._stock_class
    release_explicit(model, ROLLOUT)
    model.__dict__.pop(_PASSES, None)
    if not getattr(model, "rollout_options_are_model_args", False):  # the stock model exactly
        for attr, _ in OPTIONS.values():
            model.__dict__.pop(attr, None)


# forward_head of these classes: pool() -> fc_norm -> head_drop -> head (any timm pooling, and rollout in its place)
_POOL_HEADS = ("timm.models.vision_transformer.VisionTransformer", "timm.models.eva.Eva")
# the same head with the pooling written inline: '' (none), 'avg', else the class token
_INLINE_HEADS = ("timm.models.beit.Beit", "timm.models.vision_transformer_relpos.VisionTransformerRelPos")
_INLINE_POOLS = ("", "avg", "token")
# attention modules whose attn_drop sees one softmax (B, heads, N, N) over all N tokens (older timm: Attention
# in vision_transformer)
_SOFTMAX_ATTENTION = (
    "timm.layers.attention.Attention", "timm.layers.attention.AttentionRope",
    "timm.models.vision_transformer.Attention", "timm.models.vision_transformer.ParallelScalingBlock",
    "timm.models.eva.EvaAttention", "timm.models.beit.Attention",
    "timm.models.vision_transformer_relpos.RelPosAttention",
)


def _qualname(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _check_head(model: nn.Module, pool: str) -> None:
    """Refuse a pooling the model's own ``forward_head`` would not apply (it reads its tokens itself)."""
    owner = _qualname(getattr(model, "_stock_class", type(model)).forward_head).rsplit(".", 1)[0]  # its class
    inline = owner in _INLINE_HEADS
    if owner in _POOL_HEADS or (inline and pool in (*_INLINE_POOLS, ROLLOUT)):
        return
    if inline:
        raise ValueError(f"{type(model).__name__}'s forward_head pools only {_INLINE_POOLS} (or rollout); "
                         f"{pool!r} would be ignored")
    raise ValueError(f"{type(model).__name__} reads its tokens in its own forward_head ({owner}), which pooling "
                     f"{pool!r} cannot replace; it takes a ViT, DeiT (not distilled), BEiT, relpos ViT or Eva")


def _check_attention(model: nn.Module) -> None:
    """Rollout composes one softmax self-attention over all tokens per block: refuse anything else."""
    found = {id(m): m for m in attention_modules(model)}
    blocks = list(getattr(model, "blocks", ()))
    for i, block in enumerate(blocks):
        inner = [m for m in block.modules() if id(m) in found]
        if len(inner) != 1 or _qualname(type(inner[0])) not in _SOFTMAX_ATTENTION:
            kinds = [type(m).__name__ for m in inner] or "none"
            raise ValueError(f"rollout pooling composes one softmax self-attention per block, and block {i} of "
                             f"{type(model).__name__} runs {kinds}; use a model with one timm Attention per block")
    if len(found) != len(blocks):
        raise ValueError(f"rollout pooling composes one attention per block, and {type(model).__name__} runs "
                         f"{len(found)} attention modules in {len(blocks)} blocks")


def pools_tokens(model: nn.Module) -> bool:
    """Whether ``model`` pools tokens as timm's ViT family does (a string ``global_pool``, ``num_prefix_tokens``):
    the models :func:`set_pooling` and rollout may take; a CNN (its pooling a module, or in its head) is not one."""
    return isinstance(getattr(model, "global_pool", None), str) and hasattr(model, "num_prefix_tokens")


def pool_name(model: nn.Module) -> str:
    """How ``model`` pools its features, as timm names it: its ``global_pool`` (``'token'``, ``'avg'``,
    ``'rollout'``, ...), or the ``pool_type`` of a CNN's pooling module (in the model or its head); '' for none."""
    for owner in (model, getattr(model, "head", None)):
        pool = getattr(owner, "global_pool", None)
        if isinstance(pool, str):
            return pool
        if pool is not None:
            return str(getattr(pool, "pool_type", type(pool).__name__))
    return ""


def attention_pool(model: nn.Module) -> nn.Module | None:
    """The learned attention pool (``attn_pool`` of ``global_pool='map'``) that ``model``'s head applies; None
    without one, and under rollout pooling, which pools in its place (the pool's weights are then unused)."""
    return None if getattr(model, "global_pool", None) == ROLLOUT else getattr(model, "attn_pool", None)


def attention_free(model: nn.Module) -> str | None:
    """Why ``model`` has nothing for rollout, attention maps and :func:`set_pooling` to read, as a clause naming it:
    it pools no tokens (a CNN) or has no timm attention blocks; None for a timm ViT-family model."""
    arch = (getattr(model, "pretrained_cfg", None) or {}).get("architecture")
    name = f"{arch} ({type(model).__name__})" if arch else type(model).__name__
    if not pools_tokens(model):
        return f"{name} is not a timm VisionTransformer-family model: it has no attention over patch tokens"
    try:
        attention_modules(model)
    except ValueError:
        return f"{name} has no timm attention blocks"
    return None


def _check_pool(model: nn.Module, pool: str) -> None:
    if not pools_tokens(model):
        raise ValueError(f"{attention_free(model)}; set_pooling (--pool) takes timm ViT-family models only")
    attention_modules(model)  # raises for models without timm attention blocks
    if pool not in POOLS:
        raise ValueError(f"unknown pooling {pool!r}; use one of {', '.join(map(repr, POOLS))}")
    if pool == model.global_pool:  # its own pooling (any head, e.g. CaiT's, XCiT's, NaFlexVit's): nothing changes
        return
    _check_head(model, pool)  # first: a head of its own is the reason, whatever tokens the model has
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
    if pool == ROLLOUT:
        _check_attention(model)


def check_rollout_options(head_fusion: Any, discard_ratio: Any, grad: Any) -> tuple[str, float, bool]:
    """The rollout options (``discard_ratio`` as a float), or a one-line ValueError naming the one that is wrong."""
    check_options(head_fusion, discard_ratio)
    if not isinstance(grad, bool):
        raise ValueError(f"grad (rollout_grad) must be True or False, got {grad!r}")
    return head_fusion, float(discard_ratio), grad


def set_pooling(model: nn.Module, pool: str, **options: Any) -> nn.Module:
    """Pool ``model`` (any timm VisionTransformer-family model) with ``pool`` from now on; returns ``model``.

    ``pool`` is a timm pooling or ``'rollout'``, whose options (``head_fusion``, ``discard_ratio``, ``grad``) are
    checked by :func:`check_rollout_options` and kept on the model as ``rollout_*`` attributes (the model's own
    values, or the defaults, when not given). A timm pooling gives back the stock model.
    """
    _check_pool(model, pool)
    unknown = set(options) - set(OPTIONS)
    if unknown or (options and pool != ROLLOUT):
        raise ValueError(f"options {sorted(options)} are not rollout options of pooling {pool!r}; rollout takes "
                         f"{', '.join(OPTIONS)}")
    model.__dict__.setdefault(_BUILT_POOL, model.global_pool)  # a model built before timm_rollout was imported
    if pool == ROLLOUT:
        values = {key: options.get(key, getattr(model, attr, default)) for key, (attr, default) in OPTIONS.items()}
        for (attr, _), value in zip(OPTIONS.values(), check_rollout_options(**values), strict=True):
            setattr(model, attr, value)
        switch_pooling_class(model, rollout=True)
    model.global_pool = pool
    return model


def built_pool(model: nn.Module) -> str:
    """The pooling ``model`` was built with, which fixes its layout (``fc_norm``, a ``'map'`` pool), whatever it
    pools with now; its current pooling when that was never recorded."""
    return model.__dict__.get(_BUILT_POOL, model.global_pool)


def option_model_args(model: nn.Module) -> dict[str, Any]:
    """The current rollout options of a model that takes them as model arguments, for ``config.json``."""
    if not getattr(model, "rollout_options_are_model_args", False):
        return {}
    return {attr: getattr(model, attr) for attr, _ in OPTIONS.values()}


def export_config(config: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """timm's ``config.json`` of ``model`` (as ``save_for_hf`` writes it), made to rebuild the model as it pools now.

    timm records the current pooling as ``global_pool``, which at build time would give another layout (e.g.
    ``fc_norm`` for ``'avg'``). So a stock timm ViT pooled otherwise than it was built is named
    :data:`POOLED_ARCHITECTURE` with its stock architecture, built pooling, current pooling (:data:`POOL_ARG`) and
    rollout options as model arguments; without ``timm_rollout`` imported timm then stops at an unknown model
    instead of building another layout. The tiny models' and CNNs' configs are timm's own, but that of a tiny model
    built with ``'map'`` and pooled by rollout.
    """
    if not pools_tokens(model):
        return config  # a CNN's config is timm's own
    built, pool = built_pool(model), model.global_pool
    if getattr(model, "rollout_options_are_model_args", False) and (built, pool) != ("map", ROLLOUT):
        return config  # a tiny model has one layout for every pooling but 'map': timm's config rebuilds it
    stock = stock_architecture(config)
    args = {k: v for k, v in (config.get("model_args") or {}).items() if k not in POOLED_ARGS}
    args["global_pool"] = built
    if pool != built:
        args.update({STOCK_ARCHITECTURE: stock, POOL_ARG: pool})
        if pool == ROLLOUT:
            args.update({attr: getattr(model, attr) for attr in OPTION_ARGS})
        stock = POOLED_ARCHITECTURE
    config = dict(config)
    config["architecture"] = stock
    config["model_args"] = args
    return config


def _route_rollout_assignment(cls: type[nn.Module]) -> None:
    """Record the pooling an instance of timm's ``cls`` is built with (:func:`built_pool`), and make
    ``model.global_pool = 'rollout'`` run ``set_pooling(model, 'rollout')`` (timm would take the string and fail on
    the next forward pass). Other assignments are timm's own."""
    inherited = cls.__setattr__
    if getattr(inherited, "_routes_rollout", False):
        return

    def __setattr__(self: nn.Module, name: str, value: object) -> None:
        if name == "global_pool":  # the first assignment is the constructor's: the pooling it was built with
            self.__dict__.setdefault(_BUILT_POOL, value)
        routed = name == "global_pool" and isinstance(value, str) and value == ROLLOUT
        if routed and not isinstance(self, RolloutPooling) and not getattr(self, "rollout_options_are_model_args",
                                                                           False):  # the tiny models switch themselves
            set_pooling(self, ROLLOUT)  # swaps the class first, so its own assignment lands in the branch below
        else:
            inherited(self, name, value)

    __setattr__._routes_rollout = True
    cls.__setattr__ = __setattr__


def route_timm_classes() -> None:
    """:func:`_route_rollout_assignment` for each timm class :func:`set_pooling` accepts."""
    import importlib

    for name in (*_POOL_HEADS, *_INLINE_HEADS):
        module, cls = name.rsplit(".", 1)
        _route_rollout_assignment(getattr(importlib.import_module(module), cls))
