"""``import timm_rollout`` and ``python -m timm_rollout.train --help`` load no timm (nor datasets, faiss,
matplotlib), yet the models are registered with timm in any order of imports, and an argument error is one line.

Each check is a fresh interpreter (a module loaded once stays loaded), run on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("timm", "datasets", "faiss", "matplotlib", "sklearn")
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
