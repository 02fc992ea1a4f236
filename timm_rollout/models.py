"""The two tiny CIFAR ViTs, registered with timm: [CLS]-token pooling and attention-rollout pooling.

Both are :class:`RolloutVisionTransformer`, a timm ``VisionTransformer`` whose blocks run timm's
explicit attention path with a forward hook that records each block's attention probabilities
before dropout. With ``global_pool='rollout'`` the head averages the final (normed) patch tokens
weighted by the [CLS] row of the attention rollout. The two models share every parameter name,
so a checkpoint trained with one pooling loads into the other.
"""

from __future__ import annotations

from functools import partial

import torch
from timm.layers import LayerNorm
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from .capture import install_attention_hook, take_model_attention
from .dropout import use_fast_dropout
from .rollout import patch_weights, rollout_cls_row

__all__ = ["CIFAR100_MEAN", "CIFAR100_STD", "RolloutVisionTransformer"]

CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)

ROLLOUT = "rollout"


def _check_image_size(patch_embed: torch.nn.Module, args: tuple) -> None:
    """Forward pre-hook on ``patch_embed``: a one-line error for images the model cannot take."""
    x = args[0]
    if not getattr(patch_embed, "strict_img_size", False) or patch_embed.img_size is None:
        return
    want = tuple(patch_embed.img_size)
    if x.dim() != 4 or tuple(x.shape[-2:]) != want:
        got = "x".join(str(s) for s in x.shape[-2:]) if x.dim() == 4 else f"shape {tuple(x.shape)}"
        raise ValueError(
            f"model expects (B, C, {want[0]}, {want[1]}) images, got {got}; resize inputs to "
            f"{want[0]}x{want[1]} or create the model with img_size={x.shape[-1] if x.dim() == 4 else want[0]}"
        )


class RolloutVisionTransformer(VisionTransformer):
    """timm ``VisionTransformer`` that can pool by attention rollout (``global_pool='rollout'``).

    Args:
        global_pool: any timm pooling (``'token'``, ``'avg'``, ...) or ``'rollout'``.
        rollout_grad: let gradients flow through the rollout weights; by default they are a
            readout (detached), as in Abnar & Zuidema's use of rollout.
        **kwargs: passed to ``VisionTransformer``.
    """

    def __init__(self, *args, global_pool: str = "token", rollout_grad: bool = False, **kwargs) -> None:
        super().__init__(*args, global_pool="token" if global_pool == ROLLOUT else global_pool, **kwargs)
        self.global_pool = global_pool
        self.rollout_grad = rollout_grad
        use_fast_dropout(self)
        for block in self.blocks:
            install_attention_hook(block.attn)
        self.patch_embed.register_forward_pre_hook(_check_image_size)

    def rollout_weights(self) -> torch.Tensor:
        """Rollout pooling weights (B, num_patches) from the attention of the last forward pass.

        Consumes (releases) the recorded attention, so call it once after ``forward_features``.
        """
        attentions = [take_model_attention(block.attn) for block in self.blocks]
        if any(a is None for a in attentions):
            raise RuntimeError(
                "no attention recorded: call forward_features(x) before forward_head(x) on a "
                "rollout-pooled model, and keep timm's explicit attention path (fused_attn=False)"
            )
        if not self.rollout_grad:
            attentions = [a.detach() for a in attentions]
        row = rollout_cls_row(attentions, num_prefix_tokens=self.num_prefix_tokens)
        return patch_weights(row, self.num_prefix_tokens)

    def pool(self, x: torch.Tensor, pool_type: str | None = None) -> torch.Tensor:
        pool_type = self.global_pool if pool_type is None else pool_type
        if pool_type != ROLLOUT:
            for block in self.blocks:
                take_model_attention(block.attn)
            return super().pool(x, pool_type)
        weights = self.rollout_weights().to(x.dtype)
        return torch.bmm(weights.unsqueeze(1), x[:, self.num_prefix_tokens:]).squeeze(1)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replace the head; rollout pooling is kept unless another ``global_pool`` is given."""
        if global_pool == ROLLOUT or (global_pool is None and self.global_pool == ROLLOUT):
            super().reset_classifier(num_classes)
            self.global_pool = ROLLOUT
        else:
            super().reset_classifier(num_classes, global_pool)


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
def vit_tiny_cifar_rollout(pretrained: bool = False, **kwargs) -> RolloutVisionTransformer:
    """The same tiny CIFAR ViT, pooling final patch tokens by the [CLS] row of attention rollout."""
    return _create("vit_tiny_cifar_rollout", pretrained, ROLLOUT, **kwargs)
