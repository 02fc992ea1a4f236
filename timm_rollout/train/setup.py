"""What a run is built from: its data, model, optimizer, schedule, EMA, grad scaler and training loader.

Nothing here writes to the run folder (:mod:`.resume` and :mod:`.output` do) or trains (:mod:`.loop` does).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from timm.data import Mixup
from timm.layers import to_2tuple
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3
from torch import nn

from ..capture import set_fused_attention
from ..cli import kwarg
from ..data import (
    ImageSet,
    balanced_indices,
    check_class_names,
    load_image_set,
    normalization_stats,
    resolve_dataset,
    split_names,
)
from ..device import resolve_amp
from ..dropout import use_fast_dropout
from ..errors import UserError
from ..loading import check_input_size, create_model, pretrained_config, pretrained_overlay
from ..pooling import POOLED_ARGS, set_pooling
from .distributed import Dist
from .step import Loader, seed_everything

DEFAULT_EVAL_SPLITS = ("test", "validation")  # evaluated without --eval-split, the first the data set has


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
    board: Any = None  # --report-to tensorboard: the run's log.TensorBoardLog, opened at its first save

    @property
    def export(self) -> nn.Module:
        """The weights a run publishes and evaluates: the EMA with ``--model-ema``, else the model."""
        return self.ema.module if self.ema is not None else self.model


def _default_eval_split(dataset: str) -> str:
    """``test``, else ``validation``: the split evaluated without ``--eval-split``; neither is a :class:`UserError`."""
    splits = split_names(dataset)
    found = next((s for s in DEFAULT_EVAL_SPLITS if s in splits), None)
    if found is None:
        raise UserError(f"data set {dataset!r} has no split {' or '.join(map(repr, DEFAULT_EVAL_SPLITS))} to evaluate "
                        f"on; its splits are {', '.join(splits)}: name the one to evaluate on with --eval-split")
    return found


def _load_data(args: argparse.Namespace) -> tuple[ImageSet, ImageSet, tuple, tuple]:
    """The run's splits and normalisation."""
    cols = {"image_column": args.image_column, "label_column": args.label_column}
    train_set = load_image_set(args.dataset, args.train_split, **cols, split_flag="--train-split")
    eval_split = args.eval_split or _default_eval_split(args.dataset)
    eval_set = load_image_set(args.dataset, eval_split, **cols, split_flag="--eval-split")
    mean, std = normalization_stats(args.dataset, train_set)
    if args.pretrained_file:  # fine-tuning: the inputs the pretrained weights expect (their run's, else the model's)
        trained = pretrained_config(args.pretrained_file, args.model)
        mean, std = trained.get("mean", mean), trained.get("std", std)
    mean, std = tuple(args.mean or mean), tuple(args.std or std)  # typed statistics win over both
    if args.max_train_samples:
        train_set = train_set.subset(balanced_indices(train_set.labels, total=args.max_train_samples, seed=args.seed))
    if args.max_eval_samples:
        eval_set = eval_set.subset(balanced_indices(eval_set.labels, total=args.max_eval_samples, seed=args.seed))
    return train_set, eval_set, mean, std


def prepare_data(args: argparse.Namespace, d: Dist) -> RunData:
    """Load the splits, check they fit the run's flags, and derive the sizes and settings they imply."""
    train_set, eval_set, mean, std = _load_data(args)
    num_classes = args.num_classes or train_set.num_classes
    if len(present := train_set.labels.unique().tolist()) < 2:
        raise UserError(f"the train split {train_set.split!r} holds images of one class only "
                        f"({train_set.class_names[present[0]]!r}); a classifier needs 2 or more: add another class")
    if int(train_set.labels.max()) >= num_classes:
        raise UserError(f"labels go up to {int(train_set.labels.max())} but --num-classes is {num_classes}; "
                        "raise --num-classes or drop it")
    _check_eval_classes(train_set, eval_set, num_classes)
    steps = len(train_set) // (args.batch_size * d.world)
    if steps == 0:
        raise UserError(f"{len(train_set)} training images do not fill one batch of {args.batch_size} per process; "
                        "lower --batch-size")
    digits = resolve_dataset(args.dataset).stats_key == "svhn"
    hflip = args.hflip if args.hflip is not None else (0.0 if digits else 0.5)
    return RunData(train_set, eval_set, mean, std, num_classes, steps, hflip, min(args.warmup_epochs, args.epochs),
                   resolve_amp(args.amp, d.device))


