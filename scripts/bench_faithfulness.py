"""Benchmark faithfulness against plain inference, variants interleaved in one run, ratios side by side.

    python scripts/bench_faithfulness.py [--images 1000] [--rounds 2] [--batch-size 128]

Per model (CLS and rollout pooling), on real CIFAR-10 test images (the shipped sample when the data is missing),
times: plain inference (``harness.features.extract``), the maps (one forward + backward per image), and the
perturbed passes of each removal (mean fill, token drop) with ``harness.faithfulness.faithfulness_curves``.
Rounds alternate the variants; each variant's best round is reported. Printed: seconds, forward passes per
second, each variant's pass rate relative to plain inference, and the whole faithfulness run for ``--images``
(maps + both removals), the figure to hold against the goal (<= 60 s for 1,000 images on a 2-core CPU with
native bf16).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import timm
import torch

import timm_rollout  # noqa: F401  (registers the models)
from harness.faithfulness import faithfulness_curves
from harness.features import extract, saliency_maps
from timm_rollout.cli import CliParser, positive_int, run_cli
from timm_rollout.data import load_image_set, normalize
from timm_rollout.device import inference_batch_size, resolve_amp, resolve_device

CIFAR10 = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "cifar10"
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
SEEDS = (1, 2, 3)


def _timed(times: dict[str, list[float]], name: str, fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    times.setdefault(name, []).append(time.perf_counter() - start)
    return out


def bench_model(name: str, images: torch.Tensor, args: argparse.Namespace, device, amp) -> None:
    model = timm.create_model(name, num_classes=10).to(device).eval()
    x = normalize(images, MEAN, STD)
    saliency_maps(model, x[:8], device=device, amp_dtype=amp)  # warm-up
    times: dict[str, list[float]] = {}
    passes = {"inference": len(x), "maps (fwd+bwd)": len(x)}
    for _ in range(args.rounds):
        _timed(times, "inference", extract, model, images, MEAN, STD, device=device, amp_dtype=amp,
               batch_size=args.batch_size)
        found = _timed(times, "maps (fwd+bwd)", saliency_maps, model, x, device=device, amp_dtype=amp)
        for fill in ("mean", "drop"):
            out = _timed(times, fill, faithfulness_curves, model, x, found.logits, found.maps, seeds=SEEDS,
                         fills=(fill,), batch_size=args.batch_size, device=device, dtype=amp)
            passes[fill] = out["forward_passes"]["perturbed"] + 1
    base = passes["inference"] / min(times["inference"])
    print(f"  {name}")
    for variant, values in times.items():
        seconds = min(values)
        rate = passes[variant] / seconds
        print(f"    {variant:16s} {seconds:8.2f} s  {passes[variant]:8d} passes  {rate:8.0f} passes/s  "
              f"x{rate / base:5.2f} of inference")
    total = sum(min(times[v]) for v in ("maps (fwd+bwd)", "mean", "drop"))
    print(f"    faithfulness on {len(x)} images (maps + mean fill + token drop): {total:.1f} s; "
          f"mean fill alone {min(times['maps (fwd+bwd)']) + min(times['mean']):.1f} s")


def main(argv: list[str] | None = None) -> None:
    p = CliParser(prog="python scripts/bench_faithfulness.py", description=__doc__.splitlines()[0])
    p.add_argument("--images", type=positive_int, default=1000)
    p.add_argument("--rounds", type=positive_int, default=2)
    p.add_argument("--batch-size", type=positive_int, help="default: inference_batch_size of the device")
    args = p.parse_args(argv)
    source = str(CIFAR10) if CIFAR10.is_dir() else "cifar10-sample"
    images = load_image_set(source, "test").images[: args.images]
    device = resolve_device("auto")
    amp = resolve_amp("auto", device)
    args.batch_size = args.batch_size or inference_batch_size(device)
    print(f"faithfulness: {len(images)} images of {source}, batch {args.batch_size}, {device}, {amp or 'fp32'}, "
          f"{torch.get_num_threads()} threads, best of {args.rounds} rounds")
    for name in ("vit_tiny_cifar_cls", "vit_tiny_cifar_rollout"):
        bench_model(name, images, args, device, amp)


if __name__ == "__main__":
    run_cli(main)
