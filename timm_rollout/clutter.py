"""Cluttered canvases: each source image at a random position on a larger canvas, among fragments of others.

The construction of cluttered translated MNIST (Mnih et al. 2014) for any image classification set: a canvas of
one colour, ``fragments`` square crops of images of *other* classes of the same split pasted at random, then the
whole source image (the object) pasted last, never occluded; with its box and a per-pixel content mask. Random
streams are keyed by seed and split, so one seed places the same objects at any number (or mixture) of fragments.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from .errors import UserError
from .masks import CLUTTER, FILL, MASK_COLUMN, OBJECT
from .progress import progress

_OBJECTS, _CLUTTER, _DOSE = 0, 1, 2  # the random streams of a split
DOSE_COLUMN = "fragments"  # a mixture's per-canvas fragment count


@dataclass(frozen=True)
class ClutterRecipe:
    """Canvas side, fragment count (several: a mixture, each canvas draws one) and side (pixels), and the seed."""

    canvas: int = 64
    fragments: int | tuple[int, ...] = 16
    fragment_size: int = 8
    seed: int = 0

    @property
    def doses(self) -> tuple[int, ...]:
        """The fragment counts a canvas draws from (one for a fixed dose), sorted and distinct."""
        return tuple(sorted({self.fragments} if isinstance(self.fragments, int) else set(self.fragments)))

    @property
    def mixture(self) -> bool:
        return len(self.doses) > 1

    def check(self, image_size: tuple[int, int]) -> None:
        """Refuse a recipe that cannot be built for source images of ``(height, width)``."""
        h, w = image_size
        if max(h, w) > self.canvas:
            raise UserError(f"the {h}x{w} source images do not fit on a {self.canvas}x{self.canvas} canvas; pass "
                            f"--canvas {max(h, w)} or more")
        if self.fragment_size > self.canvas:
            raise UserError(f"--fragment-size {self.fragment_size} is larger than the {self.canvas}-pixel canvas; "
                            f"pass at most {self.canvas}")
        if max(self.doses) and self.fragment_size > min(h, w):
            raise UserError(f"--fragment-size {self.fragment_size} is larger than the {h}x{w} source images it is "
                            f"cut from; pass at most {min(h, w)}")


def _rng(seed: int, split: str, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(split.encode()), stream])


def object_positions(count: int, image_size: tuple[int, int], recipe: ClutterRecipe, split: str) -> np.ndarray:
    """int64 (count, 2) top-left ``(x, y)`` of each object: uniform integers, from the seed and split only."""
    h, w = image_size
    rng = _rng(recipe.seed, split, _OBJECTS)
    return np.stack([rng.integers(0, recipe.canvas - w + 1, count), rng.integers(0, recipe.canvas - h + 1, count)],
                    axis=1)


def _fragment_sources(labels: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """Image index of each fragment: ``draws`` (N, k) uniform in [0, number of images of other classes) mapped to
    the images whose class differs from that of the row's image, in class order."""
    order = np.argsort(labels, kind="stable")
    classes, starts, counts = np.unique(labels[order], return_index=True, return_counts=True)
    row = np.searchsorted(classes, labels)
    start, count = starts[row][:, None], counts[row][:, None]
    return order[np.where(draws < start, draws, draws + count)]


def check_split(images: torch.Tensor, labels: torch.Tensor, recipe: ClutterRecipe, split: str) -> None:
    """Refuse a split the recipe cannot be built from: images too large, unlabelled, or of a single class."""
    recipe.check(tuple(images.shape[2:]))
    if len(labels) and int(labels.min()) < 0:
        raise UserError(f"split {split!r} has unlabelled images (label {int(labels.min())}); every object needs its "
                        "class: drop that split or its unlabelled rows first")
    if max(recipe.doses) and len(labels.unique()) < 2:
        raise UserError(f"split {split!r} has one class only, so there is no other class to cut clutter from; pass "
                        "--fragments 0 or a data set with several classes")


