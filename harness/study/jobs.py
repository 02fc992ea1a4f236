"""Running a study: each job trains one run in its own trainer process and evaluates it (``harness.eval``),
``--jobs`` side by side, and ``--commit`` commits each finished run with its evaluations."""

from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from harness.record import SCHEMA
from timm_rollout.cli import as_flags
from timm_rollout.device import precision_name, resolve_amp
from timm_rollout.errors import UserError
from timm_rollout.records import RESULTS_FILE, RESUME_FILE, SUMMARY_FILE, WEIGHTS_FILE, sha256_file

from .folder import also_folder
from .plan import POSTHOC, arm_model, train_command

COMMIT_METRICS = ("top1", "linear_probe", "knn_bank")  # named in --commit messages
_GIT = threading.Lock()  # runs side by side commit one at a time (git's index lock)
_GIT_BUSY = ("index.lock", "middle of a merge", "during a merge")  # another process is using the repository


def _run(cmd: list[str], threads: int | None) -> None:
    """Run one step; ``threads`` caps its torch/OpenMP threads when runs go side by side."""
    print("+ " + shlex.join(cmd) + "\n", end="", flush=True)  # one write: jobs print from several threads
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(cmd, check=False, env=env)
    if done.returncode < 0:  # killed: preempted, timed out, requeued
        raise UserError(f"step stopped by {signal.Signals(-done.returncode).name}: {shlex.join(cmd)}; a requeued "
                        "task, or the study command run again, resumes it")
    if done.returncode != 0:
        raise UserError(f"step failed (exit {done.returncode}): {shlex.join(cmd)}; fix it and re-run the study "
                        "command, finished runs are kept")


def job_devices(device: str, jobs: int) -> list[str]:
    """The ``--device`` of each of ``jobs`` side-by-side runs: round-robin over the visible GPUs when there are
    several and ``device`` is ``auto`` or ``cuda``; otherwise ``device`` for all (they share it)."""
    count = torch.cuda.device_count() if device in ("auto", "cuda") and torch.cuda.is_available() else 0
    return [f"cuda:{i % count}" for i in range(jobs)] if count > 1 else [device] * jobs


def train_run(args: argparse.Namespace, arm: str, seed: int, run: Path) -> None:
    """Train (or resume) ``arm``'s run of ``seed`` into ``run``; a finished run (summary.json) is left alone."""
    if (run / SUMMARY_FILE).exists():
        print(f"= {run} finished, skipped")
        return
    _run([sys.executable, "-m", "timm_rollout.train", *train_command(args, arm, seed, str(run))], args.threads)


def eval_run(args: argparse.Namespace, model: str, seed: int, run: Path, folder: Path, pool: str | None = None,
             dataset: str | None = None) -> None:
    """Evaluate one finished run (read out with ``pool``, default its own) unless ``folder`` already holds results
    for these exact weights in the current layout (``schema``). ``dataset``: on that data set's test split instead
    of the study's (``--also-eval``: no k-NN bank, no faithfulness)."""
    results = folder / RESULTS_FILE
    want = precision_name(resolve_amp(args.eval_amp, torch.device("cpu"))) if args.eval_amp not in (None, "auto") \
        else None  # auto: whatever the machine chose is kept
    if results.exists():
        saved = json.loads(results.read_text(encoding="utf-8"))
        dtype = saved.get("environment", {}).get("dtype")  # records before precisions were kept: none
        if saved["model"].get("sha256") == sha256_file(run / WEIGHTS_FILE) and want in (None, dtype):
            if saved.get("schema") == SCHEMA:
                print(f"= {folder} evaluated, skipped")
                return
            print(f"= {folder} evaluated by an older harness (results.json schema {saved.get('schema', 0)}), "
                  "evaluating again")
        if want not in (None, dtype):
            print(f"= {folder} evaluated in {dtype}, evaluating again in {want} (--eval-amp {args.eval_amp})")
    options = {"model": model, "checkpoint": run, "dataset": dataset or args.dataset, "output": folder, "seed": seed,
               "device": args.device, "overwrite": True,  # what a crash or an outdated evaluation left there is redone
               "bbox_format": args.bbox_format, "amp": args.eval_amp, "pool": pool, "per_class": args.eval_per_class}
    if dataset is None:
        options.update(bank_split="train", bank_per_class=args.bank_per_class, faithfulness=bool(
            args.faithfulness_images), faithfulness_images=args.faithfulness_images or None)
    _run([sys.executable, "-m", "harness.eval", *as_flags(options)], args.threads)


def _git(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True, check=False)


