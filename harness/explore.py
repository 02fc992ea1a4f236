"""Write one self-contained page to explore the attention maps of timm ViTs in a browser.

    python -m harness.explore --model vit_tiny_cifar_rollout --checkpoint runs/c10-rollout \\
        --dataset ../shared/data/cifar10 --images 64 --compare-model vit_tiny_cifar_cls \\
        --compare-checkpoint runs/c10-cls --output explore/

Writes ``index.html`` into ``--output``, which opens from ``file://`` without network. Every map is computed here by
:mod:`timm_rollout.explain` and embedded as JSON (harness/README.md, "Explore in a browser"); the page only draws.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from harness.explain import _check_args as check_explain_args
from harness.explain import _load_input, _refuse_attention_free, denormalize, prepare_image
from harness.figures import MAP_CMAP, UNIFORM_SCALE_LABEL, relative_to_uniform
from timm_rollout.atomic import write_text
from timm_rollout.cli import (
    CliParser,
    ParseKwargs,
    as_type,
    existing_path,
    key_value,
    output_dir,
    positive_int,
    run_cli,
)
from timm_rollout.data import dataset_arg, load_image_set
from timm_rollout.device import device_arg, resolve_device
from timm_rollout.errors import UserError
from timm_rollout.explain import (
    DISCARD_RATIOS,
    READOUTS,
    AttentionPass,
    gradient_pass,
    gradient_rollout,
    readout_attention,
    rollout_buildup,
)
from timm_rollout.masks import BOX_FORMATS, OBJECT, BoxColumnError
from timm_rollout.rollout import HEAD_FUSIONS

__all__ = ["PAGE_FILE", "Gallery", "build_parser", "dataset_gallery", "main", "pass_maps", "write_page"]

PAGE_FILE = "index.html"
TEMPLATE = Path(__file__).with_name("explore.html")
RATIOS = (0.0, *DISCARD_RATIOS)  # the discard ratios every rollout map is computed at
POOLED_BY_ATTENTION = (READOUTS["rollout"], READOUTS["map"])  # readouts whose pooling weights are a map
BATCH = 32  # images per forward + backward pass


@dataclass
class Gallery:
    """The images a page shows (PIL, as read), with names, labels (None: unknown), class names and, where the data
    set has them, object boxes ``[x, y, w, h]`` (N, 4) and masks (N, H, W) in the images' pixels."""

    images: list[Image.Image]
    names: list[str]
    labels: list[int | None]
    classes: list[str] | None
    boxes: torch.Tensor | None = None
    masks: torch.Tensor | None = None


def build_parser() -> CliParser:
    """The CLI; bad values, missing paths and attention-free models are one-line errors before anything is loaded."""
    p = CliParser(prog="python -m harness.explore", description=__doc__.split("\n")[0], checks=[_check_args])
    p.add_argument("--model", required=True, help="registered timm name, hf-hub:org/name or local-dir:PATH")
    p.add_argument("--checkpoint", type=existing_path, help=".safetensors file or training output folder")
    p.add_argument("--model-kwargs", nargs="+", default={}, action=ParseKwargs, type=key_value, metavar="KEY=VALUE",
                   help="extra timm.create_model arguments of --model, e.g. depth=2")
    p.add_argument("--compare-model", help="a second model drawn beside the first (default: --model)")
    p.add_argument("--compare-checkpoint", type=existing_path, help="the second model's weights")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--image", nargs="+", type=existing_path, help="image files of any size and mode")
    src.add_argument("--dataset", type=as_type(dataset_arg), help="data set alias, Hub id or local folder")
    p.add_argument("--split", default="test", help="split of --dataset (default: test)")
    pick = p.add_mutually_exclusive_group()
    pick.add_argument("--images", type=positive_int, help="the first N images of --split (default: 64)")
    pick.add_argument("--indices", type=int, nargs="+", help="these images of --split")
    p.add_argument("--bbox-format", choices=BOX_FORMATS, help="what --dataset's bbox column holds (default: xywh)")
    p.add_argument("--device", default="cpu", type=device_arg, help="cpu, cuda, auto ...")
    p.add_argument("--workers", "-j", type=positive_int,
                   help="CPU threads for torch (default: torch's choice; 1 is far faster on a busy machine)")
    p.add_argument("--output", required=True, type=output_dir, help=f"folder for {PAGE_FILE}")
    return p


def _check_args(args: argparse.Namespace) -> None:
    from timm_rollout.loading import build_meta, check_model  # here, so that --help loads no timm

    if args.image and (args.images or args.indices):
        raise UserError(f"--{'images' if args.images else 'indices'} picks --dataset images; drop it for --image")
    check_explain_args(args, "harness.explore")
    if args.compare_model or args.compare_checkpoint:
        compare = args.compare_model or args.model
        check_model(compare, None)
        _refuse_attention_free(compare, build_meta(compare, args.compare_checkpoint), "harness.explore")


