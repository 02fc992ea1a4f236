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

The steps, in order: ``_open`` (``_prepare_data``: splits, sizes; ``_build``: model, optimizer, schedule, EMA,
grad scaler, DDP, ``--compile``; ``_restore`` or ``_write_record``), then per epoch ``_train_epoch`` (no host
sync per step) and ``_end_epoch`` (``evaluate``, the log row and, on save epochs, ``_save``);
``_write_summary`` at the end. Several ``--seed`` runs train one after another in one process.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.data import Mixup
from timm.layers import to_2tuple
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3, ParseKwargs
from torch import nn

from .accuracy import topk_hits
from .atomic import write_json
from .capture import set_fused_attention
from .checkpoint import load_resume, save_model, save_resume
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
from .device import (
    AMP_CHOICES,
    autocast,
    device_arg,
    device_name,
    fp32_precision,
    precision_name,
    resolve_amp,
    resolve_device,
)
from .diagnostics import cosine_to_mean, effective_patches
from .dropout import use_fast_dropout
from .errors import (
    CliParser,
    PerChannel,
    UserError,
    as_type,
    existing_path,
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
from .loading import check_input_size, check_model, create_model, pretrained_config, pretrained_overlay
from .pooling import OPTION_ARGS, ROLLOUT, TIMM_POOLS, set_pooling
from .progress import progress, tqdm
from .records import (
    ARGS_FILE,
    CURVES_FILE,
    LOG_FILE,
    MODEL_FILES,
    RESUME_FILE,
    SUMMARY_FILE,
    code_label,
    code_version,
    portable_path,
    versions,
)
from .train_log import plot_curves, write_log
from .train_step import Batches, optimizer_step

__all__ = ["build_parser", "main", "train"]

RUN_FILES = (*MODEL_FILES, ARGS_FILE, SUMMARY_FILE, LOG_FILE, CURVES_FILE, RESUME_FILE)
# Flags that may differ when a run is resumed: where it lives and how it runs, not what it computes.
RESUME_FREE = {"resume", "overwrite", "output", "workers", "device", "no_progress", "save_every", "compile",
               "compile_mode"}
# torch.compile's modes: reduce-overhead replays the compiled passes as CUDA graphs (GPUs; plain compilation on CPU).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
EVAL_BATCH = 500
DEFAULT_EVAL_SPLITS = ("test", "validation")  # evaluated without --eval-split, the first the data set has
BAR_EVERY = 50  # steps between loss updates of the progress bar (each costs one host sync)


POOLS = (*[p for p in TIMM_POOLS if p], ROLLOUT)  # --pool choices
# Removed flags, each refused in one line that names what to use instead (CliParser's ``removed``).
REMOVED = {"--stack": "train many runs as separate processes with scripts/study.py --jobs N",
           "--capture": "for CUDA graphs use --compile --compile-mode reduce-overhead",
           "--dropout-draws": "drop it: dropout and drop-path masks come from torch's generators, seeded per epoch"}
# Optimizer schedules that train steps every update (timm's plateau steps on epochs only).
SCHEDULERS = ("cosine", "tanh", "step", "multistep", "poly", "constant", "wsd", "rsqrt", "none")


def build_parser() -> CliParser:
    """The CLI; names follow timm's ``train.py`` where it has them. Bad values are one-line errors at parse time."""
    p = CliParser(prog="python -m timm_rollout.train", description=__doc__.split("\n\n")[0],
                  checks=[_check_model_args], removed=REMOVED)
    p.checks.append(lambda args: _check_ema_args(args, p.given))
    p.checks.append(lambda args: _check_compile_args(args, p.given))
    _data_args(p.add_argument_group("data"))
    _model_args(p.add_argument_group("model"))
    _optimisation_args(p.add_argument_group("optimisation"))
    _run_args(p.add_argument_group("run"))
    return p


def _data_args(g: argparse._ArgumentGroup) -> None:
    """Data set, subsets and augmentation."""
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
    g.add_argument("--mean", type=number(float, 0, 1), nargs="+", action=PerChannel, default=None, metavar="M",
                   help="normalisation mean in [0, 1] units, R G B or one for all; default: the data set's (the "
                        "pretrained weights' with --pretrained-file)")
    g.add_argument("--std", type=positive, nargs="+", action=PerChannel, default=None, metavar="S",
                   help="normalisation std, R G B or one for all; default as --mean")


def _model_args(g: argparse._ArgumentGroup) -> None:
    """The timm model, its pooling, starting weights and EMA."""
    g.add_argument("--model", default="vit_tiny_cifar_rollout", help="any timm model name")
    g.add_argument("--num-classes", type=positive_int, default=None, help="default: the data set's class count")
    g.add_argument("--drop-path", type=fraction, default=None, help="stochastic depth rate (model default if unset)")
    g.add_argument("--model-kwargs", nargs="+", default={}, action=ParseKwargs, type=key_value, metavar="KEY=VALUE",
                   help="extra timm.create_model arguments, e.g. depth=2")
    g.add_argument("--pool", choices=POOLS, default=None,
                   help="pool with this instead of the model's own pooling, on any timm ViT (timm_rollout.set_pooling)")
    g.add_argument("--pool-kwargs", nargs="+", default={}, action=ParseKwargs, type=key_value, metavar="KEY=VALUE",
                   help="rollout options with --pool rollout: head_fusion=max discard_ratio=0.9 grad=True")
    g.add_argument("--pretrained-file", type=existing_path, default=None,
                   help="start from these weights (safetensors or a timm checkpoint, never unpickled); the head is "
                        "new when the class count differs, the data are normalised with the model's mean/std")
    g.add_argument("--model-ema", action="store_true", help="keep a timm ModelEmaV3; evaluate and export it")
    g.add_argument("--model-ema-decay", type=number(float, 0, 1, low_open=True, high_open=True), default=0.9998)


def _optimisation_args(g: argparse._ArgumentGroup) -> None:
    """Optimizer and schedule (timm factories)."""
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


def _run_args(g: argparse._ArgumentGroup) -> None:
    """Output, seeds, device, precision and resume."""
    g.add_argument("--output", required=True, type=output_dir, help="output folder")
    g.add_argument("--seed", type=seed_arg, nargs="+", default=[0],
                   help="one seed, or several: their runs train one after another in this process, the data "
                        "loaded once, into --output with {seed} replaced (e.g. runs/gap-s{seed})")
    g.add_argument("--amp", default="auto", choices=AMP_CHOICES, help="auto: bf16 where it pays, else fp32")
    g.add_argument("--device", default="auto", type=device_arg, help="auto, cpu, cuda, cuda:1 ...")
    g.add_argument("--workers", type=positive_int, default=None,
                   help="CPU threads for torch (default: torch's choice; 1 is far faster on a busy machine)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--save-every", type=positive_int, default=1,
                   help="epochs between checkpoint, export, log and plot writes (the last epoch is always saved)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model for training and evaluation")
    g.add_argument("--compile-mode", default="default", choices=COMPILE_MODES,
                   help="torch.compile's mode with --compile (reduce-overhead: CUDA graphs, for launch-bound GPUs)")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true",
                      help="continue the run in --output; a larger --epochs trains a finished run further, on a "
                           "schedule rebuilt for the new total")
    mode.add_argument("--overwrite", action="store_true", help="replace a run already in --output")


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
    if args.pool_kwargs and args.pool != ROLLOUT:
        raise UserError("--pool-kwargs are rollout options; add --pool rollout or drop them")
    if args.pool is not None:
        try:
            with torch.device("meta"):
                set_pooling(timm.create_model(args.model, **kwargs), args.pool, **args.pool_kwargs)
        except ValueError as e:
            raise UserError(f"--pool {args.pool} {_shown(args.pool_kwargs)}: {e}") from None


