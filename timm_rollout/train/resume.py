"""Opening the run folder (``--output``) for training, in one place: a new run, an unfinished run resumed, a finished
run extended to a larger ``--epochs`` or left as it is, or a refusal (a run it would clobber, other flags or images
than the saved run's, a second process training into it). It decides; nothing trains here (:mod:`.loop`) and it
writes nothing but the run lock: the run's files are :mod:`.output`'s."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import load_resume
from ..cli import CliParser
from ..errors import UserError
from ..records import ARGS_FILE, ELIDED, RESUME_FILE, SUMMARY_FILE, portable_args, resolve_recorded
from .distributed import Dist
from .flags import as_typed
from .output import record_extension, save_run, write_record
from .setup import RunData, Trainer, build_loader, build_trainer, prepare_data
from .step import Loader

LOCK_FILE = ".train.lock"  # held by the process training into a run folder (a dot file: never committed)
# Flags that may differ when a run is resumed: where it lives and how it runs, not what it computes.
RESUME_FREE = {"resume", "overwrite", "output", "workers", "device", "no_progress", "save_every", "compile",
               "compile_mode", "report_to"}


@dataclass(eq=False)  # runs compare by identity
class Run:
    """One run opened for training: its (resume-merged) arguments, folder, data, trainer and loader."""

    args: argparse.Namespace
    out: Path
    data: RunData
    t: Trainer
    loader: Loader
    eval_images: torch.Tensor  # on the training device
    eval_labels: torch.Tensor


def open_run(args: argparse.Namespace, parser: CliParser, d: Dist) -> Run | None:
    """Check everything first (the folder, the flags, a resumed run's saved flags and images), build the trainer
    (restored on resume), then write what opening writes (:func:`_begin`); None when the run in ``--output`` is
    finished and ``--epochs`` asks for no more."""
    out = Path(args.output)
    saved_epochs = _saved_epochs(out, args)  # None: a new run
    if saved_epochs is not None:
        args = merge_saved_args(args, out, parser)
    if saved_epochs is not None and (out / SUMMARY_FILE).exists():  # finished: it trains on to a larger --epochs
        if args.epochs == saved_epochs:
            if d.main:
                print(f"{out} holds a finished run of {saved_epochs} epochs; pass a larger --epochs to train it "
                      "further")
            return None
        if not (out / RESUME_FILE).exists():  # the state to continue exactly: model, optimizer, EMA, grad scaler
            raise UserError(f"{out} holds a finished run of {saved_epochs} epochs without its {RESUME_FILE} (scripts/"
                            f"study.py removes it), so it cannot continue exactly; train --epochs {args.epochs} into a "
                            "new --output instead")
    if not args.dataset:
        raise UserError("no data set: pass --dataset (e.g. cifar10, cifar10-sample or a local folder)")
    if args.workers:
        torch.set_num_threads(args.workers)
    if (args.mixup > 0 or args.cutmix > 0) and args.batch_size % 2:
        raise UserError(f"mixup/cutmix need an even --batch-size, got {args.batch_size}")
    data = prepare_data(args, d)
    if saved_epochs is not None:
        _check_same_data(out, args, data)
    t = build_trainer(args, data, d)
    if saved_epochs is not None:
        _restore(t, out / RESUME_FILE)
    run = Run(args, out, data, t, build_loader(args, data, d), data.eval.images.to(d.device),
              data.eval.labels.to(d.device))
    _begin(run, saved_epochs, d)
    return run


def _saved_epochs(out: Path, args: argparse.Namespace) -> int | None:
    """The saved run's epoch count when ``args`` continue it, None for a new run; refuses to clobber a run unless
    asked (``--overwrite``: the old run's files go when the new run begins, :func:`_begin`)."""
    finished, has_state = (out / SUMMARY_FILE).exists(), (out / RESUME_FILE).exists()
    if args.overwrite or not (finished or has_state):
        return None
    if args.resume:
        return _saved_args(out)["epochs"]
    if finished:
        raise UserError(f"{out} holds a finished run; pass --overwrite to replace it or choose another --output")
    raise UserError(f"{out} holds an unfinished run; add --resume to continue it or --overwrite to start over")


def _begin(run: Run, saved_epochs: int | None, d: Dist) -> None:
    """What opening a run has :mod:`.output` write (rank 0): a new run's record, a longer schedule, or the files of a
    last epoch whose writes a kill interrupted."""
    t, args = run.t, run.args
    if saved_epochs is None:
        if d.main:
            write_record(run.out, args, run.data, d)
        return
    if args.epochs > saved_epochs and d.main:
        record_extension(run.out, _saved_args(run.out), t.epoch, args.epochs, run.data.warmup)
    if t.epoch == args.epochs:  # killed among the last epoch's writes: the resume state's come again
        save_run(run.out, t, args, run.data, d)


def _saved_args(out: Path) -> dict[str, Any]:
    return json.loads((out / ARGS_FILE).read_text(encoding="utf-8"))


def merge_saved_args(args: argparse.Namespace, out: Path, parser: CliParser) -> argparse.Namespace:
    """On resume, the saved configuration wins; a flag typed (``parser.given``, even at its default) with another
    value than the saved one is an error, except a larger ``--epochs`` (:func:`.output.record_extension`)."""
    saved = _saved_args(out)
    for flag, used in (("--dropout-draws keyed", saved.get("dropout_draws") == "keyed"),
                       ("--capture", saved.get("capture"))):  # removed; other removed keys of a record are ignored
        if used:
            raise UserError(f"{out} was trained with {flag}, which was removed, so it cannot continue exactly; "
                            "start a new --output")
    merged, recorded = vars(args).copy(), portable_args(vars(args), out)  # recorded: as the record holds them
    for key, value in vars(args).items():
        if key in RESUME_FREE:
            continue
        flag = "--" + key.replace("_", "-")
        if key not in saved:  # a flag newer than the run: the run trained with its default
            if key in parser.given and value != parser.get_default(key):
                raise UserError(f"{out} was trained before {flag} existed, as with {flag} "
                                f"{as_typed(parser.get_default(key))}; drop {flag} to resume it, or start a new "
                                "--output")
            continue
        if key == "epochs" and key in parser.given and value > saved[key]:
            continue  # training goes on to the typed count, on a schedule rebuilt for it
        if key in parser.given and json.loads(json.dumps(recorded[key])) != saved[key]:
            raise UserError(f"{flag} {as_typed(value)} differs from the saved run's {as_typed(saved[key])}; drop it to "
                            "resume with the saved value, or start a new --output")
        merged[key] = saved[key]
    merged["dataset"] = args.dataset if "dataset" in parser.given else resolve_recorded(merged["dataset"], out)
    if merged["dataset"].startswith(ELIDED):
        raise UserError(f"{out} names its data set folder by name only ({merged['dataset']}: it lay outside the "
                        "working directory's tree); resume it with --dataset naming that folder")
    return argparse.Namespace(**merged)


def _check_same_data(out: Path, args: argparse.Namespace, data: RunData) -> None:
    """A resumed run reads the images it trained on: the same decoded pixels and labels (``content``; runs recorded
    without it: the same datasets fingerprint), wherever the files lie now."""
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


@contextlib.contextmanager
def training_lock(out: Path, main: bool) -> Iterator[None]:
    """Hold ``out``'s lock while training into it (rank 0): a second process training into the same folder, whose
    saves would interleave with this one's, is refused in one line. The lock goes with the process however it ends
    (a kill included); folders made here and left empty (a refused run) go too."""
    if not main:
        yield
        return
    made = [p for p in (out, *out.parents) if not p.exists()]  # the folders made here, innermost first
    out.mkdir(parents=True, exist_ok=True)
    fd, locked = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644), False
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UserError(f"another process is training into {out} (it holds {out / LOCK_FILE}); wait for it to "
                            "end, or train into another --output") from None
        locked = True
        yield
    finally:
        if locked and made and [p.name for p in out.iterdir()] == [LOCK_FILE]:  # refused before writing anything
            (out / LOCK_FILE).unlink()
            for folder in made:
                with contextlib.suppress(OSError):  # another process's files since: it stays
                    folder.rmdir()
        os.close(fd)
