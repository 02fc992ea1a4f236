"""Masks and boxes a user brings (timm_rollout.masks): each convention read as such or refused in one line, boxes
checked against the masks, boxes taken from masks; all on hand-made canvases whose answers are known by
construction, and against plain numpy loops."""

from __future__ import annotations

import io
import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import timm
import torch
from PIL import Image
from timm.models import save_for_hf

from harness import eval as harness_eval
from harness.localisation import LOCALISATION, localisation_metrics
from timm_rollout.cli import run_cli
from timm_rollout.data import load_image_set
from timm_rollout.errors import UserError
from timm_rollout.masks import BACKGROUND, CLUTTER, FILL, OBJECT, BoxColumnError, object_boxes

SIZE = 16  # 16x16 images
# Hand-made objects (x, y, w, h) of four images, and an L-shaped object's pixels in image 3 (a rectangle minus a corner)
RECTS = [(2, 3, 6, 5), (8, 8, 8, 8), (0, 0, 4, 12), (5, 1, 9, 7)]
FILL_KEYS = {k for k in LOCALISATION if k.endswith(("fill_mass", "content_chance"))}


def _foreground(rects=RECTS) -> np.ndarray:
    """uint8 (N, 16, 16) 0/1 masks: 1 on each object's rectangle; image 3's top-right 3x3 corner taken off."""
    masks = np.zeros((len(rects), SIZE, SIZE), dtype=np.uint8)
    for i, (x, y, w, h) in enumerate(rects):
        masks[i, y:y + h, x:x + w] = 1
    masks[3, 1:4, 11:14] = 0
    return masks


def _clutter(rects=RECTS) -> np.ndarray:
    """uint8 masks of the clutter convention: fill, a clutter stripe in rows 14-15, the object rectangle on top."""
    masks = np.full((len(rects), SIZE, SIZE), FILL, dtype=np.uint8)
    masks[:, 14:, :] = CLUTTER
    for i, (x, y, w, h) in enumerate(rects):
        masks[i, y:y + h, x:x + w] = OBJECT
    return masks


def _png(array: np.ndarray, mode: str | None = None) -> dict:
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


