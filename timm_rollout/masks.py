"""Object boxes and content masks a data set brings: their conventions, read and checked when a split is loaded.

The harness (``load_image_set(..., boxes=True)``) reads two optional columns, training leaves them alone: ``bbox``
(one pixel box per image, ``[x, y, w, h]`` in COCO order unless ``--bbox-format`` says otherwise) and ``mask`` (one
mask per image in the clutter convention, 0 fill, 1 clutter, 2 object, or the foreground one, 0 background, 1
object). What is accepted and refused:
``harness/README.md`` ("Object boxes and masks a data set brings").
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import torch

from .errors import UserError

BOX_COLUMN = "bbox"  # one object box per image in pixels, [x, y, w, h] (COCO order) unless --bbox-format says
MASK_COLUMN = "mask"  # a per-pixel mask per image, in one of CONVENTIONS
FILL, CLUTTER, OBJECT = 0, 1, 2  # the clutter convention's values: flat fill, visible clutter, the object
BACKGROUND = 3  # a foreground mask's background in the harness's encoding: fill or clutter, not told apart
CONVENTIONS = {"clutter": "0 fill, 1 clutter, 2 object", "foreground": "0 background, 1 object"}
TOLERANCE = 1.0  # pixels a box edge may lie from its mask's object
CONVERT = ("map its values to one of them (e.g. (mask > 0).astype('uint8') for a 0/255 foreground mask), or rename "
           "the column to evaluate without masks")


class BoxColumnError(UserError):
    """A ``bbox`` or ``mask`` column the localisation metrics refuse (``harness.explain`` then draws no box)."""


def _numbers(cell: object) -> list[float] | None:
    """A ``bbox`` cell's four finite numbers (one box, or ``[[one box]]``); None for anything else."""
    if isinstance(cell, list) and len(cell) == 1 and isinstance(cell[0], list):
        cell = cell[0]
    if not isinstance(cell, list) or len(cell) != 4:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in cell):
        return None
    return [float(v) for v in cell]


def _as_xywh(box: list[float], box_format: str) -> list[float]:
    """One box's four numbers read in ``box_format`` as ``[x, y, w, h]`` (those of ``xywh`` as they are)."""
    if box_format == "xywh":
        return box
    x0, y0, x1, y1 = _READINGS[box_format][1](*box)
    return [x0, y0, x1 - x0, y1 - y0]


def _box_column(split_ds, name: str, box_format: str) -> tuple[torch.Tensor, torch.Tensor, list] | None:
    """A ``bbox`` column of one box per image in ``box_format``: float32 (N, 4) ``[x, y, w, h]``, the float64 numbers
    as the column holds them, and its cells; None without one. Anything else (several boxes, none, non-finite
    numbers, no positive width and height) is refused: the harness scores one object per image."""
    if BOX_COLUMN not in split_ds.features:
        return None
    cells = split_ds.select_columns([BOX_COLUMN]).with_format("arrow")[:].column(BOX_COLUMN).to_pylist()
    held = [_numbers(c) for c in cells]
    boxes = [None if b is None else _as_xywh(b, box_format) for b in held]
    bad = next((i for i, b in enumerate(boxes) if b is None or min(b[2:]) <= 0), None)
    if bad is not None:
        raise BoxColumnError(f"data set {name!r}: row {bad} of column {BOX_COLUMN!r} is {str(cells[bad])[:80]}, "
                             f"not one box {_READINGS[box_format][0]} of finite numbers with a positive width and "
                             "height; keep one box per image, or rename the column to evaluate without boxes")
    return (torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
            torch.tensor(held, dtype=torch.float64).reshape(-1, 4), cells)


def _check_inside(boxes: torch.Tensor, cells: list, name: str, size: tuple[int, int], box_format: str) -> None:
    """Refuse a box (``[x, y, w, h]``, read in ``box_format``) that is not at least a pixel wide and high and inside
    its ``size`` = (H, W) image (to within a pixel): the sign of another format, which would otherwise give wrong
    localisation numbers."""
    h, w = size
    x, y, bw, bh = boxes.double().unbind(dim=1)
    out = (torch.minimum(bw, bh) < 1) | (torch.minimum(x, y) < -1) | (x + bw > w + 1) | (y + bh > h + 1)
    if out.any():
        i = int(out.nonzero()[0])
        raise BoxColumnError(f"data set {name!r}: row {i} of column {BOX_COLUMN!r} is {str(cells[i])[:80]}, "
                             f"not a box {_READINGS[box_format][0]} in pixels inside its {h}x{w} image; name the "
                             f"column's format with --bbox-format ({', '.join(BOX_FORMATS)}), or convert it to one "
                             "(e.g. from fractions of the image)")


