"""Training: ``train()`` opens each ``--seed``'s run, then the one epoch loop and the end of each epoch.

Per epoch: :func:`_train_epoch` (the updates, no host sync per step), then :func:`_end_epoch` (the evaluation of
:mod:`.validation`, the log row and, on save epochs, :func:`.output.save_run`).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import UserError
from ..progress import progress, tqdm
from ..records import RESUME_FILE, code_label
from .distributed import Dist, init_distributed, reduce_sum
from .flags import as_typed, build_parser
from .log import EVENT_FILES, top5_text
from .output import (
    RUN_FILES,
    check_same_data,
    machine_label,
    merge_saved_args,
    prepare_output,
    record_extension,
    restore,
    save_run,
    saved_args,
    training_lock,
    trains_further,
    write_record,
    write_summary,
)
from .setup import RunData, Trainer, build_batches, build_trainer, derive_seed, prepare_data, seed_everything
from .step import Batches, optimizer_step
from .validation import validate

BAR_EVERY = 50  # steps between loss updates of the progress bar (each costs one host sync)


class NonFiniteLossError(UserError):
    """The training loss became NaN or infinite."""


def train(argv: list[str] | None = None) -> Path:
    """Run training from CLI-style arguments; returns the output folder."""
    parser = build_parser()
    args = parser.parse_args(argv)
    d = init_distributed(args.device)
    threads = torch.get_num_threads()
    try:
        with training_lock(Path(args.output), d.main):
            return _train(args, parser, d)
    finally:
        torch.set_num_threads(threads)
        if d.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


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


def _open(args: argparse.Namespace, parser: argparse.ArgumentParser, d: Dist) -> Run | None:
    """Check the flags, load the data, build the trainer and restore a resumed run, writing nothing (:func:`_begin`
    writes); None when the run in ``--output`` is finished and ``--epochs`` asks for no more."""
    out = Path(args.output)
    state = prepare_output(out, args)
    saved_epochs = saved_args(out)["epochs"] if state != "fresh" else args.epochs
    if state != "fresh":
        args = merge_saved_args(args, out, parser)
    if state == "finished":
        if not trains_further(out, args.epochs, saved_epochs, d):
            return None
        state = "resume"
    if not args.dataset:
        raise UserError("no data set: pass --dataset (e.g. cifar10, cifar10-sample or a local folder)")
    if args.workers:
        torch.set_num_threads(args.workers)
    if (args.mixup > 0 or args.cutmix > 0) and args.batch_size % 2:
        raise UserError(f"mixup/cutmix need an even --batch-size, got {args.batch_size}")

    data = prepare_data(args, d)
    if state == "resume":
        check_same_data(out, args, data)
    t = build_trainer(args, data, d)
    if state == "resume":
        restore(t, out / RESUME_FILE)
    return Run(args, out, data, t, build_batches(args, data, d), data.eval.images.to(d.device),
               data.eval.labels.to(d.device), saved_epochs if state == "resume" else None)


def _begin(run: Run, d: Dist) -> None:
    """What opening a run writes, once every run of the command is checked: a fresh run's record (an overwritten
    run's files removed first), a longer schedule, or the files of a last epoch whose writes a kill interrupted."""
    t, args = run.t, run.args
    if run.saved_epochs is None:
        if d.main:
            for name in RUN_FILES if args.overwrite else ():
                (run.out / name).unlink(missing_ok=True)
            for events in run.out.glob(EVENT_FILES):  # an overwritten run's, or empty ones of a run that saved nothing
                events.unlink()
            write_record(run.out, args, run.data, d)
        return
    if args.epochs > run.saved_epochs and d.main:
        record_extension(run.out, t.epoch, args.epochs, run.data.warmup)
    if t.epoch == args.epochs:  # killed among the last epoch's writes: the resume state's come again
        save_run(run.out, t, args, run.data, d)


