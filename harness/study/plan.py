"""What a study trains and evaluates: its arms (pooling and options), the post-hoc readouts and the comparisons,
and each arm's ``timm_rollout.train`` command, with the checks of ``--train-args`` against it."""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from timm_rollout.errors import UserError
from timm_rollout.train import build_parser as train_parser

# Trained arms: the pooling (any timm pooling, or rollout) and its rollout options. On the tiny CIFAR ViT (no
# --model) an arm is the registered model of its pooling with the options as model arguments (the committed
# studies' commands); on any other timm ViT (--model) it is `--pool` / `--pool-kwargs` of timm_rollout.train, and
# `map` builds the model with timm's learned attention pooling.
ARMS = {
    "cls": ("token", {}),
    "gap": ("avg", {}),
    "rollout": ("rollout", {}),
    "rollout-grad": ("rollout", {"grad": True}),
    "map": ("map", {}),  # timm's learned attention pooling (one latent query)
    # Sharpened rollout: max over heads, the weakest 90% of patch-to-patch attention discarded: of the rollout
    # variants, the least uniform weights on trained rollout and cls backbones (effective patches).
    "rollout-max-discard0.9": ("rollout", {"head_fusion": "max", "discard_ratio": 0.9}),
}
TINY = {"token": "vit_tiny_cifar_cls", "avg": "vit_tiny_cifar_gap", "rollout": "vit_tiny_cifar_rollout",
        "map": "vit_tiny_cifar_cls"}  # the tiny CIFAR ViT of each pooling


def arm_model(base: str | None, arm: str) -> tuple[str, list[str], list[str]]:
    """(timm model, --model-kwargs items, other train flags) of ``arm`` on ``base`` (None: the tiny CIFAR ViT)."""
    pool, options = ARMS[arm]
    if base is None:
        kwargs = ["global_pool=map"] if pool == "map" else [f"rollout_{k}={v}" for k, v in options.items()]
        return TINY[pool], kwargs, []
    if pool == "map":
        return base, ["global_pool=map"], []
    flags = ["--pool", pool]
    return base, [], flags + (["--pool-kwargs", *[f"{k}={v}" for k, v in options.items()]] if options else [])


# The arms a study trains unless --arms names others (the README quickstart runs these on the sample).
DEFAULT_ARMS = ("cls", "gap", "rollout", "rollout-grad")
# Post-hoc readouts of the cls backbones (no training): arm -> harness.eval --pool.
POSTHOC = {"cls-posthoc-rollout": "rollout", "cls-posthoc-avg": "avg"}
# Every other arm is compared with each of these that the study has: [CLS], plain averaging, and the detached
# rollout (so rollout-grad's own question, "do gradients through the weights change anything?", has its table).
REFERENCES = ("cls", "gap", "rollout")


def backbone(arm: str) -> str:
    """The trained arm whose run ``arm`` reads: itself, or ``cls`` for a post-hoc readout."""
    return arm if arm in ARMS else "cls"


def primary_arg(value: str) -> tuple[str, str]:
    """``BASE:ARM`` of two study arms, for ``--primary``."""
    base, _, arm = value.partition(":")
    unknown = [a for a in (base, arm) if a not in ARMS and a not in POSTHOC]
    if not arm or unknown or base == arm:
        raise UserError(f"expected BASE:ARM of two arms ({', '.join([*ARMS, *POSTHOC])}), e.g. gap:rollout")
    return base, arm


# Trainer flags (argparse destinations of timm_rollout.train) that the study's own train command sets for every
# run (train_command), with the study flag that sets them: --train-args may not contradict them.
STUDY_SETS = {
    "model": "use the study's --model", "dataset": "use the study's --dataset",
    "epochs": "use the study's --epochs", "seed": "use the study's --seeds", "output": "use the study's --output",
    "device": "use the study's --device", "max_train_samples": "use the study's --max-train-samples",
    "pool": "choose the pooling with --arms",
    "pool_kwargs": "choose the pooling with --arms",
    "resume": "drop it: re-running the study command resumes interrupted runs",
    "overwrite": "drop it: the study never overwrites a run; use a new --output to start again",
}
# --model-kwargs keys that define an arm's pooling (arm_model): set by --arms, never by --train-args.
ARM_KWARGS = ("global_pool", "rollout_")


