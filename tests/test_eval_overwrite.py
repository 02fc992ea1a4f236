"""harness.eval into a folder that holds an evaluation: refused in one line without --overwrite; with it, every file
of the old evaluation is gone before the first new one is written (none of them left beside the new record), other
files stay."""

from __future__ import annotations

import json

import pytest

from harness import eval as harness_eval
from timm_rollout.cli import run_cli
from timm_rollout.records import EVAL_FILES

QUICK = ["--model", "vit_tiny_cifar_gap", "--dataset", "cifar10-sample", "--per-class", "2", "--device", "cpu",
         "--amp", "none"]


def test_overwrite_removes_the_old_evaluation_before_writing_and_keeps_other_files(tmp_path, monkeypatch, capsys):
    out = tmp_path / "ev"
    harness_eval.main([*QUICK, "--heatmaps", "2", "--save-features", "--output", str(out)])
    (out / "notes.txt").write_text("mine")
    old = {p.name: p.read_bytes() for p in out.iterdir()}
    written = {"results.json", "predictions.json.gz", "features.safetensors", "heatmaps.png", "cosine_matrix.png"}
    assert written < set(old)

    with pytest.raises(SystemExit) as stop:
        run_cli(harness_eval.main, [*QUICK, "--seed", "1", "--heatmaps", "0", "--output", str(out)])
    assert stop.value.code == 2 and capsys.readouterr().err == (
        f"error: {out} holds an evaluation (results.json, predictions.json.gz, features.safetensors, "
        "cosine_matrix.png, heatmaps.png); pass --overwrite to replace it, or choose another --output\n")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old

    seen = []  # what the folder holds when the first new file (the cosine matrix) is written
    first = harness_eval.plot_cosine_matrix
    monkeypatch.setattr(harness_eval, "plot_cosine_matrix",
                        lambda *a, **k: (seen.append(sorted(p.name for p in out.iterdir())), first(*a, **k))[1])
    results = harness_eval.main([*QUICK, "--seed", "1", "--heatmaps", "0", "--overwrite", "--output", str(out)])
    assert seen == [["notes.txt"]]
    assert sorted(p.name for p in out.iterdir()) == ["cosine_matrix.png", "notes.txt", "predictions.json.gz",
                                                     "results.json"]
    assert json.loads((out / "results.json").read_text())["config"]["seed"] == results["config"]["seed"] == 1
    assert (out / "notes.txt").read_text() == "mine"
    assert set(EVAL_FILES) >= {"results.json", "predictions.json.gz", "predictions.json", "features.safetensors",
                               "cosine_matrix.png", "heatmaps.png", "faithfulness.png"}


def test_a_refused_overwrite_keeps_the_old_evaluation(tmp_path):
    """--overwrite with a mistake found while loading (an unknown class) removes nothing."""
    out = tmp_path / "ev"
    harness_eval.main([*QUICK, "--heatmaps", "0", "--output", str(out)])
    old = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(Exception, match="unknown class name"):
        harness_eval.main([*QUICK, "--classes", "cat", "unicorn", "--overwrite", "--output", str(out)])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old