def _decode(cell: dict) -> np.ndarray:
    """One Image cell (``{'bytes', 'path'}``) as the array PIL reads: (H, W) for one channel, (H, W, C) else."""
    from PIL import Image

    with Image.open(io.BytesIO(cell["bytes"]) if cell["bytes"] is not None else Path(cell["path"])) as image:
        return np.asarray(image)


def _mask_arrays(split_ds, name: str) -> list[np.ndarray]:
    """The ``mask`` column as one array per row: an Image column decoded, any other column read as numbers; a
    column that holds neither is refused."""
    import datasets

    column = split_ds.select_columns([MASK_COLUMN])
    feature = split_ds.features[MASK_COLUMN]
    if isinstance(feature, datasets.Image):
        cells = column.cast_column(MASK_COLUMN, datasets.Image(decode=False))[MASK_COLUMN]
        return [_decode(c) for c in cells]
    try:
        values = column.with_format("numpy")[:][MASK_COLUMN]
    except (TypeError, ValueError):  # strings, dicts, ...: not numbers
        values = None
    arrays = None if values is None else [np.asarray(v) for v in values]
    if arrays is None or any(a.dtype.kind not in "biuf" for a in arrays):
        raise BoxColumnError(f"data set {name!r}: column {MASK_COLUMN!r} holds {feature}, not masks; store one mask "
                             "per image as an Image column (one channel, e.g. PNG mode L) or a 2-D array of "
                             "integers (Array2D), or rename the column to evaluate without masks")
    return arrays


def _convention(values: set[float], name: str) -> str:
    """``'clutter'`` or ``'foreground'``, from the values a split's masks hold; any other values are refused."""
    if values <= {0, 1, 2} and 2 in values:
        return "clutter"
    if values <= {0, 1}:
        return "foreground"
    shown = ", ".join(f"{v:g}" for v in sorted(values)[:6]) + (", ..." if len(values) > 6 else "")
    raise BoxColumnError(f"data set {name!r}: column {MASK_COLUMN!r} holds the values {shown}, which fit neither mask "
                         f"convention the harness reads: clutter ({CONVENTIONS['clutter']}, as make_cluttered.py "
                         f"writes) or foreground ({CONVENTIONS['foreground']}); {CONVERT}")


def read_masks(split_ds, name: str, size: tuple[int, int]) -> tuple[torch.Tensor, str] | None:
    """uint8 (N, H, W) masks of a split's ``mask`` column in the harness's encoding and their convention (a key of
    :data:`CONVENTIONS`); None without the column."""
    if MASK_COLUMN not in split_ds.features:
        return None
    arrays = _mask_arrays(split_ds, name)
    bad = next((i for i, a in enumerate(arrays) if a.shape != tuple(size)), None)
    if bad is not None:
        raise BoxColumnError(f"data set {name!r}: row {bad} of column {MASK_COLUMN!r} is a mask of shape "
                             f"{arrays[bad].shape}, not one channel of its {size[0]}x{size[1]} image; store one "
                             "value per pixel, or rename the column to evaluate without masks")
    values = {float(v) for a in arrays for v in np.unique(a)}
    convention = _convention(values, name)
    if not arrays:
        return torch.zeros(0, *size, dtype=torch.uint8), convention
    stacked = np.stack(arrays)
    if convention == "foreground":
        stacked = np.where(stacked == 1, OBJECT, BACKGROUND)
    return torch.from_numpy(stacked.astype(np.uint8)), convention


