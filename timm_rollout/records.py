"""What a run leaves on disk: the name of every file the project writes, and the software versions it records.

Training, evaluation, export, the Hub upload and the study all take their file names from here, so a name
changes in one place and every reader follows.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

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
PREDICTIONS_FILE = "predictions.json.gz"  # gzip-compressed JSON (harness.record)
LEGACY_PREDICTIONS_FILE = "predictions.json"  # the same JSON uncompressed, as evaluations wrote it before
FEATURES_FILE = "features.safetensors"
COSINE_FILE = "cosine_matrix.png"
HEATMAPS_FILE = "heatmaps.png"
FAITHFULNESS_FILE = "faithfulness.png"
EVAL_FILES = (RESULTS_FILE, PREDICTIONS_FILE, LEGACY_PREDICTIONS_FILE, FEATURES_FILE, COSINE_FILE, HEATMAPS_FILE,
              FAITHFULNESS_FILE)  # all of them: what `harness.eval --overwrite` removes first
# A comparison (python -m harness.compare) and a study (scripts/study.py; it also writes CURVES_FILE and HEATMAPS_FILE).
REPORT_FILE = "report.md"
COMPARISON_FILE = "comparison.png"
STUDY_FILE = "study.json"
EXPLORE_FILE = "explore.html"  # a study's harness.explore page of its arms
POOLING_FILE = "pooling.png"  # a study's pooling diagnostics per arm
DOSE_FILE = "dose.png"  # a study's arm - base top-1 and object masses at each --also-eval dose
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


@functools.cache
def code_version() -> dict[str, str | bool | None]:
    """The code this process runs (read once): package version, git commit and whether the sources differ from it
    (``dirty``); ``commit`` and ``dirty`` are None outside a checkout."""
    try:
        package = version("timm-rollout")
    except PackageNotFoundError:
        package = None
    root = Path(__file__).resolve().parents[1]
    git = ["git", "-C", str(root)]
    try:
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        status = subprocess.run([*git, "status", "--porcelain", "--", "timm_rollout", "harness", "scripts",
                                 "pyproject.toml"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {"version": package, "commit": None, "dirty": None}
    if commit.returncode or status.returncode or not (root / "timm_rollout").is_dir():
        return {"version": package, "commit": None, "dirty": None}
    return {"version": package, "commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def code_label(code: dict | None = None) -> str:
    """One line naming the code, e.g. ``timm-rollout 0.1.0 @ 1a2b3c4d5e6f`` (``+ uncommitted changes`` when dirty):
    the key under which a run counts its epochs per code version."""
    code = code_version() if code is None else code
    label = f"timm-rollout {code.get('version')}"
    if code.get("commit"):
        label += f" @ {code['commit'][:12]}" + (" + uncommitted changes" if code.get("dirty") else "")
    return label


def code_labels(records: list[dict]) -> str:
    """The code versions (:func:`code_label`) that wrote ``records`` (evaluations, runs), sorted, comma-separated."""
    return ", ".join(sorted({code_label(r["code"]) if r.get("code") else "not recorded" for r in records}))


ELIDED = ".../"  # what a record holds before the name of a folder it does not place (portable_path)


def portable_path(path: str | Path | None, base: str | Path) -> str | None:
    """``path`` as the user typed it, as a record written in ``base`` holds it, naming no folder of the machine and
    never the target of a symbolic link: as typed when relative (an alias, a Hub id, a relative folder); relative to
    ``base`` when absolute and both lie in the working directory's tree; else :data:`ELIDED` and the folder's name only
    (the record's content hash says what it held). :func:`resolve_recorded` reads it back."""
    if path is None or not os.path.isabs(os.path.expanduser(str(path))):
        return None if path is None else str(path)
    found, base, tree = (os.path.abspath(os.path.expanduser(str(p))) for p in (path, base, os.getcwd()))
    if all(os.path.commonpath([p, tree]) == tree for p in (found, base)):
        return os.path.relpath(found, base)
    return ELIDED + os.path.basename(found)


def recorded_data(typed: str, found: str, base: str | Path) -> str:
    """A data set as a record written in ``base`` names it: the Hub id it was ``found`` as; a local folder (the
    ``--dataset`` typed, not the folder its links resolve to) by :func:`portable_path` of its absolute path; an
    alias of the package's sample by its name."""
    if not os.path.isabs(found):
        return found
    local = os.path.expanduser(typed)
    return portable_path(os.path.abspath(local), base) if os.path.exists(local) else typed


def portable_args(args: dict, base: str | Path) -> dict:
    """A command's arguments for a record written in ``base``: its folder arguments by :func:`portable_path`."""
    return {**args, **{key: portable_path(args[key], base) for key in ("dataset", "output") if key in args}}


def resolve_recorded(path: str | None, base: str | Path) -> str | None:
    """A path read from a record written in ``base``: resolved against ``base`` (links kept) where that names
    something, else as recorded (as typed, or :data:`ELIDED` and a folder's name)."""
    if path is None or os.path.isabs(path):
        return path
    joined = os.path.abspath(os.path.join(str(base), path))
    return joined if os.path.exists(joined) else path
