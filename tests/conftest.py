"""Shared test setup: where the full CIFAR-10 is found, the ``slow`` and ``cuda`` markers, threads per worker.

Most tests use the CIFAR-10 sample shipped in the package (``cifar10-sample``). The few that need the full
data set take the ``cifar10`` fixture: the folder named by ``TIMM_ROLLOUT_CIFAR10``, else ``../shared/data/cifar10``
beside the repository; without either they skip, and ``-ra`` (in the pytest addopts) prints why.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

CIFAR10_ENV = "TIMM_ROLLOUT_CIFAR10"
SLOW_ENV = "TIMM_ROLLOUT_SLOW_TESTS"
SHARED_CIFAR10 = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "cifar10"

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One torch thread per pytest-xdist worker (and per subprocess a test starts): with more threads than cores,
    # OpenMP threads wait on a peer whose core another worker holds, and the suite runs slower than in one process.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def full_cifar10() -> Path | None:
    """The full CIFAR-10 folder (Hub layout, as ``datasets`` reads it), or None when this machine has none."""
    named = os.environ.get(CIFAR10_ENV)
    if named:
        if not Path(named).is_dir():
            raise pytest.UsageError(f"{CIFAR10_ENV}={named} is not a folder; point it at a CIFAR-10 folder or unset it")
        return Path(named)
    return SHARED_CIFAR10 if SHARED_CIFAR10.is_dir() else None


@pytest.fixture(scope="session")
def cifar10() -> Path:
    """The full CIFAR-10 folder; the test skips, naming where it looked, when there is none."""
    found = full_cifar10()
    if found is None:
        pytest.skip(f"needs the full CIFAR-10: set {CIFAR10_ENV}=/path/to/cifar10 or place it at {SHARED_CIFAR10}")
    return found


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``cuda`` tests skip without a CUDA GPU; ``slow`` tests skip unless TIMM_ROLLOUT_SLOW_TESTS=1."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    not_slow = pytest.mark.skip(reason=f"slow (minutes on a 2-core CPU); set {SLOW_ENV}=1 to run it")
    gpu, slow = torch.cuda.is_available(), bool(os.environ.get(SLOW_ENV))
    for item in items:
        if item.get_closest_marker("cuda") and not gpu:
            item.add_marker(no_gpu)
        if item.get_closest_marker("slow") and not slow:
            item.add_marker(not_slow)
