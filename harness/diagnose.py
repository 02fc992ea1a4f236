"""Bring existing evaluations up to date without re-evaluating them.

    python -m harness.diagnose results/cifar10-cpu/eval/*-s*

Whatever a ``results.json`` lacks of what ``harness.eval`` records now (pooling diagnostics, position nulls, mask
metrics, content hashes) is computed exactly as ``harness.eval`` computes it, from the evaluation's own arguments
and in its precision. Refused, nothing written, when the weights or the images cannot be shown to be the evaluated
ones (harness/README.md, "Bring existing evaluations up to date"). An updated record says what was added and by
which code (``diagnosed``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path
from typing import Any

import torch

from harness import eval as harness_eval
from harness.compare import read_results
from harness.features import box_localisation, pooling_diagnostics
from harness.localisation import LOCALISATION, POSITION_NULLS
from harness.metrics import POOLING_DIAGNOSTICS
from timm_rollout.atomic import write_json
from timm_rollout.cli import CliParser, existing_path, run_cli
from timm_rollout.data import ALIASES, ImageSet
from timm_rollout.device import device_arg, resolve_device
from timm_rollout.errors import UserError
from timm_rollout.progress import Stopwatch
from timm_rollout.records import ARGS_FILE, ELIDED, RESULTS_FILE, code_version, resolve_recorded

__all__ = ["eval_command", "has_diagnostics", "main", "outdated", "update_evaluation"]

# present (not None) once the mask metrics were computed, in either mask convention (foreground masks have no fill)
MASK_METRICS = ("object_content_fraction",)
DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def has_diagnostics(results: dict[str, Any]) -> bool:
    """Whether ``results`` (a results.json) holds every pooling diagnostic, per-layer and variant figures
    included (None counts: no class token)."""
    if not all(k in results.get("metrics", {}) for k in POOLING_DIAGNOSTICS) or "pooling_diagnostics" not in results:
        return False
    record = results["pooling_diagnostics"]
    return record is None or ("layer_effective_patches" in record and "rollout_variants" in record)


def outdated(results: dict[str, Any]) -> bool:
    """Whether a results.json may lack something :func:`update_evaluation` adds (the mask metrics only where the
    evaluation scored boxes: whether its data set has masks is known once it is loaded)."""
    metrics = results.get("metrics", {})
    return not has_diagnostics(results) or "content" not in results.get("data", {}) or (
        metrics.get("pooling_object_mass") is not None and (lacks_mask_metrics(metrics) or lacks_position_nulls(
            metrics)))


def lacks_position_nulls(metrics: dict[str, Any]) -> bool:
    """Whether an evaluation that scored boxes was recorded before the position nulls existed."""
    return any(k not in metrics for k in POSITION_NULLS)


def lacks_mask_metrics(metrics: dict[str, Any]) -> bool:
    """Whether an evaluation's metrics lack a mask metric: one of :data:`MASK_METRICS` is None, or
    ``context_top1`` (which may be None: not every object could be taken out) was never recorded."""
    return any(metrics.get(k) is None for k in MASK_METRICS) or "context_top1" not in metrics


def _run_content(args: argparse.Namespace, folder: str | Path, dataset: str, split: str,
                 fingerprint: str) -> str | None:
    """The content hash the evaluated checkpoint's training run recorded for ``split`` of ``dataset`` (its
    train_args.json), when the run read that split under the ``fingerprint`` the evaluation recorded (so the hash
    describes what the evaluation read, not only what training read); else None. Both records name the data set's
    folder absolutely (older ones) or relative to their own folder (``folder``: the evaluation's)."""
    path = Path(args.checkpoint or _local_dir(args) or "") / ARGS_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if resolve_recorded(record.get("dataset_resolved"), path.parent) != resolve_recorded(dataset, folder):
        return None
    role = {record.get("train_split"): "train", record.get("eval_split"): "eval"}.get(split)
    if role is None or (record.get("fingerprints") or {}).get(role) != fingerprint:
        return None
    return (record.get("content") or {}).get(role)


def _same_images(folder: str | Path, results: dict[str, Any], args: argparse.Namespace, data: ImageSet) -> bool:
    """Whether ``data`` are the images the evaluation read, on evidence a changed pixel would break: the same datasets
    fingerprint, or the content hash the evaluation (or, for the split it read under the same fingerprint, its
    training run) recorded. Labels and top-1 predictions reproduced are no such evidence: a changed pixel rarely
    changes them."""
    record = results["data"]
    if data.fingerprint == record["subset_fingerprint"]:
        return True
    recorded = record.get("content") or (_run_content(args, folder, record["dataset"], record["split"],
                                                       record["fingerprint"])
                                         if record["subset_fingerprint"] == record["fingerprint"] else None)
    return recorded is not None and recorded == data.content


def _bank_content(args: argparse.Namespace, folder: str | Path, results: dict[str, Any],
                  class_ids: list[int]) -> str | None:
    """The bank's content hash when its images can be shown to be the evaluated bank's (the same fingerprint, or
    the content its training run recorded), else None (left unrecorded: such a bank pairs by fingerprint)."""
    record = results["data"].get("bank")
    if not record or not args.bank_split:
        return None
    bank = harness_eval._load_bank(args, class_ids)
    same = bank.fingerprint == record["fingerprint"] or (
        args.bank_per_class is None
        and _run_content(args, folder, results["data"]["dataset"], bank.split, record["fingerprint"]) == bank.content)
    return bank.content if same else None


def _local_dir(args: argparse.Namespace) -> str | None:
    return args.model.removeprefix("local-dir:") if args.model.startswith("local-dir:") else None


def _locate(folder: str | Path, args: argparse.Namespace, runs: str | Path | None, dataset: str | None) -> None:
    """Point the evaluation's local weights (``--checkpoint``, a ``local-dir:`` model, or both) at the folders of
    the same names in ``runs`` when given; refuse weights that are not there, and ``runs`` without local weights.
    A ``--dataset`` folder is read where the record places it (``dataset``, relative to ``folder``) when it is
    there, from any working directory (and is what a printed re-evaluation names); else as typed. The image checks
    that follow decide whether it holds the evaluated images."""
    typed, found = getattr(args, "dataset", None), resolve_recorded(dataset, folder)
    if str(found).startswith(ELIDED):
        raise UserError(f"{folder} names its data set folder by name only ({found}: it lay outside the working "
                        "directory's tree when evaluated) and cannot find it; re-evaluate it with harness.eval")
    if typed and typed not in ALIASES and found and Path(found).is_absolute() and Path(found).is_dir():
        args.dataset = found
    if runs is not None:
        if not (args.checkpoint or _local_dir(args)):
            raise UserError(f"{folder} evaluated {args.model} without local weights, so --runs has nothing to find "
                            "for it; drop --runs or run it on its own")
        if args.checkpoint:
            args.checkpoint = str(Path(runs) / Path(args.checkpoint).name)
        if _local_dir(args):
            args.model = f"local-dir:{Path(runs) / Path(_local_dir(args)).name}"
    for where in (p for p in (args.checkpoint, _local_dir(args)) if p):
        if not Path(where).exists():
            raise UserError(f"{folder} evaluated {where}, which is not there from {Path.cwd()}; run this command "
                            "from the directory the evaluation ran in, or pass --runs FOLDER holding it")


def update_evaluation(folder: str | Path, device: str | None = None, runs: str | Path | None = None) -> list[str]:
    """Add what the evaluation in ``folder`` lacks (module docstring) and rewrite its results.json; returns what
    was added (empty: nothing was missing). ``device`` overrides the evaluation's ``--device``; ``runs`` is the
    folder holding the evaluated checkpoint now (found by its name), for evaluations made elsewhere."""
    path = Path(folder) / RESULTS_FILE
    results = read_results(path)
    args = argparse.Namespace(**{"bbox_format": None, **results["args"]})  # older records: the default xywh
    _locate(folder, args, runs, results["data"].get("dataset"))
    start, dev = time.perf_counter(), resolve_device(device or args.device)
    sel = harness_eval._select(args)
    maps = not results.get("left_out")  # a model without attention has no localisation to add
    todo = [what for what, missing in (
        ("pooling diagnostics", not has_diagnostics(results)),
        ("mask localisation", sel.data.masks is not None and (lacks_mask_metrics(results["metrics"]) if maps
                                                              else "context_top1" not in results["metrics"])),
        ("position nulls", maps and sel.data.boxes is not None and lacks_position_nulls(results["metrics"])),
        ("content hashes", "content" not in results["data"])) if missing]
    if not todo:
        return []
    model, info = harness_eval._load(args, sel.full, dev)
    if info["sha256"] != results["model"].get("sha256"):
        raise UserError(f"{folder}: the weights of {args.checkpoint or _local_dir(args) or args.model} changed since "
                        f"the evaluation (sha256); re-evaluate it: {eval_command(args, folder)}")
    kwargs = {"device": dev, "amp_dtype": DTYPES[results["environment"]["dtype"]], "batch_size": args.batch_size}

    if not _same_images(folder, results, args, sel.data):
        raise UserError(f"{folder}: the images selected now cannot be shown to be the evaluated ones (neither the "
                        "same datasets fingerprint nor a recorded content hash; reproduced predictions are no proof); "
                        f"re-evaluate it: {eval_command(args, folder)}")
    if "pooling diagnostics" in todo:
        found = pooling_diagnostics(model, sel.data.images, info["mean"], info["std"], **kwargs)
        results["metrics"].update(harness_eval.diagnostic_metrics(found))
        results["pooling_diagnostics"] = None if found is None else found.record()
    if not maps and "mask localisation" in todo:  # a model without attention: context_top1 only, as eval has it
        _, found = harness_eval._pooling(model, info, sel.data, args.batch_size, dev, kwargs["amp_dtype"],
                                         Stopwatch(), attention=False)
        results["metrics"]["context_top1"] = found["context_top1"]
    elif "mask localisation" in todo or "position nulls" in todo:
        _add_localisation(folder, results, model, info, sel.data, kwargs)
    if "content hashes" in todo:
        record = results["data"]
        record.update(split_content=sel.full.content, content=sel.data.content)
        bank = _bank_content(args, folder, results, sel.class_ids)
        if bank is not None:
            record["bank"]["content"] = bank
        elif record.get("bank"):
            todo[-1] += " (not the bank's, which cannot be shown to be the evaluated one: it pairs by fingerprint)"
    results["timing"]["diagnose"] = round(time.perf_counter() - start, 3)
    results["diagnosed"] = [*results.get("diagnosed", []), {"added": todo, "code": code_version()}]
    write_json(path, results)
    return todo


def eval_command(args: argparse.Namespace, folder: str | Path) -> str:
    """The ``harness.eval --overwrite`` command that repeats an evaluation into ``folder`` (where it is now): its
    recorded arguments, those at their defaults left out (typed, some are refused: ``--bank-k`` without
    ``--bank-split``)."""
    parser, words = harness_eval.build_parser(), ["python", "-m", "harness.eval"]
    for dest, value in {**vars(args), "output": str(folder), "overwrite": True}.items():
        if value is None or value is False or value == parser.get_default(dest):
            continue
        flag = "--" + dest.replace("_", "-")
        words += [flag] if value is True else [flag, *map(str, value if isinstance(value, list) else [value])]
    return shlex.join(words)


def _add_localisation(folder: str | Path, results: dict[str, Any], model, info: dict, data: ImageSet,
                      kwargs: dict[str, Any]) -> None:
    """The localisation metrics the record lacks (with content masks, where the data set has them); those it
    holds, recomputed, must equal the recorded ones."""
    found = box_localisation(model, data.images, data.boxes, info["mean"], info["std"], masks=data.masks,
                             labels=data.labels, **kwargs)
    recorded = results["metrics"]
    differ = [k for k in LOCALISATION if recorded.get(k) is not None and (found[k] is None or abs(
        found[k] - recorded[k]) > 1e-4)]
    if differ:
        raise UserError(f"{folder}: {', '.join(differ[:3])} recomputed differ from the recorded values (e.g. "
                        f"{differ[0]} {found[differ[0]]} against {recorded[differ[0]]}); re-evaluate it: "
                        f"{eval_command(argparse.Namespace(**results['args']), folder)}")
    recorded.update({k: v for k, v in found.items() if recorded.get(k) is None})


def main(argv: list[str] | None = None) -> list[Path]:
    p = CliParser(prog="python -m harness.diagnose", description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="+", type=existing_path, help="evaluation folders (results.json of harness.eval)")
    p.add_argument("--device", type=device_arg, help="override the evaluations' --device (e.g. cpu)")
    p.add_argument("--runs", type=existing_path,
                   help="folder now holding the evaluated checkpoints or local-dir: models, found by name "
                        "(evaluations made elsewhere)")
    args = p.parse_args(argv)
    updated = []
    for folder in args.folders:
        added = update_evaluation(folder, args.device, args.runs)
        print(f"{folder}: {'added ' + ', '.join(added) if added else 'up to date, skipped'}")
        if added:
            updated.append(Path(folder))
    print(f"{len(updated)} of {len(args.folders)} evaluations updated")
    return updated


if __name__ == "__main__":
    run_cli(main)