def _check_ema_args(args: argparse.Namespace, given: frozenset[str]) -> None:
    """A typed ``--model-ema-decay`` is used or refused: it sets the decay of ``--model-ema`` only."""
    if "model_ema_decay" in given and not args.model_ema:
        raise UserError("--model-ema-decay sets the decay of the EMA that --model-ema keeps; add --model-ema or drop "
                        "--model-ema-decay")


def _check_compile_args(args: argparse.Namespace, given: frozenset[str]) -> None:
    """A typed ``--compile-mode`` is used or refused: it is the mode of ``--compile``."""
    if "compile_mode" in given and not args.compile:
        raise UserError("--compile-mode sets how --compile compiles; add --compile or drop --compile-mode")


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
        if local >= torch.cuda.device_count():
            raise UserError(f"local rank {local} has no GPU ({torch.cuda.device_count()} visible); start at most "
                            "that many processes per node, or pass --device cpu")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        if dev.type == "cuda":
            dist.init_process_group("nccl", device_id=dev)
        else:
            dist.init_process_group("gloo")
    return Dist(rank, world, dev)


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every GPU), numpy and Python's ``random``, as a run does at the start of each epoch."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _seed(*parts: int) -> int:
    """A 63-bit seed derived from ``parts`` (numpy SeedSequence): independent streams per epoch and rank."""
    return int(np.random.SeedSequence([p & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint64)[0] >> 1)


def _reduce(values: torch.Tensor, d: Dist) -> torch.Tensor:
    """Sum across ranks (identity in a single process)."""
    if d.world > 1:
        values = values.clone()
        dist.all_reduce(values)
    return values


def _default_eval_split(dataset: str) -> str:
    """``test``, else ``validation``: the split evaluated without ``--eval-split``; neither is a :class:`UserError`."""
    splits = split_names(dataset)
    found = next((s for s in DEFAULT_EVAL_SPLITS if s in splits), None)
    if found is None:
        raise UserError(f"data set {dataset!r} has no split {' or '.join(map(repr, DEFAULT_EVAL_SPLITS))} to evaluate "
                        f"on; its splits are {', '.join(splits)}: name the one to evaluate on with --eval-split")
    return found


def _load_data(args: argparse.Namespace, loaded: dict[tuple, tuple]) -> tuple[ImageSet, ImageSet, tuple, tuple]:
    """The run's splits and normalisation; ``loaded`` keeps the full splits for the other seeds of one command."""
    cols = {"image_column": args.image_column, "label_column": args.label_column}
    key = (args.dataset, args.train_split, args.eval_split, args.image_column, args.label_column)
    if key not in loaded:
        train_set = load_image_set(args.dataset, args.train_split, **cols, split_flag="--train-split")
        eval_split = args.eval_split or _default_eval_split(args.dataset)
        loaded[key] = (train_set, load_image_set(args.dataset, eval_split, **cols, split_flag="--eval-split"),
                       *normalization_stats(args.dataset, train_set))
    train_set, eval_set, mean, std = loaded[key]
    if args.pretrained_file:  # fine-tuning: the inputs the pretrained weights expect (their run's, else the model's)
        trained = pretrained_config(args.pretrained_file, args.model)
        mean, std = trained.get("mean", mean), trained.get("std", std)
    mean, std = tuple(args.mean or mean), tuple(args.std or std)  # typed statistics win over both
    if args.max_train_samples:
        train_set = train_set.subset(balanced_indices(train_set.labels, total=args.max_train_samples, seed=args.seed))
    if args.max_eval_samples:
        eval_set = eval_set.subset(balanced_indices(eval_set.labels, total=args.max_eval_samples, seed=args.seed))
    return train_set, eval_set, mean, std


def _prepare_output(out: Path, args: argparse.Namespace) -> str:
    """``'fresh'``, ``'resume'`` or ``'finished'``; refuses to clobber a run unless asked (``--overwrite``: the
    old run's files go when the new run begins, :func:`_begin`)."""
    finished, has_state = (out / SUMMARY_FILE).exists(), (out / RESUME_FILE).exists()
    if args.overwrite:
        return "fresh"
    if args.resume:
        return "finished" if finished else ("resume" if has_state else "fresh")
    if finished:
        raise UserError(f"{out} holds a finished run; pass --overwrite to replace it or choose another --output")
    if has_state:
        raise UserError(f"{out} holds an unfinished run; add --resume to continue it or --overwrite to start over")
    return "fresh"


def _saved_args(out: Path) -> dict[str, Any]:
    return json.loads((out / ARGS_FILE).read_text(encoding="utf-8"))


def _merge_saved_args(args: argparse.Namespace, out: Path, parser: CliParser) -> argparse.Namespace:
    """On resume, the saved configuration wins; a flag typed with another value than the saved one is an error.

    ``parser.given`` tells a typed flag from an omitted one, so ``--lr 5e-4`` is refused against a run saved
    with 1e-3 even though 5e-4 is the default (it would otherwise silently continue at 1e-3). The one exception
    is a larger ``--epochs``: the run continues to the new count (:func:`_record_extension`).
    """
    saved = _saved_args(out)
    for flag, used in (("--dropout-draws keyed", saved.get("dropout_draws") == "keyed"),
                       ("--capture", saved.get("capture"))):  # removed; other removed keys of a record are ignored
        if used:
            raise UserError(f"{out} was trained with {flag}, which was removed, so it cannot continue exactly; "
                            "start a new --output")
    merged = vars(args).copy()
    for key, value in vars(args).items():
        if key in RESUME_FREE:
            continue
        if key not in saved:  # a flag newer than the run: the run trained with its default
            if key in parser.given and value != parser.get_default(key):
                flag = "--" + key.replace("_", "-")
                raise UserError(f"{out} was trained before {flag} existed, as with {flag} "
                                f"{_shown(parser.get_default(key))}; drop {flag} to resume it, or start a new --output")
            continue
        if key == "epochs" and key in parser.given and value > saved[key]:
            continue  # training goes on to the typed count, on a schedule rebuilt for it
        if key in parser.given and json.loads(json.dumps(value)) != saved[key]:
            flag = "--" + key.replace("_", "-")
            raise UserError(f"{flag} {_shown(value)} differs from the saved run's {_shown(saved[key])}; drop it to "
                            "resume with the saved value, or start a new --output")
        merged[key] = saved[key]
    return argparse.Namespace(**merged)


def _check_same_data(out: Path, args: argparse.Namespace, data: RunData) -> None:
    """A resumed run reads the images it trained on: the same decoded pixels and labels (``content``, wherever the
    files lie now; runs recorded without it: the same datasets fingerprint). A relative ``--dataset`` is read from
    the current folder, and a folder may have been rewritten since. (The mean/std are the saved ones: the record's
    ``mean``/``std`` are the ``--mean``/``--std`` a resume merges back, whatever the data set's statistics now.)"""
    saved = _saved_args(out)
    for split, now in (("train", data.train), ("eval", data.eval)):
        content = (saved.get("content") or {}).get(split)
        fingerprint = (saved.get("fingerprints") or {}).get(split)
        if content == now.content if content is not None else fingerprint in (None, now.fingerprint):
            continue
        was = f"content sha256 {content[:12]}" if content else f"datasets fingerprint {fingerprint}"
        raise UserError(f"--dataset {args.dataset} ({now.dataset}) gives other {split} images ({now.split}) than "
                        f"{out} trained on ({was}, from {saved.get('dataset_resolved')}); pass the --dataset it "
                        "trained on, or start a new --output")


def _shown(value: object) -> str:
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items()) or "(none)"
    if isinstance(value, (list, tuple)):  # as typed: --mean 0.1 0.2 0.3
        return " ".join(map(str, value))
    return str(value)


