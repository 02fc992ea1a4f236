"""``import timm_rollout`` and every command's ``--help`` and argument errors load no timm (nor datasets, faiss,
submitit, matplotlib, scikit-learn), yet the models are registered with timm in any order of imports, and an argument
error is one line.

Each check is a fresh interpreter (a module loaded once stays loaded), run on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("timm", "datasets", "faiss", "matplotlib", "sklearn", "submitit")
REGISTERED = "assert {'vit_tiny_cifar_cls', 'vit_tiny_cifar_gap', 'vit_tiny_cifar_rollout'} <= set(timm.list_models())"


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)


def test_help_and_argument_errors_come_before_timm_and_the_models_register_when_it_loads():
    code = f"""
import runpy, sys
for argv in (["--help"], ["--output", "out", "--epochs", "0"]):
    sys.argv = ["python -m timm_rollout.train", *argv]
    try:
        runpy.run_module("timm_rollout.train", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        print("exit", e.code)
print("loaded", sorted(m for m in {HEAVY!r} if m in sys.modules))
import timm
{REGISTERED}
model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4)
model.global_pool = "rollout"  # routed to set_pooling once timm_rollout.models is in
print(type(model).__name__)
"""
    done = _python(code)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("usage: python -m timm_rollout.train") and "(default: 200)" in done.stdout
    assert lines[-4:] == ["exit 0", "exit 2", "loaded []", "RolloutPooledVisionTransformer"], lines[-4:]
    assert done.stderr == "error: argument --epochs: must be an integer >= 1, got 0\n"


@pytest.mark.parametrize("first", ["import timm_rollout.dropout", "import timm_rollout.loading",
                                   "from timm_rollout import set_pooling", "import timm, timm_rollout"])
def test_the_models_are_registered_whichever_module_is_imported_first(first):
    done = _python(f"{first}\nimport timm\n{REGISTERED}")
    assert done.returncode == 0, done.stderr


# Every command the READMEs document besides timm_rollout.train (above), as typed after ``python``: a bad value
# and the one-line error it gets, which comes from the flag's own check, before anything is loaded.
COMMANDS = [
    ("-m harness.eval", ["--model", "vit_tiny_cifar_cls", "--temperature", "0"],
     "error: argument --temperature: must be a number > 0, got 0"),
    ("-m harness.compare", ["run", "--metrics", "top2"], "error: argument --metrics: invalid choice: 'top2'"),
    ("-m harness.explain", ["--model", "vit_tiny_cifar_cls", "--target-class", "-1"],
     "error: argument --target-class: must be an integer >= 0, got -1"),
    ("-m harness.explore", ["--model", "vit_tiny_cifar_cls", "--images", "0"],
     "error: argument --images: must be an integer >= 1, got 0"),
    ("scripts/study.py", ["--epochs", "0"], "error: argument --epochs: must be an integer >= 1, got 0"),
    ("scripts/push_to_hub.py", ["run"], "error: the following arguments are required: --repo-id"),
    ("scripts/convert_checkpoint.py", ["--num-heads", "0"],
     "error: argument --num-heads: must be an integer >= 1, got 0"),
    ("scripts/make_cluttered.py", ["--canvas", "0"],
     "error: argument --canvas: must be an integer in [1, 1024], got 0"),
    ("scripts/make_sample.py", ["--train-per-class", "0"],
     "error: argument --train-per-class: must be an integer >= 1, got 0"),
    ("scripts/summary_figure.py", ["--pairs", "gap"], "error: argument --pairs: 'gap': give a pair as BASE:OTHER"),
    ("scripts/bench_faithfulness.py", ["--images", "0"], "error: argument --images: must be an integer >= 1, got 0"),
    ("scripts/bench_harness.py", ["--queries", "0"], "error: argument --queries: must be an integer >= 1, got 0"),
    ("scripts/bench_models.py", ["--steps", "0"], "error: argument --steps: must be an integer >= 1, got 0"),
    ("scripts/bench_train.py", ["--compile", "fast"], "error: argument --compile: invalid choice: 'fast'"),
]


@pytest.mark.parametrize(("command", "bad", "message"), COMMANDS, ids=[c for c, _, _ in COMMANDS])
def test_every_command_s_help_and_argument_errors_come_before_the_heavy_libraries(command, bad, message):
    target = command.removeprefix("-m ")
    code = f"""
import os, runpy, sys
target = {target!r}
if target.endswith(".py"):  # as `python scripts/x.py` runs it: its folder first on the path
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
for argv in (["--help"], {bad!r}):
    sys.argv = [target, *argv]
    try:
        if target.endswith(".py"):
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        print("exit", e.code)
print("loaded", sorted(m for m in {HEAVY!r} if m in sys.modules))
"""
    done = _python(code)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"usage: python {command} "), lines[0]
    assert lines[-3:] == ["exit 0", "exit 2", "loaded []"], lines[-3:]
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(message), done.stderr
