"""``scripts/study.py --executor slurm`` (harness.study.cluster): the array, its cap, the report job and each task's
command checked against stand-ins for sbatch, squeue and scontrol; the tasks run by submitit's debug executor (in
this process), by its local executor stopped at a time limit and requeued, and by a real Slurm (``slurm`` marker,
``bash scripts/slurm_local.sh`` starts one on this machine), each ending with the local pool's weights and metrics.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file

from harness import study
from harness.study import cluster, jobs, plan
from harness.study.command import render
from timm_rollout.errors import UserError

submitit = pytest.importorskip("submitit")
ROOT = Path(__file__).resolve().parents[1]
TRAIN = "--batch-size 32 --model-kwargs depth=1 --warmup-epochs 0 --max-eval-samples 100 --no-progress --workers 1"


def _argv(out: Path, *extra: str, arms: tuple[str, ...] = ("gap",), epochs: int = 3) -> list[str]:
    """Toy scale: depth-1 models, 256 training images, 3 epochs, a small evaluation."""
    return ["--dataset", "cifar10-sample", "--epochs", str(epochs), "--seeds", "0", "--max-train-samples", "256",
            "--arms", *arms, "--train-args", TRAIN, "--eval-per-class", "5", "--bank-per-class", "10",
            "--heatmaps", "0", "--device", "cpu", "--output", str(out), *extra]


@pytest.fixture(scope="module")
def local_study(tmp_path_factory) -> Path:
    """The toy study of two arms through the local pool (two runs side by side, one thread each)."""
    out = tmp_path_factory.mktemp("local") / "study"
    study.main(_argv(out, "--jobs", "2", arms=("gap", "rollout")))
    return out


def _same_run(out: Path, local: Path, arm: str, note: str = "") -> None:
    """The run's weights equal the local pool's tensor by tensor, and so does its evaluation's every metric."""
    mine, theirs = (load_file(folder / "runs" / f"{arm}-s0" / "model.safetensors") for folder in (out, local))
    assert mine.keys() == theirs.keys()
    for key in theirs:
        assert torch.equal(mine[key], theirs[key]), f"{arm}: {key} {note}"
    mine, theirs = (json.loads((folder / "eval" / f"{arm}-s0" / "results.json").read_text()) for folder in (out, local))
    assert mine["metrics"] == theirs["metrics"] and mine["model"]["sha256"] == theirs["model"]["sha256"]


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch) -> Path:
    """sbatch, squeue, scontrol and srun stand-ins first on PATH: sbatch keeps each script it is given as
    ``sbatch-<id>.sh`` and numbers the jobs from 1001, squeue prints ``queue.txt``, scontrol knows no partition
    ``nowhere``. Studies may live under /tmp here (one machine)."""
    calls = tmp_path / "calls"
    calls.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {"sbatch": f'n=$(( $(ls {calls} | grep -c "^sbatch-") + 1001 )); cp "$1" {calls}/sbatch-$n.sh; '
                         'echo "Submitted batch job $n"',
               "squeue": f"cat {calls}/queue.txt 2>/dev/null; true", "scontrol": '[ "$3" != nowhere ]', "srun": "true"}
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(cluster, "NODE_LOCAL", ())
    return calls


@pytest.mark.parametrize(("flags", "message"), [
    (["--executor", "slurm", "--jobs", "2"], "--jobs sizes the local pool; on Slurm cap the runs at once with --array"),
    (["--partition", "gpu"], "--partition is a Slurm setting; add --executor slurm, or drop it to run here"),
    (["--executor", "slurm", "--report-only"], "--report-only runs nothing on the cluster; drop --executor slurm"),
    (["--executor", "slurm", "--partition", "nowhere"], "Slurm has no partition 'nowhere'; pick one that sinfo lists"),
    (["--executor", "slurm", "--sbatch-args", "--comment 'x"], "argument --sbatch-args: does not split as shell wo"),
    (["--executor", "slurm", "--sbatch-args=--comment x"], "argument --sbatch-args: write each option as --name or --"),
    (["--status", "--epochs", "2"], "--status reads the study folder alone: drop --dataset, --epochs"),
])
def test_slurm_mistakes_are_one_line_before_anything_is_recorded(fake_slurm, tmp_path, flags, message):
    out = tmp_path / "study"
    with pytest.raises(UserError) as e:
        study.main(["--dataset", "cifar10-sample", "--epochs", "2", "--output", str(out), *flags])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert not out.exists()


