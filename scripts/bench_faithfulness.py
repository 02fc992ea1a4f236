"""Benchmark faithfulness against plain inference, variants interleaved in one run, ratios side by side.

    python scripts/bench_faithfulness.py [--images 1000] [--rounds 2] [--batch-size 128]

Per model (CLS and rollout pooling), on CIFAR-10 test images (the shipped sample when the full copy is missing),
times: plain inference (``harness.features.extract``), the maps (one forward + backward per image), and the
perturbed passes of each removal (mean fill, token drop) with ``harness.faithfulness.faithfulness_curves``.
Rounds alternate the variants (``_bench.race``); each variant's median round is reported. Printed: seconds,
forward passes per second, each variant's pass rate relative to plain inference, and the whole faithfulness run
for ``--images`` (maps + both removals), the figure to hold against the goal (<= 60 s for 1,000 images on a
2-core CPU with native bf16).
"""

from __future__ import annotations

import argparse

import torch
from _bench import DATASET, MEAN, MODELS, STD, Step, bench_images, machine_line, precision, race

import timm_rollout  # noqa: F401  (registers the models)
from harness.faithfulness import faithfulness_curves
from harness.features import extract, saliency_maps
from timm_rollout.cli import CliParser, positive_int, run_cli
from timm_rollout.data import normalize
from timm_rollout.device import inference_batch_size, resolve_amp, resolve_device

SEEDS = (1, 2, 3)


def bench_model(name: str, images: torch.Tensor, args: argparse.Namespace, device, amp) -> None:
    import timm  # here, so that --help loads no timm

    model = timm.create_model(name, num_classes=10).to(device).eval()
    x = normalize(images, MEAN, STD)
    found = saliency_maps(model, x, device=device, amp_dtype=amp)  # the maps the curves remove by; a warm-up
    passes = {"inference": len(x), "maps (fwd+bwd)": len(x)}

    def inference() -> int:
        extract(model, images, MEAN, STD, device=device, amp_dtype=amp, batch_size=args.batch_size)
        return len(x)

    def maps() -> int:
        saliency_maps(model, x, device=device, amp_dtype=amp)
        return len(x)

    def removal(fill: str) -> Step:
        def run() -> int:
            out = faithfulness_curves(model, x, found.logits, found.maps, seeds=SEEDS, fills=(fill,),
                                      batch_size=args.batch_size, device=device, dtype=amp)
            passes[fill] = out["forward_passes"]["perturbed"] + 1
            return passes[fill]

        return run

    rates = race({"inference": inference, "maps (fwd+bwd)": maps, "mean": removal("mean"), "drop": removal("drop")},
                 args.rounds, device, warmup=0)
    seconds = {variant: passes[variant] / rate for variant, rate in rates.items()}
    print(f"  {name}")
    for variant, rate in rates.items():
        print(f"    {variant:16s} {seconds[variant]:8.2f} s  {passes[variant]:8d} passes  {rate:8.0f} passes/s  "
              f"x{rate / rates['inference']:5.2f} of inference")
    total = seconds["maps (fwd+bwd)"] + seconds["mean"] + seconds["drop"]
    print(f"    faithfulness on {len(x)} images (maps + mean fill + token drop): {total:.1f} s; "
          f"mean fill alone {seconds['maps (fwd+bwd)'] + seconds['mean']:.1f} s")


def main(argv: list[str] | None = None) -> None:
    p = CliParser(prog="python scripts/bench_faithfulness.py", description=__doc__.splitlines()[0])
    p.add_argument("--images", type=positive_int, default=1000)
    p.add_argument("--rounds", type=positive_int, default=2)
    p.add_argument("--batch-size", type=positive_int, help="default: inference_batch_size of the device")
    args = p.parse_args(argv)
    images = bench_images(args.images)
    device = resolve_device("auto")
    amp = resolve_amp("auto", device)
    args.batch_size = args.batch_size or inference_batch_size(device)
    print(machine_line(device))
    print(f"faithfulness: {len(images)} test images of {DATASET}, batch {args.batch_size}, {precision(amp)}, median of "
          f"{args.rounds} rounds")
    for name in MODELS:
        bench_model(name, images, args, device, amp)


if __name__ == "__main__":
    run_cli(main)
