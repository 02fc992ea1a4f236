"""Training: ``train()`` parses the flags, takes the run folder's lock, opens the run (:mod:`.resume`), trains its
epochs and writes the summary.

Per epoch: :func:`_train_epoch` (the updates, no host sync per step), then :func:`_end_epoch` (the evaluation of
:mod:`.validation`, the log row and, on save epochs, :func:`.output.save_run`).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..cli import CliParser
from ..errors import UserError
from ..progress import progress, tqdm
from ..records import code_label
from .distributed import Dist, init_distributed, reduce_sum
from .flags import as_typed, build_parser
from .log import top5_text
from .output import machine_label, save_run, write_summary
from .resume import Run, open_run, training_lock
from .step import optimizer_step
from .validation import validate

BAR_EVERY = 50  # steps between loss updates of the progress bar (each costs one host sync)


class NonFiniteLossError(UserError):
    """The training loss became NaN or infinite."""


def train(argv: list[str] | None = None) -> Path:
    """Run training from CLI-style arguments; returns the output folder."""
    parser = build_parser()
    return train_parsed(parser.parse_args(argv), parser)


def train_parsed(args: argparse.Namespace, parser: CliParser) -> Path:
    """Train the run ``parser`` parsed into ``args`` (its ``given`` flags too); returns the output folder."""
    d = init_distributed(args.device)
    threads = torch.get_num_threads()
    try:
        with training_lock(Path(args.output), d.main):
            run = open_run(args, parser, d)
            if run is None:  # finished, and --epochs asks for no more
                return Path(args.output)
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
    finally:
        torch.set_num_threads(threads)
        if d.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


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
        r = t.rows[-1]
        tqdm.write(f"epoch {r['epoch']}/{args.epochs}: train loss {r['train_loss']:.4f}, eval loss "
                   f"{r['eval_loss']:.4f}, top-1 {r['eval_top1']:.2f}%{top5_text(r)}, {r['img_per_s']:.0f} img/s",
                   file=sys.stderr)


def _train_epoch(run: Run, d: Dist, epoch: int) -> tuple[float, float]:
    """One epoch of updates (no host sync per step); returns the mean training loss and the last learning rate."""
    t, args, data = run.t, run.args, run.data
    batches = run.loader.epoch(epoch)  # seeds the epoch's random streams
    losses = torch.zeros(data.steps, device=d.device)
    t.net.train()
    lr = t.optimizer.param_groups[0]["lr"]
    bar = progress(batches, total=data.steps, desc=f"epoch {epoch + 1}/{args.epochs}",
                   disable=not d.main or args.no_progress, leave=False, file=sys.stderr)
    for step, (x, y) in enumerate(bar):
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


def main(argv: list[str] | None = None) -> None:
    """CLI entry point."""
    train(argv)