def _criterion(args: argparse.Namespace) -> nn.Module:
    if args.mixup > 0 or args.cutmix > 0:
        return SoftTargetCrossEntropy()
    if args.smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    return nn.CrossEntropyLoss()


def _eval_pass(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits, and for a rollout-pooled model the batch sums of its pooling diagnostics (effective patches,
    cosine to the mean) from the weights and tokens of that same pass."""
    if getattr(model, "global_pool", None) != "rollout":
        return model(x), None
    tokens = model.forward_features(x)
    weights = model.rollout_weights(tokens)
    logits = model.forward_head(tokens)
    patches = tokens[:, model.num_prefix_tokens:]
    return logits, torch.stack([effective_patches(weights).sum(), cosine_to_mean(patches, weights).sum()])


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, mean, std, d: Dist,
             amp_dtype: torch.dtype | None) -> dict[str, float]:
    """Eval loss and top-1/top-5 accuracy (%) of ``model``; each rank takes every ``world``-th image. A
    rollout-pooled model adds the means of its pooling diagnostics (:mod:`timm_rollout.diagnostics`).

    Sums stay on the device until the end: one all-reduce and one host sync per evaluation.
    """
    was_training = model.training
    model.eval()
    count, images, labels = len(labels), images[d.rank::d.world], labels[d.rank::d.world]  # count: all ranks
    sums = torch.zeros(5, dtype=torch.float64, device=d.device)  # loss, top-1, top-5, effective patches, cosine
    pooled = False
    for start in range(0, len(labels), EVAL_BATCH):
        x = normalize(images[start:start + EVAL_BATCH].to(d.device, non_blocking=True), mean, std)
        y = labels[start:start + EVAL_BATCH].to(d.device, non_blocking=True)
        with autocast(d.device, amp_dtype):
            logits, diagnostics = _eval_pass(model, x)
        logits = logits.float()
        hits = [topk_hits(logits, y, k).sum().double() for k in (1, min(5, logits.shape[1]))]
        sums[:3] += torch.stack([F.cross_entropy(logits, y, reduction="sum").double(), *hits])
        if diagnostics is not None:
            sums[3:] += diagnostics.double()
            pooled = True
    sums = _reduce(sums, d).cpu()
    model.train(was_training)
    loss, top1, top5, patches, cosine = (sums / max(count, 1)).tolist()
    out = {"eval_loss": loss, "eval_top1": 100 * top1, "eval_top5": 100 * top5}
    return {**out, "rollout_effective_patches": patches, "rollout_cosine_to_mean": cosine} if pooled else out


def train(argv: list[str] | None = None) -> Path | list[Path]:
    """Run training from CLI-style arguments; returns the output folder (one per seed when given several)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    runs = seed_runs(args)
    d = _init_distributed(args.device)
    threads = torch.get_num_threads()
    loaded: dict[tuple, tuple] = {}
    try:
        outs = [_train(run, parser, d, loaded) for run in runs]
        return outs[0] if len(args.seed) == 1 else outs
    finally:
        torch.set_num_threads(threads)
        if d.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def seed_runs(args: argparse.Namespace) -> list[argparse.Namespace]:
    """One run's arguments per ``--seed``, each with its own seed and output folder: exactly what a separate
    command with that seed gets, so each run is bit-identical to it (and resumes on its own)."""
    seeds = args.seed
    if len(set(seeds)) < len(seeds):
        raise UserError(f"--seed {' '.join(map(str, seeds))} repeats a seed; name each seed once")
    if len(seeds) > 1 and "{seed}" not in args.output:
        raise UserError("several --seed values need {seed} in --output, one run folder each "
                        "(e.g. --output runs/gap-s{seed})")
    return [argparse.Namespace(**{**vars(args), "seed": seed, "output": args.output.replace("{seed}", str(seed))})
            for seed in seeds]


@dataclass
class RunData:
    """The data of a run and what follows from it: class count, updates per epoch, augmentation, precision."""

    train: ImageSet
    eval: ImageSet
    mean: tuple
    std: tuple
    num_classes: int
    steps: int
    hflip: float
    warmup: float
    amp_dtype: torch.dtype | None


@dataclass
class Trainer:
    """What training updates: the model (``net`` is what the step calls: DDP and/or compiled around it),
    optimizer, schedule, EMA, grad scaler, and the bookkeeping a resume restores."""

    model: nn.Module
    net: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    ema: ModelEmaV3 | None
    scaler: torch.amp.GradScaler | None
    criterion: nn.Module
    evaluator: nn.Module
    epoch: int = 0
    num_updates: int = 0
    saved_epoch: int = 0
    rows: list[dict[str, float]] = field(default_factory=list)
    machines: dict[str, int] = field(default_factory=dict)  # epochs trained per machine and precision
    codes: dict[str, int] = field(default_factory=dict)  # epochs trained per code version (records.code_label)

    @property
    def export(self) -> nn.Module:
        """The weights a run publishes and evaluates: the EMA with ``--model-ema``, else the model."""
        return self.ema.module if self.ema is not None else self.model


@dataclass(eq=False)  # runs compare by identity
class Run:
    """One run opened for training: its (resume-merged) arguments, folder, data, trainer and batches."""

    args: argparse.Namespace
    out: Path
    data: RunData
    t: Trainer
    batches: Batches
    eval_images: torch.Tensor  # on the training device
    eval_labels: torch.Tensor
    saved_epochs: int | None  # a resumed run's saved epoch count; None for a fresh run


def _open(args: argparse.Namespace, parser: argparse.ArgumentParser, d: Dist, loaded: dict[tuple, tuple]) -> Run | None:
    """Check the flags, load the data, build the trainer and restore a resumed run, writing nothing (:func:`_begin`
    writes); None when the run in ``--output`` is finished and ``--epochs`` asks for no more."""
    out = Path(args.output)
    state = _prepare_output(out, args)
    saved_epochs = _saved_args(out)["epochs"] if state != "fresh" else args.epochs
    if state != "fresh":
        args = _merge_saved_args(args, out, parser)
    if state == "finished":
        if not _trains_further(out, args.epochs, saved_epochs, d):
            return None
        state = "resume"
    if not args.dataset:
        raise UserError("no data set: pass --dataset (e.g. cifar10, cifar10-sample or a local folder)")
    if args.workers:
        torch.set_num_threads(args.workers)
    if (args.mixup > 0 or args.cutmix > 0) and args.batch_size % 2:
        raise UserError(f"mixup/cutmix need an even --batch-size, got {args.batch_size}")

    data = _prepare_data(args, d, loaded)
    if state == "resume":
        _check_same_data(out, args, data)
    t = _build(args, data, d)
    if state == "resume":
        _restore(t, out / RESUME_FILE)
    return Run(args, out, data, t, _batches(args, data, d, loaded), data.eval.images.to(d.device),
               data.eval.labels.to(d.device), saved_epochs if state == "resume" else None)


def _begin(run: Run, d: Dist) -> None:
    """What opening a run writes, once every run of the command is checked: a fresh run's record (an overwritten
    run's files removed first), a longer schedule, or the files of a last epoch whose writes a kill interrupted."""
    t, args = run.t, run.args
    if run.saved_epochs is None:
        if d.main:
            for name in RUN_FILES if args.overwrite else ():
                (run.out / name).unlink(missing_ok=True)
            _write_record(run.out, args, run.data, d)
        return
    if args.epochs > run.saved_epochs and d.main:
        _record_extension(run.out, t.epoch, args.epochs, run.data.warmup)
    if t.epoch == args.epochs:  # killed among the last epoch's writes: the resume state's come again
        _save(run.out, t, args, run.data, d)


def _train(args: argparse.Namespace, parser: argparse.ArgumentParser, d: Dist, loaded: dict[tuple, tuple]) -> Path:
    run = _open(args, parser, d, loaded)
    if run is None:
        return Path(args.output)
    _begin(run, d)
    machine = _machine(d, run.data, run.args)
    for epoch in range(run.t.epoch, run.args.epochs):
        t0 = time.perf_counter()
        train_loss, lr = _train_epoch(run, d, epoch)
        _end_epoch(run, d, train_loss, lr, time.perf_counter() - t0, machine)
    if d.main:
        _write_summary(run.out, run.args, run.data, run.t)
    return run.out


def _end_epoch(run: Run, d: Dist, train_loss: float, lr: float, train_seconds: float, machine: str) -> None:
    """Evaluate, log the epoch's row, and save on save epochs."""
    t, args, data = run.t, run.args, run.data
    t0 = time.perf_counter()
    metrics = evaluate(t.evaluator, run.eval_images, run.eval_labels, data.mean, data.std, d, data.amp_dtype)
    t.rows.append({"epoch": t.epoch + 1, "train_loss": train_loss, **metrics, "lr": lr,
                   "img_per_s": data.steps * args.batch_size * d.world / train_seconds,
                   "seconds": train_seconds + time.perf_counter() - t0})
    t.epoch += 1
    t.machines[machine] = t.machines.get(machine, 0) + 1
    t.codes[code_label()] = t.codes.get(code_label(), 0) + 1
    if t.epoch % args.save_every == 0 or t.epoch == args.epochs:
        _save(run.out, t, args, data, d)
    if d.main:
        _report_epoch(t.rows[-1], args.epochs)


def _prepare_data(args: argparse.Namespace, d: Dist, loaded: dict[tuple, tuple]) -> RunData:
    """Load the splits, check they fit the run's flags, and derive the sizes and settings they imply."""
    train_set, eval_set, mean, std = _load_data(args, loaded)
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
    return RunData(train_set, eval_set, mean, std, num_classes, steps, hflip, min(args.warmup_epochs, args.epochs),
                   resolve_amp(args.amp, d.device))


def _create_model(args: argparse.Namespace, data: RunData, device: torch.device) -> nn.Module:
    """The timm model named by ``--model`` (seeded), with FastDropout, checked against the image size.

    On CPU its attention runs timm's explicit path: the fused (flash) kernel's backward is the slowest op of a
    training step there (``scripts/bench_train.py``). So it does on a GPU when attention dropout is on (the
    masks then come from the model's own dropout module, as they have for every run trained so far); without
    attention dropout, fused attention stays on GPUs.
    """
    seed_everything(args.seed)
    kwargs = dict(args.model_kwargs)
    if args.drop_path is not None:
        kwargs["drop_path_rate"] = args.drop_path
    weights_fix = "pass weights of this model"
    if args.pretrained_file:
        kwargs.update(pretrained=True, pretrained_cfg_overlay=pretrained_overlay(args.pretrained_file))
        weights_fix = _weights_fix(args)
    elif args.model.startswith(("hf-hub:", "local-dir:")):
        print(f"{args.model}: its architecture with fresh random weights, as timm builds it without pretrained=True; "
              "to start from its weights pass --pretrained-file with its folder", file=sys.stderr)
    model = create_model(args.model, weights_fix=weights_fix, num_classes=data.num_classes, **kwargs)
    check_input_size(model, data.train.images, fix=_size_fix(args, model, data.train.images.shape[-1]))
    if args.pool is not None:
        set_pooling(model, args.pool, **args.pool_kwargs)
    use_fast_dropout(model)
    attention_dropout = any(getattr(getattr(m, "attn_drop", None), "p", 0.0) > 0 for m in model.modules())
    if device.type == "cpu" or attention_dropout:
        set_fused_attention(model, False)
    return model


def _weights_fix(args: argparse.Namespace) -> str:
    """How to fine-tune ``--pretrained-file`` weights that do not fit ``--model``: the model their run trained."""
    trained = pretrained_config(args.pretrained_file, args.model)
    arch, saved = trained.get("architecture"), trained["model_args"]
    def value(v: object) -> object:  # img_size [32, 32] as --model-kwargs takes it
        return (v[0] if len(set(v)) == 1 else ",".join(map(str, v))) if isinstance(v, list) else v

    shown = " ".join(f"{k}={value(v)}" for k, v in saved.items()
                     if k not in ("num_classes", "global_pool", "pool", "stock_architecture", *OPTION_ARGS))
    if arch and arch != args.model:
        return f"they were trained as {arch}: pass --model {arch}" + (f" --model-kwargs {shown}" if shown else "")
    return f"pass the --model and --model-kwargs they were trained with, or weights of {args.model}"


def _size_fix(args: argparse.Namespace, model: nn.Module, size: int) -> str:
    """The --model-kwargs that build ``model`` for ``size``, with the pretrained weights' own patch size where it
    differs (else timm would resample their patch embedding to another grid)."""
    fix = f"pass --model-kwargs img_size={size}"
    if not args.pretrained_file:
        return fix
    patch = pretrained_config(args.pretrained_file, args.model)["model_args"].get("patch_size")
    own = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    if patch is None or own is None or to_2tuple(patch) == tuple(own):
        return fix
    shown = patch[0] if isinstance(patch, list | tuple) and len(set(patch)) == 1 else patch
    return f"{fix} patch_size={shown} (the pretrained weights' patch size)"


def _build(args: argparse.Namespace, data: RunData, d: Dist) -> Trainer:
    """Model, optimizer, per-update schedule, EMA, grad scaler (fp16 only), loss, DDP and ``--compile``."""
    model = _create_model(args, data, d.device).to(d.device)
    optimizer = create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay,
                                    momentum=args.momentum)  # timm's grouping: no decay on norms, biases, pos, CLS
    scheduler, _ = create_scheduler_v2(optimizer, sched=args.sched, num_epochs=args.epochs, min_lr=args.min_lr,
                                       warmup_lr=args.warmup_lr, warmup_epochs=data.warmup, step_on_epochs=False,
                                       updates_per_epoch=data.steps)
    ema = ModelEmaV3(model, decay=args.model_ema_decay) if args.model_ema else None
    scaler = torch.amp.GradScaler(d.device.type) if data.amp_dtype == torch.float16 else None
    net = nn.parallel.DistributedDataParallel(model) if d.world > 1 else model
    evaluator = ema.module if ema is not None else model
    if args.compile:
        net, evaluator = (torch.compile(m, mode=args.compile_mode) for m in (net, evaluator))
    return Trainer(model, net, optimizer, scheduler, ema, scaler, _criterion(args), evaluator)


