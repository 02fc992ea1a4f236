"""Build the small class-balanced CIFAR-10 sample shipped in the package (timm_rollout/data/cifar10_sample).

Images are copied byte for byte from a CIFAR-10 copy in Hub layout, as parquet files ``load_dataset`` reads::

    python scripts/make_sample.py --source ../shared/data/cifar10
"""

from __future__ import annotations

from pathlib import Path

from timm_rollout.atomic import atomic_path, write_text
from timm_rollout.cli import CliParser, existing_path, output_dir, positive_int, run_cli, seed_arg
from timm_rollout.data import SAMPLE_DIR, balanced_indices

README = """---
pretty_name: CIFAR-10 sample (timm-rollout)
---
# CIFAR-10 sample

{train} train and {test} test images of CIFAR-10, class-balanced ({train_pc} and {test_pc} per class),
drawn with seed {seed} from {source} by `scripts/make_sample.py`; columns `img` (Image) and `label`
(ClassLabel), as in `uoft-cs/cifar10`. For smoke runs and offline examples; not for reporting accuracy.
"""


def main(argv: list[str] | None = None) -> None:
    parser = CliParser(prog="python scripts/make_sample.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=existing_path, default="../shared/data/cifar10", help="CIFAR-10 in Hub layout")
    parser.add_argument("--output", type=output_dir, default=str(SAMPLE_DIR), help="folder of the sample")
    parser.add_argument("--train-per-class", type=positive_int, default=200, help="training images per class")
    parser.add_argument("--test-per-class", type=positive_int, default=100, help="test images per class")
    parser.add_argument("--seed", type=seed_arg, default=0, help="seed of the class-balanced draw")
    args = parser.parse_args(argv)
    import datasets  # here, so that --help loads no datasets

    out = Path(args.output)

    splits = datasets.load_dataset(args.source)
    counts = {"train": args.train_per_class, "test": args.test_per_class}
    for split, per_class in counts.items():
        ds = splits[split]
        idx = balanced_indices(ds.with_format("numpy")["label"], per_class=per_class, seed=args.seed)
        with atomic_path(out / f"{split}.parquet") as tmp:
            ds.select(idx.tolist()).to_parquet(str(tmp))
    write_text(out / "README.md", README.format(
        train=10 * counts["train"], test=10 * counts["test"], train_pc=counts["train"], test_pc=counts["test"],
        seed=args.seed, source=args.source,
    ))
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    run_cli(main)
