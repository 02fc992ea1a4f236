"""Train any timm model (the tiny CIFAR ViTs by default) on a Hugging Face image data set.

    python -m timm_rollout.train --model vit_tiny_cifar_rollout --dataset cifar10 --epochs 200 \\
        --output runs/c10-rollout
    torchrun --nproc_per_node 2 -m timm_rollout.train ...        # DDP: gloo on CPU, NCCL on GPUs

Images are decoded once into memory and augmented in batches on the training device. The optimizer
and schedule come from timm (``create_optimizer_v2``: no weight decay on norms, biases, position
embedding and CLS token; ``create_scheduler_v2`` stepped every update). Every epoch leaves a complete
model (``model.safetensors`` + ``config.json``, loadable with ``timm.create_model("local-dir:<out>")``)
and a resume state in the output folder; ``summary.json`` appears when all epochs are done.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3, ParseKwargs
from torch import nn
from tqdm import tqdm

from . import __version__
from .atomic import write_json
from .checkpoint import MODEL_FILES, RESUME_FILE, load_resume, save_model, save_resume
from .data import (
    ImageSet,
    balanced_indices,
    dataset_arg,
    load_image_set,
    normalization_stats,
    normalize,
    resolve_dataset,
    split_names,
)
from .device import AMP_CHOICES, autocast, resolve_amp, resolve_device
from .dropout import use_fast_dropout
from .errors import (
    CliParser,
    UserError,
    as_type,
    device_arg,
    fraction,
    key_value,
    non_negative,
    non_negative_int,
    number,
    output_dir,
    positive,
    positive_int,
    run_cli,
    seed_arg,
)
from .loading import check_model
from .train_log import plot_curves, write_log
from .train_step import Batches, optimizer_step

__all__ = ["build_parser", "main", "train"]

ARGS_FILE = "train_args.json"
SUMMARY_FILE = "summary.json"
LOG_FILE = "log.csv"
CURVES_FILE = "curves.png"
RUN_FILES = (*MODEL_FILES, ARGS_FILE, SUMMARY_FILE, LOG_FILE, CURVES_FILE, RESUME_FILE)
# Flags that may differ when a run is resumed: where it lives and how it runs, not what it computes.
RESUME_FREE = {"resume", "overwrite", "output", "workers", "device", "no_progress"}
EVAL_BATCH = 500


# Optimizer schedules that train steps every update (timm's plateau steps on epochs only).
SCHEDULERS = ("cosine", "tanh", "step", "multistep", "poly", "constant", "wsd", "rsqrt", "none")


def build_parser() -> CliParser:
    """The CLI; names follow timm's ``train.py`` where it has them. Bad values are one-line errors at parse time."""
    p = CliParser(prog="python -m timm_rollout.train", description=__doc__.split("\n\n")[0],
                  checks=[_check_model_args])
    g = p.add_argument_group("data")
    g.add_argument("--dataset", type=as_type(dataset_arg),
                   help="alias (cifar10, cifar100, svhn, cifar10-sample), Hub id or local folder")
    g.add_argument("--train-split", default="train")
    g.add_argument("--eval-split", default=None, help="default: test, else validation")
    g.add_argument("--image-column", default=None, help="default: img or image")
    g.add_argument("--label-column", default=None, help="default: label or fine_label")
    g.add_argument("--max-train-samples", type=positive_int, default=None, help="class-balanced seeded subset")
    g.add_argument("--max-eval-samples", type=positive_int, default=None, help="class-balanced seeded subset")
    g.add_argument("--crop-padding", type=non_negative_int, default=4,
                   help="random crop after zero padding by this many pixels")
    g.add_argument("--hflip", type=number(float, 0, 1), default=None,
                   help="flip probability; default 0.5, 0 for svhn (digits)")
    g.add_argument("--mixup", type=non_negative, default=0.0, help="mixup alpha (timm Mixup), 0 = off")
    g.add_argument("--cutmix", type=non_negative, default=0.0, help="cutmix alpha (timm Mixup), 0 = off")
    g.add_argument("--smoothing", type=fraction, default=0.0, help="label smoothing, in [0, 1)")
    g = p.add_argument_group("model")
    g.add_argument("--model", default="vit_tiny_cifar_rollout", help="any timm model name")
    g.add_argument("--num-classes", type=positive_int, default=None, help="default: the data set's class count")
    g.add_argument("--drop-path", type=fraction, default=None, help="stochastic depth rate (model default if unset)")
    g.add_argument("--model-kwargs", nargs="*", default={}, action=ParseKwargs, type=key_value, metavar="KEY=VALUE",
                   help="extra timm.create_model arguments, e.g. depth=2")
    g.add_argument("--model-ema", action="store_true", help="keep a timm ModelEmaV3; evaluate and export it")
    g.add_argument("--model-ema-decay", type=number(float, 0, 1, low_open=True, high_open=True), default=0.9998)
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=positive_int, default=200)
    g.add_argument("--batch-size", type=positive_int, default=128, help="per process")
    g.add_argument("--opt", default="adamw", type=as_type(_optimizer_arg), help="any timm optimizer name")
    g.add_argument("--lr", type=positive, default=5e-4)
    g.add_argument("--weight-decay", type=non_negative, default=1e-4)
    g.add_argument("--momentum", type=fraction, default=0.9, help="for SGD-family optimizers")
    g.add_argument("--clip-grad", type=positive, default=None, help="gradient norm clipping, off by default")
    g.add_argument("--sched", default="cosine", choices=SCHEDULERS, help="timm scheduler, stepped every update")
    g.add_argument("--warmup-epochs", type=non_negative, default=5, help="linear warmup, clipped to the run length")
    g.add_argument("--warmup-lr", type=non_negative, default=1e-5)
    g.add_argument("--min-lr", type=non_negative, default=5e-6)
    g = p.add_argument_group("run")
    g.add_argument("--output", required=True, type=output_dir, help="output folder")
    g.add_argument("--seed", type=seed_arg, default=0)
    g.add_argument("--amp", default="auto", choices=AMP_CHOICES, help="auto: bf16 where it pays, else fp32")
    g.add_argument("--device", default="auto", type=device_arg, help="auto, cpu, cuda, cuda:1 ...")
    g.add_argument("--workers", type=positive_int, default=None,
                   help="CPU threads for torch (default: torch's choice; 1 is far faster on a busy machine)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue the run in --output (a finished run is kept)")
    mode.add_argument("--overwrite", action="store_true", help="replace a run already in --output")
    return p