def _batches(args: argparse.Namespace, data: RunData, d: Dist, loaded: dict[tuple, tuple]) -> Batches:
    """Training batches from the uint8 train images moved once to the device (once for the runs of one command
    that share them: ``loaded`` keeps the copy): crop, flip, mixup/CutMix."""
    mixup = (Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                   num_classes=data.num_classes) if args.mixup > 0 or args.cutmix > 0 else None)
    key = ("on device", id(data.train), str(d.device))
    if key not in loaded:
        loaded[key] = (data.train, data.train.images.to(d.device), data.train.labels.to(d.device))
    _, images, labels = loaded[key]
    return Batches(images, labels, data.mean, data.std, args.crop_padding, data.hflip, mixup)


def _restore(t: Trainer, path: Path) -> None:
    """Continue from the last saved epoch: states, update count (the schedule follows it) and log rows."""
    meta = load_resume(path, model=t.model, optimizer=t.optimizer, ema=t.ema.module if t.ema else None,
                       scaler=t.scaler)
    t.epoch = t.saved_epoch = meta["epoch"]
    t.num_updates, t.rows = meta["num_updates"], meta["rows"]
    t.machines = meta.get("machines", {})  # resume states written before machines were recorded lack them
    t.codes = meta.get("codes", {})  # and before code versions were
    if t.scheduler is not None:
        t.scheduler.step_update(t.num_updates)


