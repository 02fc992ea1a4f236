"""Train any timm model (the tiny CIFAR ViTs by default) on a Hugging Face image data set.

    python -m timm_rollout.train --model vit_tiny_cifar_rollout --dataset cifar10 --epochs 200 \\
        --output runs/c10-rollout

Flags, output files and resume: ``timm_rollout/README.md``. The modules, in the order a run meets them:
:mod:`.flags`, :mod:`.distributed`, :mod:`.resume` (the run opened: new, resumed, extended or refused, built by
:mod:`.setup`), :mod:`.loop` (the epochs: batches of the :mod:`.step` loader, one update each), :mod:`.validation`,
then :mod:`.output` and :mod:`.log` each save.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["build_parser", "main", "train"]


def __getattr__(name: str) -> Any:  # loaded on first use, so the command's --help loads no timm
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{'flags' if name == 'build_parser' else 'loop'}"), name)
