"""The three tiny CIFAR ViTs, registered with timm: [CLS]-token, patch-mean and attention-rollout pooling; and
``timm_rollout_pooled``, any stock timm ViT pooled otherwise than it was built (what a saved run of one names).

All three are :class:`RolloutVisionTransformer` with the same parameter names, so a checkpoint of one loads into
the others; assigning ``model.global_pool`` switches the pooling (``'rollout'``: :mod:`timm_rollout.pooling`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import timm
from timm.layers import LayerNorm, PatchEmbed, register_notrace_module
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn
from torch import nn

from .data import KNOWN_STATS
from .dropout import FastDropout, use_fast_dropout
from .pooling import (
    POOLED_ARCHITECTURE,
    POOLED_ARGS,
    ROLLOUT,
    STOCK_ARCHITECTURE,
    RolloutPooling,
    check_rollout_options,
    register_pooled_class,
    route_timm_classes,
    set_pooling,
    switch_pooling_class,
)

register_notrace_module(FastDropout)  # an FX leaf (as timm's tracing helpers treat it): masks stay its own
route_timm_classes()  # global_pool = 'rollout' on a stock timm ViT runs set_pooling

CIFAR100_MEAN, CIFAR100_STD = KNOWN_STATS["cifar100"]  # the registered default: 100 classes


class RolloutVisionTransformer(VisionTransformer):
    """timm ``VisionTransformer`` whose ``global_pool`` may also be ``'rollout'``, with the rollout options of
    :func:`timm_rollout.set_pooling` as model arguments (so ``config.json`` records them)."""

    def __init__(self, *args, global_pool: str = "token", rollout_grad: bool = False,
                 rollout_head_fusion: str = "mean", rollout_discard_ratio: float = 0.0, **kwargs) -> None:
        options = check_rollout_options(rollout_head_fusion, rollout_discard_ratio, rollout_grad)  # as set_pooling
        super().__init__(*args, global_pool="token" if global_pool == ROLLOUT else global_pool, **kwargs)
        self.rollout_head_fusion, self.rollout_discard_ratio, self.rollout_grad = options
        self.global_pool = global_pool
        use_fast_dropout(self)

    rollout_options_are_model_args = True  # set_pooling keeps them when switching to a timm pooling

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name == "global_pool":
            switch_pooling_class(self, rollout=value == ROLLOUT)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replace the head; the pooling is kept unless ``global_pool`` (any timm pooling or 'rollout') is given."""
        if global_pool == ROLLOUT:
            super().reset_classifier(num_classes)
            self.global_pool = ROLLOUT
        else:
            super().reset_classifier(num_classes, global_pool)


@register_pooled_class
class RolloutPooledVisionTransformer(RolloutPooling, RolloutVisionTransformer):
    """A :class:`RolloutVisionTransformer` while ``global_pool == 'rollout'`` (made by assigning it, never built);
    see :class:`~timm_rollout.pooling.RolloutPooling`."""

    _stock_class = RolloutVisionTransformer



def _cfg(**kwargs) -> dict:
    return {
        "url": "",
        "num_classes": 100,
        "input_size": (3, 32, 32),
        "fixed_input_size": True,
        "pool_size": None,
        "crop_pct": 1.0,
        "crop_mode": "center",
        "interpolation": "bicubic",
        "mean": CIFAR100_MEAN,
        "std": CIFAR100_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "license": "apache-2.0",
        "paper_ids": "arXiv:2005.00928",
        "paper_name": "Quantifying Attention Flow in Transformers",
        **kwargs,
    }


default_cfgs = generate_default_cfgs({
    "vit_tiny_cifar_cls": _cfg(),
    "vit_tiny_cifar_gap": _cfg(),
    "vit_tiny_cifar_rollout": _cfg(),
})