def _trains_further(out: Path, epochs: int, saved_epochs: int, d: Dist) -> bool:
    """``--resume`` on a finished run: True when ``epochs`` asks for more and the run kept the state to continue
    exactly (model, optimizer, EMA, grad scaler); False, saying so, when it already holds that many epochs."""
    if epochs == saved_epochs:
        if d.main:
            print(f"{out} holds a finished run of {saved_epochs} epochs; pass a larger --epochs to train it further")
        return False
    if not (out / RESUME_FILE).exists():
        raise UserError(f"{out} holds a finished run of {saved_epochs} epochs without its {RESUME_FILE} (scripts/"
                        f"study.py removes it), so it cannot continue exactly; train --epochs {epochs} into a new "
                        "--output instead")
    return True


def _record_extension(out: Path, at_epoch: int, epochs: int, warmup: float) -> None:
    """A run resumed with a larger ``--epochs``: ``train_args.json`` takes the new count and warmup, keeping the
    old ones under ``extended`` (the learning rates of epochs 1..at_epoch followed that schedule), and a finished
    run becomes unfinished until it reaches the new count (its ``summary.json`` goes)."""
    record = _saved_args(out)
    record["extended"] = [*record.get("extended", []), {"at_epoch": at_epoch, "epochs": record["epochs"],
                                                        "warmup_epochs_used": record["warmup_epochs_used"]}]
    write_json(out / ARGS_FILE, {**record, "epochs": epochs, "warmup_epochs_used": warmup})
    (out / SUMMARY_FILE).unlink(missing_ok=True)