def _train(args: argparse.Namespace, parser: argparse.ArgumentParser, d: Dist) -> Path:
    run = _open(args, parser, d)
    if run is None:
        return Path(args.output)
    _begin(run, d)
    machine = machine_label(d, run.data, run.args)
    for epoch in range(run.t.epoch, run.args.epochs):
        t0 = time.perf_counter()
        train_loss, lr = _train_epoch(run, d, epoch)
        _end_epoch(run, d, train_loss, lr, time.perf_counter() - t0, machine)
    if d.main:
        write_summary(run.out, run.args, run.data, run.t)
    if run.t.board is not None:
        run.t.board.writer.close()
    return run.out


def _end_epoch(run: Run, d: Dist, train_loss: float, lr: float, train_seconds: float, machine: str) -> None:
    """Evaluate, log the epoch's row, and save on save epochs."""
    t, args, data = run.t, run.args, run.data
    t0 = time.perf_counter()
    metrics = validate(t.evaluator, run.eval_images, run.eval_labels, data.mean, data.std, d, data.amp_dtype)
    t.rows.append({"epoch": t.epoch + 1, "train_loss": train_loss, **metrics, "lr": lr,
                   "img_per_s": data.steps * args.batch_size * d.world / train_seconds,
                   "seconds": train_seconds + time.perf_counter() - t0})
    t.epoch += 1
    t.machines[machine] = t.machines.get(machine, 0) + 1
    t.codes[code_label()] = t.codes.get(code_label(), 0) + 1
    if t.epoch % args.save_every == 0 or t.epoch == args.epochs:
        save_run(run.out, t, args, data, d)
    if d.main:
        _report_epoch(t.rows[-1], args.epochs)


def _epoch_order(args: argparse.Namespace, data: RunData, d: Dist, epoch: int) -> tuple[torch.Tensor, torch.Generator]:
    """This rank's image order for the epoch and the generator of its augmentation, both from the run's seed."""
    order = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(derive_seed(args.seed, epoch)))
    order = order[d.rank::d.world][: data.steps * args.batch_size].to(d.device)
    return order, torch.Generator().manual_seed(derive_seed(args.seed, epoch, d.rank, 1))


def _train_epoch(run: Run, d: Dist, epoch: int) -> tuple[float, float]:
    """One epoch of updates (no host sync per step); returns the mean training loss and the last learning rate."""
    t, args, data = run.t, run.args, run.data
    seed_everything(derive_seed(args.seed, epoch, d.rank))
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
    """The epoch's mean training loss; a non-finite step loss stops the run before this epoch is saved."""
    values = [v / d.world for v in reduce_sum(losses, d).tolist()]
    bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
    if bad is not None:
        kept = f"the last good checkpoint (epoch {run.t.saved_epoch}) is kept in {run.out}" if run.t.saved_epoch \
            else f"no checkpoint was written in {run.out}"
        fixes = ["lower --lr", *(["add --clip-grad 1.0"] if run.args.clip_grad is None else []),
                 *(["use --amp none"] if run.data.amp_dtype not in (None, torch.float32) else []),
                 *([f"raise --std (now {as_typed(run.data.std)})"] if min(run.data.std) < 0.01 else [])]
        fix = " or ".join([", ".join(fixes[:-1]), fixes[-1]] if len(fixes) > 1 else fixes)
        raise NonFiniteLossError(f"the training loss is {values[bad]} at epoch {epoch + 1} step {bad + 1}; "
                                 f"{kept}; {fix} in a new --output")
    return sum(values) / len(values)


def _report_epoch(r: dict[str, float], epochs: int) -> None:
    tqdm.write(f"epoch {r['epoch']}/{epochs}: train loss {r['train_loss']:.4f}, eval loss {r['eval_loss']:.4f}, "
               f"top-1 {r['eval_top1']:.2f}%{top5_text(r)}, {r['img_per_s']:.0f} img/s",
               file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    """CLI entry point."""
    train(argv)
