"""Class counts: training refuses a train split of one class in one line; top-5 is reported only with more than 5
classes (training log, summary, harness.eval), then against a plain loop over the logits."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from harness import eval as harness_eval
from timm_rollout.accuracy import topk_hits
from timm_rollout.cli import run_cli
from timm_rollout.data import load_image_set, normalize
from timm_rollout.loading import load_model
from timm_rollout.train import main as train_main
from timm_rollout.train import train

TRAIN = ["--model", "vit_tiny_cifar_gap", "--model-kwargs", "depth=1", "embed_dim=32", "--epochs", "1",
         "--batch-size", "8", "--workers", "1", "--no-progress", "--device", "cpu", "--amp", "none"]


def _folder(root: Path, classes: int, train_labels: list[int] | None = None) -> str:
    """A save_to_disk data set of random 32x32 images: train (16, or ``train_labels``) and test (4 per class)."""
    rng = np.random.default_rng(classes)
    names = [f"c{i}" for i in range(classes)]

    def split(labels: list[int]) -> datasets.Dataset:
        images = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in labels]
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
        return datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)

    train_labels = train_labels if train_labels is not None else [i % classes for i in range(16)]
    folder = root / f"{classes}-classes"
    datasets.DatasetDict({"train": split(train_labels), "test": split([i % classes for i in range(4 * classes)])}
                         ).save_to_disk(str(folder))
    return str(folder)


def test_topk_hits_only_below_the_class_count():
    logits = torch.tensor([[0.1, 0.5, 0.2, 0.9, 0.3, 0.0], [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]])
    labels = torch.tensor([5, 5])
    assert topk_hits(logits, labels, 5).tolist() == [False, False]  # by hand: label 5 is last in both rows
    assert topk_hits(logits[:, :5], torch.tensor([4, 4]), 5) is None  # 5 classes: every label is in the top 5
    assert topk_hits(logits[:, :5], torch.tensor([4, 4]), 1).tolist() == [False, False]


def test_training_refuses_one_class_in_one_line(tmp_path, capsys):
    data = _folder(tmp_path, 2, train_labels=[1] * 16)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        run_cli(train_main, [*TRAIN, "--dataset", data, "--output", str(tmp_path / "run")])
    assert stop.value.code == 2 and capsys.readouterr().err == (
        "error: the train split 'train' holds images of one class only ('c1'); a classifier needs 2 or more: add "
        "another class\n")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def _plain_top5(run: Path, data: str) -> float:
    """Fraction of the test images whose label is among the 5 largest logits, one image at a time."""
    model, info = load_model(f"local-dir:{run}")
    test = load_image_set(data, "test")
    with torch.no_grad():
        logits = model(normalize(test.images, info["mean"], info["std"])).tolist()
    hits = [int(y) in sorted(range(len(row)), key=lambda c: -row[c])[:5] for row, y in zip(logits, test.labels,
                                                                                          strict=True)]
    return sum(hits) / len(hits)


@pytest.mark.parametrize("classes", [5, 6])
def test_top5_is_reported_only_with_more_than_5_classes(tmp_path, capsys, classes):
    data = _folder(tmp_path, classes)
    run = train([*TRAIN, "--dataset", data, "--output", str(tmp_path / "run")])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    row = next(csv.DictReader(io.StringIO((run / "log.csv").read_text())))
    summary = json.loads((run / "summary.json").read_text())
    results = harness_eval.main(["--model", f"local-dir:{run}", "--dataset", data, "--k", "3", "--heatmaps", "0",
                                 "--device", "cpu", "--amp", "none", "--output", str(tmp_path / "eval")])
    if classes <= 5:
        assert row["eval_top5"] == "" and summary["eval_top5"] is None and "top-5" not in line
        assert results["metrics"]["top5"] is None
        assert json.loads((tmp_path / "eval" / "results.json").read_text())["metrics"]["top5"] is None
        return
    top5 = _plain_top5(run, data)
    assert results["metrics"]["top5"] == pytest.approx(top5)
    assert float(row["eval_top5"]) == pytest.approx(100 * top5) == summary["eval_top5"]
    assert f"top-5 {100 * top5:.2f}%" in line