def _write_record(out: Path, args: argparse.Namespace, data: RunData, d: Dist) -> None:
    """``train_args.json``: every argument and everything resolved from it, written once per run."""
    amp = precision_name(data.amp_dtype)
    write_json(out / ARGS_FILE, {
        **vars(args), "dataset_resolved": portable_path(data.train.dataset, out), "train_split": data.train.split,
        "eval_split": data.eval.split, "fingerprints": {"train": data.train.fingerprint,
                                                        "eval": data.eval.fingerprint},
        "content": {"train": data.train.content, "eval": data.eval.content},
        "fp32_precision": fp32_precision(d.device),
        "class_names": data.train.class_names, "num_classes": data.num_classes, "mean": list(data.mean),
        "std": list(data.std), "train_images": len(data.train), "eval_images": len(data.eval),
        "warmup_epochs_used": data.warmup, "hflip_used": data.hflip, "steps_per_epoch": data.steps,
        "world_size": d.world, "device": str(d.device), "amp_dtype": amp, "versions": versions(),
        "code": code_version()})


def _epoch_order(args: argparse.Namespace, data: RunData, d: Dist, epoch: int) -> tuple[torch.Tensor, torch.Generator]:
    """This rank's image order for the epoch and the generator of its augmentation, both from the run's seed."""
    order = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(_seed(args.seed, epoch)))
    order = order[d.rank::d.world][: data.steps * args.batch_size].to(d.device)
    return order, torch.Generator().manual_seed(_seed(args.seed, epoch, d.rank, 1))