def object_boxes(masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (N, 4) bounding box ``[x, y, w, h]`` of each (N, H, W) mask's :data:`OBJECT` pixels (pixel i
    spanning [i, i + 1)), and (N,) bool whether the mask has any (the box is zeros where not)."""
    obj = masks == OBJECT
    rows, cols = obj.any(dim=2), obj.any(dim=1)  # (N, H), (N, W)
    found = rows.any(dim=1)
    y0, x0 = rows.int().argmax(dim=1), cols.int().argmax(dim=1)  # the first object row and column
    y1 = rows.shape[1] - rows.flip(1).int().argmax(dim=1)
    x1 = cols.shape[1] - cols.flip(1).int().argmax(dim=1)
    boxes = torch.stack([x0, y0, x1 - x0, y1 - y0], dim=1).float()
    return torch.where(found[:, None], boxes, 0.0), found


# Box formats a column may hold, as the [x0, y0, x1, y1] edges each gives (of float64 columns, or numbers, a, b, c,
# d); the first three are --bbox-format's (torchvision.ops.box_convert's names, xywh the default), the last is only
# named in errors, with its fix.
_READINGS = {
    "xywh": ("[x, y, w, h] (COCO order)", lambda a, b, c, d: (a, b, a + c, b + d)),
    "xyxy": ("[x1, y1, x2, y2] (corners)", lambda a, b, c, d: (a, b, c, d)),
    "cxcywh": ("[cx, cy, w, h] (centre and size)", lambda a, b, c, d: (a - c / 2, b - d / 2, a + c / 2, b + d / 2)),
    "yxhw": ("[y, x, h, w] (rows first)", lambda a, b, c, d: (b, a, b + d, a + c)),
}
BOX_FORMATS = ("xywh", "xyxy", "cxcywh")


def _fits(boxes: torch.Tensor, edges: torch.Tensor, box_format: str) -> torch.Tensor:
    """(N,) bool: whether ``boxes`` read in ``box_format`` put every edge within :data:`TOLERANCE` of ``edges``."""
    got = torch.stack(_READINGS[box_format][1](*boxes.double().unbind(dim=1)), dim=1)
    return ((got - edges).abs() <= TOLERANCE).all(dim=1)


def check_boxes(boxes: torch.Tensor, masks: torch.Tensor, convention: str, name: str, box_format: str) -> None:
    """Refuse (N, 4) ``boxes`` (the column's numbers, read in ``box_format``) that are not the bounding boxes of
    their (N, H, W) ``masks``' objects (the masks read in ``convention``), naming the format the column looks like."""
    found, _ = object_boxes(masks)
    edges = torch.cat([found[:, :2], found[:, :2] + found[:, 2:]], dim=1).double()
    wrong = ~_fits(boxes, edges, box_format)
    if not wrong.any():
        return
    i = int(wrong.nonzero()[0])
    label, reading = _READINGS[box_format]
    x0, y0, x1, y1 = (f"{v:g}" for v in reading(*boxes[i].tolist()))
    o = [f"{v:g}" for v in edges[i].tolist()]
    n = int(wrong.sum())
    count, other = max(((int(_fits(boxes[wrong], edges[wrong], k).sum()), k) for k in _READINGS if k != box_format),
                       key=lambda fit: fit[0])
    fix = f"pass --bbox-format {other}" if other in BOX_FORMATS else "swap x with y and w with h"
    likely = "" if 2 * count <= n else (f"; {'every such box' if count == n else f'{count} of them'} reads as "
                                        f"{_READINGS[other][0]}: {fix}")
    raise BoxColumnError(
        f"data set {name!r}: {n} boxes of column {BOX_COLUMN!r} contradict their masks (read as "
        f"{convention}: {CONVENTIONS[convention]}), e.g. row {i}: {[round(v, 3) for v in boxes[i].tolist()]} read "
        f"as {label.split(' (')[0]} spans x {x0}..{x1}, y {y0}..{y1}, its object x {o[0]}..{o[2]}, y {o[1]}..{o[3]}"
        f"{likely}; give each box as its object's bounding box in pixels, or remove the {BOX_COLUMN!r} column to "
        "take the boxes from the masks")


def read_localisation(split_ds, name: str, size: tuple[int, int], box_format: str | None = None
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None, str | None]:
    """A split's checked object boxes (float32 (N, 4) ``[x, y, w, h]``, the ``bbox`` column read in ``box_format``,
    None: xywh, not asked for), masks (uint8 (N, H, W)) and convention, or Nones."""
    fmt = box_format or BOX_FORMATS[0]
    column, read = _box_column(split_ds, name, fmt), read_masks(split_ds, name, size)
    if column is None and box_format is not None:
        raise UserError(f"--bbox-format {box_format}: data set {name!r} has no {BOX_COLUMN!r} column to read; drop "
                        "--bbox-format")
    boxes = None if column is None else column[0]
    if read is None:
        if column is not None:
            _check_inside(column[0], column[2], name, size, fmt)
        return boxes, None, None
    masks, convention = read
    derived, found = object_boxes(masks)
    if not found.all():
        i = int((~found).nonzero()[0])
        marked = "2" if convention == "clutter" else "1"
        raise BoxColumnError(
            f"data set {name!r}: the mask of row {i} marks no pixel as the object (read as {convention}: "
            f"{CONVENTIONS[convention]}; the object is {marked}); mark every image's object, drop its row, or "
            f"rename the {MASK_COLUMN!r} column to evaluate without masks")
    if boxes is None:
        return derived, masks, convention
    check_boxes(column[1], masks, convention, name, fmt)
    return boxes, masks, convention
