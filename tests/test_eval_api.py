"""``harness.evaluate`` from Python: a timm model object on a ``datasets`` object scores what the CLI scores on the
same model and images, its top-1 that of a plain loop; ``Evaluation.save`` writes what the CLI writes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import pytest
import timm
import torch

import harness
from harness import eval as harness_eval
from harness.record import read_predictions
from timm_rollout.data import SAMPLE_DIR, load_image_set, normalize
from timm_rollout.errors import UserError
from timm_rollout.pooling import pool_name

CPU = {"device": "cpu", "amp": "none"}  # fp32 on the CPU: the numbers below are exact


@pytest.fixture(scope="module")
def sample() -> datasets.DatasetDict:
    """The shipped CIFAR-10 sample loaded by datasets itself, not by the package."""
    files = {split: str(SAMPLE_DIR / f"{split}.parquet") for split in ("train", "test")}
    return datasets.load_dataset("parquet", data_files=files)


def test_a_timm_cnn_on_a_datasets_object_scores_what_the_cli_scores(sample, tmp_path):
    torch.manual_seed(0)  # what the CLI does before building an untrained registered model (--seed 0)
    model = timm.create_model("resnet18", num_classes=10)
    ev = harness.evaluate(model, sample, per_class=20, bank_split="train", bank_per_class=10, heatmaps=0, **CPU)
    cli = harness_eval.main(["--model", "resnet18", "--dataset", "cifar10-sample", "--per-class", "20",
                             "--bank-split", "train", "--bank-per-class", "10", "--heatmaps", "0", "--device", "cpu",
                             "--amp", "none", "--output", str(tmp_path / "cli")])
    assert ev.metrics == cli["metrics"] and ev.metrics["knn_bank"] is not None
    assert ev.record["data"]["content"] == cli["data"]["content"]  # the same images, loaded two ways
    assert ev.record["model"]["name"] == "resnet18" and len(ev.record["model"]["sha256"]) == 64
    saved = ev.save(tmp_path / "py")
    assert json.loads((tmp_path / "py" / "results.json").read_text()) == saved
    assert saved["data"]["dataset"] == "parquet (in memory)" and saved["args"]["model"] == "resnet18"
    assert read_predictions(tmp_path / "py") == read_predictions(tmp_path / "cli")
    assert sorted(p.name for p in (tmp_path / "py").iterdir()) == sorted(p.name for p in (tmp_path / "cli").iterdir())
    with pytest.raises(UserError, match=r"holds an evaluation .* pass --overwrite"):
        ev.save(tmp_path / "py")


def test_top1_of_a_vit_object_is_a_plain_loops_and_its_pooling_is_left_alone(sample):
    torch.manual_seed(1)
    model = timm.create_model("vit_tiny_cifar_cls", num_classes=10, depth=1)
    ev = harness.evaluate(model, sample["test"], heatmaps=0, pool="avg", **CPU)
    assert pool_name(model) == "token" and ev.record["model"]["pool"] == "avg"  # read out by a copy
    data = load_image_set("cifar10-sample", "test")
    reference = timm.create_model("vit_tiny_cifar_cls", num_classes=10, depth=1, global_pool="avg")
    reference.load_state_dict(model.state_dict())
    cfg = model.pretrained_cfg
    with torch.no_grad():
        hits = [int(reference.eval()(normalize(data.images[i:i + 1], cfg["mean"], cfg["std"])).argmax()) == int(y)
                for i, y in enumerate(data.labels)]
    # one image apart at most: a batch of 1 and the harness's batches may round a near-tie in fp32 otherwise
    assert ev.metrics["top1"] == pytest.approx(sum(hits) / len(hits), abs=1.001e-3) and len(hits) == 1000


def test_a_checkpoint_by_name_saves_exactly_what_the_cli_writes(tmp_path: Path):
    torch.manual_seed(0)
    run = tmp_path / "run"
    timm.models.save_for_hf(timm.create_model("vit_tiny_cifar_gap", num_classes=10, depth=1), run,
                            safe_serialization=True)
    options = {"per_class": 5, "heatmaps": 2, "seed": 3}
    record = harness.evaluate("vit_tiny_cifar_gap", "cifar10-sample", checkpoint=run, **options, **CPU).save(
        tmp_path / "a")
    cli = harness_eval.main(["--model", "vit_tiny_cifar_gap", "--checkpoint", str(run), "--dataset", "cifar10-sample",
                             "--per-class", "5", "--heatmaps", "2", "--seed", "3", "--device", "cpu", "--amp", "none",
                             "--output", str(tmp_path / "b")])
    differ = {k for k in cli if record[k] != cli[k]}
    assert differ == {"args", "timing"}
    assert {k: v for k, v in record["args"].items() if record["args"][k] != cli["args"][k]} == {"output": ".../a"}


def test_options_are_the_cli_flags_and_bad_ones_are_refused(sample):
    model = timm.create_model("vit_tiny_cifar_cls", num_classes=10, depth=1)
    with pytest.raises(TypeError, match=r"unknown options per_clas; the options: .*per_class"):
        harness.evaluate(model, sample, per_clas=5)
    with pytest.raises(UserError, match="--bank-k only applies with --bank-split"):
        harness.evaluate(model, sample, bank_k=5)
    with pytest.raises(UserError, match="has no split 'validation'"):
        harness.evaluate(model, sample, "validation", **CPU)
    for option, message in [({"k": 0}, "argument --k: must be an integer >= 1, got 0"),  # the CLI's own checks
                            ({"per_class": 2.5}, "argument --per-class: expected an integer >= 2, got '2.5'"),
                            ({"amp": "fp16x"}, "argument --amp: invalid choice: 'fp16x'"),
                            ({"classes": "cat"}, "argument --classes: takes a list, got 'cat'"),
                            ({"faithfulness": 1}, "argument --faithfulness: takes True or False, got 1")]:
        with pytest.raises(UserError, match=re.escape(message)):
            harness.evaluate(model, sample, **option)
    with pytest.raises(UserError, match="a Dataset object is one split, so bank_split has none to read"):
        harness.evaluate(model, sample["test"], bank_split="train")  # it would score the test images as the bank
    cnn = timm.create_model("resnet18", num_classes=10).train()
    with pytest.raises(UserError, match=r"--heatmaps needs attention, and resnet18 .*drop --heatmaps"):
        harness.evaluate(cnn, sample, heatmaps=4)
    ev = harness.evaluate(cnn, sample, per_class=2, heatmaps=0, **CPU)
    assert cnn.training and ev.record["model"]["input_size"] == [3, 32, 32]  # its mode kept; the size it took
