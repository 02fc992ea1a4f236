"""Training throughput on this machine, side by side in one run (images/s, batch 128 by default):

(a) the full training loop of ``python -m timm_rollout.train`` (in-memory uint8 images, batched crop+flip,
    normalisation, FastDropout, timm's explicit attention path): the ``img_per_s`` it logs for a warm epoch;
(b) the bare model step (forward, loss, backward, AdamW) of the same model on a batch already in memory;
(b0) the same bare step with PyTorch's own ``nn.Dropout`` (what FastDropout saves);
(c) what a user gets from stock timm: the same architecture as a plain timm ``VisionTransformer`` (fused
    attention, nn.Dropout), fed by a torchvision-style ``DataLoader`` over the Hugging Face data set with
    per-image PIL transforms (RandomCrop(32, padding=4), RandomHorizontalFlip, ToTensor, Normalize).

All in the precision ``--amp auto`` picks here; with ``--bf16-steps N`` also (b) and (c) in bf16 autocast for a
few steps (bf16 is emulated, and slow, on CPUs without AVX512-BF16/AMX)::

    python scripts/bench_train.py --steps 20 --bf16-steps 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import datasets
import timm
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from timm.optim import create_optimizer_v2
from torch import nn
from torch.utils.data import DataLoader
from torchvision import transforms

from timm_rollout.data import normalization_stats
from timm_rollout.device import autocast, resolve_amp, resolve_device
from timm_rollout.errors import run_cli
from timm_rollout.models import _TINY_CIFAR
from timm_rollout.train import train
from timm_rollout.train_log import read_log

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "cifar10"


def _timed_steps(step, batches, steps: int) -> float:
    """Images/s over ``steps`` steps after one untimed warm-up step; ``batches`` yields (x, y)."""
    it = iter(batches)
    step(*next(it))
    n = 0
    start = time.perf_counter()
    for _ in range(steps):
        x, y = next(it)
        step(x, y)
        n += len(y)
    return n / (time.perf_counter() - start)


def _make_step(model: nn.Module, dtype: torch.dtype | None, device: torch.device):
    model.to(device).train()
    opt = create_optimizer_v2(model, opt="adamw", lr=5e-4, weight_decay=1e-4)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with autocast(device, dtype):
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def bare_step(model: nn.Module, batch: int, steps: int, dtype, device) -> float:
    """(b): the model step on one normalised batch kept in memory."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (batch,), generator=gen)
    return _timed_steps(_make_step(model, dtype, device), iter(lambda: (x, y), None), steps)


def stock_loader(dataset: str, batch: int, steps: int, workers: int, mean, std) -> DataLoader:
    """A DataLoader with per-image PIL transforms over the HF data set, as a stock training script builds it."""
    tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    ds = datasets.load_dataset(dataset, split="train").select(range(batch * (steps + 2)))

    def apply(rows: dict) -> dict:
        return {"x": [tf(img.convert("RGB")) for img in rows["img"]], "y": rows["label"]}

    ds = ds.with_transform(apply)
    return DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True)


def stock_step(loader: DataLoader, steps: int, dtype, device) -> float:
    """(c): stock timm ViT (fused attention, nn.Dropout) fed by the PIL DataLoader; loader time included."""
    torch.manual_seed(0)
    model = VisionTransformer(**_TINY_CIFAR, num_classes=10)
    return _timed_steps(_make_step(model, dtype, device), ((d["x"], d["y"]) for d in loader), steps)


def full_loop(dataset: str, batch: int, steps: int, amp: str) -> float:
    """(a): ``img_per_s`` that timm_rollout.train logs for its second (warm) epoch of ``steps`` steps."""
    with tempfile.TemporaryDirectory() as tmp:
        train(["--dataset", dataset, "--max-train-samples", str(batch * steps), "--max-eval-samples", "10",
               "--batch-size", str(batch), "--epochs", "2", "--amp", amp, "--output", tmp, "--no-progress"])
        return read_log(Path(tmp) / "log.csv")[-1]["img_per_s"]


def ours(dropout: bool = True) -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_cifar_rollout", num_classes=10)
    if not dropout:  # back to PyTorch's dropout: same p, same modules
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.__class__ = nn.Dropout
    return model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default=str(SHARED) if SHARED.exists() else "cifar10-sample")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    p.add_argument("--bf16-steps", type=int, default=0, help="also time (b) and (c) in bf16 for this many steps")
    p.add_argument("--loader-workers", type=int, default=2, help="DataLoader workers for (c)")
    p.add_argument("--repeats", type=int, default=1, help="repeat each measurement, report the median")
    args = p.parse_args(argv)
    device = resolve_device("cpu")
    dtype = resolve_amp("auto", device)
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    mean, std = normalization_stats(args.dataset)
    loader = stock_loader(args.dataset, args.batch_size, args.steps, args.loader_workers, mean, std)
    b, steps = args.batch_size, args.steps

    def measure(label: str, fn) -> float:
        values = [fn() for _ in range(args.repeats)]
        value = statistics.median(values)
        print(f"{label:<62} {value:8.1f} img/s", flush=True)
        return value

    print(f"CPU, {torch.get_num_threads()} threads, batch {b}, {steps} steps, --amp auto = {precision}")
    a = measure(f"(a) full loop, timm_rollout.train ({precision})", lambda: full_loop(args.dataset, b, steps, "auto"))
    bb = measure(f"(b) bare step, FastDropout ({precision})", lambda: bare_step(ours(), b, steps, dtype, device))
    b0 = measure(f"(b0) bare step, nn.Dropout ({precision})", lambda: bare_step(ours(False), b, steps, dtype, device))
    c = measure(f"(c) stock timm + PIL DataLoader, {args.loader_workers} workers ({precision})",
                lambda: stock_step(loader, steps, dtype, device))
    print(f"ratios ({precision}): (a)/(b) = {a / bb:.2f}, (a)/(c) = {a / c:.2f}, (b)/(b0) = {bb / b0:.2f}")
    if args.bf16_steps:
        n = args.bf16_steps
        bf = measure(f"(b) bare step, FastDropout (bf16, {n} steps)",
                     lambda: bare_step(ours(), b, n, torch.bfloat16, device))
        cf = measure(f"(c) stock timm + PIL DataLoader (bf16, {n} steps)",
                     lambda: stock_step(loader, n, torch.bfloat16, device))
        print(f"bf16: (b)/(c) = {bf / cf:.2f}; (a, {precision}) / (c, bf16) = {a / cf:.2f}")


if __name__ == "__main__":
    run_cli(main)
