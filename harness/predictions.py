"""An evaluation's per-image predictions on disk: gzip-compressed compact JSON (``predictions.json.gz``, its
content in harness/README.md, "Output files"), or the plain ``predictions.json`` of older evaluations.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from timm_rollout.atomic import atomic_path
from timm_rollout.records import LEGACY_PREDICTIONS_FILE, PREDICTIONS_FILE

__all__ = ["read_predictions", "write_predictions"]


def write_predictions(folder: str | Path, predictions: dict[str, Any]) -> Path:
    """Atomically write ``predictions`` as ``folder/predictions.json.gz`` (byte-identical for the same content);
    a legacy ``predictions.json`` of an earlier evaluation in ``folder`` goes, so no reader sees stale predictions."""
    data = (json.dumps(predictions, separators=(",", ":")) + "\n").encode("utf-8")
    path = Path(folder) / PREDICTIONS_FILE
    with atomic_path(path) as tmp:
        tmp.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    (Path(folder) / LEGACY_PREDICTIONS_FILE).unlink(missing_ok=True)
    return path


def read_predictions(folder: str | Path) -> dict[str, Any] | None:
    """The predictions of the evaluation in ``folder`` (``predictions.json.gz``, else a legacy ``predictions.json``);
    None when it has neither."""
    folder = Path(folder)
    if (folder / PREDICTIONS_FILE).is_file():
        return json.loads(gzip.decompress((folder / PREDICTIONS_FILE).read_bytes()))
    if (folder / LEGACY_PREDICTIONS_FILE).is_file():
        return json.loads((folder / LEGACY_PREDICTIONS_FILE).read_text(encoding="utf-8"))
    return None
