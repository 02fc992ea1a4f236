"""The three tiny CIFAR ViTs, registered with timm: [CLS]-token, patch-mean and attention-rollout pooling.

All three are :class:`RolloutVisionTransformer`, a timm ``VisionTransformer`` with the same parameter
names, so a checkpoint trained with one pooling loads into the others. Pooling is switchable at run time
by assigning ``model.global_pool``. Any timm pooling (``'token'``, ``'avg'``, ...) runs stock timm code:
fused attention, TorchScript, FX. Assigning ``'rollout'`` swaps the model's class to
:class:`RolloutPooledVisionTransformer` (object identity and parameters untouched, as ``use_fast_dropout``
does for dropout): it runs timm's explicit attention path with a recorder hook on each ``attn_drop``,
records each block's attention before dropout during ``forward_features``, turns it into (B, num_patches)
pooling weights at the end of that pass and releases it; ``forward_head`` uses the weights once. Assigning
another pooling swaps back (recorder removed, timm's default fused attention restored).
"""

from __future__ import annotations

from functools import partial

import torch
from timm.layers import LayerNorm, use_fused_attn
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from .capture import attention_modules, record_attention, set_attention_recorder
from .dropout import use_fast_dropout
from .rollout import check_options, patch_weights, rollout_cls_row

__all__ = ["CIFAR100_MEAN", "CIFAR100_STD", "RolloutPooledVisionTransformer", "RolloutVisionTransformer"]

CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)

ROLLOUT = "rollout"
_WEIGHTS = "_rollout_pool_weights"  # (B, num_patches) from the latest forward pass, used once by pool()