def train_flags(tokens: list[str]) -> tuple[frozenset[str], dict[str, Any]]:
    """The trainer flags ``tokens`` set (destinations, abbreviations and ``--flag=value`` resolved as the trainer
    resolves them) and their ``--model-kwargs``; values are checked later, with the whole command."""
    probe = train_parser()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # -h would print the trainer's help and exit mid-check
            parsed, extras = probe.parse_typed(tokens)
    except UserError as e:
        raise UserError(f"--train-args: {e}") from None
    except SystemExit:
        raise UserError("--train-args asks for the trainer's help; read it with python -m timm_rollout.train "
                        "--help") from None
    if extras:
        raise UserError(f"--train-args: unrecognized training flags {' '.join(extras)}; see python -m "
                        "timm_rollout.train --help")
    return probe.given, dict(parsed.model_kwargs)


def check_train_args(args: argparse.Namespace) -> None:
    """Parse-time checks of ``--train-args``: it must split as a shell would, set none of the flags the study sets
    for every run (:data:`STUDY_SETS`, the arms' pooling keys of ``--model-kwargs``), and give every arm's training
    command values the trainer accepts."""
    try:
        tokens = shlex.split(args.train_args)
    except ValueError as e:
        raise UserError(f"--train-args {args.train_args!r} does not split as shell words ({e}); balance its "
                        "quotes") from None
    given, model_kwargs = train_flags(tokens)
    for dest, fix in STUDY_SETS.items():
        if dest in given:
            raise UserError(f"--train-args sets --{dest.replace('_', '-')}, which the study sets itself; {fix}")
    for key in model_kwargs:
        if key.startswith(ARM_KWARGS):
            raise UserError(f"--train-args sets --model-kwargs {key}, which defines an arm's pooling; choose the "
                            "pooling with --arms")
    short = [t.split("=", 1)[0] for t in tokens if t.startswith("--model-k") and t.split("=", 1)[0] != "--model-kwargs"]
    if short:  # merge_model_kwargs would miss it, and the arm's own list would replace it
        raise UserError(f"--train-args: write {short[0]} out as --model-kwargs; the study merges it with each arm's "
                        "own")
    for arm in args.arms:
        output = str(Path(args.output) / "runs" / f"{arm}-s{args.seeds[0]}")
        try:
            train_parser().parse_args(train_command(args, arm, args.seeds[0], output))
        except UserError as e:
            raise UserError(f"arm {arm} would not train: {e} (check --train-args)") from None


def train_command(args: argparse.Namespace, arm: str, seed: int, output: str) -> list[str]:
    """The ``timm_rollout.train`` flags that train (or resume) ``arm``'s run of ``seed`` into ``output``."""
    model, kwargs, flags = arm_model(args.model, arm)
    cmd = ["--model", model, "--dataset", args.dataset, "--epochs", str(args.epochs), "--seed", str(seed),
           "--output", output, "--resume", "--device", args.device,
           *merge_model_kwargs(shlex.split(args.train_args), kwargs), *flags]
    if args.max_train_samples is not None:
        cmd += ["--max-train-samples", str(args.max_train_samples)]
    return cmd


def merge_model_kwargs(argv: Sequence[str], extra: Sequence[str]) -> list[str]:
    """``argv`` with its ``--model-kwargs`` lists and ``extra`` merged into one trailing ``--model-kwargs``: timm's
    ``ParseKwargs`` keeps only the last occurrence. A key of ``extra`` overrides the same key of ``argv``."""
    rest: list[str] = []
    pairs: list[str] = []
    collecting = False
    for token in argv:
        if token == "--model-kwargs":
            collecting = True
        elif token.startswith("--model-kwargs="):
            pairs.append(token.split("=", 1)[1])
            collecting = False
        elif collecting and not token.startswith("-"):
            pairs.append(token)
        else:
            collecting = False
            rest.append(token)
    merged = {pair.split("=", 1)[0]: pair for pair in [*pairs, *extra]}
    return [*rest, "--model-kwargs", *merged.values()] if merged else rest