def dataset_gallery(dataset: str, split: str, indices: Sequence[int] | None = None, box_format: str | None = None
                    ) -> Gallery:
    """Images ``indices`` of a data set split (default: the first 64), with its boxes and masks if any."""
    try:
        data = load_image_set(dataset, split, boxes=True, box_format=box_format)
    except BoxColumnError as e:  # boxes only outline the object here: a column the metrics refuse is drawn nowhere
        print(f"no box outlined: {e}")
        data = load_image_set(dataset, split)
    picked = list(range(min(64, len(data)))) if indices is None else list(indices)
    if not all(-len(data) <= i < len(data) for i in picked):
        raise UserError(f"{split} has {len(data)} images: pass --indices in 0..{len(data) - 1} or --images up to "
                        f"{len(data)}")
    at = torch.tensor(picked) % len(data)
    images = [Image.fromarray(data.images[i].permute(1, 2, 0).numpy()) for i in at]
    return Gallery(images, [f"{Path(dataset).name}/{split} #{int(i)}" for i in at], data.labels[at].tolist(),
                   data.class_names, None if data.boxes is None else data.boxes[at],
                   None if data.masks is None else data.masks[at])


def pass_maps(model: nn.Module, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], AttentionPass]:
    """Every map the page offers for normalised images ``x``, keyed as the page looks them up (harness/README.md),
    each (B, P), and the :func:`gradient_pass` they come from."""
    from harness.features import patch_pooling_weights

    p = gradient_pass(model, x)
    maps = {}
    for layer, attn in enumerate(p.attentions, start=1):
        maps.update({f"attention/{layer}/head{h + 1}": readout_attention(p, layer - 1, head=h)
                     for h in range(attn.shape[1])})
        maps.update({f"attention/{layer}/{f}": readout_attention(p, layer - 1, f) for f in HEAD_FUSIONS})
    for fusion in HEAD_FUSIONS:
        for ratio in RATIOS:
            built = rollout_buildup(p, fusion, ratio)
            maps.update({f"rollout/{i + 1}/{fusion}/{ratio:g}": built[:, i] for i in range(built.shape[1])})
    maps["gradient_rollout"] = gradient_rollout(p)
    if p.readout_name in POOLED_BY_ATTENTION:
        maps["pooling"] = patch_pooling_weights(model, p)
    return maps, p


def _quantised(maps: torch.Tensor) -> tuple[list[str], list[list[float]]]:
    """(N, K, P) maps on the :func:`relative_to_uniform` scale as one base64 uint8 string per image (``q / 255 *
    vmax``) and each map's ``vmax`` (its largest value, rounded up to 4 decimals)."""
    rel = relative_to_uniform(maps).double()
    vmax = (rel.amax(dim=-1) * 1e4).ceil().clamp_min(1) / 1e4
    q = (rel / vmax[..., None] * 255).round().to(torch.uint8).numpy()
    return [base64.b64encode(row.tobytes()).decode() for row in q], vmax.tolist()


def _coverage(gallery: Gallery, size: Sequence[int], grid: Sequence[int]) -> torch.Tensor | None:
    """(N, P) share of each patch on the object (mask pixels, else box area), or None without either."""
    from harness.localisation import box_coverage, mask_fractions

    if gallery.masks is not None:
        return mask_fractions(gallery.masks, grid)[..., OBJECT]
    return None if gallery.boxes is None else box_coverage(gallery.boxes, size, grid)


def model_entry(name: str, model: nn.Module, x: torch.Tensor, gallery: Gallery | None) -> dict[str, Any]:
    """A model's part of the page data: its maps of the (N, 3, H, W) images ``x`` in batches, top-5, and with a
    ``gallery`` of boxes or masks each map's object mass (the share of the map on the object)."""
    from harness.features import batched
    from harness.localisation import map_shares, object_mass

    model.eval()
    last: list = []

    def step(batch: torch.Tensor) -> dict[str, torch.Tensor]:
        last[:] = pass_maps(model, batch)
        return {"maps": torch.stack([m.float() for m in last[0].values()], dim=1), "logits": last[1].logits}

    out = batched(step, x, device=x.device, batch_size=BATCH, desc=f"{name}: maps")
    (maps, p), values, probs = last, out["maps"], out["logits"].softmax(dim=1)
    top = probs.topk(min(5, probs.shape[1]), dim=1)
    strings, vmax = _quantised(values)
    entry = {"name": name, "readout": p.readout_name, "grid": list(p.grid), "depth": len(p.attentions),
             "heads": p.attentions[0].shape[1], "maps": list(maps), "values": strings, "vmax": vmax,
             "top5": [[[int(c), round(float(v), 4)] for c, v in zip(ci, vi, strict=True)]
                      for ci, vi in zip(top.indices, top.values, strict=True)], "mass": None}
    coverage = _coverage(gallery, x.shape[-2:], p.grid) if gallery is not None else None
    if coverage is not None:
        shares = map_shares(values.flatten(0, 1)).view_as(values)
        entry["mass"] = torch.stack([object_mass(shares[:, k], coverage) for k in range(values.shape[1])], dim=1
                                    ).round(decimals=4).tolist()
    return entry