def test_a_node_local_folder_a_missing_submitit_or_sbatch_are_one_line_each(tmp_path, monkeypatch):
    argv = ["--dataset", "cifar10-sample", "--epochs", "2", "--executor", "slurm", "--output"]
    node_local = Path("/tmp") / f"study-{os.getpid()}"  # refused before it is made
    with pytest.raises(UserError, match=r"^\S+ is on a node-local disk \(/tmp/.*\); the nodes write the study there"):
        study.main([*argv, str(node_local)])
    assert not node_local.exists()
    monkeypatch.setattr(cluster, "NODE_LOCAL", ())
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    with pytest.raises(UserError, match=r"^--executor slurm submits with sbatch, which is not on PATH here; run the"):
        study.main([*argv, str(tmp_path / "study")])
    monkeypatch.setitem(sys.modules, "submitit", None)  # as if not installed
    with pytest.raises(UserError, match=r"^--executor slurm needs submitit: pip install -e '\.\[slurm\]'$"):
        study.main([*argv, str(tmp_path / "study")])
    assert not (tmp_path / "study").exists()


def test_one_array_of_the_missing_runs_its_cap_the_report_job_and_each_task_s_command(fake_slurm, tmp_path, capsys):
    out = tmp_path / "study"
    slurm = ["--executor", "slurm", "--array-parallelism", "2", "--partition", "p", "--time", "30", "--gpus-per-task",
             "1", "--cpus-per-task", "1", "--mem", "4", "--account", "acc", "--qos", "q", "--sbatch-args",
             "--constraint=x --exclusive"]
    assert study.main(_argv(out, *slurm, arms=("cls", "gap", "rollout"))) is None  # submitted, the report too
    array, report = ((fake_slurm / f"sbatch-{n}.sh").read_text() for n in (1001, 1002))
    for line in ("--array=0-2%2", "--partition=p", "--time=30", "--gpus-per-task=1", "--cpus-per-task=1", "--mem=4G",
                 "--account=acc", "--qos=q", "--constraint=x", "--exclusive", "--signal=USR2@90",
                 "--job-name=study-study"):
        assert f"#SBATCH {line}\n" in array, line
    assert "#SBATCH --dependency=afterany:1001\n" in report and "--array" not in report
    assert json.loads((out / "slurm" / "jobs.json").read_text()) == {"cls-s0": "1001_0", "gap-s0": "1001_1",
                                                                      "rollout-s0": "1001_2"}
    local = study.build_parser().parse_args(_argv(out, arms=("cls", "gap", "rollout")))
    for i, arm in enumerate(("cls", "gap", "rollout")):  # each task is the local pool's run_arm of its run
        task = submitit.core.utils.DelayedSubmission.load(out / "slurm" / f"1001_{i}_submitted.pkl").function
        fn = task.fn
        assert task.cwd == os.getcwd() and fn.func is jobs.run_arm and fn.args[1:3] == (arm, 0)
        assert not fn.args[0].commit and fn.args[0].threads == 1
        run = str(fn.args[3][arm, 0])
        assert plan.train_command(fn.args[0], arm, 0, run) == plan.train_command(local, arm, 0, run)
    report = submitit.core.utils.DelayedSubmission.load(out / "slurm" / "1002_submitted.pkl").function.fn
    assert report.func is render and not report.args[0].commit
    # --status from the folder: the queue, a task that left it unfinished, its log
    (fake_slurm / "queue.txt").write_text("1001_0|RUNNING\n1001_1|PENDING\n")
    capsys.readouterr()
    study.main(["--output", str(out), "--status"])
    assert [line.split(None, 1) for line in capsys.readouterr().out.splitlines()] == [
        ["cls-s0", "running (job 1001_0, 0 of 3 epochs saved)"], ["gap-s0", "queued (job 1001_1, 0 of 3 epochs saved)"],
        ["rollout-s0", f"failed (job 1001_2, 0 of 3 epochs saved), log {out}/slurm/1001_2_0_log.err"]]
    # The same command again submits only what is neither finished nor in the queue, the report after both.
    assert study.main(_argv(out, *slurm, arms=("cls", "gap", "rollout"))) is None
    assert "--array" not in (fake_slurm / "sbatch-1003.sh").read_text()
    assert "#SBATCH --dependency=afterany:1001:1003\n" in (fake_slurm / "sbatch-1004.sh").read_text()
    assert json.loads((out / "slurm" / "jobs.json").read_text())["rollout-s0"] == "1003"


