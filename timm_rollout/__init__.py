"""timm-rollout: tiny CIFAR Vision Transformers pooled by [CLS] token, patch mean or attention rollout, in timm.

Importing the package registers ``vit_tiny_cifar_cls``, ``vit_tiny_cifar_gap`` and ``vit_tiny_cifar_rollout``
with timm.
"""

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
