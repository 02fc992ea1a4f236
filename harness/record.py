"""An evaluation's record, in memory (:class:`Evaluation`) and on disk, read and written here by every command:
``results.json``, whose layout is numbered by ``schema``, and beside it the per-image predictions, gzip-compressed
compact JSON (``predictions.json.gz``; the plain ``predictions.json`` of older evaluations is still read). Their
content: harness/README.md, "Output files".
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness import metrics
from harness.metrics import POOLING_DIAGNOSTICS
from timm_rollout.atomic import atomic_path, write_json
from timm_rollout.data import ImageSet, box_hash
from timm_rollout.device import device_name, fp32_precision, precision_name
from timm_rollout.errors import UserError
from timm_rollout.masks import BOX_FORMATS
from timm_rollout.progress import Stopwatch
from timm_rollout.records import (
    EVAL_FILES,
    FEATURES_FILE,
    LEGACY_PREDICTIONS_FILE,
    PREDICTIONS_FILE,
    RESULTS_FILE,
    portable_args,
    portable_path,
    recorded_data,
    versions,
)

__all__ = ["SCHEMA", "Evaluation", "config_record", "data_record", "environment_record", "held", "load_results",
           "model_config", "predictions_record", "read_predictions", "read_results", "summary_line", "upgrade",
           "write_evaluation"]

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
            bank = record["data"]["bank"]
            record["data"]["bank"] = {**bank, "content": bank.get("content")}
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
    """Atomically write the predictions, then ``results`` as ``results.json`` (so an interrupted re-evaluation
    leaves the pair it had intact); the predictions byte-identical for the same content, a legacy
    ``predictions.json`` removed."""
    data = (json.dumps(predictions, separators=(",", ":")) + "\n").encode("utf-8")
    with atomic_path(Path(folder) / PREDICTIONS_FILE) as tmp:
        tmp.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    (Path(folder) / LEGACY_PREDICTIONS_FILE).unlink(missing_ok=True)
    write_json(Path(folder) / RESULTS_FILE, results)


def read_predictions(folder: str | Path) -> dict[str, Any] | None:
    """The predictions of the evaluation in ``folder`` (``predictions.json.gz``, else a legacy ``predictions.json``);
    None when it has neither."""
    folder = Path(folder)
    if (folder / PREDICTIONS_FILE).is_file():
        return json.loads(gzip.decompress((folder / PREDICTIONS_FILE).read_bytes()))
    if (folder / LEGACY_PREDICTIONS_FILE).is_file():
        return json.loads((folder / LEGACY_PREDICTIONS_FILE).read_text(encoding="utf-8"))
    return None


def config_record(options: Mapping[str, Any], silhouette_sample: int, feature_dim: int,
                  has_bank: bool) -> dict[str, Any]:
    """results.json's ``config``: the settings every metric was computed with (``options``: harness.eval's, by
    Python name)."""
    return {**{k: options[k] for k in ("seed", "per_class", "k", "bank_k", "temperature")},
            "silhouette_sample_size": silhouette_sample, "heatmaps": options["heatmaps"],
            "batch_size": options["batch_size"], "feature_dim": feature_dim,
            "linear_probe": metrics.LINEAR_PROBE if has_bank else None}


# where timm would download the architecture's stock weights from: not where the evaluated weights came from
_WEIGHT_SOURCE = ("state_dict", "url", "file", "hf_hub_id", "hf_hub_filename", "source", "tag")


def model_config(model: torch.nn.Module) -> dict[str, Any]:
    """The model's timm ``pretrained_cfg`` (input size, mean/std, ...) without a weight source: its weights are
    those of ``model.name`` / ``model.checkpoint`` in the record, even where timm keeps the stock weights' URL."""
    return {k: v for k, v in model.pretrained_cfg.items() if k not in _WEIGHT_SOURCE}


def environment_record(device: torch.device, amp_dtype: torch.dtype | None, faiss_threads: int) -> dict[str, Any]:
    """results.json's ``environment``: where and in which precision the evaluation ran, and the software."""
    return {"device": str(device), "machine": device_name(device),
            "dtype": precision_name(amp_dtype), "fp32_precision": fp32_precision(device),
            "torch_threads": torch.get_num_threads(),
            "faiss_threads": faiss_threads, "packages": versions()}


