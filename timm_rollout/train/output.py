"""What a run writes into its folder (``--output``): its record, the saves of each epoch, the summary. Opening the
folder (refusals, resume, the lock) is :mod:`.resume`'s."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..atomic import write_json
from ..checkpoint import save_model, save_resume
from ..curves import plot_curves
from ..device import device_name, fp32_precision, precision_name
from ..records import (
    ARGS_FILE,
    CURVES_FILE,
    LOG_FILE,
    MODEL_FILES,
    RESUME_FILE,
    SUMMARY_FILE,
    code_version,
    portable_args,
    recorded_data,
    versions,
)
from .distributed import Dist
from .log import EVENT_FILES, TensorBoardLog, top5_text, write_log
from .setup import RunData, Trainer
from .validation import EVAL_BATCH

RUN_FILES = (*MODEL_FILES, ARGS_FILE, SUMMARY_FILE, LOG_FILE, CURVES_FILE, RESUME_FILE)  # --overwrite removes them


def write_record(out: Path, args: argparse.Namespace, data: RunData, d: Dist) -> None:
    """``train_args.json``: every argument and everything resolved from it, written once per run, after an
    overwritten run's files (``--overwrite``) and any event files without a run go."""
    for name in RUN_FILES if args.overwrite else ():
        (out / name).unlink(missing_ok=True)
    for events in out.glob(EVENT_FILES):  # an overwritten run's, or empty ones of a run that saved nothing
        events.unlink()
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


def record_extension(out: Path, record: dict[str, Any], at_epoch: int, epochs: int, warmup: float) -> None:
    """A run resumed with a larger ``--epochs``: its ``train_args.json`` ``record`` takes the new count and warmup
    (the old ones under ``extended``), and ``summary.json`` goes until the run reaches the new count."""
    record["extended"] = [*record.get("extended", []), {"at_epoch": at_epoch, "epochs": record["epochs"],
                                                        "warmup_epochs_used": record["warmup_epochs_used"]}]
    write_json(out / ARGS_FILE, {**record, "epochs": epochs, "warmup_epochs_used": warmup})
    (out / SUMMARY_FILE).unlink(missing_ok=True)


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
    """``summary.json`` and the run's closing line, once every epoch is trained."""
    rows, last = t.rows, t.rows[-1]
    summary = {"epochs": args.epochs, **{k: last.get(k) for k in ("train_loss", "eval_loss", "eval_top1", "eval_top5")},
               "best_eval_top1": max(r["eval_top1"] for r in rows), "wall_seconds": sum(r["seconds"] for r in rows),
               "machines": t.machines, "code": t.codes, "train_images": len(data.train), "eval_images": len(data.eval)}
    write_json(out / SUMMARY_FILE, summary)
    print(f"{args.model} on {args.dataset}: eval top-1 {last['eval_top1']:.2f}%{top5_text(last)} "
          f"after {args.epochs} epochs ({summary['wall_seconds']:.0f} s; evaluated in "
          f"{precision_name(data.amp_dtype)}, batches of {EVAL_BATCH}) -> {out}")