def test_status_of_a_local_study_from_its_files(local_study, tmp_path, capsys):
    out = shutil.copytree(local_study, tmp_path / "study")
    shutil.rmtree(out / "eval" / "gap-s0")
    (out / "runs" / "gap-s0" / "summary.json").unlink()  # as if stopped after its last epoch's state was saved
    (out / "runs" / "gap-s0" / "resume.safetensors").write_bytes(b"")
    (out / "eval" / "rollout-s0" / "results.json").unlink()
    record = json.loads((out / "study.json").read_text())
    (out / "study.json").write_text(json.dumps({**record, "seeds": [0, 1]}))
    study.main(["--output", str(out), "--status"])
    assert [line.split(None, 1) for line in capsys.readouterr().out.splitlines()] == [
        ["gap-s0", "started (3 of 3 epochs saved)"], ["rollout-s0", "trained"], ["gap-s1", "not started"],
        ["rollout-s1", "not started"]]
    shutil.rmtree(out / "runs" / "gap-s0")
    shutil.copytree(local_study / "eval" / "rollout-s0", out / "eval" / "rollout-s0", dirs_exist_ok=True)
    study.main(["--output", str(out), "--status"])
    assert [line.split(None, 1) for line in capsys.readouterr().out.splitlines()][:2] == [
        ["gap-s0", "not started"], ["rollout-s0", "evaluated"]]


class Recording(submitit.DebugExecutor):
    """submitit's debug executor (jobs run in this process when asked for their result), keeping its jobs."""

    made: ClassVar[list] = []

    def _internal_process_submissions(self, delayed):
        made = super()._internal_process_submissions(delayed)
        Recording.made += made
        return made


def test_debug_executor_tasks_train_and_evaluate_exactly_as_the_local_pool(local_study, fake_slurm, tmp_path,
                                                                          monkeypatch):
    Recording.made = []
    monkeypatch.setattr(cluster, "make_executor", lambda args, folder, dependency=None: Recording(folder))
    out = tmp_path / "debug"
    assert study.main(_argv(out, "--executor", "slurm", "--cpus-per-task", "1")) is None
    assert len(Recording.made) == 2  # the array's one task, then the report
    for job in Recording.made:
        job.result()
    _same_run(out, local_study, "gap")
    assert "gap" in (out / "report.md").read_text()


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_task_stopped_at_its_time_limit_is_requeued_and_ends_with_the_uninterrupted_weights(
        local_study, fake_slurm, tmp_path, monkeypatch):
    """submitit's local executor: the task gets the time limit's signal (USR2) once its run has saved an epoch, as
    Slurm sends it before the limit; submitit requeues it and the run resumes."""
    made = []

    def executor(args, folder, dependency=None):
        if dependency:  # the report job: not run here
            return submitit.DebugExecutor(folder)
        local = submitit.LocalExecutor(folder, max_num_timeout=3)
        local.update_parameters(timeout_min=10)
        local._internal_process_submissions = lambda d, real=local._internal_process_submissions: made.extend(
            real(d)) or made
        return local

    monkeypatch.setattr(cluster, "make_executor", executor)
    out = tmp_path / "requeue"
    study.main(_argv(out, "--executor", "slurm", "--cpus-per-task", "1"))
    (job,) = made
    log_csv, deadline = out / "runs" / "gap-s0" / "log.csv", time.time() + 300  # written after the resume state
    while not log_csv.exists() and time.time() < deadline:
        time.sleep(0.1)
    saved = len(log_csv.read_text().splitlines()) - 1
    os.kill(_children(job._process.pid)[0], signal.SIGUSR2)  # the task (its trainer is the task's child)
    job.result()
    log = job.stdout()
    assert 1 <= saved < 3 and "this job is timed-out" in log and "Requeued job" in log
    assert log.count("-m timm_rollout.train") == 2  # started again, resuming its saved epochs
    _same_run(out, local_study, "gap")