def data_record(options: Mapping[str, Any], full: ImageSet, data: ImageSet, class_ids: list[int],
                bank: ImageSet | None) -> dict[str, Any]:
    """results.json's ``data``: what was evaluated (``data``, drawn from the split ``full``) and the bank; where the
    data set is (``dataset``, ``argument``) is filled in when the record is saved, relative to its folder."""
    counts = torch.bincount(data.labels, minlength=full.num_classes)
    return {
        "dataset": None, "argument": None, "split": data.split, "fingerprint": full.fingerprint,
        "subset_fingerprint": data.fingerprint, "split_content": full.content, "content": data.content,
        "class_names": [full.class_names[c] for c in class_ids],
        "class_ids": class_ids, "per_class_counts": {full.class_names[c]: int(counts[c]) for c in class_ids},
        "num_images": len(data), "mask_convention": data.mask_convention,
        "bbox_format": None if data.boxes is None else options["bbox_format"] or BOX_FORMATS[0],
        "box_content": None if data.boxes is None else box_hash(data.boxes),  # the boxes as read, [x, y, w, h]
        "intra_left_out": [full.class_names[c] for c in metrics.lone_classes(data.labels).tolist()],
        "bank": None if bank is None else {"split": bank.split, "fingerprint": bank.fingerprint,
                                           "content": bank.content, "num_images": len(bank),
                                           "per_class": options["bank_per_class"]}}


def predictions_record(predicted: dict[str, np.ndarray | None], labels: torch.Tensor,
                        index: torch.Tensor) -> dict[str, Any]:
    """The predictions file's content: split index and label of each evaluated image, the class each accuracy
    metric predicted for it, and whether its label is in the head's top 5 (one list per key)."""
    return {"index": index.tolist(), "label": labels.tolist(),
            "predicted": {k: v.tolist() for k, v in predicted.items() if v is not None and k != "top5"},
            "top5_hit": None if predicted["top5"] is None else predicted["top5"].astype(int).tolist()}


def summary_line(results: dict[str, Any]) -> str:
    """The one line harness.eval ends with: the metrics, precision, batch size and time."""
    shown = ", ".join(f"{k} {v:.4f}" for k, v in results["metrics"].items() if v is not None)
    env = results["environment"]  # bf16 results depend on the batch size too: say both
    posthoc = " (a post-hoc readout, not the trained model)" if results["model"].get("readout_note") else ""
    return f"{results['model']['name']}{posthoc} on {results['data']['num_images']} images: {shown} " \
           f"({env['dtype']}, batches of {results['config']['batch_size']}, {results['timing']['total']:.1f} s)"


@dataclass
class Evaluation:
    """One evaluation in memory: ``record`` is results.json's content, :meth:`save` writes every file harness.eval
    writes."""

    record: dict[str, Any]
    predictions: dict[str, Any]  # predictions.json.gz's content
    drawings: list[Callable[[Path], Path]]  # each draws one figure into a folder
    features: Callable[..., None] | None  # writes features.safetensors: save_features(path, dataset=...)
    options: dict[str, Any]  # harness.eval's options by Python name, the model, data set and folders as given

    @property
    def metrics(self) -> dict[str, float | None]:
        return self.record["metrics"]

    def save(self, folder: str | Path, overwrite: bool = False) -> dict[str, Any]:
        """Write the evaluation into ``folder`` (created if missing); one holding an evaluation is refused unless
        ``overwrite``, then its files go first. Returns results.json as written."""
        out, start, clock = Path(folder), time.perf_counter(), Stopwatch()
        out.mkdir(parents=True, exist_ok=True)
        for name in held(out, overwrite):
            (out / name).unlink()
        with clock.stage("figures"):
            figures = [draw(out).name for draw in self.drawings]
        args, data = {**self.options, "output": str(out), "overwrite": overwrite}, self.record["data"]
        typed = args["dataset"] if isinstance(args["dataset"], str) else data["dataset"]
        if self.features is not None:
            with clock.stage("save_features"):
                self.features(out / FEATURES_FILE, dataset=typed)
        timing = {**self.record["timing"], **clock.seconds}
        record = {**self.record, "data": {**data, "dataset": recorded_data(typed, data["dataset"], out),
                                          "argument": portable_path(typed, out)},
                  "args": portable_args({**args, "model": self.record["model"]["name"], "dataset": typed}, out),
                  "outputs": {"figures": figures, "features": FEATURES_FILE if self.features else None,
                              "predictions": PREDICTIONS_FILE},
                  "timing": {**timing, "total": round(timing["total"] + time.perf_counter() - start, 3)}}
        write_evaluation(out, record, self.predictions)
        return read_results(out)


def held(out: Path, overwrite: bool) -> list[str]:
    """The files of an evaluation in ``out``: refused in one line unless ``overwrite``."""
    found = [n for n in EVAL_FILES if (out / n).exists()]
    if found and not overwrite:
        raise UserError(f"{out} holds an evaluation ({', '.join(found)}); pass --overwrite to replace it, or choose "
                        "another --output")
    return found
