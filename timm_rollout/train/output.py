"""The run folder (``--output``): refusing to clobber a run, resuming one (merged flags, the same images, the
restored state, a longer schedule), and what a run writes: its record, the saves of each epoch, the summary."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..atomic import write_json
from ..checkpoint import load_resume, save_model, save_resume
from ..cli import CliParser
from ..curves import plot_curves
from ..device import device_name, fp32_precision, precision_name
from ..errors import UserError
from ..records import (
    ARGS_FILE,
    CURVES_FILE,
    ELIDED,
    LOG_FILE,
    MODEL_FILES,
    RESUME_FILE,
    SUMMARY_FILE,
    code_version,
    portable_args,
    recorded_data,
    resolve_recorded,
    versions,
)
from .distributed import Dist
from .flags import as_typed
from .log import TensorBoardLog, top5_text, write_log
from .setup import RunData, Trainer
from .validation import EVAL_BATCH

LOCK_FILE = ".train.lock"  # held by the process training into a run folder (a dot file: never committed)
RUN_FILES = (*MODEL_FILES, ARGS_FILE, SUMMARY_FILE, LOG_FILE, CURVES_FILE, RESUME_FILE)
# Flags that may differ when a run is resumed: where it lives and how it runs, not what it computes.
RESUME_FREE = {"resume", "overwrite", "output", "workers", "device", "no_progress", "save_every", "compile",
               "compile_mode", "report_to"}


def prepare_output(out: Path, args: argparse.Namespace) -> str:
    """``'fresh'``, ``'resume'`` or ``'finished'``; refuses to clobber a run unless asked (``--overwrite``: the
    old run's files go when the new run begins, :func:`.loop._begin`)."""
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


def saved_args(out: Path) -> dict[str, Any]:
    return json.loads((out / ARGS_FILE).read_text(encoding="utf-8"))


def merge_saved_args(args: argparse.Namespace, out: Path, parser: CliParser) -> argparse.Namespace:
    """On resume, the saved configuration wins; a flag typed (``parser.given``, even at its default) with another
    value than the saved one is an error, except a larger ``--epochs`` (:func:`record_extension`)."""
    saved = saved_args(out)
    for flag, used in (("--dropout-draws keyed", saved.get("dropout_draws") == "keyed"),
                       ("--capture", saved.get("capture"))):  # removed; other removed keys of a record are ignored
        if used:
            raise UserError(f"{out} was trained with {flag}, which was removed, so it cannot continue exactly; "
                            "start a new --output")
    merged, recorded = vars(args).copy(), portable_args(vars(args), out)  # recorded: as the record holds them
    for key, value in vars(args).items():
        if key in RESUME_FREE:
            continue
        if key not in saved:  # a flag newer than the run: the run trained with its default
            if key in parser.given and value != parser.get_default(key):
                flag = "--" + key.replace("_", "-")
                raise UserError(f"{out} was trained before {flag} existed, as with {flag} "
                                f"{as_typed(parser.get_default(key))}; drop {flag} to resume it, or start a new "
                                "--output")
            continue
        if key == "epochs" and key in parser.given and value > saved[key]:
            continue  # training goes on to the typed count, on a schedule rebuilt for it
        if key in parser.given and json.loads(json.dumps(recorded[key])) != saved[key]:
            flag = "--" + key.replace("_", "-")
            raise UserError(f"{flag} {as_typed(value)} differs from the saved run's {as_typed(saved[key])}; drop it to "
                            "resume with the saved value, or start a new --output")
        merged[key] = saved[key]
    merged["dataset"] = args.dataset if "dataset" in parser.given else resolve_recorded(merged["dataset"], out)
    if merged["dataset"].startswith(ELIDED):
        raise UserError(f"{out} names its data set folder by name only ({merged['dataset']}: it lay outside the "
                        "working directory's tree); resume it with --dataset naming that folder")
    return argparse.Namespace(**merged)


def check_same_data(out: Path, args: argparse.Namespace, data: RunData) -> None:
    """A resumed run reads the images it trained on: the same decoded pixels and labels (``content``; runs recorded
    without it: the same datasets fingerprint), wherever the files lie now."""
    saved = saved_args(out)
    for split, now in (("train", data.train), ("eval", data.eval)):
        content = (saved.get("content") or {}).get(split)
        fingerprint = (saved.get("fingerprints") or {}).get(split)
        if content == now.content if content is not None else fingerprint in (None, now.fingerprint):
            continue
        was = f"content sha256 {content[:12]}" if content else f"datasets fingerprint {fingerprint}"
        raise UserError(f"--dataset {args.dataset} ({now.dataset}) gives other {split} images ({now.split}) than "
                        f"{out} trained on ({was}, from {saved.get('dataset_resolved')}); pass the --dataset it "
                        "trained on, or start a new --output")


def restore(t: Trainer, path: Path) -> None:
    """Continue from the last saved epoch: states, update count (the schedule follows it) and log rows."""
    meta = load_resume(path, model=t.model, optimizer=t.optimizer, ema=t.ema.module if t.ema else None,
                       scaler=t.scaler)
    t.epoch = t.saved_epoch = meta["epoch"]
    t.num_updates, t.rows = meta["num_updates"], meta["rows"]
    t.machines = meta.get("machines", {})  # resume states written before machines were recorded lack them
    t.codes = meta.get("codes", {})  # and before code versions were
    if t.scheduler is not None:
        t.scheduler.step_update(t.num_updates)


def trains_further(out: Path, epochs: int, saved_epochs: int, d: Dist) -> bool:
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


def record_extension(out: Path, at_epoch: int, epochs: int, warmup: float) -> None:
    """A run resumed with a larger ``--epochs``: ``train_args.json`` takes the new count and warmup (the old ones
    under ``extended``), and ``summary.json`` goes until the run reaches the new count."""
    record = saved_args(out)
    record["extended"] = [*record.get("extended", []), {"at_epoch": at_epoch, "epochs": record["epochs"],
                                                        "warmup_epochs_used": record["warmup_epochs_used"]}]
    write_json(out / ARGS_FILE, {**record, "epochs": epochs, "warmup_epochs_used": warmup})
    (out / SUMMARY_FILE).unlink(missing_ok=True)


def write_record(out: Path, args: argparse.Namespace, data: RunData, d: Dist) -> None:
    """``train_args.json``: every argument and everything resolved from it, written once per run."""
    amp = precision_name(data.amp_dtype)
    write_json(out / ARGS_FILE, {
        **portable_args(vars(args), out), "dataset_resolved": recorded_data(args.dataset, data.train.dataset, out),
        "train_split": data.train.split, "eval_split": data.eval.split,
        "fingerprints": {"train": data.train.fingerprint, "eval": data.eval.fingerprint},
        "content": {"train": data.train.content, "eval": data.eval.content},
        "fp32_precision": fp32_precision(d.device),
        "class_names": data.train.class_names, "num_classes": data.num_classes, "mean": list(data.mean),
        "std": list(data.std), "train_images": len(data.train), "eval_images": len(data.eval),
        "warmup_epochs_used": data.warmup, "hflip_used": data.hflip, "steps_per_epoch": data.steps,
        "world_size": d.world, "device": str(d.device), "amp_dtype": amp, "versions": versions(),
        "code": code_version()})


def save_run(out: Path, t: Trainer, args: argparse.Namespace, data: RunData, d: Dist) -> None:
    """Rank 0 writes the resume state, the model export, ``log.csv``, ``curves.png`` and with ``--report-to
    tensorboard`` the event files (after the resume state, so they never hold an epoch a resume trains again)."""
    if d.main:
        save_resume(out / RESUME_FILE, model=t.model, optimizer=t.optimizer, ema=t.ema.module if t.ema else None,
                    scaler=t.scaler,
                    meta={"epoch": t.epoch, "num_updates": t.num_updates, "rows": t.rows, "machines": t.machines,
                          "codes": t.codes})
        save_model(out, t.export, data.train.class_names, data.mean, data.std, data.train.images.shape[1:])
        write_log(out / LOG_FILE, t.rows)
        plot_curves(out / CURVES_FILE, t.rows, f"{args.model} on {Path(args.dataset).name}")
        if args.report_to == "tensorboard":
            t.board = t.board or TensorBoardLog(out)
            t.board.write(t.rows)
    t.saved_epoch = t.epoch
    if d.world > 1:
        dist.barrier()


def machine_label(d: Dist, data: RunData, args: argparse.Namespace) -> str:
    """What trains this session's epochs (machine, precision, compilation), for ``summary.json``."""
    compiled = f", torch.compile mode {args.compile_mode}" if args.compile else ""
    processes = f", {d.world} processes" if d.world > 1 else ""
    return f"{device_name(d.device)}, {precision_name(data.amp_dtype)}{compiled}{processes}"


def write_summary(out: Path, args: argparse.Namespace, data: RunData, t: Trainer) -> None:
    rows, last = t.rows, t.rows[-1]
    summary = {"epochs": args.epochs, **{k: last.get(k) for k in ("train_loss", "eval_loss", "eval_top1", "eval_top5")},
               "best_eval_top1": max(r["eval_top1"] for r in rows), "wall_seconds": sum(r["seconds"] for r in rows),
               "machines": t.machines, "code": t.codes, "train_images": len(data.train), "eval_images": len(data.eval)}
    write_json(out / SUMMARY_FILE, summary)
    print(f"{args.model} on {args.dataset}: eval top-1 {last['eval_top1']:.2f}%{top5_text(last)} "
          f"after {args.epochs} epochs ({summary['wall_seconds']:.0f} s; evaluated in "
          f"{precision_name(data.amp_dtype)}, batches of {EVAL_BATCH}) -> {out}")


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