def _save(folder: Path, masks=None, boxes=None, *, mask_feature: str = "png", labels=None) -> str:
    """A save_to_disk data set of len(masks or boxes) random 16x16 images in two classes, with a ``mask`` column
    stored as ``mask_feature`` (png: Image, array: Array2D of the masks' dtype, list: nested lists) and a ``bbox``
    column where given."""
    n = len(masks if masks is not None else boxes)
    rng = np.random.default_rng(0)
    images = [_png(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)) for _ in range(n)]
    columns = {"image": images, "label": labels if labels is not None else [i % 2 for i in range(n)]}
    features = {"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])}
    if boxes is not None:
        columns["bbox"] = [list(map(float, b)) for b in boxes]
        features["bbox"] = datasets.Sequence(datasets.Value("float64"))
    if masks is not None:
        if mask_feature == "png":
            columns["mask"], features["mask"] = [_png(m) for m in masks], datasets.Image()
        elif mask_feature == "array":
            columns["mask"] = list(masks)
            features["mask"] = datasets.Array2D((SIZE, SIZE), str(np.asarray(masks).dtype))
        else:
            columns["mask"] = [np.asarray(m).tolist() for m in masks]
            value = datasets.Value(str(np.asarray(masks).dtype))
            features["mask"] = datasets.Sequence(datasets.Sequence(value))
    ds = datasets.Dataset.from_dict(columns, features=datasets.Features(features))
    datasets.DatasetDict({"test": ds}).save_to_disk(str(folder))
    return str(folder)


def _loop_bounding_boxes(masks: np.ndarray, value: int) -> list[list[float]]:
    """[x, y, w, h] of the pixels equal to ``value``, one pixel at a time."""
    out = []
    for m in masks:
        xs = [x for y in range(m.shape[0]) for x in range(m.shape[1]) if m[y, x] == value]
        ys = [y for y in range(m.shape[0]) for x in range(m.shape[1]) if m[y, x] == value]
        out.append([min(xs), min(ys), max(xs) + 1 - min(xs), max(ys) + 1 - min(ys)])
    return out


@pytest.mark.parametrize("feature", ["png", "array", "list"])
def test_a_foreground_mask_is_read_as_such_and_boxes_come_from_it(tmp_path, feature):
    masks = _foreground()
    data = load_image_set(_save(tmp_path / "ds", masks, mask_feature=feature), "test", boxes=True)
    assert data.mask_convention == "foreground"
    assert torch.equal(data.masks, torch.from_numpy(np.where(masks == 1, OBJECT, BACKGROUND).astype(np.uint8)))
    assert data.boxes.tolist() == _loop_bounding_boxes(masks, 1)  # no bbox column: each object's bounding box
    assert data.boxes.tolist() == [list(map(float, r)) for r in RECTS]  # and by construction the rectangles
    assert data.subset(torch.tensor([1])).mask_convention == "foreground"
    assert load_image_set(str(tmp_path / "ds"), "test").masks is None  # training leaves it alone


@pytest.mark.parametrize("feature", ["png", "array", "list"])
def test_a_clutter_mask_is_read_as_such_whatever_the_column_type(tmp_path, feature):
    masks = _clutter()
    data = load_image_set(_save(tmp_path / "ds", masks, RECTS, mask_feature=feature), "test", boxes=True)
    assert data.mask_convention == "clutter" and torch.equal(data.masks, torch.from_numpy(masks))
    assert data.boxes.tolist() == [list(map(float, r)) for r in RECTS]


@pytest.mark.parametrize(("dtype", "feature"), [(bool, "array"), (np.float32, "array"), (bool, "png")])
def test_bool_and_float_masks_holding_only_0_and_1_are_foreground(tmp_path, dtype, feature):
    masks = _foreground().astype(dtype)
    if feature == "png":
        assert Image.open(io.BytesIO(_png(masks[0])["bytes"])).mode == "1"  # a one-bit PNG
    data = load_image_set(_save(tmp_path / "ds", masks, mask_feature=feature), "test", boxes=True)
    assert data.mask_convention == "foreground" and data.boxes.tolist() == _loop_bounding_boxes(_foreground(), 1)


def _error(folder: str) -> str:
    with pytest.raises(UserError) as e:
        load_image_set(folder, "test", boxes=True)
    assert isinstance(e.value, BoxColumnError) and "\n" not in str(e.value)  # explain draws no box, one line
    return str(e.value)


def test_values_of_no_known_convention_are_refused_naming_both_and_the_conversion(tmp_path):
    message = _error(_save(tmp_path / "a", _foreground() * 255))
    assert "holds the values 0, 255, which fit neither mask convention" in message
    assert "clutter (0 fill, 1 clutter, 2 object" in message and "foreground (0 background, 1 object)" in message
    assert "(mask > 0).astype('uint8')" in message
    four = _clutter()
    four[0, 0, 0] = 3
    assert "holds the values 0, 1, 2, 3, which fit neither" in _error(_save(tmp_path / "b", four))
    halves = _foreground().astype(np.float32) / 2
    assert "holds the values 0, 0.5, which fit neither" in _error(_save(tmp_path / "c", halves, mask_feature="array"))


def test_masks_that_are_not_one_channel_of_the_image_or_not_numbers_are_refused(tmp_path):
    rgb = np.repeat(_foreground()[..., None], 3, axis=-1)
    assert "is a mask of shape (16, 16, 3), not one channel of its 16x16 image" in _error(_save(tmp_path / "a", rgb))
    small = _foreground()[:, :8, :8]
    assert "shape (8, 8)" in _error(_save(tmp_path / "b", small))
    words = datasets.Dataset.from_dict({"image": [_png(np.zeros((SIZE, SIZE, 3), np.uint8))] * 2, "label": [0, 1],
                                        "mask": ["left", "right"]})
    datasets.DatasetDict({"test": words.cast_column("image", datasets.Image())}).save_to_disk(str(tmp_path / "c"))
    assert "column 'mask' holds Value('string'), not masks; store one mask per image as an Image column" in \
        _error(str(tmp_path / "c"))


def test_an_image_whose_mask_marks_no_object_is_refused(tmp_path):
    masks = _foreground()
    masks[2] = 0
    assert "the mask of row 2 marks no pixel as the object (read as foreground: 0 background, 1 object" in \
        _error(_save(tmp_path / "a", masks))
    clutter = _clutter()
    clutter[1][clutter[1] == OBJECT] = CLUTTER
    assert "the mask of row 1 marks no pixel as the object (read as clutter" in _error(_save(tmp_path / "b", clutter))


def _corners(rects):
    return [(x, y, x + w, y + h) for x, y, w, h in rects]


def test_boxes_that_contradict_their_masks_are_refused_naming_the_likely_convention(tmp_path):
    masks = _clutter()
    message = _error(_save(tmp_path / "xyxy", masks, _corners(RECTS)))
    # row 0: [2, 3, 8, 8] read as [x, y, w, h] spans x 2..10, y 3..11; the object x 2..8, y 3..8
    assert "3 boxes of column 'bbox' contradict their masks (read as clutter: 0 fill, 1 clutter, 2 object)" in message
    assert "row 0: [2.0, 3.0, 8.0, 8.0] read as [x, y, w, h] spans x 2..10, y 3..11, its object x 2..8, y 3..8" \
        in message
    assert "every such box reads as [x1, y1, x2, y2] (corners): pass --bbox-format xyxy" in message
    assert message.endswith("or remove the 'bbox' column to take the boxes from the masks")
    centres = [(x + w / 2, y + h / 2, w, h) for x, y, w, h in RECTS]
    assert "[cx, cy, w, h] (centre and size)" in _error(_save(tmp_path / "centre", masks, centres))
    swapped = [(y, x, h, w) for x, y, w, h in RECTS]
    assert "[y, x, h, w] (rows first)" in _error(_save(tmp_path / "yx", masks, swapped))
    fit = [(1, 1, 3, 4), (8, 8, 4, 2), (0, 0, 4, 12), (5, 1, 5, 7)]  # corner boxes that fit the image as [x, y, w, h]
    message = _error(_save(tmp_path / "fits", _clutter(fit), _corners(fit)))
    # row 0's corner box [1, 1, 4, 5] lies within a pixel of its object [1, 1, 3, 4]: passed (the tolerance)
    assert "2 boxes" in message and "e.g. row 1:" in message and "every such box reads as [x1, y1, x2, y2]" in message
    shifted = [(x + 3, y, w, h) if i == 2 else (x, y, w, h) for i, (x, y, w, h) in enumerate(RECTS)]
    message = _error(_save(tmp_path / "off", masks, shifted))
    assert "1 boxes" in message and "row 2:" in message and "reads as" not in message  # no convention fits it
    foreground = _foreground()
    assert "(read as foreground: 0 background, 1 object)" in _error(_save(tmp_path / "fg", foreground,
                                                                          _corners(RECTS)))


def test_boxes_within_a_pixel_of_their_masks_pass(tmp_path):
    loose = [(x - 0.5, y - 1, w + 1.5, h + 1) for x, y, w, h in RECTS[1:]]
    data = load_image_set(_save(tmp_path / "a", _clutter(RECTS[1:]), loose), "test", boxes=True)
    assert data.boxes.tolist() == [list(map(float, b)) for b in loose]  # the column's own boxes are kept
    # At the origin a corner box and an [x, y, w, h] box coincide: nothing to refuse
    at_origin = [(0, 0, 4, 12)]
    assert load_image_set(_save(tmp_path / "b", _clutter(at_origin), _corners(at_origin)), "test",
                          boxes=True).boxes.tolist() == [[0.0, 0.0, 4.0, 12.0]]


def test_object_boxes_against_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    masks = torch.randint(0, 3, (20, 9, 13), generator=g, dtype=torch.uint8)
    masks[masks == OBJECT] = CLUTTER
    for i in range(20):
        y, x = torch.randint(0, 9, (2,), generator=g).tolist(), torch.randint(0, 13, (2,), generator=g).tolist()
        masks[i, y[0], x[0]] = masks[i, y[1], x[1]] = OBJECT  # two object pixels anywhere (a rectangle's corners)
    masks[7] = FILL  # no object
    boxes, found = object_boxes(masks)
    assert found.tolist() == [i != 7 for i in range(20)]
    want = _loop_bounding_boxes(masks.numpy()[found.numpy()], OBJECT)
    assert boxes[found].tolist() == want and boxes[7].tolist() == [0.0] * 4


def _loop_foreground(weights: np.ndarray, masks01: np.ndarray, grid: tuple[int, int]) -> tuple[list, list]:
    """Per image, pixel by pixel: the weight on the object's pixels (sum_p w_p x object share of patch p) and the
    object's share of the image."""
    n, h, w = masks01.shape
    rows, cols = grid
    ph, pw = h // rows, w // cols
    mass, share = [], []
    for i in range(n):
        total = 0.0
        for r in range(rows):
            for c in range(cols):
                pixels = [(y, x) for y in range(r * ph, (r + 1) * ph) for x in range(c * pw, (c + 1) * pw)]
                obj = sum(masks01[i, y, x] == 1 for y, x in pixels)
                total += weights[i, r * cols + c] * obj / (ph * pw)
        mass.append(total)
        share.append(float((masks01[i] == 1).mean()))
    return mass, share


def test_foreground_metrics_against_a_plain_loop_and_by_hand():
    masks01 = _foreground()
    internal = torch.from_numpy(np.where(masks01 == 1, OBJECT, BACKGROUND).astype(np.uint8))
    boxes = torch.tensor(RECTS, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    weights = torch.rand(4, 16, generator=g, dtype=torch.float64)
    weights /= weights.sum(dim=1, keepdim=True)
    values = localisation_metrics(weights, {"rollout": weights}, boxes, (SIZE, SIZE), (4, 4), internal)
    mass, share = _loop_foreground(weights.numpy(), masks01, (4, 4))
    assert values["pooling_object_share"] == pytest.approx(np.mean(mass), abs=1e-12)  # the object's pixels' weight
    assert values["rollout_object_share"] == pytest.approx(np.mean(mass), abs=1e-12)
    assert values["object_content_fraction"] == pytest.approx(np.mean(share), abs=1e-12)
    assert all(values[k] is None for k in FILL_KEYS)  # no fill known: None, not 0
    # By hand: a 4x4 image of 2x2 patches, the object patch 0; every weight on it. Read as clutter (the bug), this
    # 0/1 mask was all clutter: object share 0.0.
    mask = torch.tensor([[2, 2, 3, 3], [2, 2, 3, 3], [3, 3, 3, 3], [3, 3, 3, 3]], dtype=torch.uint8)[None]
    on_object = localisation_metrics(torch.tensor([[1.0, 0, 0, 0]]), {}, torch.tensor([[0.0, 0, 2, 2]]), (4, 4),
                                     (2, 2), mask)
    assert on_object["pooling_object_share"] == 1.0 and on_object["object_content_fraction"] == 0.25
    assert on_object["pooling_object_mass"] == 1.0 and on_object["content_chance"] is None


def test_eval_reads_a_foreground_mask_without_boxes(tmp_path, capsys, monkeypatch):
    """harness.eval of the uniform (gap) pooling on 16x16 images with foreground masks and no bbox column: boxes
    from the masks, object share = the object's pixel share, no fill metrics, the objects taken out for context
    top-1. A contradicting box column is one line, exit 2."""
    rects = [(x % 12, (3 * x) % 12, 4, 4) for x in range(16)]  # each object elsewhere: every one can be taken out
    masks = _foreground(rects)
    folder = _save(tmp_path / "ds", masks)
    torch.manual_seed(0)
    save_for_hf(timm.create_model("vit_tiny_cifar_gap", num_classes=2, img_size=16, patch_size=4, depth=1),
                tmp_path / "gap", safe_serialization=True, data_config={"mean": (0.5,) * 3, "std": (0.25,) * 3})
    argv = ["--model", "vit_tiny_cifar_gap", "--checkpoint", str(tmp_path / "gap"), "--dataset", folder,
            "--heatmaps", "0", "--device", "cpu", "--amp", "none", "--k", "3"]
    monkeypatch.chdir(tmp_path)  # the data and the evaluation in one tree: recorded relative to each other
    found = harness_eval.main([*argv, "--output", str(tmp_path / "eval")])["metrics"]
    recorded = json.loads((tmp_path / "eval" / "results.json").read_text())["data"]
    assert recorded["mask_convention"] == "foreground"  # how the masks were read, in the record
    want = load_image_set(folder, "test", boxes=True)
    assert want.boxes.tolist() == _loop_bounding_boxes(masks, 1)
    assert found["pooling_object_mass"] == pytest.approx(16 / 256) == found["object_area_fraction"]
    assert found["pooling_object_share"] == pytest.approx((masks == 1).mean(), abs=1e-6)
    assert all(found[k] is None for k in FILL_KEYS) and found["context_top1"] is not None
    _save(tmp_path / "bad", masks, [(x, y, x + w, y + h) for x, y, w, h in rects])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_cli(harness_eval.main, [*argv, "--dataset", str(tmp_path / "bad"), "--output", str(tmp_path / "e2")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: data set") and err.count("\n") == 1
    assert "14 boxes" in err and "every such box reads as [x1, y1, x2, y2] (corners)" in err  # 2 at the origin
