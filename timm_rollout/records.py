"""What a run leaves on disk: the name of every file the project writes, and the software versions it records.

Training, evaluation, export, the Hub upload and the study all take their file names from here, so a name
changes in one place and every reader follows.
"""

from __future__ import annotations

import hashlib
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

__all__ = [
    "ARGS_FILE",
    "CARD_FILE",
    "COMPARISON_FILE",
    "CONFIG_FILE",
    "COSINE_FILE",
    "CURVES_FILE",
    "DATA_DIR",
    "FAITHFULNESS_FILE",
    "FEATURES_FILE",
    "HEATMAPS_FILE",
    "HUB_DIR",
    "LEGACY_PREDICTIONS_FILE",
    "LOCALISATION_FILE",
    "LOG_FILE",
    "MODEL_FILES",
    "POOLING_FILE",
    "PREDICTIONS_FILE",
    "REPORT_FILE",
    "RESULTS_FILE",
    "RESUME_FILE",
    "STUDY_FILE",
    "SUMMARY_FILE",
    "WEIGHTS_FILE",
    "data_card_title",
    "sha256_file",
    "versions",
]

# A model export (timm's save_for_hf layout): what `timm.create_model("local-dir:...")` and the Hub read.
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
MODEL_FILES = (WEIGHTS_FILE, CONFIG_FILE)
# A training run (python -m timm_rollout.train --output).
RESUME_FILE = "resume.safetensors"
ARGS_FILE = "train_args.json"
LOG_FILE = "log.csv"
CURVES_FILE = "curves.png"
SUMMARY_FILE = "summary.json"
# An evaluation (python -m harness.eval --output).
RESULTS_FILE = "results.json"
PREDICTIONS_FILE = "predictions.json.gz"  # gzip-compressed JSON (harness.predictions)
LEGACY_PREDICTIONS_FILE = "predictions.json"  # the same JSON uncompressed, as evaluations wrote it before
FEATURES_FILE = "features.safetensors"
COSINE_FILE = "cosine_matrix.png"
HEATMAPS_FILE = "heatmaps.png"
FAITHFULNESS_FILE = "faithfulness.png"
# A comparison (python -m harness.compare) and a study (scripts/study.py; it also writes CURVES_FILE and HEATMAPS_FILE).
REPORT_FILE = "report.md"
COMPARISON_FILE = "comparison.png"
STUDY_FILE = "study.json"
POOLING_FILE = "pooling.png"  # a study's pooling diagnostics per arm
LOCALISATION_FILE = "localisation.png"  # a study's pooling weight inside and outside the object's box per arm
HUB_DIR = "hub"  # a study's Hub exports: hub/<arm>, the best run of each arm
DATA_DIR = "data"  # a study's copies of its data sets' cards: data/<data set folder name>.md
NOTES_FILE = "notes.md"  # hand-written notes in a study folder, included in its report.md
# The model card of a Hub upload, and a data set folder's card (scripts/make_cluttered.py writes one).
CARD_FILE = "README.md"

PACKAGES = ("torch", "timm", "datasets", "faiss-cpu", "scikit-learn", "numpy", "safetensors", "timm-rollout")


def data_card_title(folder: str | Path) -> str | None:
    """The title (first ``# `` line) of a data set folder's card, or None when it has none."""
    card = Path(folder) / CARD_FILE
    if not card.is_file():
        return None
    return next((line[2:].strip() for line in card.read_text(encoding="utf-8").splitlines()
                 if line.startswith("# ")), None)


def versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Python's and each installed distribution's version (None when it is not installed), for run records."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in packages:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