def _check_eval_classes(train_set: ImageSet, eval_set: ImageSet, num_classes: int) -> None:
    """Refuse, before training, an eval split whose classes are not the train split's: other class names or the same
    in another order (scored against the wrong classes), or labels beyond the model's classes (a crash at the first
    evaluation)."""
    what, whose = f"the eval split {eval_set.split!r}", f"the train split {train_set.split!r}"
    check_class_names(eval_set.class_names, train_set.class_names, what, whose,
                      "give both splits one ClassLabel, in one class order (datasets' align_labels_with_mapping)")
    top = int(eval_set.labels.max())
    if top >= num_classes:
        raise UserError(f"{what} has labels up to {top} but the model has {num_classes} classes (0-{num_classes - 1}); "
                        "evaluate on a split of the training classes with --eval-split, or raise --num-classes")


def build_model(args: argparse.Namespace, data: RunData, device: torch.device) -> nn.Module:
    """The timm model named by ``--model`` (seeded), with FastDropout, checked against the image size. Attention
    runs timm's explicit path on CPU (the fused kernel's backward is slower there) and wherever attention dropout
    is on (its masks then come from the model's dropout module)."""
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
    if args.pretrained_file:
        _say_resampled(kwargs["pretrained_cfg_overlay"]["state_dict"], model)
    check_input_size(model, data.train.images, fix=_size_fix(args, model, tuple(data.train.images.shape[-2:])))
    if args.pool is not None:
        set_pooling(model, args.pool, **args.pool_kwargs)
    use_fast_dropout(model)
    attention_dropout = any(getattr(getattr(m, "attn_drop", None), "p", 0.0) > 0 for m in model.modules())
    if device.type == "cpu" or attention_dropout:
        set_fused_attention(model, False)
    return model


def _say_resampled(state: dict[str, torch.Tensor], model: nn.Module) -> None:
    """One line for each pretrained tensor timm resampled to fit ``model`` (position and patch embedding), so a
    fine-tune at another image or patch size does not start from changed weights in silence."""
    own = model.state_dict()
    for name, what in (("pos_embed", "position embedding"), ("patch_embed.proj.weight", "patch embedding")):
        if name in state and name in own and state[name].shape != own[name].shape:
            print(f"note: --pretrained-file's {what} resampled by timm from {tuple(state[name].shape)} to "
                  f"{tuple(own[name].shape)} to fit --model-kwargs", file=sys.stderr)


def _weights_fix(args: argparse.Namespace) -> str:
    """How to fine-tune ``--pretrained-file`` weights that do not fit ``--model``: the model their run trained."""
    trained = pretrained_config(args.pretrained_file, args.model)
    arch, saved = trained.get("architecture"), trained["model_args"]
    shown = " ".join(kwarg(k, v) for k, v in saved.items() if k not in ("num_classes", "global_pool", *POOLED_ARGS))
    if arch and arch != args.model:
        return f"they were trained as {arch}: pass --model {arch}" + (f" --model-kwargs {shown}" if shown else "")
    return f"pass the --model and --model-kwargs they were trained with, or weights of {args.model}"


def _size_fix(args: argparse.Namespace, model: nn.Module, size: tuple[int, int]) -> str:
    """The --model-kwargs that build ``model`` for images of ``size`` (H, W), with the pretrained weights' own patch
    size where it differs (else timm would resample their patch embedding to another grid)."""
    fix = f"pass --model-kwargs {kwarg('img_size', size)}"
    if not args.pretrained_file:
        return fix
    patch = pretrained_config(args.pretrained_file, args.model)["model_args"].get("patch_size")
    own = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    if patch is None or own is None or to_2tuple(patch) == tuple(own):
        return fix
    return f"{fix} {kwarg('patch_size', patch)} (the pretrained weights' patch size)"


def _criterion(args: argparse.Namespace) -> nn.Module:
    if args.mixup > 0 or args.cutmix > 0:
        return SoftTargetCrossEntropy()
    if args.smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    return nn.CrossEntropyLoss()


def build_trainer(args: argparse.Namespace, data: RunData, d: Dist) -> Trainer:
    """Model, optimizer, per-update schedule, EMA, grad scaler (fp16 only), loss, DDP and ``--compile``."""
    model = build_model(args, data, d.device).to(d.device)
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


def build_loader(args: argparse.Namespace, data: RunData, d: Dist) -> Loader:
    """This rank's training loader (crop, flip, mixup/CutMix) over the train images moved once to the device."""
    mixup = (Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                   num_classes=data.num_classes) if args.mixup > 0 or args.cutmix > 0 else None)
    return Loader(data.train.images.to(d.device), data.train.labels.to(d.device), data.mean, data.std, args.batch_size,
                  data.steps, args.seed, args.crop_padding, data.hflip, mixup, d.rank, d.world)
