"""Evaluate a model's pooled features: classifier accuracy, faiss k-NN, centroid geometry, silhouette, figures.

    python -m harness.eval --model vit_tiny_cifar_rollout --checkpoint runs/c10-rollout \\
        --dataset cifar10 --bank-split train --heatmaps 8 --output eval/c10-rollout

Writes ``results.json``, ``predictions.json.gz`` and the figures into ``--output`` (harness/README.md, "Output
files").
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness import metrics
from harness.faithfulness import evaluate_faithfulness
from harness.features import (
    PoolingDiagnostics,
    SaliencyMaps,
    context_hits,
    extract,
    pooling_diagnostics,
    saliency_maps,
    save_features,
)
from harness.figures import plot_cosine_matrix, plot_faithfulness, plot_heatmaps
from harness.localisation import LOCALISATION, localisation_metrics
from harness.record import (
    SCHEMA,
    Evaluation,
    config_record,
    data_record,
    environment_record,
    held,
    model_config,
    predictions_record,
    summary_line,
)
from timm_rollout.cli import (
    CliParser,
    as_type,
    check_needs,
    existing_path,
    non_negative_int,
    number,
    output_dir,
    positive,
    positive_int,
    run_cli,
    seed_arg,
)
from timm_rollout.data import (
    ImageSet,
    balanced_indices,
    check_class_names,
    dataset_arg,
    load_image_set,
)
from timm_rollout.device import (
    AMP_CHOICES,
    device_arg,
    inference_batch_size,
    resolve_amp,
    resolve_device,
)
from timm_rollout.errors import UserError
from timm_rollout.explain import MAP_LABELS, READOUTS
from timm_rollout.masks import BOX_FORMATS
from timm_rollout.pooling import attention_free, pool_name, set_pooling
from timm_rollout.progress import Stopwatch
from timm_rollout.records import (
    COSINE_FILE,
    FAITHFULNESS_FILE,
    HEATMAPS_FILE,
    code_version,
)

__all__ = ["Evaluation", "build_parser", "evaluate", "main", "posthoc_readout", "select_classes"]

POST_HOC_POOLS = tuple(k for k in READOUTS if k != "map")  # a learned attention pool cannot be added post hoc
# The flags that ask for parts reading attention (a model without it is refused them): dest -> flag.
ATTENTION_FLAGS = {"pool": "--pool", "faithfulness": "--faithfulness", "heatmaps": "--heatmaps"}


def build_parser() -> CliParser:
    """The CLI; bad values, missing paths and unknown models are one-line errors before anything is loaded."""
    p = CliParser(prog="python -m harness.eval", description=__doc__.split("\n")[0])
    p.checks.append(lambda args: _check_args(args, p.given))
    p.add_argument("--model", required=True, help="registered timm name, hf-hub:org/name or local-dir:PATH")
    p.add_argument("--checkpoint", type=existing_path,
                   help=".safetensors file or training output folder (model.safetensors + config) (default: none: "
                        "a local-dir:/hf-hub: model's own weights, a registered name's untrained ones)")
    p.add_argument("--dataset", default="cifar10", type=as_type(dataset_arg),
                   help="alias (cifar10, cifar100, svhn, cifar10-sample), Hub id or local folder")
    p.add_argument("--split", default="test", help="split to evaluate (default: test)")
    p.add_argument("--image-column", help="image column (detected when omitted)")
    p.add_argument("--label-column", help="label column (detected when omitted)")
    p.add_argument("--bbox-format", choices=BOX_FORMATS, help="what the bbox column holds (default: xywh, COCO)")
    sel = p.add_mutually_exclusive_group()
    sel.add_argument("--classes", nargs="+", metavar="NAME", help="evaluate only these classes (default: all)")
    sel.add_argument("--num-classes", type=number(int, 2), metavar="K",
                     help="evaluate only the first K classes (default: all)")
    p.add_argument("--per-class", type=number(int, 2), metavar="N",
                   help="N random images per class, at least 2: intra-class angles and silhouette need two (default: "
                        "all)")
    p.add_argument("--seed", type=seed_arg, default=0,
                   help="seed of the per-class draws, heatmap picks, silhouette sample")
    p.add_argument("--pool", choices=POST_HOC_POOLS, help="read the features out with this pooling instead of the "
                   "model's own (token: [CLS], avg: patch mean, rollout: rollout weights) (default: the model's own)")
    p.add_argument("--k", type=positive_int, default=metrics.KNN_K,
                   help="neighbours of the leave-one-out k-NN")
    p.add_argument("--bank-split", help="split whose features form the k-NN bank (e.g. train); off by default")
    p.add_argument("--bank-per-class", type=positive_int, metavar="N",
                   help="N random bank images per class (default: all of the bank split)")
    p.add_argument("--bank-k", type=positive_int, default=metrics.BANK_K,
                   help="neighbours of the bank k-NN")
    p.add_argument("--temperature", type=positive, default=metrics.TEMPERATURE,
                   help="bank k-NN vote temperature, > 0")
    p.add_argument("--cosine-classes", nargs="+", metavar="NAME", help="classes of the cosine matrix (default: all)")
    p.add_argument("--heatmaps", type=non_negative_int, default=8, metavar="N", help="images in heatmaps.png (0: none)")
    p.add_argument("--save-features", action="store_true",
                   help="write features.safetensors (features and labels, the bank's too)")
    p.add_argument("--faithfulness", action="store_true", help="deletion/insertion curves of saliency maps")
    p.add_argument("--faithfulness-images", type=positive_int, default=1000, metavar="N",
                   help="score the first N evaluated images")
    p.add_argument("--batch-size", type=positive_int,
                   help="images per forward pass (default: 512 on a GPU, 128 on a CPU, where it is faster)")
    p.add_argument("--device", default="auto", type=device_arg, help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--amp", default="auto", choices=AMP_CHOICES, help="autocast dtype (auto: bf16 only where native)")
    p.add_argument("--output", required=True, type=output_dir, help="folder for results.json, figures and features")
    p.add_argument("--overwrite", action="store_true", help="replace an evaluation already in --output")
    return p


# Flags that only mean something with another one: dest -> (the dest it needs, the flag to add; timm_rollout.cli).
NEEDS = {
    "bank_per_class": ("bank_split", "--bank-split train"),
    "bank_k": ("bank_split", "--bank-split train"),
    "temperature": ("bank_split", "--bank-split train"),
    "faithfulness_images": ("faithfulness", "--faithfulness"),
}


def _check_args(args: argparse.Namespace, given: frozenset[str]) -> None:
    """Refuse flag combinations that cannot work; ``given``: the flags the user typed (:class:`CliParser`)."""
    from timm_rollout.loading import build_meta, check_model  # here, so that --help loads no timm

    _check_options(args, given)
    if args.output is not None:
        held(Path(args.output), args.overwrite)
    check_model(args.model)
    if _attention_asked(args, given):
        _refuse_attention(args, build_meta(args.model, args.checkpoint), given)


def _check_options(args: argparse.Namespace, given: set[str] | frozenset[str]) -> None:
    """Refuse options that need another one (``given``: those set) and a bank drawn from the evaluated split."""
    check_needs(args, given, NEEDS)
    if args.bank_split is not None and args.bank_split == args.split:
        raise UserError(f"--bank-split {args.bank_split} is the evaluated split; use another split (e.g. train)")


def evaluate(model: str | torch.nn.Module, dataset: Any = "cifar10", split: str = "test", *,
             checkpoint: str | Path | None = None, **options: Any) -> Evaluation:
    """Evaluate ``model`` (a timm model object; or a registered name, ``hf-hub:`` or ``local-dir:`` with its
    ``checkpoint``) on ``split`` of ``dataset`` (an alias, Hub id or folder; or a ``datasets`` Dataset or
    DatasetDict) as ``python -m harness.eval`` does; ``options`` are its flags by their Python names
    (``per_class=100``, ``bank_split="train"``, ``faithfulness=True``, ``device="cpu"``...), refused as the CLI
    refuses them. A model object is evaluated where ``device`` puts it, its training mode restored (a copy when
    ``pool`` reads it out otherwise). Nothing is written until :meth:`Evaluation.save`."""
    parser = build_parser()
    defaults = {a.dest: a.default for a in parser._actions if a.dest not in ("help", "output", "overwrite")}
    unknown = sorted(set(options) - set(defaults) | set(options) & {"model", "dataset", "split", "checkpoint"})
    if unknown:
        raise TypeError(f"evaluate() got unknown options {', '.join(unknown)}; the options: "
                        f"{', '.join(sorted(set(defaults) - {'model', 'dataset', 'split', 'checkpoint'}))}")
    if options.get("bank_split") and not isinstance(dataset, str) and type(dataset).__name__ != "DatasetDict":
        raise UserError("a Dataset object is one split, so bank_split has none to read; pass a DatasetDict")
    args = argparse.Namespace(**{**defaults, **options, **parser.typed_values(options), "model": model,
                                 "dataset": dataset, "split": split,
                                 "checkpoint": None if checkpoint is None else str(checkpoint)})
    if isinstance(model, str):  # a name is checked before anything loads, as the CLI checks it
        _check_args(argparse.Namespace(**vars(args), output=None, overwrite=False), frozenset(options))
        return _evaluate(args)
    _check_options(args, set(options))
    _refuse_attention(args, model, frozenset(options))
    training = model.training
    try:
        return _evaluate(args)
    finally:
        model.train(training)


def _attention_asked(args: argparse.Namespace, given: frozenset[str] | None) -> list[str]:
    """The flags in ``args`` that ask for parts reading attention: those typed (``given``), else ``--pool`` and
    ``--faithfulness`` (``--heatmaps`` has a default)."""
    return [flag for dest, flag in ATTENTION_FLAGS.items()
            if getattr(args, dest) and (dest in given if given is not None else dest != "heatmaps")]


def _refuse_attention(args: argparse.Namespace, model: torch.nn.Module | None,
                      given: frozenset[str] | None = None) -> None:
    """A one-line error when ``args`` ask for a part reading attention that ``model`` does not have (nothing where
    it is None: not known yet)."""
    asked = _attention_asked(args, given)
    reason = attention_free(model) if model is not None and asked else None
    if reason is not None:
        raise UserError(f"{' and '.join(asked)} need{'s' if len(asked) == 1 else ''} attention, and {reason}; "
                        f"drop {' and '.join(asked)} (accuracy, k-NN, geometry, linear probe and silhouette need none)")


def _class_ids(names: Sequence[str], class_names: Sequence[str], flag: str) -> list[int]:
    lookup = {name: i for i, name in enumerate(class_names)}
    unknown = [n for n in names if n not in lookup]
    if unknown:
        raise UserError(f"unknown class name(s) for {flag}: {', '.join(unknown)}; valid: {', '.join(class_names)}")
    return list(dict.fromkeys(lookup[n] for n in names))


def select_classes(class_names: Sequence[str], classes: Sequence[str] | None, num_classes: int | None) -> list[int]:
    """Class ids to evaluate: the named ones, the first ``num_classes``, or all."""
    if classes:
        return _class_ids(classes, class_names, "--classes")
    if num_classes is not None:
        if num_classes > len(class_names):
            raise UserError(f"--num-classes {num_classes} but the data set has {len(class_names)} classes")
        return list(range(num_classes))
    return list(range(len(class_names)))


def _subset(data: ImageSet, class_ids: list[int], per_class: int | None, seed: int,
            what: str) -> tuple[ImageSet, torch.Tensor]:
    """The selected images and their indices in the split."""
    idx = balanced_indices(data.labels, per_class=per_class, classes=class_ids, seed=seed)
    if len(idx) == 0:
        raise UserError(f"the {what} selection is empty: {data.split} has no images of the selected classes")
    return data.subset(idx), idx


def _check_head(info: dict[str, Any], data: ImageSet, dataset: str) -> None:
    """The data's classes (``dataset``: as the user named it) are the checkpoint's: as many, or (plain integer
    labels, whose classes are only known up to the largest label present) labels that fit its head."""
    integers = data.class_names == [str(i) for i in range(data.num_classes)]
    if info["num_classes"] != data.num_classes and not (integers and data.num_classes < info["num_classes"]):
        raise UserError(
            f"checkpoint has {info['num_classes']} classes, data set {dataset!r} has {data.num_classes}; "
            "evaluate it on the data set it was trained on"
        )
    if info.get("label_names"):
        check_class_names(data.class_names, info["label_names"], f"data set {dataset!r}", "the checkpoint",
                          "cast its plain integer label column to the checkpoint's classes if they are those, in "
                          "that order (datasets' cast_column with ClassLabel(names=[...]))" if integers else
                          "evaluate it on data whose label column lists its classes in its order (datasets' "
                          "align_labels_with_mapping reorders one)")


def posthoc_readout(model: torch.nn.Module, pool: str | None) -> str:
    """``--pool``: read a trained model out with ``pool`` (None: its own pooling) through
    :func:`timm_rollout.set_pooling`, refusing a learned attention pool or a norm after pooling; returns the
    pooling."""
    own = pool_name(model)
    if pool is None or pool == own:
        return own
    if getattr(model, "attn_pool", None) is not None:
        raise UserError(f"the model pools with a learned attention pool (global_pool={own!r}), which --pool {pool} "
                        "would bypass or keep; evaluate it with its own pooling")
    if not isinstance(getattr(model, "fc_norm", torch.nn.Identity()), torch.nn.Identity):
        raise UserError(f"the model normalises after pooling (fc_norm), so --pool {pool} would read un-normed "
                        "tokens; evaluate it with its own pooling")
    try:
        set_pooling(model, pool)
    except ValueError as e:
        raise UserError(f"--pool {pool}: {e}") from None
    return pool


def _heatmap_pick(data: ImageSet, args: argparse.Namespace) -> torch.Tensor:
    """``--heatmaps`` seeded picks of the evaluated images (all of them, said in a note, when fewer)."""
    if args.heatmaps > len(data):
        print(f"note: --heatmaps {args.heatmaps} but {len(data)} images are evaluated: all of them drawn",
              file=sys.stderr)
    return torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed))[: args.heatmaps].sort().values


def _maps(model, info: dict, data: ImageSet, pick: torch.Tensor, args: argparse.Namespace, device, amp_dtype,
          clock: Stopwatch) -> Callable[[torch.Tensor], SaliencyMaps]:
    """The saliency maps of every evaluated image a part uses (localisation: all, where the split has boxes; the
    heatmaps' ``pick``; the faithfulness images), in one pass; returns the lookup of any of them by index."""
    parts = [*([torch.arange(len(data))] if data.boxes is not None else []), pick,
             *([torch.arange(min(args.faithfulness_images, len(data)))] if args.faithfulness else [])]
    needed = torch.cat(parts).unique()
    with clock.stage("maps"):
        found = saliency_maps(model, data.images[needed], device=device, amp_dtype=amp_dtype,
                              batch_size=args.batch_size, mean=info["mean"], std=info["std"]) if len(needed) else None
    row = torch.full((len(data),), -1, dtype=torch.int64)
    row[needed] = torch.arange(len(needed))
    return lambda index: found.take(row[index])


def _heatmap_drawing(sel: Selection, info: dict, pick: torch.Tensor,
                     maps: Callable[[torch.Tensor], SaliencyMaps]) -> Callable[[Path], Path]:
    """heatmaps.png, drawn into a folder later: the maps of the ``pick``ed images, each titled with its index in the
    split."""
    data = sel.data
    images, found, names = data.images[pick], maps(pick), data.class_names
    true = [f"{names[int(y)]} (#{int(i)})" for y, i in zip(data.labels[pick], sel.index[pick], strict=True)]
    pred = [names[int(i)] if int(i) < len(names) else str(int(i)) for i in found.logits.argmax(dim=1)]
    shown = {f"{MAP_LABELS[k]}\n(readout {found.readout})": v for k, v in found.maps.items()}
    title = f"{info['name']}: maps of its readout ({found.readout}, {data.split})"
    boxes = data.boxes[pick] if data.boxes is not None else None
    return lambda out: plot_heatmaps(images, shown, true, pred, out / HEATMAPS_FILE, title, boxes, grid=found.grid)


def _predictions(feats: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                 bank_feats: torch.Tensor | None, bank_labels: torch.Tensor | None,
                 args: argparse.Namespace) -> dict[str, np.ndarray | None]:
    """Per-image predictions of the head and both k-NN protocols (the linear probe is added in its own stage);
    ``top5`` holds per-image hits instead."""
    return {"top1": logits.argmax(dim=1).numpy(), "top5": metrics.topk_hits(logits, labels, 5), "linear_probe": None,
            "knn_loo": metrics.knn_loo_predictions(feats, labels, args.k),
            "knn_bank": None if bank_feats is None else
            metrics.knn_bank_predictions(bank_feats, bank_labels, feats, args.bank_k, args.temperature)}


def _metric_values(predicted: dict[str, np.ndarray | None], labels: torch.Tensor, geometry: dict[str, float | None],
                   silhouette: float) -> dict[str, float | None]:
    """results.json's metrics: accuracies from the per-image predictions, then geometry and silhouette."""
    values = {name: None if (pred := predicted[name]) is None else float(pred.mean()) if name == "top5"
              else metrics.accuracy(pred, labels) for name in metrics.ACCURACIES}
    ours = {k: geometry[k] for k in ("intra", "inter", "ratio")}
    original = {k: v for k, v in geometry.items() if k.endswith("_original")}
    return {**values, **ours, "silhouette": silhouette, **original}


@dataclass
class Selection:
    """The evaluated images (``data``, at ``index`` in the split ``full``), their classes and the cosine matrix's."""

    full: ImageSet
    data: ImageSet
    index: torch.Tensor
    class_ids: list[int]
    cosine_ids: list[int]


def _select(args: argparse.Namespace) -> Selection:
    """Load the evaluated split and pick its classes and images; one-line errors for selections that cannot work."""
    full = load_image_set(args.dataset, args.split, image_column=args.image_column, label_column=args.label_column,
                          boxes=True, box_format=args.bbox_format)
    class_ids = select_classes(full.class_names, args.classes, args.num_classes)
    if len(class_ids) < 2:
        raise UserError("select at least 2 classes: centroid separation and silhouette compare classes")
    data, index = _subset(full, class_ids, args.per_class, args.seed, "evaluated")
    if len(data) <= args.k:
        raise UserError(f"{len(data)} images selected; leave-one-out {args.k}-NN needs more than {args.k}")
    cosine_ids = _class_ids(args.cosine_classes, full.class_names, "--cosine-classes") if args.cosine_classes \
        else class_ids
    missing = sorted(set(cosine_ids) - set(class_ids))
    if missing:
        raise UserError(f"--cosine-classes {', '.join(full.class_names[i] for i in missing)} are not evaluated; "
                        "add them to --classes")
    return Selection(full, data, index, class_ids, cosine_ids)


def _load(args: argparse.Namespace, full: ImageSet, device: torch.device) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model to evaluate, checked against the data set, read out with ``--pool``."""
    from timm_rollout.loading import check_input_size, load_model, module_info

    if isinstance(args.model, torch.nn.Module):
        model = copy.deepcopy(args.model) if args.pool not in (None, pool_name(args.model)) else args.model
        model, info = model.to(device).eval(), module_info(model)
        info["input_size"] = [3, *full.images.shape[2:]]  # the size it takes (checked below), not timm's default
    else:
        prefixed = args.model.startswith(("hf-hub:", "local-dir:"))
        default_classes = None if args.checkpoint or prefixed else full.num_classes
        with torch.random.fork_rng(devices=[]):  # an untrained model's initial weights are reproducible too; the
            torch.manual_seed(args.seed)         # caller's random state is left as it was
            model, info = load_model(args.model, args.checkpoint, num_classes=default_classes, device=device)
        if args.checkpoint is None and args.model.startswith("local-dir:"):  # its run folder: harness.compare reads
            info["checkpoint"] = args.model.removeprefix("local-dir:")  # the training seed there, as for --checkpoint
    _refuse_attention(args, model)  # where the meta device could not tell before
    _check_head(info, full, args.dataset if isinstance(args.dataset, str) else full.dataset)
    check_input_size(model, full.images, fix="evaluate it on a data set of its input size")
    info["pool"] = posthoc_readout(model, args.pool)
    info["readout_note"] = _readout_note(info, args.pool)
    if info["readout_note"]:
        print(f"note: {info['readout_note']}", file=sys.stderr)
    return model, info


def _readout_note(info: dict[str, Any], pool: str | None) -> str | None:
    """What to say when the weights are read out otherwise than they were trained (another architecture of the same
    backbone, or ``--pool``): a post-hoc readout, not the trained model; None otherwise."""
    trained = info.get("checkpoint_architecture")
    if trained and trained != info.get("architecture"):
        return (f"the weights were trained as {trained} and are read out as {info['architecture']} (pool "
                f"{info.get('pool')}): a post-hoc readout, not the trained model")
    if pool is not None and pool != info.get("global_pool"):
        return (f"{info['name']} pools with {info.get('global_pool')} and is read out with --pool {pool}: a "
                "post-hoc readout, not the trained model")
    return None


def _load_bank(args: argparse.Namespace, class_ids: list[int]) -> ImageSet:
    bank_full = load_image_set(args.dataset, args.bank_split, image_column=args.image_column,
                               label_column=args.label_column, split_flag="--bank-split")
    bank, _ = _subset(bank_full, class_ids, args.bank_per_class, args.seed, "bank")
    if len(bank) < args.bank_k:
        raise UserError(f"the bank has {len(bank)} images, fewer than --bank-k {args.bank_k}")
    return bank


def _cosine(feats: torch.Tensor, labels: torch.Tensor, sel: Selection) -> tuple[np.ndarray, list[str]]:
    """Cosine matrix of the class centroids of ``--cosine-classes`` (in the order asked for) and their names."""
    present, cents = metrics.centroids(feats, labels)
    row = {int(c): i for i, c in enumerate(present)}
    ids = [c for c in sel.cosine_ids if c in row]
    return metrics.cosine_matrix(cents[[row[c] for c in ids]]), [sel.full.class_names[c] for c in ids]


def _left_out(model: torch.nn.Module, data: ImageSet, args: argparse.Namespace) -> dict[str, Any] | None:
    """What the evaluation of a model without attention leaves out (results.json's ``left_out``: why, and the
    parts), said in one note line; None for a ViT."""
    reason = attention_free(model)
    if reason is None:
        return None
    parts = ["rollout pooling diagnostics", *(["heatmaps of attention maps"] if args.heatmaps else []),
             *(["localisation of pooling weights and attention maps"] if data.boxes is not None else [])]
    print(f"note: {reason}; left out the parts that need attention ({', '.join(parts)}), their metrics null",
          file=sys.stderr)
    return {"reason": reason, "parts": parts}


def _pooling(model, info: dict, data: ImageSet, args: argparse.Namespace, device, amp_dtype, clock: Stopwatch,
             maps: Callable[[torch.Tensor], SaliencyMaps] | None) -> tuple[PoolingDiagnostics | None, dict]:
    """The pooling diagnostics, and where the split has object boxes harness.localisation's metrics (else none);
    without ``maps`` (a model without attention) none of them, but for ``context_top1`` (where the split has content
    masks)."""
    diagnostics = None
    if maps is not None:
        with clock.stage("pooling_diagnostics"):
            diagnostics = pooling_diagnostics(model, data.images, info["mean"], info["std"], device=device,
                                              amp_dtype=amp_dtype, batch_size=args.batch_size)
    if data.boxes is None:
        return diagnostics, {}
    with clock.stage("localisation"):
        hits = None if data.masks is None else context_hits(
            model, data.images, data.labels, data.masks, info["mean"], info["std"], device=device,
            amp_dtype=amp_dtype, batch_size=args.batch_size)
        if maps is None:
            return None, {**dict.fromkeys(LOCALISATION), "context_top1": None if hits is None else float(hits.mean())}
        found = maps(torch.arange(len(data)))
        return diagnostics, localisation_metrics(found.pooling, found.maps, data.boxes, data.images.shape[-2:],
                                                 found.grid, data.masks, hits)


def _evaluate(args: argparse.Namespace) -> Evaluation:
    """Run one evaluation in memory (``args``: harness.eval's options; ``model`` and ``dataset`` may be objects)."""
    clock = Stopwatch()
    start = time.perf_counter()
    device = resolve_device(args.device)
    args.batch_size = args.batch_size or inference_batch_size(device)  # recorded in results.json as used
    amp_dtype = resolve_amp(args.amp, device)
    with clock.stage("load_data"):
        sel = _select(args)
    data, labels = sel.data, sel.data.labels
    with clock.stage("load_model"):
        model, info = _load(args, sel.full, device)
    left_out = _left_out(model, data, args)
    features = partial(extract, model, mean=info["mean"], std=info["std"], device=device, amp_dtype=amp_dtype,
                       batch_size=args.batch_size)
    with clock.stage("extract"):
        feats, logits = features(data.images, desc=f"{data.split} features")
    pick = _heatmap_pick(data, args) if args.heatmaps and left_out is None else torch.arange(0)
    maps = _maps(model, info, data, pick, args, device, amp_dtype, clock) if left_out is None else None
    diagnostics, localisation = _pooling(model, info, data, args, device, amp_dtype, clock, maps)
    bank = bank_feats = None
    if args.bank_split:
        with clock.stage("load_bank"):
            bank = _load_bank(args, sel.class_ids)
        with clock.stage("extract_bank"):
            bank_feats, _ = features(bank.images, desc=f"{bank.split} bank features")

    with clock.stage("metrics"):
        faiss_threads = metrics.default_threads()
        predicted = _predictions(feats, logits, labels, bank_feats, None if bank is None else bank.labels, args)
        geometry = {**metrics.centroid_metrics(feats, labels), **metrics.original_metrics(feats, labels)}
        sil, sample = metrics.silhouette(feats, labels, seed=args.seed)
        cos, cos_names = _cosine(feats, labels, sel)
    if bank is not None:
        with clock.stage("linear_probe"):
            predicted["linear_probe"] = metrics.linear_probe_predictions(bank_feats, bank.labels, feats)
    drawings, faithfulness = _drawings(model, info, sel, (cos, cos_names), pick, maps, args, device, amp_dtype,
                                       clock)
    record = {
        "schema": SCHEMA,
        "metrics": {**_metric_values(predicted, labels, geometry, sil),
                    **(dict.fromkeys(metrics.POOLING_DIAGNOSTICS) if diagnostics is None else diagnostics.metrics()),
                    **localisation},
        "pooling_diagnostics": None if diagnostics is None else diagnostics.record(),
        "cosine_matrix": {"classes": cos_names, "matrix": cos.round(6).tolist()},
        "faithfulness": faithfulness,
        "left_out": left_out,
        "model": {**info, "pretrained_cfg": model_config(model)},
        "data": {**data_record(vars(args), sel.full, data, sel.class_ids, bank), "dataset": data.dataset},
        "config": config_record(vars(args), sample, int(feats.shape[1]), bank is not None),
        "args": None,  # these three: as saved (Evaluation.save)
        "environment": environment_record(device, amp_dtype, faiss_threads),
        "code": code_version(),
        "outputs": None,
        "timing": {**clock.seconds, "total": round(time.perf_counter() - start, 3)},
    }
    saver = partial(save_features, model=info["name"], data=data, feats=feats, bank=bank,
                    bank_feats=bank_feats) if args.save_features else None
    return Evaluation(record, predictions_record(predicted, labels, sel.index), drawings, saver, vars(args))


def _drawings(model, info: dict, sel: Selection, cosine: tuple[np.ndarray, list[str]], pick: torch.Tensor,
              maps: Callable[[torch.Tensor], SaliencyMaps] | None, args: argparse.Namespace, device, amp_dtype,
              clock: Stopwatch) -> tuple[list[Callable[[Path], Path]], dict[str, Any] | None]:
    """The figures to draw (the cosine matrix; the heatmaps of ``pick``; ``--faithfulness``) and the faithfulness
    results, from the ``maps`` computed before."""
    data = sel.data
    cosine_title = f"{info['name']}: centroid cosine similarity ({data.split})"
    drawings = [lambda out: plot_cosine_matrix(*cosine, out / COSINE_FILE, cosine_title)]
    if len(pick) and maps is not None:
        drawings.append(_heatmap_drawing(sel, info, pick, maps))
    if not args.faithfulness or maps is None:
        return drawings, None
    with clock.stage("faithfulness"):
        n = min(args.faithfulness_images, len(data))
        faithfulness = evaluate_faithfulness(model, data.images[:n], data.labels[:n], info["mean"], info["std"],
                                             batch_size=args.batch_size, tie_seed=args.seed,
                                             seeds=[args.seed + i for i in range(1, 4)], device=device,
                                             dtype=amp_dtype, found=maps(torch.arange(n)))
    title = f"{info['name']}: faithfulness ({data.split})"
    return [*drawings, lambda out: plot_faithfulness(faithfulness, out / FAITHFULNESS_FILE, title)], faithfulness


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    results = _evaluate(args).save(args.output, overwrite=args.overwrite)
    print(summary_line(results))
    return results


if __name__ == "__main__":
    run_cli(main)