def _data_uri(rgb: np.ndarray) -> str:
    """An (H, W, 3) float image in [0, 1] as a PNG (small images) or JPEG data URI."""
    buf, small = io.BytesIO(), rgb.shape[0] * rgb.shape[1] <= 128 * 128
    Image.fromarray((rgb * 255).round().astype(np.uint8)).save(buf, format="PNG" if small else "JPEG", quality=90)
    return f"data:image/{'png' if small else 'jpeg'};base64,{base64.b64encode(buf.getvalue()).decode()}"


def _prepared(models: Sequence[tuple[str, nn.Module, dict]], gallery: Gallery) -> tuple[list[torch.Tensor], bool]:
    """Each model's normalised (N, 3, H, W) inputs (timm's eval transform) and whether all leave the pixels in place
    (so that boxes and masks still fit); a model of another input size than the first is refused."""
    from timm_rollout.loading import check_input_size

    inputs, kept = [], True
    for name, model, _ in models:
        prepared = [prepare_image(image, model) for image in gallery.images]
        inputs.append(torch.stack([x for x, _, _ in prepared]))
        check_input_size(model, inputs[-1], fix=f"explore {name} at the input size it was built for")
        kept = kept and all(k for _, _, k in prepared)
        if inputs[-1].shape != inputs[0].shape:
            raise UserError(f"{name} takes {tuple(inputs[-1].shape[-2:])} images, {models[0][0]} "
                            f"{tuple(inputs[0].shape[-2:])}: compare models of one input size")
    return inputs, kept


def write_page(models: Sequence[tuple[str, nn.Module, dict]], gallery: Gallery, path: str | Path, title: str,
               device: torch.device | str = "cpu") -> Path:
    """Write the page for ``models`` (name, model, :func:`timm_rollout.loading.load_model` info) on ``gallery``'s
    images: every map computed here, the JSON schema in harness/README.md."""
    inputs, as_is = _prepared(models, gallery)
    if not as_is and (gallery.boxes is not None or gallery.masks is not None):
        print("no object outlined: the model's eval transform resizes or crops the images, which moves the boxes")
    located = gallery if as_is else None
    entries = [model_entry(name, model, x.to(device), located) for (name, model, _), x in zip(models, inputs,
                                                                                               strict=True)]
    first = models[0][2]
    masks = None if located is None or gallery.masks is None else [
        base64.b64encode(np.packbits((m == OBJECT).numpy()).tobytes()).decode() for m in gallery.masks]
    from matplotlib import colormaps

    lut = (colormaps[MAP_CMAP](np.linspace(0, 1, 256))[:, :3] * 255).round().astype(np.uint8)
    data = {"version": 1, "title": title, "scale": UNIFORM_SCALE_LABEL, "colormap": lut.tobytes().hex(),
            "fusions": list(HEAD_FUSIONS), "discard_ratios": list(RATIOS), "classes": gallery.classes,
            "image_size": list(inputs[0].shape[-2:]),
            "images": [{"name": n, "label": y, "src": _data_uri(denormalize(x, first["mean"], first["std"]))}
                       for n, y, x in zip(gallery.names, gallery.labels, inputs[0], strict=True)],
            "boxes": None if located is None or gallery.boxes is None else gallery.boxes.tolist(),
            "masks": masks, "models": entries}
    text = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")  # no "</script" nor "<!--" in the page
    return write_text(path, TEMPLATE.read_text(encoding="utf-8").replace("__DATA__", text, 1))


def _load(name: str, checkpoint: str | None, kwargs: dict, classes: int | None, device: torch.device
          ) -> tuple[str, nn.Module, dict]:
    from timm_rollout.loading import load_model

    prefixed = name.startswith(("hf-hub:", "local-dir:"))
    model, info = load_model(name, checkpoint, num_classes=None if checkpoint or prefixed else classes,
                             device=device, **kwargs)
    _refuse_attention_free(name, model, "harness.explore")
    return name, model, info


def main(argv: list[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    start, device = time.perf_counter(), resolve_device(args.device)
    if args.workers:
        torch.set_num_threads(args.workers)
    if args.dataset:
        picked = args.indices or (range(args.images) if args.images else None)
        gallery = dataset_gallery(args.dataset, args.split, picked, args.bbox_format)
    else:
        read = [_load_input(argparse.Namespace(image=path)) for path in args.image]
        gallery = Gallery([r[0] for r in read], [r[1] for r in read], [None] * len(read), None)
    classes = len(gallery.classes) if gallery.classes else None
    models = [_load(args.model, args.checkpoint, args.model_kwargs, classes, device)]
    if args.compare_model or args.compare_checkpoint:
        models.append(_load(args.compare_model or args.model, args.compare_checkpoint, {}, classes, device))
    gallery.classes = gallery.classes or models[0][2].get("label_names")
    try:
        path = write_page(models, gallery, Path(args.output) / PAGE_FILE,
                          " vs ".join(n for n, _, _ in models), device)
    except ValueError as e:
        raise UserError(f"cannot explain {args.model}: {e}") from None
    print(f"wrote {path} ({len(gallery.images)} images, {len(models)} model(s), "
          f"{path.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - start:.0f} s")
    return path


if __name__ == "__main__":
    run_cli(main)
