"""``python -m harness.sweep`` was removed: each value of a training flag is its own study, compared by
``python -m harness.compare`` (harness/README.md, "Compare runs")."""

from timm_rollout.errors import fail

if __name__ == "__main__":
    fail("harness.sweep was removed; compare each value's study with python -m harness.compare "
         "STUDY/eval/{cls,gap,rollout}-s? --output DIR")
