"""Draw every saliency map of a timm ViT-family model for one image, in one figure.

    python -m harness.explain --model vit_tiny_cifar_rollout --checkpoint runs/c10-rollout \\
        --dataset ../shared/data/cifar10 --index 17 --output fig/
    python -m harness.explain --model vit_small_patch16_224 --image photo.jpg --output fig/

Writes ``explain_<image>.png`` into ``--output``; the panels are listed in harness/README.md, "Explain a
prediction".
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from harness.figures import plot_explanation
from timm_rollout.cli import (
    CliParser,
    ParseKwargs,
    as_type,
    existing_path,
    key_value,
    non_negative_int,
    output_dir,
    run_cli,
)
from timm_rollout.data import dataset_arg, load_image_set
from timm_rollout.device import device_arg, resolve_device
from timm_rollout.errors import UserError
from timm_rollout.explain import explain
from timm_rollout.masks import BOX_FORMATS, BoxColumnError
from timm_rollout.pooling import attention_free

__all__ = ["build_parser", "denormalize", "main", "prepare_image"]


def build_parser() -> CliParser:
    """The CLI; bad values, missing paths and unknown models are one-line errors before anything is loaded."""
    p = CliParser(prog="python -m harness.explain", description=__doc__.split("\n")[0], checks=[_check_args])
    p.add_argument("--model", required=True, help="registered timm name, hf-hub:org/name or local-dir:PATH")
    p.add_argument("--checkpoint", type=existing_path,
                   help=".safetensors file or training output folder (model.safetensors + config)")
    p.add_argument("--model-kwargs", nargs="+", default={}, action=ParseKwargs, type=key_value, metavar="KEY=VALUE",
                   help="extra timm.create_model arguments, e.g. depth=2")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--image", type=existing_path,
                     help="an image file of any size and mode (converted to RGB and resized)")
    src.add_argument("--dataset", type=as_type(dataset_arg),
                     help="data set alias, Hub id or local folder; pick the image with --index")
    p.add_argument("--split", default="test", help="split of --dataset (default: test)")
    p.add_argument("--index", type=int, default=0, help="image index in --dataset's split")
    p.add_argument("--bbox-format", choices=BOX_FORMATS,
                   help="what --dataset's bbox column holds, as harness.eval --bbox-format (default: xywh)")
    p.add_argument("--target-class", type=non_negative_int,
                   help="class explained by the gradient map (default: predicted)")
    p.add_argument("--no-flow", action="store_true", help="skip attention flow (one max-flow per patch)")
    p.add_argument("--device", default="cpu", type=device_arg, help="cpu, cuda, auto ...")
    p.add_argument("--output", required=True, type=output_dir, help="folder for the figure")
    return p


def _check_args(args: argparse.Namespace, command: str = "harness.explain") -> None:
    from timm_rollout.loading import build_meta, check_model  # here, so that --help loads no timm

    prefixed = args.model.startswith(("hf-hub:", "local-dir:"))
    if args.bbox_format and not args.dataset:
        raise UserError("--bbox-format reads the boxes of a --dataset image; drop it for --image")
    if "num_classes" in args.model_kwargs and (args.dataset or args.checkpoint or prefixed):
        raise UserError("drop --model-kwargs num_classes: the class count comes from the checkpoint or the data set")
    check_model(args.model, None if prefixed or args.checkpoint else args.model_kwargs)
    _refuse_attention_free(args.model, build_meta(args.model, args.checkpoint), command)


def _refuse_attention_free(name: str, model: torch.nn.Module | None, command: str = "harness.explain") -> None:
    """A one-line error for a model without attention to draw (nothing where it is None: not known yet)."""
    reason = attention_free(model) if model is not None else None
    if reason is not None:
        raise UserError(f"cannot explain {name}: every map of {command} is drawn from attention, and {reason}; "
                        "evaluate it with python -m harness.eval (accuracy, k-NN, geometry, linear probe)")


def prepare_image(image: Image.Image, model: torch.nn.Module) -> tuple[torch.Tensor, str, bool]:
    """RGB-convert and resize/crop ``image`` with timm's eval transform for ``model``: ((3, H, W), note, whether
    the pixels are the image's own: no resize or crop moved them)."""
    from timm.data import create_transform, resolve_data_config

    cfg = resolve_data_config(model=model)
    transform = create_transform(**cfg, is_training=False)
    _, h, w = cfg["input_size"]
    scale = (math.floor(h / cfg["crop_pct"]), math.floor(w / cfg["crop_pct"]))  # timm's eval resize, then crop
    steps = []
    if image.mode != "RGB":
        steps.append(f"converted {image.mode} to RGB" + (" (alpha dropped)" if "A" in image.mode else ""))
        image = image.convert("RGB")
    moved = image.size != (w, h) or scale != (h, w)
    if moved:
        steps.append(f"resized {image.height}x{image.width} (shorter side to {scale[0]}, crop_pct "
                     f"{cfg['crop_pct']:g}, {cfg['interpolation']}) and centre-cropped to {h}x{w} with timm's eval "
                     "transform")
    note = "; ".join(steps) if steps else f"RGB {h}x{w}, the model's input size: used as is"
    return transform(image), note, not moved


