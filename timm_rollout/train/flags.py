"""The command line of ``python -m timm_rollout.train``: its flags, their checks and the removed flags.

Names follow timm's ``train.py`` where it has them. Bad values, unknown models and flag combinations that
cannot work are one-line errors at parse time, before any data or model is loaded (:class:`CliParser`).
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util

from ..cli import (
    CliParser,
    ParseKwargs,
    PerChannel,
    as_type,
    check_needs,
    existing_path,
    fraction,
    key_value,
    non_negative,
    non_negative_int,
    number,
    output_dir,
    positive,
    positive_int,
    seed_arg,
)
from ..data import dataset_arg
from ..device import AMP_CHOICES, device_arg
from ..errors import UserError
from ..pooling import POOLS, ROLLOUT, attention_free, set_pooling

DESCRIPTION = "Train any timm model (the tiny CIFAR ViTs by default) on a Hugging Face image data set."
# torch.compile's modes: reduce-overhead replays the compiled passes as CUDA graphs (GPUs; plain compilation on CPU).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Removed flags, each refused in one line that names what to use instead (CliParser's ``removed``).
REMOVED = {"--stack": "train many runs as separate processes with scripts/study.py --jobs N",
           "--capture": "for CUDA graphs use --compile --compile-mode reduce-overhead",
           "--dropout-draws": "drop it: dropout and drop-path masks come from torch's generators, seeded per epoch"}
_AUGMENT = "drop {flag}: augmentation here is a padded random crop (--crop-padding), --hflip, --mixup and --cutmix"
TIMM_FLAGS = {  # timm train.py's common flags this command lacks -> its own way (CliParser foreign)
    "--data-dir": "name the data set (a local folder, a Hub id or an alias) with --dataset",
    "--gp": "pool with --pool (token, avg, rollout, ...)", "--drop": "set dropout with --model-kwargs drop_rate=0.1",
    "--pretrained": "start from local weights with --pretrained-file (nothing is downloaded)",
    "--initial-checkpoint": "start from weights with --pretrained-file",
    "--img-size": "set the model's input size with --model-kwargs img_size=32",
    "--input-size": "set the model's input size with --model-kwargs img_size=32",
    "--amp-dtype": "pass --amp bf16 or --amp fp16", "--torchcompile": "pass --compile",
    "--model-ema-force-cpu": "drop {flag}: the EMA (--model-ema) stays on the training device",
    **dict.fromkeys(("--aa", "--reprob", "--remode", "--recount", "--color-jitter", "--scale", "--ratio", "--vflip",
                     "--no-aug", "--aug-repeats", "--train-interpolation"), _AUGMENT),
}
# Optimizer schedules that train steps every update (timm's plateau steps on epochs only).
SCHEDULERS = ("cosine", "tanh", "step", "multistep", "poly", "constant", "wsd", "rsqrt", "none")


def build_parser() -> CliParser:
    """The CLI; names follow timm's ``train.py`` where it has them. Bad values are one-line errors at parse time."""
    p = CliParser(prog="python -m timm_rollout.train", description=DESCRIPTION,
                  checks=[_one_seed, _check_report_to, _check_model_args], removed=REMOVED, foreign=TIMM_FLAGS)
    p.checks.append(lambda args: check_needs(args, p.given, NEEDS))
    _data_args(p.add_argument_group("data"))
    _model_args(p.add_argument_group("model"))
    _optimisation_args(p.add_argument_group("optimisation"))
    _run_args(p.add_argument_group("run"))
    return p


def _data_args(g: argparse._ArgumentGroup) -> None:
    """Data set, subsets and augmentation."""
    g.add_argument("--dataset", type=as_type(dataset_arg),
                   help="alias (cifar10, cifar100, svhn, cifar10-sample), Hub id or local folder (required for a new "
                        "run; one resumed or trained further reuses its own)")
    g.add_argument("--train-split", default="train", help="split to train on")
    g.add_argument("--eval-split", "--val-split", default=None, help="default: test, else validation")
    g.add_argument("--image-column", default=None, help="default: img or image")
    g.add_argument("--label-column", default=None, help="default: label or fine_label")
    g.add_argument("--max-train-samples", type=positive_int, default=None,
                   help="class-balanced seeded subset of this many images (default: all)")
    g.add_argument("--max-eval-samples", type=positive_int, default=None,
                   help="class-balanced seeded subset of this many images (default: all)")
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
    g.add_argument("--pool", choices=[p for p in POOLS if p], default=None,
                   help="pool with this instead of the model's own pooling, on any timm ViT (timm_rollout.set_pooling)")
    g.add_argument("--pool-kwargs", nargs="+", default={}, action=ParseKwargs, type=key_value, metavar="KEY=VALUE",
                   help="rollout options with --pool rollout: head_fusion=max discard_ratio=0.9 grad=True")
    g.add_argument("--pretrained-file", type=existing_path, default=None,
                   help="start from these weights (safetensors or a timm checkpoint, never unpickled); the head is "
                        "new when the class count differs, the data are normalised with the model's mean/std")
    g.add_argument("--model-ema", action="store_true", help="keep a timm ModelEmaV3; evaluate and export it")
    g.add_argument("--model-ema-decay", type=number(float, 0, 1, low_open=True, high_open=True), default=0.9998,
                   help="EMA decay per update, in (0, 1)")


