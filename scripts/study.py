"""The study in one command (``harness.study``): train every pooling arm per seed with one recipe, evaluate every
run, write a report.

    python scripts/study.py --dataset cifar10 --epochs 30 --seeds 0 1 2 --output study/c10
"""

from harness.study import main
from timm_rollout.errors import run_cli

if __name__ == "__main__":
    run_cli(main)