def fragment_counts(count: int, recipe: ClutterRecipe, split: str) -> np.ndarray:
    """int64 (count,) fragments on each canvas: the recipe's one count, or for a mixture a uniform draw from its
    doses per canvas (its own stream, so object places and clutter draws do not depend on it)."""
    doses = np.asarray(recipe.doses, dtype=np.int64)
    return doses[_rng(recipe.seed, split, _DOSE).integers(0, len(doses), count)] if recipe.mixture \
        else np.full(count, doses[0])


def clutter_split(images: torch.Tensor, labels: torch.Tensor, fill: tuple[int, int, int], recipe: ClutterRecipe,
                  split: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 (N, 3, H, W) ``images`` of one split -> uint8 canvases, int64 (N, 4) object boxes ``[x, y, w, h]`` and
    uint8 content masks (what each pixel was last painted with). In a mixture every canvas draws the fragments of
    the largest dose and shows its first :func:`fragment_counts` of them."""
    n, _, h, w = images.shape
    check_split(images, labels, recipe, split)
    lab = labels.numpy()
    k, f, c = max(recipe.doses), recipe.fragment_size, recipe.canvas
    counts = fragment_counts(n, recipe, split)
    pos = object_positions(n, (h, w), recipe, split)
    rng = _rng(recipe.seed, split, _CLUTTER)
    others = n - np.bincount(lab)[lab]
    src = _fragment_sources(lab, rng.integers(0, others[:, None], (n, k)))
    crop = np.stack([rng.integers(0, h - f + 1, (n, k)), rng.integers(0, w - f + 1, (n, k))], axis=-1)
    at = rng.integers(0, c - f + 1, (n, k, 2))  # (y, x) on the canvas
    source = images.numpy()
    out = np.empty((n, 3, c, c), dtype=np.uint8)
    out[:] = np.asarray(fill, dtype=np.uint8)[:, None, None]
    masks = np.full((n, c, c), FILL, dtype=np.uint8)
    canvases, marks = _windows(out, (f, f)), _windows(masks[:, None], (f, f))
    patches, every = _windows(source, (f, f)), np.arange(n)
    for t in progress(range(k), desc=f"clutter {split}", leave=False):  # fragment t of every canvas at once
        on = every[counts > t]  # every canvas at a fixed dose
        (y, x), (cy, cx) = at[on, t].T, crop[on, t].T
        canvases[on, :, y, x] = patches[src[on, t], :, cy, cx]
        marks[on, :, y, x] = CLUTTER
    objects, object_marks = _windows(out, (h, w)), _windows(masks[:, None], (h, w))
    objects[every, :, pos[:, 1], pos[:, 0]] = source
    object_marks[every, :, pos[:, 1], pos[:, 0]] = OBJECT
    boxes = np.concatenate([pos, np.broadcast_to([w, h], (n, 2))], axis=1)
    return torch.from_numpy(out), torch.from_numpy(boxes.astype(np.int64)), torch.from_numpy(masks)


def _windows(a: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Writable (N, C, H - h + 1, W - w + 1, h, w) view of every ``size`` patch of ``a``, by top-left corner."""
    n, ch, height, width = a.shape
    s = a.strides
    return as_strided(a, (n, ch, height - size[0] + 1, width - size[1] + 1, *size), (*s, *s[2:]), writeable=True)


def fill_colour(images: torch.Tensor) -> tuple[int, int, int]:
    """The mean colour of uint8 (N, 3, H, W) images, rounded to uint8 (the canvas background)."""
    from .data import compute_stats

    mean, _ = compute_stats(images)
    return tuple(round(m * 255) for m in mean)


CARD_MARK = "Cluttered canvases made by `timm_rollout.clutter`"  # a folder holding it may be overwritten
CARD = """---
pretty_name: {name}
---
# {name}

{mark} (the construction of cluttered translated MNIST, Mnih et al.
2014) from `{source}`:

    {command}

Recipe: a {canvas}x{canvas} canvas filled with the mean colour RGB {fill} of the `{fill_split}` images it read;
{fragments} crops of {fragment_size}x{fragment_size} pixels, each from a random spot of a random image of another
class of the same split, pasted at uniform random positions; then the whole {height}x{width} source image (the
object) pasted last at a uniform random integer position, never occluded, its pixels equal to the source's. Seed
{seed}: the objects and their positions depend on the seed and split only, so the same seed at any `--fragments`
gives the same objects in the same places.

Columns: `image` (PNG), `label` (ClassLabel: {classes}), `bbox` (the object's box `[x, y, w, h]` in pixels,
COCO order) and `mask` (PNG, one byte per pixel: what the canvas shows there, 0 flat fill, 1 a visible piece of
clutter, 2 the object; the object's pixels are exactly its box){dose_column}. One file per split,
`data/<split>-00000-of-00001.parquet`, the Hub's layout: `datasets.load_dataset("<this folder>")` finds the
splits by the file names (the card names no files, so datasets keys its cache by the files, not by the folder's
name).

| split | images | source fingerprint | source sha256 (pixels, labels) | canvas sha256 (pixels, labels, boxes) |
|---|---:|---|---|---|
{rows}

The files are the same byte for byte for the same arguments and library versions; another PNG encoder or parquet
writer gives other bytes, and the last column, a sha256 of the written data as decoded
(`timm_rollout.data.content_hash`), says whether the data are the same. The source fingerprint is datasets'.
"""


def _png(pixels: np.ndarray) -> bytes:
    """PNG bytes of a (3, H, W) RGB canvas or an (H, W) mask (mode L)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels.transpose(1, 2, 0) if pixels.ndim == 3 else pixels)).save(
        buf, format="PNG")
    return buf.getvalue()


def _write_parquet(path, canvases: torch.Tensor, labels: torch.Tensor, boxes: torch.Tensor, masks: torch.Tensor,
                   class_names: list[str], counts: np.ndarray | None = None) -> None:
    """One split's parquet file; ``counts``: a mixture's fragments per canvas (column ``fragments``)."""
    import datasets

    from .atomic import atomic_path

    features = {"image": datasets.Image(), "label": datasets.ClassLabel(names=class_names),
                "bbox": datasets.List(datasets.Value("int32"), length=4), MASK_COLUMN: datasets.Image()}
    images = [{"bytes": _png(c), "path": None} for c in progress(canvases.numpy(), desc="png", leave=False)]
    mask_images = [{"bytes": _png(m), "path": None} for m in progress(masks.numpy(), desc="mask png", leave=False)]
    columns = {"image": images, "label": labels.tolist(), "bbox": boxes.tolist(), MASK_COLUMN: mask_images}
    if counts is not None:
        features[DOSE_COLUMN], columns[DOSE_COLUMN] = datasets.Value("int32"), counts.tolist()
    table = datasets.Dataset.from_dict(columns, features=datasets.Features(features))
    with atomic_path(path) as tmp:
        table.to_parquet(str(tmp))


def split_file(split: str) -> str:
    """A split's parquet file in an output folder: the Hub's sharded name, which datasets reads as that split."""
    return f"data/{split}-00000-of-00001.parquet"


def _check_output(source: str, output: Path) -> None:
    from .data import resolve_dataset

    src = Path(resolve_dataset(source).path).expanduser()  # an alias names a folder too (cifar10-sample)
    if src.is_dir() and output.resolve().is_relative_to(src.resolve()):
        raise UserError(f"--output {output} is inside the source data set {source}; write the canvases elsewhere")
    card = output / "README.md"
    if output.is_dir() and any(output.iterdir()) and not (
            card.is_file() and CARD_MARK in card.read_text(encoding="utf-8", errors="replace")):
        raise UserError(f"--output {output} holds files this script did not write; pass a new or empty folder (one "
                        "it wrote before is overwritten)")


def _check_memory(images: int, canvas: int) -> None:
    """Refuse a split whose canvases (held in memory while written) would not fit in half of this machine's RAM."""
    needed = images * 3 * canvas * canvas * 2  # the canvases and their PNG bytes, about
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return
    if needed > ram / 2:
        raise UserError(f"{images} canvases of {canvas}x{canvas} need about {needed / 2**30:.1f} GiB, more than half "
                        f"of this machine's {ram / 2**30:.0f} GiB; pass a smaller --canvas or --per-class N")


def make_cluttered(source: str, output: str | Path, recipe: ClutterRecipe, *, per_class: int | None = None,
                   splits: list[str] | None = None, command: str = "") -> dict[str, int]:
    """Write a cluttered copy of the ``splits`` (default: all) of ``source`` into ``output`` (a parquet file per split
    and a data card), of ``per_class`` images per class if given; returns the image count per split."""
    from .atomic import write_text
    from .data import balanced_indices, content_hash, load_image_set, split_names

    output = Path(output)
    _check_output(source, output)
    sets, found = {}, split_names(source)
    missing = [split for split in splits or () if split not in found]
    if missing:
        raise UserError(f"{source} has no split {', '.join(map(repr, missing))}; pass --splits among "
                        f"{', '.join(found)}")
    for split in [split for split in found if splits is None or split in splits]:
        data = load_image_set(source, split)
        if per_class is not None:
            data = data.subset(balanced_indices(data.labels, per_class=per_class, seed=recipe.seed))
        check_split(data.images, data.labels, recipe, split)
        sets[split] = data
    sizes = {split: "x".join(map(str, data.images.shape[2:])) for split, data in sets.items()}
    if len(set(sizes.values())) > 1:  # checked before anything is written: a refused source leaves no files
        raise UserError(f"the splits' images have different sizes ({', '.join(f'{k} {v}' for k, v in sizes.items())}); "
                        "resize the data set to one size first (e.g. with datasets' map)")
    _check_memory(max(len(data) for data in sets.values()), recipe.canvas)
    fill_split = "train" if "train" in found else next(iter(sets))  # the same fill whichever splits are written
    fill = fill_colour(sets[fill_split].images if fill_split in sets else _fill_source(source, fill_split, per_class,
                                                                                      recipe.seed))
    rows = []
    for split, data in sets.items():
        canvases, boxes, masks = clutter_split(data.images, data.labels, fill, recipe, split)
        counts = fragment_counts(len(data), recipe, split) if recipe.mixture else None
        _write_parquet(output / split_file(split), canvases, data.labels, boxes, masks, data.class_names, counts)
        rows.append(f"| {split} | {len(data)} | {data.fingerprint} | {content_hash(data.images, data.labels)} | "
                    f"{content_hash(canvases, data.labels, boxes)} |")
    first = next(iter(sets.values()))
    write_text(output / "README.md", CARD.format(
        mark=CARD_MARK,
        name=f"{Path(source).name or source} cluttered ({_doses_text(recipe)} fragments, seed {recipe.seed})",
        source=source, command=command,
        canvas=recipe.canvas, fill=fill, fill_split=fill_split,
        fragments=(f"{_doses_text(recipe)} (drawn uniformly per canvas, its own random stream)" if recipe.mixture
                   else recipe.doses[0]),
        dose_column=(f"; `{DOSE_COLUMN}` (int32: this canvas's number of fragments)" if recipe.mixture else ""),
        fragment_size=recipe.fragment_size, height=first.images.shape[2], width=first.images.shape[3],
        seed=recipe.seed, classes=", ".join(first.class_names), rows="\n".join(rows)))
    return {split: len(data) for split, data in sets.items()}


def _doses_text(recipe: ClutterRecipe) -> str:
    *rest, last = map(str, recipe.doses)
    return f"{', '.join(rest)} or {last}" if rest else last


def _fill_source(source: str, split: str, per_class: int | None, seed: int) -> torch.Tensor:
    """The images the fill colour is the mean of, when their split is not written: the same as when it is."""
    from .data import balanced_indices, load_image_set

    data = load_image_set(source, split)
    return (data.subset(balanced_indices(data.labels, per_class=per_class, seed=seed)) if per_class is not None
            else data).images
