"""timm-rollout: tiny CIFAR Vision Transformers pooled by [CLS] token, patch mean or attention rollout, in timm.

Importing the package registers ``vit_tiny_cifar_cls``, ``vit_tiny_cifar_gap``, ``vit_tiny_cifar_rollout`` and
``timm_rollout_pooled`` (a stock timm ViT pooled by rollout, as a saved run of one names it) with timm, and makes
``model.global_pool = 'rollout'`` on a timm ViT what ``set_pooling(model, 'rollout')`` does.
"""

from .errors import install_guard

with install_guard():  # a torchvision that does not match torch (it fails on import): one line naming the fix
    from .capture import AttentionCapture, attention_modules, capture_attention
    from .models import RolloutPooledVisionTransformer, RolloutVisionTransformer
    from .pooling import set_pooling
    from .rollout import HEAD_FUSIONS, attention_rollout, fuse_heads, patch_weights, rollout_cls_row

__version__ = "0.1.0"

__all__ = [
    "HEAD_FUSIONS",
    "AttentionCapture",
    "RolloutPooledVisionTransformer",
    "RolloutVisionTransformer",
    "attention_modules",
    "attention_rollout",
    "capture_attention",
    "fuse_heads",
    "patch_weights",
    "rollout_cls_row",
    "set_pooling",
]
