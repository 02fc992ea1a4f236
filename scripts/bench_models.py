"""Throughput of the two models side by side: training step and inference, fp32 and bf16 autocast.

    python scripts/bench_models.py [--batch-size 128] [--steps 10] [--device cpu]
    python scripts/bench_models.py --infer-batches 128 256 512 [--steps 8]

Steps of the two models are interleaved (CLS, rollout, CLS, ...) so machine noise hits both alike;
the ratio rollout/CLS of time per step is the figure to read (goal: <= 1.10 for training).
``--infer-batches`` instead times inference of 2,048 images at each batch size (the evaluation passes, in the
precision ``--amp auto`` picks), every model and batch once per round, and prints each batch's median images/s
and its ratio to the largest batch: what ``timm_rollout.device.inference_batch_size`` is chosen by.
"""

from __future__ import annotations

import statistics
import time

import timm
import torch
import torch.nn.functional as F

import timm_rollout  # noqa: F401  (registers the models)
from timm_rollout.capture import set_fused_attention
from timm_rollout.cli import CliParser, positive_int, run_cli
from timm_rollout.device import autocast, cpu_supports_bf16, device_arg, resolve_amp

NAMES = ("vit_tiny_cifar_cls", "vit_tiny_cifar_rollout")


def make_step(name: str, train: bool, dtype: torch.dtype | None, batch: int, device: torch.device):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10).to(device).train(train)
    if train and device.type == "cpu":
        set_fused_attention(model, False)  # as timm_rollout.train does on CPU
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def train_step() -> None:
        with autocast(device, dtype):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    @torch.inference_mode()
    def infer_step() -> None:
        with autocast(device, dtype):
            model(x)

    return train_step if train else infer_step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench(train: bool, dtype: torch.dtype | None, batch: int, steps: int, device: torch.device) -> dict[str, float]:
    """Seconds per step of each model, measured interleaved after one warm-up step each."""
    fns = {name: make_step(name, train, dtype, batch, device) for name in NAMES}
    for fn in fns.values():
        fn()
    total = dict.fromkeys(NAMES, 0.0)
    for _ in range(steps):
        for name, fn in fns.items():
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            total[name] += time.perf_counter() - t
    return {name: t / steps for name, t in total.items()}


@torch.inference_mode()
def batch_sweep(batches: list[int], rounds: int, device: torch.device) -> None:
    """Median images/s of inference over 2,048 images per model and batch size, interleaved round by round."""
    dtype = resolve_amp("auto", device)
    models = {name: timm.create_model(name, num_classes=10).to(device).eval() for name in NAMES}
    x = torch.randn(2048, 3, 32, 32, device=device)
    rates: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds + 1):  # round 0 warms up
        for name, model in models.items():
            for b in batches:
                sync(device)
                t = time.perf_counter()
                with autocast(device, dtype):
                    for s in range(0, len(x), b):
                        model(x[s:s + b])
                sync(device)
                if r:
                    rates.setdefault((name, b), []).append(len(x) / (time.perf_counter() - t))
    print(f"inference, {'bf16' if dtype == torch.bfloat16 else 'fp16' if dtype else 'fp32'}, median of {rounds} rounds")
    print(f"{'batch':<8}" + "".join(f"{n + ' img/s':>30}{'/ batch ' + str(max(batches)):>14}" for n in NAMES))
    for b in batches:
        cells = [(statistics.median(rates[n, b]), statistics.median(rates[n, max(batches)])) for n in NAMES]
        print(f"{b:<8}" + "".join(f"{v:>30.0f}{v / ref:>14.2f}" for v, ref in cells))


def main(argv: list[str] | None = None) -> None:
    p = CliParser(prog="python scripts/bench_models.py", description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=positive_int, default=128)
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per model and setting")
    p.add_argument("--device", default="cpu", type=device_arg)
    p.add_argument("--infer-batches", type=positive_int, nargs="+", help="time inference at these batch sizes instead")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.infer_batches:
        print(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
        batch_sweep(sorted(args.infer_batches), args.steps, device)
        return
    native = device.type != "cpu" or cpu_supports_bf16()
    print(f"device {device}, batch {args.batch_size}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"native bf16: {native}")
    print(f"{'mode':<10}{'precision':<10}{'CLS img/s':>12}{'rollout img/s':>15}{'rollout/CLS time':>18}")
    for dtype in (None, torch.bfloat16):
        # emulated bf16 is ~10x slower than fp32 on CPUs without AVX512-BF16/AMX: time fewer steps there
        steps = args.steps if dtype is None or native else max(1, args.steps // 5)
        for train in (True, False):
            sec = bench(train, dtype, args.batch_size, steps, device)
            cls_s, roll_s = (sec[n] for n in NAMES)
            print(f"{'train' if train else 'infer':<10}{'bf16' if dtype else 'fp32':<10}"
                  f"{args.batch_size / cls_s:>12.0f}{args.batch_size / roll_s:>15.0f}{roll_s / cls_s:>18.3f}")


if __name__ == "__main__":
    run_cli(main)