class RolloutVisionTransformer(VisionTransformer):
    """timm ``VisionTransformer`` whose pooling can be attention rollout (``global_pool='rollout'``).

    Args:
        global_pool: any timm pooling (``'token'``, ``'avg'``, ...) or ``'rollout'``.
        rollout_grad: let gradients flow through the rollout weights; by default they are a
            readout (detached), as in Abnar & Zuidema's use of rollout.
        rollout_head_fusion: how each layer's heads are fused before rollout: ``'mean'`` (default),
            ``'max'`` or ``'min'``, as in :func:`timm_rollout.rollout.attention_rollout`.
        rollout_discard_ratio: fraction of each layer's weakest patch-to-patch attention zeroed before
            rollout (0 keeps all), as in :func:`timm_rollout.rollout.attention_rollout`.
        **kwargs: passed to ``VisionTransformer``.

    The three rollout options are model arguments, so timm's ``config.json`` (``model_args``) records them and
    ``timm.create_model("local-dir:...", pretrained=True)`` rebuilds the model with them.
    """

    def __init__(self, *args, global_pool: str = "token", rollout_grad: bool = False,
                 rollout_head_fusion: str = "mean", rollout_discard_ratio: float = 0.0, **kwargs) -> None:
        check_options(rollout_head_fusion, rollout_discard_ratio)
        super().__init__(*args, global_pool="token" if global_pool == ROLLOUT else global_pool, **kwargs)
        self.rollout_grad = rollout_grad
        self.rollout_head_fusion = rollout_head_fusion
        self.rollout_discard_ratio = float(rollout_discard_ratio)
        self.global_pool = global_pool
        use_fast_dropout(self)

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name == "global_pool":
            _use_pooling_class(self, value == ROLLOUT)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replace the head; the pooling is kept unless ``global_pool`` (any timm pooling or 'rollout') is given."""
        if global_pool == ROLLOUT:
            super().reset_classifier(num_classes)
            self.global_pool = ROLLOUT
        else:
            super().reset_classifier(num_classes, global_pool)


class RolloutPooledVisionTransformer(RolloutVisionTransformer):
    """A :class:`RolloutVisionTransformer` while ``global_pool == 'rollout'`` (made by assigning it, never built).

    ``forward_features`` and ``forward_intermediates`` record the attention of the pass they run, compute
    the pooling weights from it at the end (float32, autocast off) and release it; the model then holds
    only those (B, num_patches) weights, which the next ``forward_head`` consumes.
    """

    def forward_features(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        with record_attention(self) as attentions:
            x = super().forward_features(x, *args, **kwargs)
        self.keep_rollout_weights(attentions)
        return x

    def forward_intermediates(self, x: torch.Tensor, *args, **kwargs) -> tuple | list | dict:
        with record_attention(self) as attentions:
            out = super().forward_intermediates(x, *args, **kwargs)
        self.keep_rollout_weights(attentions)
        return out

    def keep_rollout_weights(self, attentions: list[torch.Tensor | None]) -> None:
        """Store the pooling weights of one pass's recorded attention for the next ``forward_head``.

        ``forward_features`` calls it; so does code that runs the blocks itself inside
        :func:`~timm_rollout.capture.record_attention` (e.g. on a shortened token sequence). No weights
        when some block did not run (``stop_early``).
        """
        weights = None
        if all(a is not None for a in attentions):
            if not self.rollout_grad:
                attentions = [a.detach() for a in attentions]
            row = rollout_cls_row(attentions, self.rollout_head_fusion, self.rollout_discard_ratio,
                                  self.num_prefix_tokens)
            weights = patch_weights(row, self.num_prefix_tokens)
        setattr(self, _WEIGHTS, weights)

    def rollout_weights(self) -> torch.Tensor:
        """Pooling weights (B, num_patches) of the latest ``forward_features`` that no ``forward_head`` used yet."""
        weights = getattr(self, _WEIGHTS, None)
        if weights is None:
            raise RuntimeError(
                "no rollout weights: call forward_features(x) before each forward_head(x) on a rollout-pooled "
                "model (the weights of one pass are used once)"
            )
        return weights

    def pool(self, x: torch.Tensor, pool_type: str | None = None) -> torch.Tensor:
        pool_type = self.global_pool if pool_type is None else pool_type
        if pool_type != ROLLOUT:
            return super().pool(x, pool_type)
        weights = self.rollout_weights()
        setattr(self, _WEIGHTS, None)  # used once: pooling never reuses an earlier pass's attention
        patches = x[:, self.num_prefix_tokens:]
        if weights.shape != patches.shape[:2]:
            raise RuntimeError(
                f"rollout weights {tuple(weights.shape)} from the latest forward_features do not fit tokens "
                f"{tuple(x.shape)}: pass forward_head the output of that same forward_features call"
            )
        return torch.bmm(weights.to(x.dtype).unsqueeze(1), patches).squeeze(1)


def _use_pooling_class(model: RolloutVisionTransformer, rollout: bool) -> None:
    """Swap ``model`` between the two classes; rollout pooling needs the explicit attention path."""
    cls = RolloutPooledVisionTransformer if rollout else RolloutVisionTransformer
    if type(model) is cls:
        return
    model.__class__ = cls
    for attn in attention_modules(model):
        attn.fused_attn = False if rollout else use_fused_attn()
    set_attention_recorder(model, rollout)
    model.__dict__.pop(_WEIGHTS, None)


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
)


def _create(variant: str, pretrained: bool, default_pool: str, **kwargs) -> RolloutVisionTransformer:
    kwargs = {**_TINY_CIFAR, "global_pool": default_pool, **kwargs}
    return build_model_with_cfg(
        RolloutVisionTransformer,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=3, feature_cls="getter"),
        **kwargs,
    )


@register_model
def vit_tiny_cifar_cls(pretrained: bool = False, **kwargs) -> RolloutVisionTransformer:
    """Tiny CIFAR ViT (patch 4, dim 128, depth 6, 4 heads) classifying from the final [CLS] token."""
    return _create("vit_tiny_cifar_cls", pretrained, "token", **kwargs)


@register_model
def vit_tiny_cifar_gap(pretrained: bool = False, **kwargs) -> RolloutVisionTransformer:
    """The same tiny CIFAR ViT, averaging the final (normed) patch tokens (timm's ``global_pool='avg'``).

    ``fc_norm=False`` keeps the final LayerNorm before pooling (timm would move it after), so the three
    models differ in pooling only and share every parameter name.
    """
    return _create("vit_tiny_cifar_gap", pretrained, "avg", **{"fc_norm": False, **kwargs})


@register_model
def vit_tiny_cifar_rollout(pretrained: bool = False, **kwargs) -> RolloutVisionTransformer:
    """The same tiny CIFAR ViT, pooling final patch tokens by the [CLS] row of attention rollout."""
    return _create("vit_tiny_cifar_rollout", pretrained, ROLLOUT, **kwargs)
