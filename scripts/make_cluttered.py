"""Write a cluttered copy of an image classification data set, with the object's box (``timm_rollout.clutter``).

    python scripts/make_cluttered.py --dataset ../shared/data/cifar10 --fragments 16 --output ../c10-clutter16

The construction, the files and the data card: scripts/README.md.
"""

from __future__ import annotations

import argparse
import shlex
import time

from timm_rollout.cli import CliParser, as_type, number, output_dir, positive_int, run_cli, seed_arg
from timm_rollout.clutter import ClutterRecipe, make_cluttered
from timm_rollout.data import dataset_arg


def build_parser() -> CliParser:
    p = CliParser(prog="python scripts/make_cluttered.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True, type=as_type(dataset_arg),
                   help="source: alias (cifar10, cifar10-sample, ...), Hub id or folder")
    p.add_argument("--output", required=True, type=output_dir, help="folder for the parquet files and data card")
    p.add_argument("--fragments", type=number(int, 0, 256), nargs="+", default=[16],
                   help="clutter crops per canvas (0: none); several values make a mixture: each canvas draws one of "
                        "them uniformly and records it in a column 'fragments' (default: 16)")
    p.add_argument("--fragment-size", type=positive_int, default=8, help="side of each clutter crop, pixels")
    p.add_argument("--canvas", type=number(int, 1, 1024), default=64, help="side of the square canvas, pixels")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the placements and fragments")
    p.add_argument("--per-class", type=positive_int, help="a seeded class-balanced subset of N images per class")
    p.add_argument("--splits", nargs="+", metavar="SPLIT",
                   help="write only these splits (default: every split); the fill colour stays the train split's")
    return p


def main(argv: list[str] | None = None) -> dict[str, int]:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    fragments = args.fragments[0] if len(set(args.fragments)) == 1 else tuple(args.fragments)
    recipe = ClutterRecipe(args.canvas, fragments, args.fragment_size, args.seed)
    counts = make_cluttered(args.dataset, args.output, recipe, per_class=args.per_class, splits=args.splits,
                            command=_command(args))
    shown = ", ".join(f"{split} {n}" for split, n in counts.items())
    doses = "/".join(map(str, recipe.doses))
    print(f"wrote {args.output}: {shown} canvases of {args.canvas}x{args.canvas} with {doses} fragments "
          f"in {time.perf_counter() - start:.0f} s")
    return counts


def _command(args: argparse.Namespace) -> str:
    """The command as the data card shows it: every recipe flag spelled out with its value, whatever was typed,
    abbreviated or left to a default, so it makes the same data even if a default changes."""
    recipe = ["--fragments", *args.fragments, "--fragment-size", args.fragment_size, "--canvas", args.canvas,
              "--seed", args.seed, *(["--per-class", args.per_class] if args.per_class is not None else []),
              *(["--splits", *args.splits] if args.splits else [])]
    return shlex.join(["python", "scripts/make_cluttered.py", "--dataset", args.dataset, *map(str, recipe),
                       "--output", args.output])


if __name__ == "__main__":
    run_cli(main)