def _optimizer_arg(name: str) -> str:
    from timm.optim import get_optimizer_info, list_optimizers

    try:
        get_optimizer_info(name.lower().removeprefix("lookahead_"))
    except ValueError:
        close = difflib.get_close_matches(name.lower(), list_optimizers(), n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else "see timm.optim.list_optimizers()"
        raise UserError(f"unknown optimizer {name!r}; {hint}") from None
    return name


def _check_model_args(args: argparse.Namespace) -> None:
    """The model name and --model-kwargs, checked on the meta device before any data is loaded."""
    kwargs = dict(args.model_kwargs)
    if "num_classes" in kwargs:
        raise UserError("pass --num-classes N instead of --model-kwargs num_classes=N")
    if args.drop_path is not None:
        kwargs["drop_path_rate"] = args.drop_path
    if args.num_classes:
        kwargs["num_classes"] = args.num_classes
    check_model(args.model, kwargs)


class NonFiniteLossError(UserError):
    """The training loss became NaN or infinite."""


@dataclass
class Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def _init_distributed(device: str) -> Dist:
    """Single process, or DDP under ``torchrun`` (NCCL on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = resolve_device(device)
    if world == 1:
        return Dist(0, 1, dev)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank, world, dev)


def _seed(*parts: int) -> int:
    """A 63-bit seed derived from ``parts`` (numpy SeedSequence): independent streams per epoch and rank."""
    return int(np.random.SeedSequence([p & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint64)[0] >> 1)


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _reduce(values: torch.Tensor, d: Dist) -> torch.Tensor:
    """Sum across ranks (identity in a single process)."""
    if d.world > 1:
        values = values.clone()
        dist.all_reduce(values)
    return values


def _load_data(args: argparse.Namespace) -> tuple[ImageSet, ImageSet, tuple, tuple]:
    cols = {"image_column": args.image_column, "label_column": args.label_column}
    train_set = load_image_set(args.dataset, args.train_split, **cols)
    eval_split = args.eval_split
    if eval_split is None:
        eval_split = "test" if "test" in split_names(args.dataset) else "validation"
    eval_set = load_image_set(args.dataset, eval_split, **cols)
    mean, std = normalization_stats(args.dataset, train_set)
    if args.max_train_samples:
        train_set = train_set.subset(balanced_indices(train_set.labels, total=args.max_train_samples, seed=args.seed))
    if args.max_eval_samples:
        eval_set = eval_set.subset(balanced_indices(eval_set.labels, total=args.max_eval_samples, seed=args.seed))
    return train_set, eval_set, mean, std


def _check_input_size(model: nn.Module, images: torch.Tensor) -> None:
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    want = tuple(cfg.get("input_size", ())[1:])
    got = tuple(images.shape[-2:])
    if cfg.get("fixed_input_size") and want and want != got:
        raise UserError(f"the data set's images are {got[0]}x{got[1]} but {cfg.get('architecture')} takes "
                        f"{want[0]}x{want[1]}; pass --model-kwargs img_size={got[0]}")


def _prepare_output(out: Path, args: argparse.Namespace, d: Dist) -> str:
    """``'fresh'``, ``'resume'`` or ``'finished'``; refuses to clobber a run unless asked."""
    finished, has_state = (out / SUMMARY_FILE).exists(), (out / RESUME_FILE).exists()
    if args.overwrite:
        if d.main:
            for name in RUN_FILES:
                (out / name).unlink(missing_ok=True)
        return "fresh"
    if args.resume:
        return "finished" if finished else ("resume" if has_state else "fresh")
    if finished:
        raise UserError(f"{out} holds a finished run; pass --overwrite to replace it or choose another --output")
    if has_state:
        raise UserError(f"{out} holds an unfinished run; add --resume to continue it or --overwrite to start over")
    return "fresh"


def _merge_saved_args(args: argparse.Namespace, out: Path, parser: CliParser) -> argparse.Namespace:
    """On resume, the saved configuration wins; a flag typed with another value than the saved one is an error.

    ``parser.given`` tells a typed flag from an omitted one, so ``--lr 5e-4`` is refused against a run saved
    with 1e-3 even though 5e-4 is the default (it would otherwise silently continue at 1e-3).
    """
    saved = json.loads((out / ARGS_FILE).read_text(encoding="utf-8"))
    merged = vars(args).copy()
    for key, value in vars(args).items():
        if key in RESUME_FREE or key not in saved:
            continue
        if key in parser.given and json.loads(json.dumps(value)) != saved[key]:
            flag = "--" + key.replace("_", "-")
            raise UserError(f"{flag} {_shown(value)} differs from the saved run's {_shown(saved[key])}; drop it to "
                            "resume with the saved value, or start a new --output")
        merged[key] = saved[key]
    return argparse.Namespace(**merged)


def _shown(value: object) -> str:
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items()) or "(none)"
    return str(value)


def _versions() -> dict[str, str]:
    import datasets

    return {"python": platform.python_version(), "torch": torch.__version__, "timm": timm.__version__,
            "datasets": datasets.__version__, "timm_rollout": __version__}


def _criterion(args: argparse.Namespace) -> nn.Module:
    if args.mixup > 0 or args.cutmix > 0:
        return SoftTargetCrossEntropy()
    if args.smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    return nn.CrossEntropyLoss()


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, mean, std, d: Dist,
             amp_dtype: torch.dtype | None) -> dict[str, float]:
    """Eval loss and top-1/top-5 accuracy (%) of ``model``; each rank takes every ``world``-th image."""
    was_training = model.training
    model.eval()
    images, labels = images[d.rank::d.world], labels[d.rank::d.world]
    sums = torch.zeros(4, dtype=torch.float64)  # loss, top-1, top-5, count
    for start in range(0, len(labels), EVAL_BATCH):
        x = normalize(images[start:start + EVAL_BATCH].to(d.device), mean, std)
        y = labels[start:start + EVAL_BATCH].to(d.device)
        with autocast(d.device, amp_dtype):
            logits = model(x)
        logits = logits.float()
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        hit = top == y[:, None]
        sums += torch.tensor([F.cross_entropy(logits, y, reduction="sum").item(), hit[:, 0].sum().item(),
                              hit.any(dim=1).sum().item(), len(y)], dtype=torch.float64)
    sums = _reduce(sums.to(d.device), d).cpu()
    model.train(was_training)
    n = max(sums[3].item(), 1.0)
    loss, top1, top5 = (sums[:3] / n).tolist()
    return {"eval_loss": loss, "eval_top1": 100 * top1, "eval_top5": 100 * top5}


def train(argv: list[str] | None = None) -> Path:
    """Run training from CLI-style arguments; returns the output folder."""
    parser = build_parser()
    args = parser.parse_args(argv)
    d = _init_distributed(args.device)
    threads = torch.get_num_threads()
    try:
        return _train(args, parser, d)
    finally:
        torch.set_num_threads(threads)
        if d.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _train(args: argparse.Namespace, parser: argparse.ArgumentParser, d: Dist) -> Path:
    out = Path(args.output)
    state = _prepare_output(out, args, d)
    if state == "finished":
        if d.main:
            print(f"{out} already holds a finished run; nothing to do")
        return out
    if state == "resume":
        args = _merge_saved_args(args, out, parser)
    if not args.dataset:
        raise UserError("no data set: pass --dataset (e.g. cifar10, cifar10-sample or a local folder)")
    if args.workers:
        torch.set_num_threads(args.workers)
    if (args.mixup > 0 or args.cutmix > 0) and args.batch_size % 2:
        raise UserError(f"mixup/cutmix need an even --batch-size, got {args.batch_size}")

    train_set, eval_set, mean, std = _load_data(args)
    num_classes = args.num_classes or train_set.num_classes
    if int(train_set.labels.max()) >= num_classes:
        raise UserError(f"labels go up to {int(train_set.labels.max())} but --num-classes is {num_classes}; "
                        "raise --num-classes or drop it")
    steps = len(train_set) // (args.batch_size * d.world)
    if steps == 0:
        raise UserError(f"{len(train_set)} training images do not fill one batch of {args.batch_size} per process; "
                        "lower --batch-size")
    digits = resolve_dataset(args.dataset).stats_key == "svhn"
    hflip = args.hflip if args.hflip is not None else (0.0 if digits else 0.5)
    warmup = min(args.warmup_epochs, args.epochs)
    amp_dtype = resolve_amp(args.amp, d.device)

    _seed_everything(args.seed)
    kwargs = dict(args.model_kwargs)
    if args.drop_path is not None:
        kwargs["drop_path_rate"] = args.drop_path
    try:
        model = timm.create_model(args.model, num_classes=num_classes, **kwargs)
    except RuntimeError as e:
        if "Unknown model" in str(e):
            raise UserError(f"unknown model {args.model!r}; use a timm model name such as vit_tiny_cifar_rollout") \
                from None
        raise
    _check_input_size(model, train_set.images)
    use_fast_dropout(model)
    model.to(d.device)
    optimizer = create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay,
                                    momentum=args.momentum)
    scheduler, _ = create_scheduler_v2(optimizer, sched=args.sched, num_epochs=args.epochs, min_lr=args.min_lr,
                                       warmup_lr=args.warmup_lr, warmup_epochs=warmup, step_on_epochs=False,
                                       updates_per_epoch=steps)
    ema = ModelEmaV3(model, decay=args.model_ema_decay) if args.model_ema else None
    scaler = torch.amp.GradScaler(d.device.type) if amp_dtype == torch.float16 else None
    mixup = (Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                   num_classes=num_classes) if args.mixup > 0 or args.cutmix > 0 else None)
    criterion = _criterion(args)
    net = nn.parallel.DistributedDataParallel(model) if d.world > 1 else model

    start_epoch, num_updates, rows = 0, 0, []
    if state == "resume":
        meta = load_resume(out / RESUME_FILE, model=model, optimizer=optimizer,
                           ema=ema.module if ema else None, scaler=scaler)
        start_epoch, num_updates, rows = meta["epoch"], meta["num_updates"], meta["rows"]
        if scheduler is not None:
            scheduler.step_update(num_updates)
    elif d.main:
        record = {**vars(args), "dataset_resolved": train_set.dataset, "train_split": train_set.split,
                  "eval_split": eval_set.split, "fingerprints": {"train": train_set.fingerprint,
                                                                 "eval": eval_set.fingerprint},
                  "class_names": train_set.class_names, "num_classes": num_classes, "mean": list(mean),
                  "std": list(std), "train_images": len(train_set), "eval_images": len(eval_set),
                  "warmup_epochs_used": warmup, "hflip_used": hflip, "steps_per_epoch": steps,
                  "world_size": d.world, "device": str(d.device), "amp_dtype": str(amp_dtype).replace("torch.", "")
                  if amp_dtype else "float32", "versions": _versions()}
        write_json(out / ARGS_FILE, record)

    batches = Batches(train_set.images.to(d.device), train_set.labels.to(d.device), mean, std, args.crop_padding,
                      hflip, mixup)
    eval_model = ema.module if ema else model
    title = f"{args.model} on {Path(args.dataset).name}"
    for epoch in range(start_epoch, args.epochs):
        t0 = time.perf_counter()
        _seed_everything(_seed(args.seed, epoch, d.rank))
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(_seed(args.seed, epoch)))
        order = order[d.rank::d.world][: steps * args.batch_size].to(d.device)
        aug_gen = torch.Generator().manual_seed(_seed(args.seed, epoch, d.rank, 1))
        net.train()
        loss_sum, lr = 0.0, optimizer.param_groups[0]["lr"]
        bar = tqdm(range(steps), desc=f"epoch {epoch + 1}/{args.epochs}", disable=not d.main or args.no_progress,
                   leave=False, file=sys.stderr)
        for step in bar:
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            x, y = batches(idx, aug_gen)
            lr = optimizer.param_groups[0]["lr"]
            loss = optimizer_step(net, x, y, criterion, optimizer, device=d.device, amp_dtype=amp_dtype,
                                  scaler=scaler, clip_grad=args.clip_grad)
            num_updates += 1
            if scheduler is not None:
                scheduler.step_update(num_updates)
            if ema is not None:
                ema.update(model, step=num_updates)
            value = _reduce(loss.float(), d).item() / d.world
            if not math.isfinite(value):
                kept = f"the last good checkpoint (epoch {rows[-1]['epoch']}) is kept in {out}" if rows else \
                    "no checkpoint was written"
                raise NonFiniteLossError(f"the training loss is {value} at epoch {epoch + 1} step {step + 1}; "
                                         f"{kept}; lower --lr, add --clip-grad 1.0 or use --amp none in a new --output")
            loss_sum += value
            bar.set_postfix(loss=f"{value:.3f}", refresh=False)
        train_seconds = time.perf_counter() - t0
        metrics = evaluate(eval_model, eval_set.images, eval_set.labels, mean, std, d, amp_dtype)
        rows.append({"epoch": epoch + 1, "train_loss": loss_sum / steps, **metrics, "lr": lr,
                     "img_per_s": steps * args.batch_size * d.world / train_seconds,
                     "seconds": time.perf_counter() - t0})
        if d.main:
            save_resume(out / RESUME_FILE, model=model, optimizer=optimizer, ema=ema.module if ema else None,
                        scaler=scaler, meta={"epoch": epoch + 1, "num_updates": num_updates, "rows": rows})
            save_model(out, eval_model, train_set.class_names, mean, std)
            write_log(out / LOG_FILE, rows)
            plot_curves(out / CURVES_FILE, rows, title)
            r = rows[-1]
            tqdm.write(f"epoch {epoch + 1}/{args.epochs}: train loss {r['train_loss']:.4f}, eval loss "
                       f"{r['eval_loss']:.4f}, top-1 {r['eval_top1']:.2f}%, top-5 {r['eval_top5']:.2f}%, "
                       f"{r['img_per_s']:.0f} img/s", file=sys.stderr)
        if d.world > 1:
            dist.barrier()

    if d.main:
        last = rows[-1]
        summary = {"epochs": args.epochs, **{k: last[k] for k in ("train_loss", "eval_loss", "eval_top1",
                                                                  "eval_top5")},
                   "best_eval_top1": max(r["eval_top1"] for r in rows),
                   "wall_seconds": sum(r["seconds"] for r in rows),
                   "train_images": len(train_set), "eval_images": len(eval_set)}
        write_json(out / SUMMARY_FILE, summary)
        print(f"{args.model} on {args.dataset}: eval top-1 {last['eval_top1']:.2f}%, top-5 {last['eval_top5']:.2f}% "
              f"after {args.epochs} epochs ({summary['wall_seconds']:.0f} s) -> {out}")
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI entry point."""
    train(argv)


if __name__ == "__main__":
    run_cli(main)