def _slurm_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    done = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, check=False)
    return done.returncode == 0 and any(s in done.stdout for s in ("idle", "mix", "alloc"))


@pytest.mark.slurm
@pytest.mark.skipif(not _slurm_up(), reason="needs a running Slurm: sudo bash scripts/slurm_local.sh starts one here")
def test_a_real_slurm_runs_the_study_requeues_a_task_and_matches_the_local_pool(local_study, tmp_path, monkeypatch,
                                                                                  capsys):
    """Through sbatch: one array of two tasks (one CPU each), one task requeued by ``scontrol requeue`` once its run
    has saved an epoch, the report job after them; then the same command with --commit commits each run and the
    report from here."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for argv in (["init", "-q"], ["config", "user.email", "t@t"], ["config", "user.name", "t"]):
        subprocess.run(["git", *argv], cwd=repo, check=True)
    shutil.copyfile(ROOT / ".gitignore", repo / ".gitignore")
    out = repo / "results" / "toy"
    monkeypatch.setattr(cluster, "NODE_LOCAL", ())
    argv = _argv(out, "--executor", "slurm", "--cpus-per-task", "1", "--time", "10", "--commit",
                 arms=("gap", "rollout"))
    assert study.main(argv) is None
    report_job = capsys.readouterr().out.split("+ submitted the report as job ")[1].split(",")[0]
    requeued, released, deadline = [], [], time.time() + 900
    while time.time() < deadline and (set(live := cluster.queue()) & {*cluster.submitted(out).values(), report_job}):
        for run, job in cluster.submitted(out).items():
            if not requeued and (out / "runs" / run / "resume.safetensors").exists() and live.get(job) == "RUNNING":
                subprocess.run(["scontrol", "requeue", job], check=True)
                requeued.append(job)
            elif job in requeued and job not in released and live.get(job) == "PENDING":
                # Slurm holds a requeued job for two minutes; let it start at once
                subprocess.run(["scontrol", "update", f"jobid={job}", "starttime=now"], check=True)
                released.append(job)
        time.sleep(0.2)
    assert requeued, "no task was requeued"
    assert (out / "slurm" / f"{requeued[0]}_0_log.out").read_text().count("-m timm_rollout.train") == 2
    for arm in ("gap", "rollout"):
        _same_run(out, local_study, arm, f"(task {requeued[0]} requeued)")
    assert (out / "report.md").exists()  # rendered by the report job
    study.main(["--output", str(out), "--status"])
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()] == ["evaluated", "evaluated"]
    assert study.main(argv) == out / "report.md"  # nothing left to run: commits and renders here
    log = subprocess.run(["git", "log", "--format=%s"], cwd=repo, capture_output=True, text=True).stdout.splitlines()
    assert [line.split(" (")[0] for line in log] == ["study: report", "study: rollout seed 0", "study: gap seed 0",
                                                     "study: settings and commands of toy"]
