"""Throughput of the two models side by side: training step and inference, fp32 and bf16 autocast.

    python scripts/bench_models.py [--batch-size 128] [--steps 10] [--device cpu]
    python scripts/bench_models.py --infer-batches 128 256 512 [--steps 8]

Steps of the two models race round-robin (``_bench.race``), so machine noise hits both alike; the ratio
rollout/CLS of time per step is the figure to read (goal: <= 1.10 for training). ``--infer-batches`` instead times
inference of 2,048 images at each batch size (in the precision ``--amp auto`` picks) and prints each batch's
images/s and its ratio to the largest batch: what ``timm_rollout.device.inference_batch_size`` is chosen by.
"""

from __future__ import annotations

import torch
from _bench import MODELS, Step, bare_step, machine_line, precision, race

import timm_rollout  # noqa: F401  (registers the models)
from timm_rollout.capture import set_fused_attention
from timm_rollout.cli import CliParser, positive_int, run_cli
from timm_rollout.device import autocast, cpu_supports_bf16, device_arg, resolve_amp


def sweep_step(model: torch.nn.Module, x: torch.Tensor, batch: int, dtype: torch.dtype | None,
               device: torch.device) -> Step:
    """Inference over all of ``x`` in batches of ``batch``."""
    @torch.inference_mode()
    def run() -> int:
        with autocast(device, dtype):
            for s in range(0, len(x), batch):
                model(x[s:s + batch])
        return len(x)

    return run


def make_step(name: str, train: bool, dtype: torch.dtype | None, batch: int, device: torch.device) -> Step:
    """A training step (``timm_rollout.train``'s, with its explicit attention on a CPU) or one inference batch."""
    import timm  # here, so that --help loads no timm

    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10)
    if not train:
        return sweep_step(model.to(device).eval(), torch.randn(batch, 3, 32, 32, device=device), batch, dtype, device)
    if device.type == "cpu":
        set_fused_attention(model, False)  # as timm_rollout.train does on CPU
    return bare_step(model, batch, dtype, device)


def batch_sweep(batches: list[int], rounds: int, device: torch.device) -> None:
    """Median images/s of inference over 2,048 images per model and batch size, raced round by round."""
    import timm

    dtype = resolve_amp("auto", device)
    models = {name: timm.create_model(name, num_classes=10).to(device).eval() for name in MODELS}
    x = torch.randn(2048, 3, 32, 32, device=device)
    rates = race({(n, b): sweep_step(m, x, b, dtype, device) for n, m in models.items() for b in batches}, rounds,
                 device, warmup=1)
    print(f"inference, {precision(dtype)}, median of {rounds} rounds")
    print(f"{'batch':<8}" + "".join(f"{n + ' img/s':>30}{'/ batch ' + str(max(batches)):>14}" for n in MODELS))
    for b in batches:
        cells = [(rates[n, b], rates[n, max(batches)]) for n in MODELS]
        print(f"{b:<8}" + "".join(f"{v:>30.0f}{v / ref:>14.2f}" for v, ref in cells))


def main(argv: list[str] | None = None) -> None:
    p = CliParser(prog="python scripts/bench_models.py", description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=positive_int, default=128)
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per model and setting")
    p.add_argument("--device", default="cpu", type=device_arg)
    p.add_argument("--infer-batches", type=positive_int, nargs="+", help="time inference at these batch sizes instead")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    print(machine_line(device))
    if args.infer_batches:
        batch_sweep(sorted(args.infer_batches), args.steps, device)
        return
    native = device.type != "cpu" or cpu_supports_bf16()
    print(f"{'mode':<10}{'precision':<10}{'CLS img/s':>12}{'rollout img/s':>15}{'rollout/CLS time':>18}")
    for dtype in (None, torch.bfloat16):
        # emulated bf16 is ~10x slower than fp32 on CPUs without AVX512-BF16/AMX: time fewer steps there
        steps = args.steps if dtype is None or native else max(1, args.steps // 5)
        for train in (True, False):
            rates = race({n: make_step(n, train, dtype, args.batch_size, device) for n in MODELS}, steps, device,
                         warmup=1)
            cls, roll = (rates[n] for n in MODELS)
            mode = "train" if train else "infer"
            print(f"{mode:<10}{precision(dtype):<10}{cls:>12.0f}{roll:>15.0f}{cls / roll:>18.3f}")


if __name__ == "__main__":
    run_cli(main)
