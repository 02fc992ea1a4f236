"""Training throughput on this machine, variants side by side in one run (images/s, batch 128 by default):

(a) the full training loop of ``timm_rollout.train``, step for step (``Loader``, ``optimizer_step``, scheduler);
(a0) the same without dropout; (b) the bare model step on one batch in memory; (b0) the same with PyTorch's
``nn.Dropout`` (what FastDropout saves); (f)/(e) the bare step of ``vit_tiny_cifar_cls`` with fused and explicit
attention (why training on CPU runs the explicit path); (c) stock timm: a plain ``VisionTransformer`` fed by a
``DataLoader`` with per-image PIL transforms. ``--compile MODE ...`` adds (a) through ``torch.compile``.

They run round-robin (``_bench.race``), all in the precision ``--amp auto`` picks. Then, when asked: ``--ranks N``
(CPU) one whole training process against ``torchrun`` with N single-thread processes; ``--concurrent N ...`` N
whole runs sharing ``--device`` (one process each, as ``study.py --jobs N``); ``--profile`` (CUDA) where a step's
time goes. ``--json PATH`` writes every figure with the machine's record, rewritten after each section
(``complete`` false until the last). Commands and measured figures: scripts/README.md, Benchmarks::

    python scripts/bench_train.py --device cuda --steps 50 --compile default reduce-overhead --concurrent 1 8 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _bench
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchvision import transforms

from timm_rollout.atomic import write_json
from timm_rollout.capture import set_fused_attention
from timm_rollout.cli import CliParser, non_negative_int, positive_int, run_cli
from timm_rollout.data import load_image_set, normalization_stats, resolve_dataset
from timm_rollout.device import device_arg, resolve_amp, resolve_device
from timm_rollout.errors import UserError
from timm_rollout.progress import progress
from timm_rollout.train.flags import COMPILE_MODES
from timm_rollout.train.log import read_log
from timm_rollout.train.step import Loader

NO_DROPOUT = {"pos_drop_rate": 0.0, "attn_drop_rate": 0.0, "proj_drop_rate": 0.0}


def ours(fast_dropout: bool = True, **kwargs) -> nn.Module:
    import timm  # here, so that --help loads no timm (nor datasets, in stock)

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_cifar_rollout", num_classes=10, **kwargs)
    if not fast_dropout:  # back to PyTorch's dropout: same p, same modules
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.__class__ = nn.Dropout
    return model


def full_loop(dataset: str, batch: int, dtype, device, compile_mode: str | None = None, **model_kwargs) -> _bench.Step:
    """(a): the training loop's per-step work on real images (see the module docstring)."""
    from timm.scheduler import create_scheduler_v2

    train = load_image_set(dataset, "train")
    mean, std = normalization_stats(dataset, train)
    step, opt = _bench.model_step(ours(**model_kwargs), dtype, device, compile_mode)
    sched, _ = create_scheduler_v2(opt, sched="cosine", num_epochs=200, warmup_epochs=5, min_lr=5e-6,
                                   step_on_epochs=False, updates_per_epoch=390)
    loader = Loader(train.images.to(device), train.labels.to(device), mean, std, batch, len(train) // batch)
    batches = enumerate(loader.epoch(0), start=1)

    def run() -> int:
        k, (x, y) = next(batches)
        step(x, y)
        sched.step_update(k)
        return batch

    return run


def profile_steps(steps: dict[str, _bench.Step], rounds: int, device: torch.device) -> dict[str, dict]:
    """Where a step's time goes, per variant: wall time per step against the GPU's kernel time per step (their
    ratio: how busy the GPU is), kernels per step and the costliest kernels (``torch.profiler``, ``rounds`` steps
    after the warm-up ones)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    found = {}
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.type == "cuda" else [])]
    for name, run in steps.items():
        for _ in range(_bench.WARMUP_ROUNDS):
            run()
        _bench.sync(device)
        with profile(activities=activities) as prof:
            t = time.perf_counter()
            images = sum(run() for _ in range(rounds))
            _bench.sync(device)
            wall = (time.perf_counter() - t) / rounds
        kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        gpu = sum(e.self_device_time_total for e in kernels) / 1e6 / rounds
        top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:6]
        found[name] = {"wall_ms_per_step": 1e3 * wall, "gpu_kernel_ms_per_step": 1e3 * gpu,
                       "gpu_busy": gpu / wall, "kernels_per_step": sum(e.count for e in kernels) / rounds,
                       "img_per_s": images / rounds / wall,
                       "top_kernels_ms_per_step": {e.key[:80]: e.self_device_time_total / 1e3 / rounds for e in top}}
        f = found[name]
        print(f"profile {name}: {f['wall_ms_per_step']:.2f} ms a step, GPU kernels {f['gpu_kernel_ms_per_step']:.2f} "
              f"ms ({100 * f['gpu_busy']:.0f}% busy), {f['kernels_per_step']:.0f} kernels a step; costliest: "
              + ", ".join(f"{k[:40]} {v:.3f} ms" for k, v in list(f["top_kernels_ms_per_step"].items())[:3]))
    return found


def cls_model(fused: bool) -> nn.Module:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_cifar_cls", num_classes=10)
    set_fused_attention(model, fused)
    return model


def stock(dataset: str, batch: int, rounds: int, workers: int, dtype, device) -> _bench.Step:
    """(c): stock timm ViT (fused attention, nn.Dropout) fed by a DataLoader with per-image PIL transforms."""
    import datasets
    from timm.models.vision_transformer import VisionTransformer

    from timm_rollout.models import _TINY_CIFAR

    mean, std = normalization_stats(dataset)
    tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    ds = datasets.load_dataset(resolve_dataset(dataset).path, split="train").select(
        range(batch * (rounds + _bench.WARMUP_ROUNDS)))
    ds = ds.with_transform(lambda rows: {"x": [tf(img.convert("RGB")) for img in rows["img"]], "y": rows["label"]})
    loader = iter(DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True,
                             pin_memory=device.type == "cuda"))
    torch.manual_seed(0)
    step, _ = _bench.model_step(VisionTransformer(**_TINY_CIFAR, num_classes=10), dtype, device)

    def run() -> int:
        item = next(loader)
        step(item["x"].to(device, non_blocking=True), item["y"].to(device, non_blocking=True))
        return batch

    return run


def train_cli(dataset: str, samples: int, batch: int, epochs: int, device: torch.device | str) -> list[str]:
    """The ``timm_rollout.train`` flags of a short run of the default model: ``epochs`` over ``samples`` images."""
    return ["-m", "timm_rollout.train", "--model", "vit_tiny_cifar_rollout", "--dataset", dataset, "--epochs",
            str(epochs), "--max-train-samples", str(samples), "--max-eval-samples", "100", "--batch-size", str(batch),
            "--device", str(device), "--no-progress", "--overwrite"]


def cli_rate(dataset: str, batch: int, steps: int, ranks: int, folder: Path) -> float:
    """Training images/s of one whole ``timm_rollout.train`` run of ``steps`` updates (from its log.csv), in one
    process (``ranks`` 1) or ``ranks`` single-thread torchrun processes sharing the global ``batch``."""
    args = [*train_cli(dataset, batch * steps, batch // ranks, 1, "cpu"), "--warmup-epochs", "0", "--output",
            str(folder)]
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc_per_node", str(ranks)]
    env = {**os.environ, **({"OMP_NUM_THREADS": "1"} if ranks > 1 else {})}
    subprocess.run([*launcher, *args], check=True, env=env, capture_output=True)
    return read_log(folder / "log.csv")[-1]["img_per_s"]


def compare_ranks(dataset: str, batch: int, steps: int, ranks: int, repeats: int) -> dict[str, float]:
    """(a1) vs (aN), alternated ``repeats`` times; medians (returned by process count) and their ratio."""
    rates: dict[int, list[float]] = {1: [], ranks: []}
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as tmp:
        for _ in progress(range(repeats), desc="train CLI", leave=False):
            for n in rates:
                rates[n].append(cli_rate(dataset, batch, steps, n, Path(tmp) / f"r{n}"))
    one, many = statistics.median(rates[1]), statistics.median(rates[ranks])
    print(f"{'(a1) timm_rollout.train, 1 process, batch ' + str(batch):<64} {one:8.1f} img/s")
    print(f"{f'(a{ranks}) torchrun, {ranks} x 1 thread, batch {batch // ranks} each':<64} {many:8.1f} img/s")
    print(f"ratio: (a{ranks})/(a1) = {many / one:.2f} (median of {repeats} alternated runs of {steps} updates)")
    return {"1": one, str(ranks): many}


def concurrent_rates(dataset: str, batch: int, steps: int, n: int, device: torch.device, folder: Path) -> list[float]:
    """Training images/s of each of ``n`` ``timm_rollout.train`` runs started together on ``device``, one process
    each with ``cores / n`` threads (as ``study.py --jobs n`` runs them): epoch 2 of ``steps`` updates, so that
    epoch 1 absorbs start-up and warm-up."""
    args = [sys.executable, *train_cli(dataset, batch * steps, batch, 2, device), "--save-every", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
    runs = [folder / f"n{n}-{i}" for i in range(n)]
    procs = [subprocess.Popen([*args, "--seed", str(i), "--output", str(run)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for i, run in enumerate(runs)]
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode:
            raise UserError(f"a concurrent training run failed: {err.strip().splitlines()[-1:]}")
    return [read_log(run / "log.csv")[-1]["img_per_s"] for run in runs]


def compare_concurrent(dataset: str, batch: int, steps: int, counts: list[int], device: torch.device
                       ) -> dict[str, float]:
    """Total training images/s of 1, 4, 8 ... runs sharing the device (returned by run count), and each total's
    ratio to the first."""
    with tempfile.TemporaryDirectory(prefix="bench-concurrent-") as tmp:
        totals = {n: sum(concurrent_rates(dataset, batch, steps, n, device, Path(tmp))) for n in counts}
    first = totals[counts[0]]
    for n, total in totals.items():
        label = f"{n} run{'s' * (n > 1)} at once, batch {batch} each, epoch 2 of {steps} updates"
        print(f"{label:<64} {total:8.1f} img/s in all ({total / first:.2f}x the {counts[0]}-run total)")
    return {str(n): total for n, total in totals.items()}


def _check_args(args: argparse.Namespace, given: frozenset[str]) -> None:
    """Flags that only mean something with another are refused alone (never silently unused); ``given``: the
    flags typed (:class:`CliParser`)."""
    if args.ranks == 1:
        raise UserError("--ranks compares N >= 2 processes with one; pass 2 or more (0: off)")
    if "repeats" in given and not args.ranks:
        raise UserError("--repeats counts the alternated runs of --ranks; add --ranks N or drop it")


def build_parser() -> CliParser:
    """The benchmark's flags; each optional comparison is off unless asked for."""
    p = CliParser(prog="python scripts/bench_train.py", description=__doc__.split("\n\n")[0],
                  removed={"--capture-runs": "time N separate processes with --concurrent N ..., and CUDA graphs with "
                                             "--compile reduce-overhead",
                           "--pack": "time N separate processes (study.py --jobs N) with --concurrent N ..."})
    p.checks.append(lambda args: _check_args(args, p.given))
    p.add_argument("--dataset", default=_bench.DATASET)
    p.add_argument("--batch-size", type=positive_int, default=128)
    p.add_argument("--steps", type=positive_int, default=20, help="timed rounds (one step of each variant per round)")
    p.add_argument("--loader-workers", type=non_negative_int, default=2, help="DataLoader workers for (c)")
    p.add_argument("--device", default="auto", type=device_arg, help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--ranks", type=non_negative_int, default=0,
                   help="also compare the train CLI in 1 vs N processes (CPU)")
    p.add_argument("--repeats", type=positive_int, default=3, help="alternated CLI runs per variant with --ranks")
    p.add_argument("--concurrent", type=positive_int, nargs="+", default=[],
                   help="also time N train CLI runs sharing the device, for each N given (e.g. 1 4 8)")
    p.add_argument("--compile", nargs="+", default=[], choices=COMPILE_MODES, metavar="MODE",
                   help=f"also time (a) through torch.compile in each mode given ({', '.join(COMPILE_MODES)})")
    p.add_argument("--profile", action="store_true",
                   help="CUDA: profile (a), and (a) in each --compile mode: wall against GPU kernel time per step, "
                        "kernels per step, the costliest kernels")
    p.add_argument("--json", type=Path, help="write every figure of this run, with the machine's name, to this file")
    return p


def single_runs(args: argparse.Namespace, dtype: torch.dtype, precision: str,
                device: torch.device) -> tuple[dict, dict]:
    """Race the one-run variants side by side; print rates and ratios."""
    b = args.batch_size
    labels = {
        "a": f"(a) full loop: data + augmentation + step ({precision})",
        "a0": f"(a0) the same full loop without dropout ({precision})",
        "b": f"(b) bare step, FastDropout ({precision})",
        "b0": f"(b0) bare step, nn.Dropout ({precision})",
        "c": f"(c) stock timm + PIL DataLoader, {args.loader_workers} workers ({precision})",
        "f": f"(f) bare step, CLS model, fused attention ({precision})",
        "e": f"(e) bare step, CLS model, explicit attention ({precision})",
    }
    compiled = {f"a:{mode}": full_loop(args.dataset, b, dtype, device, compile_mode=mode) for mode in args.compile}
    labels |= {key: f"(a) full loop, torch.compile mode={key[2:]} ({precision})" for key in compiled}
    r = _bench.race({
        **compiled,
        "a": full_loop(args.dataset, b, dtype, device),
        "a0": full_loop(args.dataset, b, dtype, device, **NO_DROPOUT),
        "b": _bench.bare_step(ours(), b, dtype, device),
        "b0": _bench.bare_step(ours(fast_dropout=False), b, dtype, device),
        "c": stock(args.dataset, b, args.steps, args.loader_workers, dtype, device),
        "f": _bench.bare_step(cls_model(True), b, dtype, device),
        "e": _bench.bare_step(cls_model(False), b, dtype, device),
    }, args.steps, device, precision)
    for key, label in labels.items():
        print(f"{label:<64} {r[key]:8.1f} img/s")
    print(f"ratios ({precision}): (a)/(b) = {r['a'] / r['b']:.2f}, (a)/(c) = {r['a'] / r['c']:.2f}, "
          f"(b)/(b0) = {r['b'] / r['b0']:.2f}, (a0)/(c) = {r['a0'] / r['c']:.2f}, "
          f"(e)/(f) = {r['e'] / r['f']:.2f}"
          + "".join(f", (a {key[2:]})/(c) = {r[key] / r['c']:.2f}" for key in compiled))
    return r, labels


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    if args.ranks and device.type != "cpu":
        raise UserError("--ranks compares CPU processes; drop it or pass --device cpu")
    if args.profile and device.type != "cuda":
        raise UserError("--profile times CUDA kernels; pass --device cuda (or drop it)")
    dtype = resolve_amp("auto", device)
    b = args.batch_size
    print(f"{_bench.machine_line(device)}; batch {b}, median of {args.steps} rounds, "
          f"--amp auto = {_bench.precision(dtype)}")
    record: dict[str, object] = {**_bench.machine_record(device), "batch_size": b, "steps": args.steps,
                                 "precision": _bench.precision(dtype), "complete": False}
    r, labels = single_runs(args, dtype, _bench.precision(dtype), device)
    record |= {"img_per_s": {labels[k]: v for k, v in r.items()},
               "ratio_vs_stock_timm_b128": r["a"] / r["c"] if b == 128 else None}
    save(args.json, record)
    if args.ranks:
        record["ranks_img_per_s"] = compare_ranks(args.dataset, b, args.steps * 3, args.ranks, args.repeats)
        save(args.json, record)
    if args.concurrent:
        record["concurrent_total_img_per_s"] = compare_concurrent(args.dataset, b, args.steps * 3, args.concurrent,
                                                                  device)
        save(args.json, record)
    if args.profile:
        record["profile"] = profile_steps({
            "(a) full loop": full_loop(args.dataset, b, dtype, device),
            **{f"(a) full loop, torch.compile mode={mode}": full_loop(args.dataset, b, dtype, device, compile_mode=mode)
               for mode in args.compile}}, 20, device)
    save(args.json, record | {"complete": True})


def save(path: Path | None, record: dict[str, object]) -> None:
    """Write the figures measured so far (atomically; ``complete`` false until the last section), so that a
    benchmark cut off by a time limit still leaves its finished sections."""
    if path:
        write_json(path, record)

if __name__ == "__main__":
    run_cli(main)