def _optimisation_args(g: argparse._ArgumentGroup) -> None:
    """Optimizer and schedule (timm factories)."""
    g.add_argument("--epochs", type=positive_int, default=200, help="passes over the training split")
    g.add_argument("--batch-size", "-b", type=positive_int, default=128, help="per process")
    g.add_argument("--opt", default="adamw", type=as_type(_optimizer_arg), help="any timm optimizer name")
    g.add_argument("--lr", type=positive, default=5e-4, help="peak learning rate, after warmup")
    g.add_argument("--weight-decay", type=non_negative, default=1e-4,
                   help="none on norms, biases, position embedding and [CLS] (timm)")
    g.add_argument("--momentum", type=fraction, default=0.9, help="for SGD-family optimizers")
    g.add_argument("--clip-grad", type=positive, default=None, help="gradient norm clipping, off by default")
    g.add_argument("--sched", default="cosine", choices=SCHEDULERS, help="timm scheduler, stepped every update")
    g.add_argument("--warmup-epochs", type=non_negative, default=5, help="linear warmup, clipped to the run length")
    g.add_argument("--warmup-lr", type=non_negative, default=1e-5, help="learning rate the warmup starts from")
    g.add_argument("--min-lr", type=non_negative, default=5e-6, help="learning rate the schedule ends at")


def _run_args(g: argparse._ArgumentGroup) -> None:
    """Output, seeds, device, precision and resume."""
    g.add_argument("--output", required=True, type=output_dir, help="output folder")
    g.add_argument("--seed", type=seed_arg, nargs="+", default=[0], metavar="SEED",
                   help="seed of the initialisation, data order, augmentation and subsets: one per run (several "
                        "train faster as separate processes: scripts/study.py --seeds 0 1 2 --jobs 2); default 0")
    g.add_argument("--amp", default="auto", choices=AMP_CHOICES, help="auto: bf16 where it pays, else fp32")
    g.add_argument("--device", default="auto", type=device_arg, help="auto, cpu, cuda, cuda:1 ...")
    g.add_argument("--workers", "-j", type=positive_int, default=None,
                   help="CPU threads for torch (default: torch's choice; 1 is far faster on a busy machine)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--report-to", default="none", choices=("none", "tensorboard"),
                   help="also log each epoch's row of log.csv to TensorBoard event files in --output (pip install -e "
                        "'.[tensorboard]'); pass it again when resuming")
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


def _one_seed(args: argparse.Namespace) -> None:
    """One run per command: several seeds are refused in one line naming the faster way (``args.seed`` an int)."""
    if len(args.seed) > 1:
        raise UserError(f"--seed {' '.join(map(str, args.seed))}: one seed per run; train several as separate "
                        "processes side by side, e.g. scripts/study.py --seeds 0 1 2 --jobs 2 (faster in every "
                        "measurement of scripts/README.md)")
    args.seed = args.seed[0]


def _check_report_to(args: argparse.Namespace) -> None:
    """``--report-to tensorboard`` needs the tensorboard package (imported only when training logs to it)."""
    if args.report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise UserError("--report-to tensorboard needs the tensorboard package: pip install -e '.[tensorboard]' "
                        "(or pip install tensorboard), or drop --report-to")


def _check_model_args(args: argparse.Namespace) -> None:
    """The model name and --model-kwargs, checked on the meta device before any data is loaded."""
    import timm
    import torch

    from ..loading import check_model

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
        with torch.device("meta"):
            model = timm.create_model(args.model, **kwargs)
        if attention_free(model):  # no tokens to pool: the fix first
            raise UserError(f"drop --pool, or train a timm ViT (e.g. vit_tiny_cifar_rollout): {attention_free(model)}")
        try:
            set_pooling(model, args.pool, **args.pool_kwargs)
        except ValueError as e:
            shown = f" {as_typed(args.pool_kwargs)}" if args.pool_kwargs else ""
            raise UserError(f"--pool {args.pool}{shown}: {e}") from None


# A flag that only sets how another one works: typed without it, it is refused (the dest it needs, the flag to add).
NEEDS = {"model_ema_decay": ("model_ema", "--model-ema"), "compile_mode": ("compile", "--compile")}


def as_typed(value: object) -> str:
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items()) or "(none)"
    if isinstance(value, (list, tuple)):  # as typed: --mean 0.1 0.2 0.3
        return " ".join(map(str, value))
    return str(value)
