"""``--executor slurm``: the study's missing runs as one Slurm job array (submitit, imported only here), each task the
local pool's :func:`~.jobs.run_arm` of one run, requeued and resumed after a preemption or its time limit; and
``--status``, each run's state from the study folder (and ``squeue``)."""

from __future__ import annotations

import argparse
import contextlib
import getpass
import io
import json
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from timm_rollout.atomic import write_json
from timm_rollout.errors import UserError
from timm_rollout.records import LOG_FILE, RESULTS_FILE, RESUME_FILE, STUDY_FILE, SUMMARY_FILE

from .folder import also_folder, layout
from .jobs import run_arm
from .plan import ARMS, POSTHOC

SLURM_DIR, JOBS_FILE = "slurm", "jobs.json"  # <study>/slurm: submitit's pickles and logs, jobs.json: run -> task id
NODE_LOCAL = ("/tmp", "/var/tmp", "/dev/shm", "/run", tempfile.gettempdir())  # never shared between nodes
MAX_REQUEUES = 20  # time-limit requeues of one task (preemptions are not counted)
SLURM_FLAGS = ("partition", "time", "gpus_per_task", "cpus_per_task", "mem", "array_parallelism", "account", "qos",
               "sbatch_args")


def check_slurm(args: argparse.Namespace, given: frozenset[str]) -> None:
    """What ``--executor slurm`` needs, before anything is recorded; with ``--executor local`` no Slurm flag."""
    typed = [f"--{k.replace('_', '-')}" for k in SLURM_FLAGS if k in given]
    if args.executor == "local":
        if typed:
            raise UserError(f"{typed[0]} is a Slurm setting; add --executor slurm, or drop it to run here")
        return
    if "jobs" in given:
        raise UserError("--jobs sizes the local pool; on Slurm cap the runs at once with --array-parallelism")
    if args.report_only:
        raise UserError("--report-only runs nothing on the cluster; drop --executor slurm")
    try:
        import submitit  # noqa: F401
    except ImportError:
        raise UserError("--executor slurm needs submitit: pip install -e '.[slurm]'") from None
    out = Path(args.output).resolve()
    if any(out == p or p in out.parents for p in map(Path.resolve, map(Path, NODE_LOCAL))):
        raise UserError(f"{args.output} is on a node-local disk ({out}); the nodes write the study there, so use a "
                        "folder on a file system they share (e.g. under your home or project directory)")
    if shutil.which("sbatch") is None:
        raise UserError("--executor slurm submits with sbatch, which is not on PATH here; run the study command on a "
                        "Slurm login node")
    if args.partition and subprocess.run(["scontrol", "show", "partition", args.partition],
                                         capture_output=True, check=False).returncode != 0:
        raise UserError(f"Slurm has no partition {args.partition!r}; pick one that sinfo lists")


def sbatch_options(text: str) -> dict[str, str | bool]:
    """``--sbatch-args '--constraint=a100 --exclusive'`` as submitit's extra sbatch parameters."""
    try:
        tokens = shlex.split(text)
    except ValueError as e:
        raise UserError(f"does not split as shell words ({e}); balance its quotes") from None
    if not all(t.startswith("--") for t in tokens):
        raise UserError(f"write each option as --name or --name=value, got {text!r}")
    return {key: value or True for key, _, value in (t[2:].partition("=") for t in tokens)}


def make_executor(args: argparse.Namespace, folder: Path, dependency: str | None = None) -> Any:
    """submitit's Slurm executor with the study's Slurm flags, its jobs started after ``dependency``."""
    import submitit
    executor = submitit.SlurmExecutor(folder, max_num_timeout=MAX_REQUEUES)
    params = {"job_name": f"study-{Path(args.output).name}", "partition": args.partition, "time": args.time,
              "gpus_per_task": args.gpus_per_task, "cpus_per_task": args.cpus_per_task,
              "mem": None if args.mem is None else f"{args.mem}G", "array_parallelism": args.array_parallelism,
              "account": args.account, "qos": args.qos, "additional_parameters": args.sbatch_args,
              "dependency": dependency}
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    return executor