def _train_epoch(run: Run, d: Dist, epoch: int) -> tuple[float, float]:
    """One epoch of updates; returns the mean training loss (over ranks and steps) and the last learning rate.

    Per-step losses stay on the device and are fetched once at the end (no host sync per step).
    """
    t, args, data = run.t, run.args, run.data
    seed_everything(_seed(args.seed, epoch, d.rank))
    order, aug_gen = _epoch_order(args, data, d, epoch)
    losses = torch.zeros(data.steps, device=d.device)
    t.net.train()
    lr = t.optimizer.param_groups[0]["lr"]
    bar = progress(range(data.steps), desc=f"epoch {epoch + 1}/{args.epochs}", disable=not d.main or args.no_progress,
                   leave=False, file=sys.stderr)
    for step in bar:
        x, y = run.batches(order[step * args.batch_size:(step + 1) * args.batch_size], aug_gen)
        lr = t.optimizer.param_groups[0]["lr"]
        losses[step] = optimizer_step(t.net, x, y, t.criterion, t.optimizer, device=d.device,
                                      amp_dtype=data.amp_dtype, scaler=t.scaler, clip_grad=args.clip_grad)
        t.num_updates += 1
        if t.scheduler is not None:
            t.scheduler.step_update(t.num_updates)
        if t.ema is not None:
            t.ema.update(t.model, step=t.num_updates)
        if not bar.disable and (step + 1) % BAR_EVERY == 0:  # one local sync per BAR_EVERY steps, rank 0 only
            bar.set_postfix(loss=f"{losses[step + 1 - BAR_EVERY:step + 1].mean().item():.3f}", refresh=False)
    return _epoch_loss(losses, run, d, epoch), lr


