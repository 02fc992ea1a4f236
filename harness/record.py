"""An evaluation's record on disk, read and written here by every command: ``results.json``, whose layout is
numbered by ``schema``, and beside it the per-image predictions, gzip-compressed compact JSON
(``predictions.json.gz``; the plain ``predictions.json`` of older evaluations is still read). Their content:
harness/README.md, "Output files".
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.metrics import POOLING_DIAGNOSTICS
from timm_rollout.atomic import atomic_path, write_json
from timm_rollout.errors import UserError
from timm_rollout.records import LEGACY_PREDICTIONS_FILE, PREDICTIONS_FILE, RESULTS_FILE

__all__ = ["SCHEMA", "load_results", "read_predictions", "read_results", "upgrade", "write_evaluation"]

SCHEMA = 1  # results.json's layout: raise it when a key is added, renamed or changes meaning, and teach upgrade()
# what results.json gained before it had a schema; a record made before holds them as null (never measured)
_ADDED = ("left_out", "code")
_ADDED_DATA = ("split_content", "content", "mask_convention", "bbox_format", "box_content")


def upgrade(record: dict[str, Any], where: str | Path = RESULTS_FILE) -> dict[str, Any]:
    """``record`` (a results.json) in the current layout, its numbers unchanged: what a record from before the
    schema lacks is added as null. A record of a newer schema is refused (``where`` names it)."""
    schema = record.get("schema", 0)
    if not isinstance(schema, int) or schema > SCHEMA:
        raise UserError(f"{where} has results.json schema {schema}, newer than this harness reads ({SCHEMA}); "
                        "upgrade timm-rollout")
    if schema < 1:
        record = {"schema": 1, **record, **{k: record.get(k) for k in _ADDED}}
        record["data"] = {**record["data"], **{k: record["data"].get(k) for k in _ADDED_DATA}}
        if record["data"].get("bank"):
            record["data"]["bank"] = {**record["data"]["bank"], "content": record["data"]["bank"].get("content")}
        record["metrics"] = {**record["metrics"], **{k: record["metrics"].get(k) for k in POOLING_DIAGNOSTICS}}
        record.setdefault("pooling_diagnostics", None)
    return record


def read_results(folder: str | Path) -> dict[str, Any]:
    """``results.json`` of an evaluation folder (or the file itself) in the current layout (:func:`upgrade`);
    one-line errors for a missing, invalid or foreign file."""
    path = Path(folder) if Path(folder).suffix == ".json" else Path(folder) / RESULTS_FILE
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path.parent} has no {RESULTS_FILE}; run python -m harness.eval --output {path.parent} "
                        "first") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); re-run python -m harness.eval for it") from None
    if "metrics" not in result or "model" not in result:
        raise UserError(f"{path} is not a harness.eval results.json (no metrics/model); re-run the evaluation")
    return upgrade(result, path)


def load_results(folders: Sequence[str | Path]) -> list[dict[str, Any]]:
    """:func:`read_results` of each folder, with the folder under ``"path"``."""
    return [{**read_results(f), "path": str(Path(f).parent if Path(f).suffix == ".json" else Path(f))}
            for f in folders]


def write_evaluation(folder: str | Path, results: dict[str, Any], predictions: dict[str, Any]) -> None:
    """Atomically write the predictions, then ``results.json`` (so an interrupted re-evaluation leaves the pair it
    had intact); the predictions byte-identical for the same content, a legacy ``predictions.json`` removed."""
    data = (json.dumps(predictions, separators=(",", ":")) + "\n").encode("utf-8")
    with atomic_path(Path(folder) / PREDICTIONS_FILE) as tmp:
        tmp.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    (Path(folder) / LEGACY_PREDICTIONS_FILE).unlink(missing_ok=True)
    write_json(Path(folder) / RESULTS_FILE, {"schema": SCHEMA, **results})


def read_predictions(folder: str | Path) -> dict[str, Any] | None:
    """The predictions of the evaluation in ``folder`` (``predictions.json.gz``, else a legacy ``predictions.json``);
    None when it has neither."""
    folder = Path(folder)
    if (folder / PREDICTIONS_FILE).is_file():
        return json.loads(gzip.decompress((folder / PREDICTIONS_FILE).read_bytes()))
    if (folder / LEGACY_PREDICTIONS_FILE).is_file():
        return json.loads((folder / LEGACY_PREDICTIONS_FILE).read_text(encoding="utf-8"))
    return None
