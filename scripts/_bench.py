"""What the benchmarks in ``scripts/`` share: the data and models they time, the training step, the round-robin
race that times variants side by side, and the record of the machine that ran them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from timm_rollout.data import KNOWN_STATS, load_image_set
from timm_rollout.device import cpu_supports_bf16, device_name
from timm_rollout.progress import progress
from timm_rollout.train.step import optimizer_step

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "cifar10"
# The full CIFAR-10 copy beside the checkout when there is one, else the sample shipped in the package.
DATASET = str(SHARED) if SHARED.is_dir() else "cifar10-sample"
MEAN, STD = KNOWN_STATS["cifar10"]
MODELS = ("vit_tiny_cifar_cls", "vit_tiny_cifar_rollout")
# Untimed rounds before the timed ones: compilation, and CUDA graphs, which reduce-overhead records only after a
# compiled pass has run eagerly once.
WARMUP_ROUNDS = 3
Step = Callable[[], int]  # runs one step of a variant, returns the number of images (or passes) it did


def bench_images(n: int) -> torch.Tensor:
    """The first ``n`` uint8 test images of :data:`DATASET`."""
    return load_image_set(DATASET, "test").images[:n]


def model_step(model: nn.Module, dtype: torch.dtype | None, device: torch.device, compile_mode: str | None = None):
    """The training step function of ``timm_rollout.train`` for ``model`` and its AdamW optimizer (and GradScaler
    for fp16); the model through ``torch.compile`` in ``compile_mode`` when one is given, as ``train --compile
    --compile-mode``."""
    from timm.optim import create_optimizer_v2  # here, so that --help loads no timm

    model.to(device).train()
    opt = create_optimizer_v2(model, opt="adamw", lr=5e-4, weight_decay=1e-4)
    net = torch.compile(model, mode=compile_mode) if compile_mode else model
    loss_fn = nn.CrossEntropyLoss()
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    return (lambda x, y: optimizer_step(net, x, y, loss_fn, opt, device=device, amp_dtype=dtype,
                                        scaler=scaler)), opt


def bare_step(model: nn.Module, batch: int, dtype: torch.dtype | None, device: torch.device) -> Step:
    """The bare training step of ``model`` on one normalised batch kept in memory."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (batch,), generator=gen)
    x, y = x.to(device), y.to(device)
    step, _ = model_step(model, dtype, device)

    def run() -> int:
        step(x, y)
        return batch

    return run


def precision(dtype: torch.dtype | None) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def sync(device: torch.device) -> None:
    """Wait for the GPU, so a step is timed whole."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def race(steps: dict[Hashable, Step], rounds: int, device: torch.device, desc: str = "",
         warmup: int = WARMUP_ROUNDS) -> dict[Hashable, float]:
    """Round-robin ``rounds`` timed rounds after ``warmup`` untimed ones, one step of each variant per round, so
    that machine noise hits them alike; median images/s per variant."""
    for _ in range(warmup):
        for run in steps.values():
            run()
    sync(device)
    rates: dict[Hashable, list[float]] = {k: [] for k in steps}
    for _ in progress(range(rounds), desc=desc, leave=False):
        for name, run in steps.items():
            t = time.perf_counter()
            n = run()
            sync(device)
            rates[name].append(n / (time.perf_counter() - t))
    return {k: statistics.median(v) for k, v in rates.items()}


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and its wall seconds."""
    start = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - start


def machine_record(device: torch.device) -> dict[str, object]:
    """What ran the benchmark: the GPU's name, or the CPU's model and whether it has native bf16."""
    import timm

    record: dict[str, object] = {"machine": device_name(device), "device": str(device), "torch": torch.__version__,
                                 "timm": timm.__version__}
    return record if device.type == "cuda" else {**record, "cpu_native_bf16": cpu_supports_bf16()}


def machine_line(device: torch.device) -> str:
    """:func:`machine_record` as the first line a benchmark prints."""
    return ", ".join(f"{k} {v}" for k, v in machine_record(device).items())