def _epoch_loss(losses: torch.Tensor, run: Run, d: Dist, epoch: int) -> float:
    """The epoch's mean training loss over ranks and steps; a non-finite step loss stops the run, naming its
    step, before anything of this epoch is saved."""
    values = [v / d.world for v in _reduce(losses, d).tolist()]
    bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
    if bad is not None:
        kept = f"the last good checkpoint (epoch {run.t.saved_epoch}) is kept in {run.out}" if run.t.saved_epoch \
            else f"no checkpoint was written in {run.out}"
        fixes = ["lower --lr", *(["add --clip-grad 1.0"] if run.args.clip_grad is None else []),
                 *(["use --amp none"] if run.data.amp_dtype not in (None, torch.float32) else []),
                 *([f"raise --std (now {_shown(run.data.std)})"] if min(run.data.std) < 0.01 else [])]
        fix = " or ".join([", ".join(fixes[:-1]), fixes[-1]] if len(fixes) > 1 else fixes)
        raise NonFiniteLossError(f"the training loss is {values[bad]} at epoch {epoch + 1} step {bad + 1}; "
                                 f"{kept}; {fix} in a new --output")
    return sum(values) / len(values)


def _save(out: Path, t: Trainer, args: argparse.Namespace, data: RunData, d: Dist) -> None:
    """Rank 0 writes the resume state, the model export, ``log.csv`` and ``curves.png``, all for one epoch."""
    if d.main:
        save_resume(out / RESUME_FILE, model=t.model, optimizer=t.optimizer, ema=t.ema.module if t.ema else None,
                    scaler=t.scaler,
                    meta={"epoch": t.epoch, "num_updates": t.num_updates, "rows": t.rows, "machines": t.machines,
                          "codes": t.codes})
        save_model(out, t.export, data.train.class_names, data.mean, data.std, data.train.images.shape[1:])
        write_log(out / LOG_FILE, t.rows)
        plot_curves(out / CURVES_FILE, t.rows, f"{args.model} on {Path(args.dataset).name}")
    t.saved_epoch = t.epoch
    if d.world > 1:
        dist.barrier()


def _report_epoch(r: dict[str, float], epochs: int) -> None:
    tqdm.write(f"epoch {r['epoch']}/{epochs}: train loss {r['train_loss']:.4f}, eval loss {r['eval_loss']:.4f}, "
               f"top-1 {r['eval_top1']:.2f}%, top-5 {r['eval_top5']:.2f}%, {r['img_per_s']:.0f} img/s",
               file=sys.stderr)


def _machine(d: Dist, data: RunData, args: argparse.Namespace) -> str:
    """What trains this session's epochs, for ``summary.json``: a resumed run may continue on another machine,
    precision or compilation."""
    compiled = f", torch.compile mode {args.compile_mode}" if args.compile else ""
    processes = f", {d.world} processes" if d.world > 1 else ""
    return f"{device_name(d.device)}, {precision_name(data.amp_dtype)}{compiled}{processes}"


def _write_summary(out: Path, args: argparse.Namespace, data: RunData, t: Trainer) -> None:
    rows, last = t.rows, t.rows[-1]
    summary = {"epochs": args.epochs, **{k: last[k] for k in ("train_loss", "eval_loss", "eval_top1", "eval_top5")},
               "best_eval_top1": max(r["eval_top1"] for r in rows), "wall_seconds": sum(r["seconds"] for r in rows),
               "machines": t.machines, "code": t.codes, "train_images": len(data.train), "eval_images": len(data.eval)}
    write_json(out / SUMMARY_FILE, summary)
    print(f"{args.model} on {args.dataset}: eval top-1 {last['eval_top1']:.2f}%, top-5 {last['eval_top5']:.2f}% "
          f"after {args.epochs} epochs ({summary['wall_seconds']:.0f} s; evaluated in "
          f"{precision_name(data.amp_dtype)}, batches of {EVAL_BATCH}) -> {out}")


def main(argv: list[str] | None = None) -> None:
    """CLI entry point."""
    train(argv)


if __name__ == "__main__":
    run_cli(main)