class InFolder:
    """A study task: ``fn`` in the submitting command's directory; requeued as it is, it resumes from the files."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.cwd = fn, os.getcwd()

    def __call__(self) -> Any:
        os.chdir(self.cwd)
        return self.fn()

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        from submitit.helpers import DelayedSubmission
        return DelayedSubmission(self)


def submit(args: argparse.Namespace, pairs: list[tuple[str, int]], runs: dict, evals: dict) -> list[Any]:
    """Submit ``pairs`` (arm, seed) as one job array of :func:`run_arm`, recorded in ``<study>/slurm/jobs.json``."""
    folder = Path(args.output) / SLURM_DIR
    executor = make_executor(args, folder.resolve())
    try:
        with contextlib.redirect_stderr(io.StringIO()), executor.batch():  # sbatch's error comes once, below
            jobs = [executor.submit(InFolder(partial(run_arm, args, arm, seed, runs, evals)))
                    for arm, seed in pairs]
    except Exception as e:  # sbatch's refusal (account, QOS, limits), as its last line
        raise UserError(f"sbatch refused the job array: {str(e).strip().splitlines()[-1]}; check the Slurm flags "
                        "and re-run, nothing was submitted") from None
    ids = {f"{arm}-s{seed}": job.job_id for (arm, seed), job in zip(pairs, jobs, strict=True)}
    write_json(folder / JOBS_FILE, {**submitted(Path(args.output)), **ids})
    print(f"+ submitted {len(jobs)} runs as job{' array' * (len(jobs) > 1)} {jobs[0].job_id.split('_')[0]}: "
          f"{' '.join(f'{a}-s{s}' for a, s in pairs)}", flush=True)
    return jobs


def submitted(out: Path) -> dict[str, str]:
    """Run name (``<arm>-s<seed>``) -> the Slurm task id it was last submitted as."""
    path = out / SLURM_DIR / JOBS_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def queue() -> dict[str, str]:
    """Task id -> state of this user's Slurm jobs (array tasks one by one)."""
    if shutil.which("squeue") is None:
        raise UserError("the study has Slurm tasks, and squeue is not on PATH here; run it on a Slurm login node")
    done = subprocess.run(["squeue", "-h", "-r", "-u", getpass.getuser(), "-o", "%i|%T"], capture_output=True,
                          text=True, check=True)
    return dict(line.split("|", 1) for line in done.stdout.split())


def evaluated(arm: str, seed: int, evals: dict, also_eval: list[str] | None, output: str | Path) -> bool:
    """Whether every evaluation of ``arm``'s run of ``seed`` is written (its post-hoc readouts, ``--also-eval``)."""
    names = (arm, *(POSTHOC if arm == "cls" else ()))
    folders = [evals[n, seed] for n in names]
    folders += [also_folder(d, output, n, seed) for d in also_eval or () for n in names]
    return all((f / RESULTS_FILE).exists() for f in folders)


def run_slurm(args: argparse.Namespace, todo: list[tuple[str, int]], runs: dict, evals: dict,
              report: Callable[[argparse.Namespace], Any]) -> bool:
    """Check (and commit) the evaluated runs of ``todo`` here as the local pool does; submit those neither evaluated
    nor queued as one job array, ``report`` as a job after them (tasks never commit). True: nothing pending."""
    out, jobs, live = Path(args.output), submitted(Path(args.output)), queue()
    task_args = argparse.Namespace(**{**vars(args), "commit": False})
    pending = {p: jobs[f"{p[0]}-s{p[1]}"] for p in todo if jobs.get(f"{p[0]}-s{p[1]}") in live}
    done = [p for p in todo if p not in pending and evaluated(*p, evals, args.also_eval, out)]
    for pair in done:
        run_arm(args, *pair, runs, evals)  # skips what is finished; commits with --commit
    missing = [p for p in todo if p not in pending and p not in done]
    if missing:
        pending |= {p: job.job_id for p, job in zip(missing, submit(task_args, missing, runs, evals), strict=True)}
    if not pending:
        return True
    after = "afterany:" + ":".join(sorted({j.split("_")[0] for j in pending.values()}))
    executor = make_executor(args, (out / SLURM_DIR).resolve(), after)
    job = executor.submit(InFolder(partial(report, task_args, len(todo))))
    then = "; then re-run this command to commit each run and the report" if args.commit else ""
    print(f"+ submitted the report as job {job.job_id}, to run when they end; watch with python scripts/study.py "
          f"--output {shlex.quote(str(out))} --status, or squeue -u {getpass.getuser()}{then}", flush=True)
    return False


def log_path(out: Path, job: str) -> Path:
    """submitit's stderr log of task ``job`` (its stdout is the ``.out`` beside it)."""
    return out / SLURM_DIR / f"{job}_0_log.err"


def status(out: Path) -> list[str]:
    """One line per run of the study folder: evaluated, queued or running (its Slurm task), failed (with its log),
    trained, started (epochs saved) or not started."""
    try:
        study = json.loads((out / STUDY_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{out} holds no {STUDY_FILE}; name a folder written by scripts/study.py --output") from None
    runs, evals = layout(out, study["seeds"])
    jobs = submitted(out)
    live = queue() if jobs else {}
    return [f"{arm}-s{seed}".ljust(28) + _state(out, study, runs, evals, jobs, live, arm, seed)
            for seed in study["seeds"] for arm in ARMS if arm in study["arms"]]


def _state(out: Path, study: dict, runs: dict, evals: dict, jobs: dict, live: dict, arm: str, seed: int) -> str:
    run, job = runs[arm, seed], jobs.get(f"{arm}-s{seed}")
    rows = len((run / LOG_FILE).read_text(encoding="utf-8").splitlines()) - 1 if (run / LOG_FILE).exists() else 0
    saved = f"{max(0, rows)} of {study['identity']['epochs']} epochs saved"  # log.csv: a header, a row per epoch
    if evaluated(arm, seed, evals, study.get("also_eval"), out):
        return "evaluated"
    if job in live:
        return f"{ {'RUNNING': 'running', 'PENDING': 'queued'}.get(live[job], live[job].lower())} (job {job}, {saved})"
    if job:
        return f"failed (job {job}, {saved}), log {log_path(out, job)}"
    if (run / SUMMARY_FILE).exists():
        return "trained"
    return f"started ({saved})" if (run / RESUME_FILE).exists() else "not started"
