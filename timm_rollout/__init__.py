"""timm-rollout: tiny CIFAR Vision Transformers pooled by [CLS] token, patch mean or attention rollout, in timm.

The package registers ``vit_tiny_cifar_cls``, ``vit_tiny_cifar_gap``, ``vit_tiny_cifar_rollout`` and
``timm_rollout_pooled`` (a stock timm ViT pooled by rollout, as a saved run of one names it) with timm, and makes
``model.global_pool = 'rollout'`` on a timm ViT what ``set_pooling(model, 'rollout')`` does. Importing it is light:
the registration happens as soon as timm is imported (at once when it already is), and the names below load on
first use, so a command's ``--help`` and argument errors come before timm loads.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from importlib.abc import MetaPathFinder
from typing import Any

from .errors import install_guard

__version__ = "0.1.0"

_HOMES = {  # public name -> the module that holds it
    "HEAD_FUSIONS": "rollout",
    "AttentionCapture": "capture",
    "RolloutPooledVisionTransformer": "models",
    "RolloutVisionTransformer": "models",
    "attention_modules": "capture",
    "attention_rollout": "rollout",
    "capture_attention": "capture",
    "fuse_heads": "rollout",
    "patch_weights": "rollout",
    "rollout_cls_row": "rollout",
    "set_pooling": "pooling",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with install_guard():  # a torchvision that does not match torch (it fails on import): one line naming the fix
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


def _register() -> None:
    """Register the models with timm (importing :mod:`.models` does it)."""
    importlib.import_module(f"{__name__}.models")


class _AfterTimm(MetaPathFinder):
    """A one-shot import hook: when timm is first imported, register the models right after its import finishes,
    so ``timm.create_model('vit_tiny_cifar_rollout')`` works in any order of the two imports."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "timm":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:  # timm not installed: its own ImportError follows
            return None
        run = spec.loader.exec_module

        def exec_then_register(module: Any) -> None:
            with install_guard():
                run(module)
                _register()

        spec.loader.exec_module = exec_then_register
        return spec


if "timm" in sys.modules:
    with install_guard():
        _register()
else:
    sys.meta_path.insert(0, _AfterTimm())
