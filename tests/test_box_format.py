"""--bbox-format: a bbox column read as xywh (COCO, the default), xyxy or cxcywh, against torchvision's box_convert;
checked against masks in the format named; recorded by harness.eval, whose localisation then does not depend on how
the column wrote the same boxes; a flag with nothing to read refused in one line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.ops import box_convert

from harness import eval as harness_eval
from harness import explain as harness_explain
from harness.study import jobs
from timm_rollout.cli import run_cli
from timm_rollout.data import box_hash, load_image_set
from timm_rollout.errors import UserError
from timm_rollout.masks import BoxColumnError

SIZE = 32
RECTS = torch.tensor([[2, 3, 6, 5], [8, 8, 16, 8], [0, 0, 4, 20], [5.5, 1, 9, 7.5]], dtype=torch.float64)  # xywh


def _png(array: np.ndarray) -> dict:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


def _save(folder: Path, boxes: torch.Tensor | None, masks: np.ndarray | None = None, n: int = 4) -> str:
    """A save_to_disk data set of ``n`` random 32x32 images in classes a and b, with a float ``bbox`` column (where
    given) and a foreground ``mask`` column (where given)."""
    rng = np.random.default_rng(0)
    columns = {"image": [_png(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)) for _ in range(n)],
               "label": [i % 2 for i in range(n)]}
    features = {"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])}
    if boxes is not None:
        columns["bbox"], features["bbox"] = boxes.tolist(), datasets.Sequence(datasets.Value("float64"))
    if masks is not None:
        columns["mask"], features["mask"] = [_png(m) for m in masks], datasets.Image()
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(columns, features=datasets.Features(features))}
                         ).save_to_disk(str(folder))
    return str(folder)


@pytest.mark.parametrize("fmt", ["xywh", "xyxy", "cxcywh"])
def test_each_format_is_read_as_torchvision_converts_it(tmp_path, fmt):
    column = box_convert(RECTS, "xywh", fmt)  # the same boxes as this format writes them
    data = load_image_set(_save(tmp_path / fmt, column), "test", boxes=True, box_format=fmt)
    torch.testing.assert_close(data.boxes.double(), box_convert(column, fmt, "xywh"), rtol=0, atol=1e-6)
    torch.testing.assert_close(data.boxes.double(), RECTS, rtol=0, atol=1e-6)


def test_the_default_reads_xywh_and_corner_boxes_are_not_guessed(tmp_path):
    """Corner boxes that fit the image as [x, y, w, h] are read as such without the flag (nothing tells them apart),
    and as corners with it."""
    corners = box_convert(RECTS, "xywh", "xyxy")
    folder = _save(tmp_path / "c", corners)
    assert load_image_set(folder, "test", boxes=True).boxes.tolist() == corners.tolist()
    assert load_image_set(folder, "test", boxes=True, box_format="xyxy").boxes.tolist() == RECTS.tolist()


def _foreground(rects: torch.Tensor) -> np.ndarray:
    masks = np.zeros((len(rects), SIZE, SIZE), dtype=np.uint8)
    for i, (x, y, w, h) in enumerate(rects.int().tolist()):
        masks[i, y:y + h, x:x + w] = 1
    return masks


def test_boxes_are_checked_against_masks_in_the_format_named(tmp_path):
    whole = torch.tensor([[2, 3, 6, 5], [1, 2, 16, 8], [0, 0, 4, 20]], dtype=torch.float64)  # of whole pixels
    corners = box_convert(whole, "xywh", "xyxy")
    folder = _save(tmp_path / "m", corners, _foreground(whole), n=3)
    assert load_image_set(folder, "test", boxes=True, box_format="xyxy").boxes.tolist() == whole.tolist()
    with pytest.raises(BoxColumnError) as e:
        load_image_set(folder, "test", boxes=True)
    assert "every such box reads as [x1, y1, x2, y2] (corners): pass --bbox-format xyxy" in str(e.value)
    with pytest.raises(BoxColumnError) as e:  # named wrong the other way: the fix names the default
        load_image_set(_save(tmp_path / "w", whole, _foreground(whole), n=3), "test", boxes=True, box_format="xyxy")
    assert "reads as [x, y, w, h] (COCO order): pass --bbox-format xywh" in str(e.value)


def test_a_box_without_width_in_its_format_and_a_flag_without_a_column_are_refused(tmp_path):
    with pytest.raises(BoxColumnError, match=r"row 1 of column 'bbox' is \[8.0, 8.0, 8.0, 12.0\], not one box "
                                             r"\[x1, y1, x2, y2\] \(corners\) of finite numbers with a positive width"):
        load_image_set(_save(tmp_path / "a", torch.tensor([[1.0, 1, 4, 4], [8, 8, 8, 12]] * 2)), "test", boxes=True,
                       box_format="xyxy")
    with pytest.raises(UserError) as e:
        load_image_set(_save(tmp_path / "b", None, _foreground(RECTS[:3]), n=3), "test", boxes=True,
                       box_format="cxcywh")
    assert str(e.value) == (f"--bbox-format cxcywh: data set {str(tmp_path / 'b')!r} has no 'bbox' column to read; "
                            "drop --bbox-format") and not isinstance(e.value, BoxColumnError)


def test_eval_records_the_format_and_scores_the_same_boxes_alike(tmp_path):
    """The same boxes written as xywh and as cxcywh (read with --bbox-format cxcywh) give the same localisation, by
    the same untrained model; results.json records the format."""
    argv = ["--model", "vit_tiny_cifar_gap", "--split", "test", "--k", "3", "--heatmaps", "0", "--device", "cpu",
            "--amp", "none"]
    rects = torch.tensor([[2, 3, 6, 5], [8, 8, 16, 8], [0, 0, 4, 20], [5, 1, 9, 7]] * 2, dtype=torch.float64)
    plain = harness_eval.main([*argv, "--dataset", _save(tmp_path / "xywh", rects, n=8), "--output",
                               str(tmp_path / "e1")])
    centred = harness_eval.main([*argv, "--dataset", _save(tmp_path / "cx", box_convert(rects, "xywh", "cxcywh"), n=8),
                                 "--bbox-format", "cxcywh", "--output", str(tmp_path / "e2")])
    assert plain["metrics"]["object_area_fraction"] == pytest.approx(float((rects[:, 2] * rects[:, 3]).mean()) / 1024)
    unset = {k for k, v in plain["metrics"].items() if v is None}
    assert unset == {k for k, v in centred["metrics"].items() if v is None}
    assert {k: v for k, v in centred["metrics"].items() if k not in unset} == pytest.approx(
        {k: v for k, v in plain["metrics"].items() if k not in unset}, rel=0, abs=1e-9)
    record = json.loads((tmp_path / "e2" / "results.json").read_text())
    assert (record["args"]["bbox_format"], record["data"]["bbox_format"]) == ("cxcywh", "cxcywh")
    assert (plain["args"]["bbox_format"], plain["data"]["bbox_format"]) == (None, "xywh")
    assert record["data"]["box_content"] == plain["data"]["box_content"] == box_hash(rects)  # the same objects


def test_explain_and_the_study_take_the_flag(tmp_path, monkeypatch, capsys):
    image = tmp_path / "x.png"
    Image.fromarray(np.zeros((SIZE, SIZE, 3), dtype=np.uint8)).save(image)
    with pytest.raises(SystemExit) as stop:
        run_cli(harness_explain.main, ["--model", "vit_tiny_cifar_gap", "--image", str(image), "--bbox-format", "xyxy",
                                       "--output", str(tmp_path / "fig")])
    assert stop.value.code == 2 and capsys.readouterr().err == (
        "error: --bbox-format reads the boxes of a --dataset image; drop it for --image\n")
    ran = []
    monkeypatch.setattr(jobs, "_run", lambda cmd, threads: ran.append(cmd))
    args = type("Args", (), dict(eval_amp=None, device="cpu", dataset="d", eval_per_class=None, bank_per_class=None,
                                 faithfulness_images=0, threads=None, bbox_format="xyxy"))()
    jobs.eval_run(args, "vit_tiny_cifar_gap", 0, tmp_path / "run", tmp_path / "eval")
    assert ran[0][ran[0].index("--bbox-format") + 1] == "xyxy" and "--overwrite" in ran[0]