# The original study's architecture: patch 4 on 32x32 (64 patches + CLS), dim 128, depth 6, 4 heads,
# MLP ratio 4, pre-norm blocks, learned position embedding, dropout 0.1 (position, attention,
# projection/MLP), LayerNorm eps 1e-5 and exact GELU as in torch.nn defaults.
_TINY_CIFAR = dict(
    img_size=32,
    patch_size=4,
    embed_dim=128,
    depth=6,
    num_heads=4,
    mlp_ratio=4.0,
    pos_drop_rate=0.1,
    attn_drop_rate=0.1,
    proj_drop_rate=0.1,
    norm_layer=partial(LayerNorm, eps=1e-5),
    fc_norm=False,  # the final LayerNorm stays before pooling under every pooling: one set of parameter names
)


def record_input_size(net: nn.Module) -> nn.Module:
    """Make ``net.pretrained_cfg["input_size"]`` the size a timm ViT was built for (timm keeps the registered one,
    so its data config would resize images for another model); returns ``net``."""
    embed = getattr(net, "patch_embed", None)
    size, cfg = getattr(embed, "img_size", None), getattr(net, "pretrained_cfg", None)
    if size is None or not isinstance(cfg, dict):
        return net
    # a hybrid ViT's proj takes its CNN backbone's feature channels, not the image's: keep the registered count
    chans = embed.proj.in_channels if isinstance(embed, PatchEmbed) else cfg.get("input_size", (3,))[0]
    cfg["input_size"] = (int(chans), *(int(s) for s in size))  # in place: timm's default_cfg is the same dict
    return net


def _create(variant: str, pretrained: bool, default_pool: str, **kwargs) -> RolloutVisionTransformer:
    kwargs = {**_TINY_CIFAR, "global_pool": default_pool, **kwargs}
    return record_input_size(build_model_with_cfg(
        RolloutVisionTransformer,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=3, feature_cls="getter"),
        **kwargs,
    ))


@register_model
def vit_tiny_cifar_cls(pretrained: bool = False, **kwargs) -> RolloutVisionTransformer:
    """Tiny CIFAR ViT (patch 4, dim 128, depth 6, 4 heads) classifying from the final [CLS] token."""
    return _create("vit_tiny_cifar_cls", pretrained, "token", **kwargs)


@register_model
def vit_tiny_cifar_gap(pretrained: bool = False, **kwargs) -> RolloutVisionTransformer:
    """The same tiny CIFAR ViT, averaging the final (normed) patch tokens (timm's ``global_pool='avg'``)."""
    return _create("vit_tiny_cifar_gap", pretrained, "avg", **kwargs)


@register_model
def vit_tiny_cifar_rollout(pretrained: bool = False, **kwargs) -> RolloutVisionTransformer:
    """The same tiny CIFAR ViT, pooling final patch tokens by the [CLS] row of attention rollout."""
    return _create("vit_tiny_cifar_rollout", pretrained, ROLLOUT, **kwargs)


@register_model
def timm_rollout_pooled(pretrained: bool = False, stock_architecture: str | None = None, pool: str = ROLLOUT,
                        rollout_head_fusion: str | None = None, rollout_discard_ratio: float | None = None,
                        rollout_grad: bool | None = None, **kwargs: Any) -> nn.Module:
    """A stock timm ViT (``stock_architecture``, built with the other arguments) pooled with ``pool``: the
    architecture of a stock ViT saved while pooled otherwise than it was built (:func:`~.pooling.export_config`)."""
    if not isinstance(stock_architecture, str) or stock_architecture == POOLED_ARCHITECTURE \
            or not timm.is_model(stock_architecture):
        raise ValueError(f"{POOLED_ARCHITECTURE} builds a registered timm ViT pooled otherwise than it was built; name "
                         f"it with {STOCK_ARCHITECTURE}=..., e.g. 'vit_small_patch16_224' (got {stock_architecture!r})")
    source = kwargs.pop("pretrained_model_args", None)  # timm's record of the saved arguments: the stock model's
    if source:
        kwargs["pretrained_model_args"] = {k: v for k, v in source.items()
                                           if k not in POOLED_ARGS}
    options = {key: value for key, value in (("head_fusion", rollout_head_fusion),
                                             ("discard_ratio", rollout_discard_ratio), ("grad", rollout_grad))
               if value is not None}
    model = record_input_size(timm.create_model(stock_architecture, pretrained=pretrained, **kwargs))
    return set_pooling(model, pool, **options)
