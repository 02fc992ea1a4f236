"""Train any timm model (the tiny CIFAR ViTs by default) on a Hugging Face image data set.

    python -m timm_rollout.train --model vit_tiny_cifar_rollout --dataset cifar10 --epochs 200 \\
        --output runs/c10-rollout
    torchrun --nproc_per_node 2 -m timm_rollout.train ...        # DDP: gloo on CPU, NCCL on GPUs

Images are decoded once into memory and augmented in batches on the training device. The optimizer
and schedule come from timm (``create_optimizer_v2``: no weight decay on norms, biases, position
embedding and CLS token; ``create_scheduler_v2`` stepped every update). Every ``--save-every`` epochs
(default 1) and at the last, the output folder gets a complete model (``model.safetensors`` +
``config.json``, loadable with ``timm.create_model("local-dir:<out>")``), a resume state, the log and the
curves; ``summary.json`` appears when all epochs are done.

The modules, in the order a run meets them: :mod:`.flags` (flags and their checks), :mod:`.setup` (data, model,
optimizer, schedule, EMA, grad scaler, batches), :mod:`.distributed` (``torchrun``), :mod:`.output` (the run
folder: resume, record, saves, summary), :mod:`.loop` (``train()``: the one epoch loop, one :mod:`.step` per
update), :mod:`.validation` (the evaluation after each epoch) and :mod:`.log` (``log.csv``, ``curves.png``).
Several ``--seed`` runs train one after another in one process.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["build_parser", "main", "train"]


def __getattr__(name: str) -> Any:  # loaded on first use, so the command's --help loads neither torch nor timm
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{'flags' if name == 'build_parser' else 'loop'}"), name)
