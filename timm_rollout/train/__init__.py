"""Train any timm model (the tiny CIFAR ViTs by default) on a Hugging Face image data set.

    python -m timm_rollout.train --model vit_tiny_cifar_rollout --dataset cifar10 --epochs 200 \\
        --output runs/c10-rollout

Flags, output files and resume: ``timm_rollout/README.md``. The modules, in the order a run meets them:
:mod:`.flags`, :mod:`.setup`, :mod:`.distributed`, :mod:`.output`, :mod:`.loop` (one :mod:`.step` per update),
:mod:`.validation` and :mod:`.log`.
"""

from .flags import build_parser
from .loop import main, train

__all__ = ["build_parser", "main", "train"]