def check_commit(out: Path) -> None:
    """``--commit`` needs ``out`` inside a git work tree whose ``.gitignore`` lets the run weights in."""
    probe = out.resolve()
    while not probe.exists():
        probe = probe.parent
    inside = _git(probe, "rev-parse", "--is-inside-work-tree")
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        raise UserError(f"--commit needs --output inside a git work tree, and {out} is not; use a folder of the "
                        "repository such as results/cifar10-cpu")
    weights = out.resolve() / "runs" / "cls-s0" / WEIGHTS_FILE
    if _git(probe, "check-ignore", "-q", str(weights)).returncode == 0:
        raise UserError(f"git ignores the weights written under {out} (.gitignore); use --output results/<name>")


def commit_paths(paths: Sequence[Path], message: str, *, attempts: int = 60, wait: float = 10.0) -> bool:
    """``git add`` and commit exactly ``paths`` (other staged changes stay staged); False when nothing changed.

    A repository busy with other work (another process's index lock, a merge in progress) is waited for, up to
    ``attempts`` tries ``wait`` seconds apart, so a long study never dies of a concurrent ``git commit``.
    """
    files = [str(p.resolve()) for p in paths]
    cwd = Path(files[0]).parent
    for attempt in range(attempts):
        with _GIT:
            added = _git(cwd, "add", "--", *files)
            if added.returncode == 0 and _git(cwd, "diff", "--cached", "--quiet", "--", *files).returncode == 0:
                return False
            done = added if added.returncode else _git(cwd, "commit", "--quiet", "-m", message, "--only", "--", *files)
        error = (done.stderr or done.stdout).strip()
        if done.returncode == 0 or not any(s in error for s in _GIT_BUSY) or attempt == attempts - 1:
            break
        time.sleep(wait)
    if done.returncode != 0:
        raise UserError(f"git could not commit {', '.join(files)}: {error}; fix the repository and re-run the study "
                        "command, finished runs are kept")
    print(f"+ git commit: {message}\n", end="", flush=True)
    return True


def _commit_message(arm: str, seed: int, folder: Path, posthoc: Sequence[str]) -> str:
    metrics = json.loads((folder / RESULTS_FILE).read_text(encoding="utf-8"))["metrics"]
    shown = ", ".join(f"{m} {metrics[m]:.4f}" for m in COMMIT_METRICS if metrics.get(m) is not None)
    extra = f"; post-hoc readouts {', '.join(posthoc)}" if posthoc else ""
    return f"study: {arm} seed {seed} ({shown}{extra})"


def run_arm(args: argparse.Namespace, arm: str, seed: int, runs: dict[tuple[str, int], Path],
            evals: dict[tuple[str, int], Path]) -> None:
    """Train one run of ``arm``, then evaluate it (for ``cls`` also its post-hoc readouts) and commit it when
    asked."""
    run = runs[arm, seed]
    train_run(args, arm, seed, run)
    model = arm_model(args.model, arm)[0]
    (run / RESUME_FILE).unlink(missing_ok=True)  # a finished run never resumes: its state would weigh on git
    eval_run(args, model, seed, run, evals[arm, seed])
    posthoc = [name for name in POSTHOC if arm == "cls"]
    for name in posthoc:
        eval_run(args, model, seed, run, evals[name, seed], pool=POSTHOC[name])
    also = [(name, dataset, also_folder(dataset, args.output, name, seed)) for dataset in args.also_eval or ()
            for name in (arm, *posthoc)]
    for name, dataset, folder in also:
        eval_run(args, model, seed, run, folder, pool=POSTHOC.get(name), dataset=dataset)
    if args.commit:
        commit_paths([run, evals[arm, seed], *(evals[name, seed] for name in posthoc), *(f for *_, f in also)],
                     _commit_message(arm, seed, evals[arm, seed], [POSTHOC[name] for name in posthoc]))


def run_all(args: argparse.Namespace, todo: Sequence[tuple[str, int]], runs: dict[tuple[str, int], Path],
            evals: dict[tuple[str, int], Path]) -> None:
    """Run ``todo`` (arm, seed) in order, ``--jobs`` side by side; a job holds one device of :func:`job_devices`
    while it runs, so with several GPUs no two jobs share one."""
    slots: queue.Queue[str] = queue.Queue()
    for device in job_devices(args.device, args.jobs):
        slots.put(device)

    def job(arm: str, seed: int) -> None:
        device = slots.get()
        try:
            run_arm(argparse.Namespace(**{**vars(args), "device": device}), arm, seed, runs, evals)
        finally:
            slots.put(device)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda pair: job(*pair), todo))