def denormalize(x: torch.Tensor, mean, std) -> np.ndarray:
    """Normalised (3, H, W) -> (H, W, 3) float image in [0, 1]."""
    m = torch.tensor(mean).view(3, 1, 1)
    s = torch.tensor(std).view(3, 1, 1)
    return (x.cpu() * s + m).clamp(0, 1).permute(1, 2, 0).numpy()


def _load_input(args: argparse.Namespace) -> tuple[Image.Image, str, str, list[str] | None, torch.Tensor | None]:
    """(PIL image, source description, file stem, class names or None, the object's box ``[x, y, w, h]`` or None)."""
    if args.image:
        path = Path(args.image)
        try:
            image = Image.open(path)
            image.load()
        except FileNotFoundError:
            raise UserError(f"--image {path} does not exist; pass an image file") from None
        except (UnidentifiedImageError, OSError) as e:
            raise UserError(f"--image {path} is not an image PIL can read ({e}); pass a JPEG, PNG, ...") from None
        return image, path.name, path.stem, None, None
    try:
        data = load_image_set(args.dataset, args.split, boxes=True, box_format=args.bbox_format)
    except BoxColumnError as e:  # boxes only outline the object here: a column the metrics refuse is drawn nowhere
        print(f"no box outlined: {e}")
        data = load_image_set(args.dataset, args.split)
    if not -len(data) <= args.index < len(data):
        raise UserError(f"--index {args.index} is outside {args.split} ({len(data)} images); pass 0..{len(data) - 1}")
    label = data.class_names[int(data.labels[args.index])]
    array = data.images[args.index].permute(1, 2, 0).numpy()
    stem = f"{Path(args.dataset).name}_{args.split}_{args.index}"
    box = data.boxes[args.index] if data.boxes is not None else None
    return Image.fromarray(array), f"{args.dataset} {args.split} #{args.index} (label: {label})", stem, \
        data.class_names, box


def _class_name(names: list[str] | None, index: int) -> str:
    return f"{names[index]} ({index})" if names and index < len(names) else str(index)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    from timm_rollout.loading import check_input_size, load_model

    device = resolve_device(args.device)
    image, source, stem, class_names, box = _load_input(args)
    prefixed = args.model.startswith(("hf-hub:", "local-dir:"))
    num_classes = len(class_names) if class_names and not args.checkpoint and not prefixed else None
    model, info = load_model(args.model, args.checkpoint, num_classes=num_classes, device=device, **args.model_kwargs)
    _refuse_attention_free(args.model, model)  # where the meta device could not tell before
    names = info.get("label_names") or class_names
    if args.target_class is not None and not 0 <= args.target_class < info["num_classes"]:
        raise UserError(f"--target-class {args.target_class} is outside the model's {info['num_classes']} classes; "
                        f"pass 0..{info['num_classes'] - 1}")
    x, note, as_is = prepare_image(image, model)
    check_input_size(model, x, fix="explain it at the input size it was built for")  # and patches that tile it
    print(f"{source}: {note}")
    try:
        ex = explain(model, x[None].to(device), target_class=args.target_class, flow=not args.no_flow)
    except ValueError as e:
        raise UserError(f"cannot explain {args.model}: {e}") from None
    probs = ex.logits[0].softmax(dim=0)
    pred, target = int(probs.argmax()), int(ex.target[0])
    rgb = denormalize(x, info["mean"], info["std"])
    input_title = (f"input: {source}\npred {_class_name(names, pred)} p={probs[pred]:.2f}; "
                   f"gradient map for {_class_name(names, target)}")
    title = f"{info['name']}: attention maps ({ex.grid[0]}x{ex.grid[1]} patches, readout {ex.readout})"
    out = plot_explanation(ex, rgb, title, input_title, Path(args.output) / f"explain_{stem}.png",
                           box if as_is else None)
    print(f"wrote {out} ({len(ex.maps) + ex.buildup.shape[1]} maps; predicted {_class_name(names, pred)}, "
          f"p={probs[pred]:.3f})")
    return {"figure": str(out), "predicted": pred, "target": target, "note": note, "maps": list(ex.maps)}


if __name__ == "__main__":
    run_cli(main)
