"""``python -m timm_rollout.train`` and ``torchrun -m timm_rollout.train``: one-line errors, exit code 2."""

from ..errors import run_cli
from .loop import main

if __name__ == "__main__":
    run_cli(main)
