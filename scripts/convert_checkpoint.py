"""Convert a state dict saved by the original study's code into a timm folder (safetensors + config.json).

    python scripts/convert_checkpoint.py rollout.pth out/c10-rollout-orig --pooling rollout

The file is read with ``torch.load(weights_only=True)``: plain tensors only, nothing is unpickled. Details:
scripts/README.md.
"""

from __future__ import annotations

import argparse
import sys

from timm_rollout.cli import CliParser, existing_path, number, output_dir, positive, positive_int, run_cli
from timm_rollout.convert import POOLING_MODELS, convert_checkpoint, guess_pooling


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = CliParser(prog="python scripts/convert_checkpoint.py", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=existing_path, help="the original study's state dict (.pth)")
    p.add_argument("output", type=output_dir, help="folder to write model.safetensors and config.json into")
    p.add_argument("--pooling", choices=sorted(POOLING_MODELS), help="default: guessed from the file name")
    p.add_argument("--num-heads", type=positive_int, default=4,
                   help="attention heads (not stored in a state dict; the study used 4)")
    p.add_argument("--label-names", nargs="+", metavar="NAME", help="class names in head order")
    p.add_argument("--mean", type=number(float, 0, 1), nargs=3, help="normalisation mean the weights were trained with")
    p.add_argument("--std", type=positive, nargs=3,
                   help="normalisation std the weights were trained with")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    pooling = args.pooling
    if pooling is None:
        pooling = guess_pooling(args.checkpoint)
        print(f"pooling guessed from the file name: {pooling} (override with --pooling)", file=sys.stderr)
    model = convert_checkpoint(args.checkpoint, args.output, pooling, args.num_heads, args.label_names,
                               mean=args.mean, std=args.std)
    given = args.mean is not None or args.std is not None
    norm = "" if given else " (the model's default; pass --mean/--std if the original used others)"
    print(
        f"converted {args.checkpoint} -> {args.output} as {POOLING_MODELS[pooling]}: depth {len(model.blocks)}, "
        f"dim {model.embed_dim}, {args.num_heads} heads (from --num-heads), {model.num_classes} classes, "
        f"mean {tuple(args.mean or model.pretrained_cfg['mean'])} std {tuple(args.std or model.pretrained_cfg['std'])}"
        f"{norm}"
    )


if __name__ == "__main__":
    run_cli(main)
