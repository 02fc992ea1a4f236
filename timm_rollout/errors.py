"""User-facing errors: :class:`UserError`, a torch/torchvision pair that does not match, and the one line a
command ends with (:func:`fail`). The command-line machinery that raises and renders them is :mod:`timm_rollout.cli`.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path


class UserError(ValueError):
    """A mistake in the user's input: one line naming the fix, printed by the commands without a traceback."""


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _matching_pair() -> str:
    """``pip install torch==X torchvision==Y``: the installed torch with the torchvision of its release (torch 2.N
    pairs with torchvision 0.(N + 15)) from pip's own index, which every pip reaches; PyTorch's index of the torch
    build (``+cpu``, ``+cu121``) named after it, for where that one is reachable."""
    torch_version = _version("torch")
    if torch_version is None:
        return "pip install torch torchvision (from one index)"
    release, _, build = torch_version.partition("+")
    major, minor = [*release.split("."), "0"][:2]
    vision = f"==0.{int(minor) + 15}.*" if major == "2" and minor.isdigit() else ""
    index = f" (or both from https://download.pytorch.org/whl/{build} with --index-url)" if build else ""
    return f"pip install torch=={release} torchvision{vision}{index}"


def _importing_torchvision(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) came out of torchvision's import: its module code failing,
    e.g. ``operator torchvision::nms does not exist`` when its compiled ops were built for another torch."""
    while error is not None:
        frames = traceback.extract_tb(error.__traceback__)
        if any(f.name == "<module>" and f"{os.sep}torchvision{os.sep}" in f.filename for f in frames) or \
                "partially initialized module 'torchvision'" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def install_error(error: BaseException) -> UserError | None:
    """The one-line error for a missing or mismatched torchvision's import exception; None for any other."""
    if isinstance(error, ModuleNotFoundError) and error.name == "torchvision":
        return UserError(f"torchvision is not installed; install it with the torch it matches: {_matching_pair()}")
    if not isinstance(error, (ImportError, RuntimeError, AttributeError, OSError)) or not _importing_torchvision(error):
        return None
    reason = str(error).strip().splitlines()[0][:120] if str(error).strip() else type(error).__name__
    return UserError(f"install a matching torch/torchvision pair: {_matching_pair()}; torchvision "
                     f"{_version('torchvision')} does not match torch {_version('torch')} (importing it fails: "
                     f"{reason})")


def _running_cli() -> bool:
    """Whether this process is a command of this project: ``python -m ...`` (while its package is imported,
    ``sys.argv[0]`` is ``-m``) or a script in its repository."""
    first = sys.argv[0] if sys.argv else ""
    if first == "-m":
        return True
    return first not in ("", "-c") and Path(__file__).resolve().parents[1] in Path(first).resolve().parents


@contextmanager
def install_guard() -> Iterator[None]:
    """Around the package's first imports: a broken torch/torchvision pair (:func:`install_error`) ends a command
    with one line ``error: ...`` and exit 2, and is an ``ImportError`` with that line elsewhere."""
    try:
        yield
    except Exception as e:
        found = install_error(e)
        if found is None:
            raise
        if _running_cli():
            fail(str(found))
        raise ImportError(str(found)) from e


def fail(message: str) -> None:
    """Print ``error: message`` on one line and exit 2: how every command ends on a user's mistake."""
    print("error: " + " ".join(message.split("\n")), file=sys.stderr)
    raise SystemExit(2) from None

