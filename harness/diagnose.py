"""Add the pooling diagnostics to existing evaluations without re-evaluating them.

    python -m harness.diagnose results/cifar10-cpu/eval/*-s*

For each evaluation folder whose ``results.json`` lacks :data:`harness.metrics.POOLING_DIAGNOSTICS`, the
evaluation's own arguments (``results["args"]``) select the same images and load the same model, read out the
same way; the diagnostics are computed exactly as ``harness.eval`` computes them and written into
``results.json`` (metrics, ``pooling_diagnostics``, their timing), atomically. Refused, nothing written, when
the weights' sha256 or the evaluated images' fingerprint differ from what the evaluation recorded. Run it from
the directory the evaluations ran in: their paths are relative to it, or, for evaluations made on another
machine, name the folder that now holds their checkpoints with ``--runs`` (a checkpoint, or the folder of a
``--model local-dir:PATH``, is looked up there by its folder name; the sha256 check still applies; evaluations
without local weights are refused with it). Folders that have the diagnostics are skipped.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from harness import eval as harness_eval
from harness.features import pooling_diagnostics
from harness.metrics import POOLING_DIAGNOSTICS
from timm_rollout.atomic import write_json
from timm_rollout.device import device_arg, resolve_amp, resolve_device
from timm_rollout.errors import CliParser, UserError, existing_path, run_cli
from timm_rollout.records import RESULTS_FILE

__all__ = ["add_pooling_diagnostics", "has_diagnostics", "main"]


def has_diagnostics(results: dict[str, Any]) -> bool:
    """Whether ``results`` (a results.json) holds every pooling diagnostic, per-layer and variant figures
    included (None counts: no class token)."""
    if not all(k in results.get("metrics", {}) for k in POOLING_DIAGNOSTICS) or "pooling_diagnostics" not in results:
        return False
    record = results["pooling_diagnostics"]
    return record is None or ("layer_effective_patches" in record and "rollout_variants" in record)


def _relocate(args: argparse.Namespace, runs: Path, folder: str | Path) -> None:
    """Point an evaluation's local weights (``--checkpoint``, a ``local-dir:`` model, or both) at the folders of
    the same names in ``runs``; an evaluation without local weights (a Hub or untrained model) is refused."""
    found = False
    if args.checkpoint:
        args.checkpoint, found = str(runs / Path(args.checkpoint).name), True
    if args.model.startswith("local-dir:"):
        args.model, found = f"local-dir:{runs / Path(args.model.removeprefix('local-dir:')).name}", True
    if not found:
        raise UserError(f"{folder} evaluated {args.model} without local weights, so --runs has nothing to find for "
                        "it; drop --runs or run it on its own")


def add_pooling_diagnostics(folder: str | Path, device: str | None = None, runs: str | Path | None = None) -> bool:
    """Compute the missing pooling diagnostics of the evaluation in ``folder`` and rewrite its results.json;
    False when it already has them. ``device`` overrides the evaluation's ``--device``; ``runs`` is the folder
    holding the evaluated checkpoint now (found by its name), for evaluations made elsewhere."""
    path = Path(folder) / RESULTS_FILE
    if not path.is_file():
        raise UserError(f"{folder} holds no {RESULTS_FILE}; pass folders written by python -m harness.eval")
    results = json.loads(path.read_text(encoding="utf-8"))
    if has_diagnostics(results):
        return False
    args = argparse.Namespace(**results["args"])
    if runs is not None:
        _relocate(args, Path(runs), folder)
    local_dir = args.model.removeprefix("local-dir:") if args.model.startswith("local-dir:") else None
    for where in (p for p in (args.checkpoint, local_dir) if p):
        if not Path(where).exists():
            raise UserError(f"{folder} evaluated {where}, which is not there from {Path.cwd()}; run this command "
                            "from the directory the evaluation ran in, or pass --runs FOLDER holding it")
    start = time.perf_counter()
    dev = resolve_device(device or args.device)
    sel = harness_eval._select(args)
    if sel.data.fingerprint != results["data"]["subset_fingerprint"]:
        raise UserError(f"{folder}: the images selected now differ from the evaluated ones (data fingerprint); "
                        "re-evaluate it with python -m harness.eval")
    model, info = harness_eval._load(args, sel.full, dev)
    if info["sha256"] != results["model"].get("sha256"):
        raise UserError(f"{folder}: the weights of {args.checkpoint or local_dir or args.model} changed since the "
                        "evaluation (sha256); re-evaluate it with python -m harness.eval")
    found = pooling_diagnostics(model, sel.data.images, info["mean"], info["std"], device=dev,
                                amp_dtype=resolve_amp(args.amp, dev), batch_size=args.batch_size)
    results["metrics"].update(harness_eval.diagnostic_metrics(found))
    results["pooling_diagnostics"] = None if found is None else found.record()
    results["timing"]["pooling_diagnostics"] = round(time.perf_counter() - start, 3)
    write_json(path, results)
    return True


def main(argv: list[str] | None = None) -> list[Path]:
    p = CliParser(prog="python -m harness.diagnose", description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="+", type=existing_path, help="evaluation folders (results.json of harness.eval)")
    p.add_argument("--device", type=device_arg, help="override the evaluations' --device (e.g. cpu)")
    p.add_argument("--runs", type=existing_path,
                   help="folder now holding the evaluated checkpoints or local-dir: models, found by name "
                        "(evaluations made elsewhere)")
    args = p.parse_args(argv)
    added = []
    for folder in args.folders:
        if add_pooling_diagnostics(folder, args.device, args.runs):
            metrics = json.loads((Path(folder) / RESULTS_FILE).read_text(encoding="utf-8"))["metrics"]
            shown = ", ".join(f"{k} {metrics[k]:.4f}" for k in POOLING_DIAGNOSTICS if metrics[k] is not None)
            print(f"{folder}: {shown or 'no class token, diagnostics None'}")
            added.append(Path(folder))
        else:
            print(f"{folder}: has the diagnostics, skipped")
    print(f"pooling diagnostics added to {len(added)} of {len(args.folders)} evaluations")
    return added


if __name__ == "__main__":
    run_cli(main)
