"""``--executor slurm``: every missing run of a study is one task of one Slurm job array (submitit), which trains (or
resumes) the run and evaluates it with the local pool's own :func:`~.jobs.run_arm`; a task that is preempted or hits
its time limit is requeued and resumes. ``--status`` reads each run's state from the study folder (and ``squeue``).
submitit is imported only here, when a study goes to Slurm."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
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
POLL_S = 30.0  # --commit: how often the submitting side looks at the queue
SLURM_FLAGS = ("partition", "time", "gpus_per_task", "cpus_per_task", "mem", "array_parallelism", "account", "qos",
               "sbatch_args")


def check_slurm(args: argparse.Namespace, given: frozenset[str]) -> None:
    """Everything ``--executor slurm`` needs, checked before anything is recorded or submitted; with ``--executor
    local`` the Slurm flags are refused."""
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
    local = [Path(p).resolve() for p in NODE_LOCAL]
    if any(out == p or p in out.parents for p in local):
        raise UserError(f"{args.output} is on a node-local disk ({out}); the nodes write the study there, so use a "
                        "folder on a file system they share (e.g. under your home or project directory)")
    if shutil.which("sbatch") is None:
        raise UserError("--executor slurm submits with sbatch, which is not on PATH here; run the study command on a "
                        "Slurm login node")
    if args.partition and subprocess.run(["scontrol", "show", "partition", args.partition],
                                         capture_output=True, check=False).returncode != 0:
        raise UserError(f"Slurm has no partition {args.partition!r}; pick one that sinfo lists")
    try:
        shlex.split(args.sbatch_args or "")
    except ValueError as e:
        raise UserError(f"--sbatch-args does not split as shell words ({e}); balance its quotes") from None


def make_executor(args: argparse.Namespace, folder: Path, dependency: str | None = None) -> Any:
    """submitit's Slurm executor with the study's Slurm flags, its jobs started after ``dependency`` (the tests swap
    in submitit's debug and local executors)."""
    import submitit

    executor = submitit.SlurmExecutor(folder, max_num_timeout=MAX_REQUEUES)
    extra = {}
    for token in shlex.split(args.sbatch_args or ""):  # --constraint=a100 --exclusive -> constraint: a100, exclusive
        key, _, value = token.lstrip("-").partition("=")
        extra[key] = value or True
    params = {"job_name": f"study-{Path(args.output).name}", "partition": args.partition, "time": args.time,
              "gpus_per_task": args.gpus_per_task, "cpus_per_task": args.cpus_per_task,
              "mem": None if args.mem is None else f"{args.mem}G", "array_parallelism": args.array_parallelism,
              "account": args.account, "qos": args.qos, "additional_parameters": extra or None,
              "dependency": dependency}
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    return executor


class InFolder:
    """A task of the study: ``fn`` run in the submitting command's directory (the study's paths are relative to
    it). Requeued as it is after a preemption or a time limit: the run resumes from its own files."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.cwd = fn, os.getcwd()

    def __call__(self) -> Any:
        os.chdir(self.cwd)
        return self.fn()

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self)


def submit(args: argparse.Namespace, pairs: list[tuple[str, int]], runs: dict, evals: dict) -> list[Any]:
    """Submit ``pairs`` (arm, seed) as one job array, each task :func:`run_arm` without ``--commit``; their task ids
    are recorded in ``<study>/slurm/jobs.json``. Returns submitit's jobs."""
    folder = Path(args.output) / SLURM_DIR
    task_args = argparse.Namespace(**{**vars(args), "commit": False})  # commits are the submitting side's
    executor = make_executor(args, folder.resolve())
    try:
        with executor.batch():
            jobs = [executor.submit(InFolder(partial(run_arm, task_args, arm, seed, runs, evals)))
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


def queue() -> dict[str, str] | None:
    """Task id -> state of this user's Slurm jobs (array tasks one by one); None where squeue is missing."""
    if shutil.which("squeue") is None:
        return None
    done = subprocess.run(["squeue", "-h", "-r", "-u", getpass.getuser(), "-o", "%i|%T"], capture_output=True,
                          text=True, check=False)
    return dict(line.split("|", 1) for line in done.stdout.split()) if done.returncode == 0 else None


def evaluated(arm: str, seed: int, evals: dict, also_eval: list[str] | None, output: str | Path) -> bool:
    """Whether every evaluation of ``arm``'s run of ``seed`` is written (its post-hoc readouts, ``--also-eval``)."""
    names = (arm, *(POSTHOC if arm == "cls" else ()))
    folders = [evals[n, seed] for n in names]
    folders += [also_folder(d, output, n, seed) for d in also_eval or () for n in names]
    return all((f / RESULTS_FILE).exists() for f in folders)


def run_slurm(args: argparse.Namespace, todo: list[tuple[str, int]], runs: dict, evals: dict,
              report: Callable[[], Any]) -> bool:
    """Submit what ``todo`` lacks as one job array (runs queued or running already are left to their job); runs
    evaluated already are checked here as the local pool would (and committed with ``--commit``). With ``--commit``
    wait, committing each run as its task ends, and return True (the caller renders); otherwise submit ``report``
    as a job after the array and return False. True as well when nothing is left to run."""
    out, jobs, live = Path(args.output), submitted(Path(args.output)), queue() or {}
    pending = {p: jobs[f"{p[0]}-s{p[1]}"] for p in todo if jobs.get(f"{p[0]}-s{p[1]}") in live}
    done = [p for p in todo if p not in pending and evaluated(*p, evals, args.also_eval, out)]
    for pair in done:
        run_arm(args, *pair, runs, evals)  # skips what is finished; commits with --commit
    missing = [p for p in todo if p not in pending and p not in done]
    if missing:
        pending |= {p: job.job_id for p, job in zip(missing, submit(args, missing, runs, evals), strict=True)}
    if not pending:
        return True
    if args.commit:
        wait_and_commit(args, pending, runs, evals)
        return True
    after = "afterany:" + ":".join(sorted({j.split("_")[0] for j in pending.values()}))
    job = make_executor(args, (out / SLURM_DIR).resolve(), after).submit(InFolder(report))
    print(f"+ submitted the report as job {job.job_id}, to run when they end; watch with python scripts/study.py "
          f"--output {shlex.quote(str(out))} --status, or squeue -u {getpass.getuser()}", flush=True)
    return False


def wait_and_commit(args: argparse.Namespace, pending: dict[tuple[str, int], str], runs: dict, evals: dict) -> None:
    """Wait for the tasks of ``pending`` to leave the queue, committing each evaluated run as the local pool does,
    one at a time; a task that ended without its evaluations is reported with its log at the end."""
    failed = []
    while pending:
        time.sleep(POLL_S)
        live = queue() or {}
        for pair, job in [(p, j) for p, j in pending.items() if j not in live]:
            del pending[pair]
            if evaluated(*pair, evals, args.also_eval, args.output):
                run_arm(args, *pair, runs, evals)
            else:
                failed.append(f"{pair[0]}-s{pair[1]} (log {log_path(Path(args.output), job)})")
    if failed:
        raise UserError(f"{len(failed)} runs ended on Slurm unfinished: {', '.join(failed)}; fix the cause and re-run "
                        "the study command, finished runs are kept")


def log_path(out: Path, job: str) -> Path:
    """submitit's stderr log of task ``job`` (its stdout is the ``.out`` beside it)."""
    return out / SLURM_DIR / f"{job}_0_log.err"


def status(out: Path, arms: list[str] | None, seeds: list[int] | None) -> list[str]:
    """One line per run of the study folder (or of ``arms`` x ``seeds``): evaluated, queued or running (its Slurm
    task), failed (with its log), trained, started (epochs saved) or not started."""
    try:
        study = json.loads((out / STUDY_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{out} holds no {STUDY_FILE}; name a folder written by scripts/study.py --output") from None
    seeds = seeds or study["seeds"]
    runs, evals = layout(out, seeds)
    jobs, live = submitted(out), queue()
    pairs = [(arm, seed) for seed in seeds for arm in ARMS if arm in (arms or study["arms"])]
    names = {pair: f"{pair[0]}-s{pair[1]}" for pair in pairs}
    return [f"{names[p]:<28} {_state(out, study, runs[p], evals, *p, jobs.get(names[p]), live)}" for p in pairs]


def _state(out: Path, study: dict, run: Path, evals: dict, arm: str, seed: int, job: str | None,
           live: dict[str, str] | None) -> str:
    log = run / LOG_FILE  # a header, then one row per epoch
    rows = len(log.read_text(encoding="utf-8").splitlines()) - 1 if log.exists() else 0
    saved = f"{max(0, rows)} of {study['identity']['epochs']} epochs saved"
    if evaluated(arm, seed, evals, study.get("also_eval"), out):
        return "evaluated"
    if job and live is not None and job in live:
        return f"{ {'RUNNING': 'running', 'PENDING': 'queued'}.get(live[job], live[job].lower())} (job {job}, {saved})"
    if job:
        ended = "submitted, no squeue here to ask" if live is None else "failed"
        return f"{ended} (job {job}, {saved}), log {log_path(out, job)}"
    if (run / SUMMARY_FILE).exists():
        return "trained"
    return f"started ({saved})" if (run / RESUME_FILE).exists() else "not started"
