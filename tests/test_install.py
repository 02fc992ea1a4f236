"""A torchvision that does not match torch (it fails on import, as after an install that mixed two indexes): every
command ends with one line naming the cause and the pip command that installs a matching pair."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from timm_rollout import errors
from timm_rollout.cli import run_cli
from timm_rollout.errors import UserError, install_error

ROOT = Path(__file__).resolve().parents[1]
BROKEN = "operator torchvision::nms does not exist"


@pytest.fixture
def broken_torchvision(tmp_path: Path) -> Path:
    """A folder holding a ``torchvision`` package whose import fails as a mismatched build's does."""
    package = tmp_path / "torchvision"
    package.mkdir()
    (package / "__init__.py").write_text(f"raise RuntimeError({BROKEN!r})\n")
    return tmp_path


# torch 2.N pairs with torchvision 0.(N + 15): PyTorch's published compatibility table
@pytest.mark.parametrize(("torch_version", "want"), [
    ("2.5.1+cu121", "pip install torch==2.5.1 torchvision==0.20.* (or both from https://download.pytorch.org/whl/"
                    "cu121 with --index-url)"),
    ("2.0.1", "pip install torch==2.0.1 torchvision==0.15.*"),
    ("2.14.1+cpu", "pip install torch==2.14.1 torchvision==0.29.* (or both from https://download.pytorch.org/whl/cpu "
                   "with --index-url)"),
])
def test_the_fix_names_the_matching_pair_from_pips_index_first(monkeypatch, torch_version, want):
    """pip's own index first (PyTorch's may be unreachable, as where pip then mixed two indexes), the build's after."""
    monkeypatch.setattr(errors, "_version", lambda package: torch_version if package == "torch" else "0.1.0")
    assert errors._matching_pair() == want


def test_the_installed_working_pair_fits_the_rule():
    """This machine's torch and torchvision import together: the rule names the torchvision installed."""
    vision = metadata.version("torchvision").split("+")[0].rsplit(".", 1)[0]
    assert f"torchvision=={vision}.*" in errors._matching_pair()


def test_only_an_error_out_of_torchvisions_import_is_named(broken_torchvision):
    with pytest.raises(RuntimeError) as e:
        runpy.run_path(str(broken_torchvision / "torchvision" / "__init__.py"))
    found = install_error(e.value)
    assert isinstance(found, UserError) and str(found).startswith(
        "install a matching torch/torchvision pair: pip install torch==") and str(found).endswith(
        f"; torchvision {metadata.version('torchvision')} does not match torch {metadata.version('torch')} "
        f"(importing it fails: {BROKEN})")
    assert install_error(RuntimeError("CUDA out of memory")) is None
    missing = ModuleNotFoundError("No module named 'torchvision'", name="torchvision")
    assert str(install_error(missing)).startswith("torchvision is not installed; install it with the torch it matches")


def test_run_cli_names_it_when_a_command_imports_it_late(broken_torchvision, capsys):
    def main(argv):
        runpy.run_path(str(broken_torchvision / "torchvision" / "__init__.py"))

    with pytest.raises(SystemExit) as e:
        run_cli(main, [])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: install a matching") and err.count("\n") == 1 and BROKEN in err
    with pytest.raises(RuntimeError, match="something else"):  # anything else is not hidden
        run_cli(lambda argv: (_ for _ in ()).throw(RuntimeError("something else")), [])


def test_a_command_and_a_library_import_name_it_in_one_line(broken_torchvision):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(broken_torchvision), str(ROOT)])}
    command = ["-m", "harness.eval", "--model", "vit_tiny_cifar_cls", "--output", str(broken_torchvision / "out")]
    cli = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)  # its flags, not --help: --help comes before timm, which imports torchvision
    assert cli.returncode == 2 and cli.stdout == "" and cli.stderr.count("\n") == 1, cli.stderr
    assert cli.stderr.startswith("error: install a matching torch/torchvision pair: pip install torch==")
    assert BROKEN in cli.stderr
    library = subprocess.run([sys.executable, "-c", "import timm_rollout, timm"], capture_output=True, text=True,
                             env=env, cwd=ROOT, timeout=300)  # the package registers its models as timm loads
    assert library.returncode == 1
    assert library.stderr.splitlines()[-1].startswith("ImportError: install a matching torch/torchvision pair: ")
