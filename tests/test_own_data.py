"""A researcher's own data and models: non-square images, a stock ViT evaluated as ``local-dir:RUN`` and as
``--model ARCH --checkpoint RUN``, patch sizes that do not tile the image, class names out of order, labels beyond
the training classes, a data card that disagrees with its files, and the help text. Each against a value worked out
by hand or a plain loop, on tiny data sets built here."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import datasets
import numpy as np
import pyarrow.parquet as pq
import pytest
import timm
import torch

from harness import compare
from harness import eval as harness_eval
from harness import explain as harness_explain
from harness.record import load_results
from harness.study import build_parser as study_parser
from timm_rollout.checkpoint import save_model
from timm_rollout.cli import ParseKwargs
from timm_rollout.data import load_image_set
from timm_rollout.errors import UserError
from timm_rollout.pooling import set_pooling
from timm_rollout.train import train

H, W = 16, 24  # non-square: 16 high, 24 wide
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
TRAIN = ["--epochs", "1", "--batch-size", "8", "--workers", "1", "--no-progress", "--device", "cpu", "--amp", "none",
         "--model", "vit_tiny_patch16_224"]
EVAL = ["--heatmaps", "0", "--device", "cpu", "--amp", "none", "--k", "2"]


def _split(n: int, labels: list[int] | None, names: list[str] | None, seed: int) -> datasets.Dataset:
    """``n`` random H x W RGB images; ``labels`` (default: alternating 0, 1) as a ClassLabel of ``names``, or as
    plain integers without names."""
    rng = np.random.default_rng(seed)
    labels = labels if labels is not None else [i % 2 for i in range(n)]
    images = [rng.integers(0, 256, (H, W, 3), dtype=np.uint8) for _ in range(n)]
    label = datasets.ClassLabel(names=names) if names else datasets.Value("int64")
    features = datasets.Features({"image": datasets.Image(), "label": label})
    return datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)


def _dataset(folder: Path, train_names=("a", "b"), test_names=("a", "b"), test_labels=None) -> str:
    datasets.DatasetDict({
        "train": _split(16, None, list(train_names) if train_names else None, 0),
        "test": _split(12, test_labels, list(test_names) if test_names else None, 1),
    }).save_to_disk(str(folder))
    return str(folder)


def _run(folder: Path, pool: str, seed: int, names=("a", "b"), **kwargs) -> Path:
    """A training output folder of a stock ViT read out with ``pool``, as training exports it, trained with
    ``seed`` on classes ``names``."""
    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", num_classes=len(names), depth=1,
                              **{"img_size": (H, W), "patch_size": 8, **kwargs})
    set_pooling(model, pool)
    save_model(folder, model, list(names), MEAN, STD, (3, H, W))
    (folder / "train_args.json").write_text(json.dumps({"seed": seed, "model": "vit_tiny_patch16_224"}))
    return folder


def _error(call, argv: list[str]) -> str:
    with pytest.raises(UserError) as e:
        call(argv)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return _dataset(tmp_path_factory.mktemp("data") / "digits")


def test_local_dir_and_checkpoint_evaluations_group_and_pair_alike(data, tmp_path):
    """The same four runs (two poolings x training seeds 5 and 9, evaluated with --seed 0) evaluated both ways give
    the same groups, the training seeds, and the paired difference a plain loop over the seeds gives."""
    runs = {(pool, seed): _run(tmp_path / f"{pool}-s{seed}", pool, seed) for pool in ("avg", "rollout")
            for seed in (5, 9)}
    order = [("avg", 9), ("avg", 5), ("rollout", 5), ("rollout", 9)]  # positions do not pair the seeds
    routes = {}
    for route in ("local", "checkpoint"):
        folders = []
        for pool, seed in order:
            out = tmp_path / route / f"{pool}-s{seed}"
            model = ["--model", f"local-dir:{runs[pool, seed]}"] if route == "local" else \
                ["--model", "vit_tiny_patch16_224", "--checkpoint", str(runs[pool, seed])]
            harness_eval.main([*model, "--dataset", data, *EVAL, "--output", str(out)])
            folders.append(out)
        results = load_results(folders)
        compare.check_distinct(results)
        routes[route] = (results, compare.summarise(results, ["top1", "intra"]))
    (local, by_local), (checkpoint, by_checkpoint) = routes["local"], routes["checkpoint"]
    assert [g.label for g in by_local] == [g.label for g in by_checkpoint] == [
        f"vit_tiny_patch16_224 (global_pool={pool}) on digits/test" for pool in ("avg", "rollout")]
    assert [g.seeds for g in by_local] == [g.seeds for g in by_checkpoint] == [[9, 5], [5, 9]]
    assert local[0]["model"]["checkpoint"] == str(runs["avg", 9])
    for results, groups in routes.values():
        intra = {order[i]: r["metrics"]["intra"] for i, r in enumerate(results)}
        by_hand = np.mean([intra["rollout", s] - intra["avg", s] for s in (5, 9)])
        row = next(r for r in compare.compare_groups(*groups, ["top1", "intra"]) if r.metric == "intra")
        assert row.seeds == [5, 9] and row.delta.mean == pytest.approx(by_hand, abs=1e-12)
    with pytest.raises(UserError, match="both seed 9 of vit_tiny_patch16_224"):  # one run, two routes: counted twice
        compare.check_distinct([local[0], checkpoint[0]])
    older = {**local[0], "model": {**local[0]["model"], "checkpoint": None}}  # a local-dir: record without it
    assert compare.run_seed(older) == 9 and compare.run_label(older) == by_local[0].label


def test_a_patch_size_that_does_not_tile_the_image_is_refused(data, tmp_path, capsys):
    """Patch 7 on 16x24 images: timm's conv sees the top-left 14x21 pixels only (checked: changing the others
    changes no logit), so training, harness.eval and harness.explain refuse it, naming patch_size=8 (the divisor of
    16 and of 24 nearest 7)."""
    want = ("patch size 7x7 does not divide the 16x24 images: the patch embedding sees only their top-left 14x21 "
            "pixels, so no map or localisation metric would line up with the image; use a patch size that divides "
            "them (e.g. patch_size=8)")
    run = _run(tmp_path / "p7", "avg", 0, patch_size=7)
    model = timm.create_model(f"local-dir:{run}", pretrained=True).eval()
    x = torch.randn(1, 3, H, W)
    y = x.clone()
    y[..., 14:, :], y[..., :, 21:] = 5.0, -5.0
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(y), rtol=0, atol=0)
    assert _error(harness_eval.main, ["--model", f"local-dir:{run}", "--dataset", data, *EVAL, "--output",
                                      str(tmp_path / "ev")]) == want
    assert _error(harness_explain.main, ["--model", f"local-dir:{run}", "--dataset", data, "--output",
                                         str(tmp_path / "fig")]) == want
    assert _error(train, [*TRAIN, "--dataset", data, "--model-kwargs", "img_size=(16,24)", "patch_size=7",
                          "depth=1", "--output", str(tmp_path / "tr")]) == want
    assert not any((tmp_path / name).exists() for name in ("ev", "fig", "tr"))


def test_the_image_size_fix_reads_h_x_w_and_builds_the_model(data, tmp_path, capsys):
    """img_size (24,16) on 16x24 images: the fix names (16,24), which ParseKwargs reads back and which builds a model
    that takes them; harness.explain says 16x24 too."""
    message = _error(train, [*TRAIN, "--dataset", data, "--model-kwargs", "img_size=(24,16)", "patch_size=8",
                             "depth=1", "--output", str(tmp_path / "tr")])
    assert message == ("the data set's images are 16x24 but vit_tiny_patch16_224 takes 24x16; pass --model-kwargs "
                       "'img_size=(16,24)'")
    typed = message.rsplit("--model-kwargs ", 1)[1].strip("'")  # what the shell passes on
    ns = argparse.Namespace()
    ParseKwargs(["--model-kwargs"], "kwargs")(None, ns, [typed])
    parsed = ns.kwargs
    assert parsed == {"img_size": (16, 24)}
    model = timm.create_model("vit_tiny_patch16_224", depth=1, patch_size=8, **parsed)
    assert model(torch.zeros(1, 3, H, W)).shape == (1, 1000)
    run = _run(tmp_path / "run", "avg", 0)
    harness_explain.main(["--model", f"local-dir:{run}", "--dataset", data, "--no-flow", "--output",
                          str(tmp_path / "fig")])
    assert "RGB 16x24, the model's input size: used as is" in capsys.readouterr().out


def test_class_names_out_of_order_are_refused(tmp_path, monkeypatch):
    """Train split a, b and test split b, a: training refuses before it trains; a checkpoint recorded as a, b is
    refused on the b, a split, and on plain integer labels, with the fix that names their classes."""
    swapped = _dataset(tmp_path / "swapped", test_names=("b", "a"))
    message = _error(train, [*TRAIN, "--dataset", swapped, "--model-kwargs", "img_size=(16,24)", "patch_size=8",
                             "depth=1", "--output", str(tmp_path / "tr")])
    assert message.startswith("the eval split 'test' lists the classes of the train split 'train' in another order "
                              "(b, a vs a, b)")
    assert not (tmp_path / "tr").exists()
    run = _run(tmp_path / "run", "avg", 0)
    message = _error(harness_eval.main, ["--model", f"local-dir:{run}", "--dataset", swapped, *EVAL, "--output",
                                         str(tmp_path / "ev")])
    assert "lists the classes of the checkpoint in another order (b, a vs a, b)" in message
    other = _dataset(tmp_path / "other", test_names=("a", "c"))
    assert "has other class names than the checkpoint (a, c vs a, b)" in _error(
        harness_eval.main, ["--model", f"local-dir:{run}", "--dataset", other, *EVAL, "--output", str(tmp_path / "e")])
    monkeypatch.chdir(tmp_path)  # plain integer labels: the fix is to name their classes; the data set as typed
    _dataset(tmp_path / "ints", train_names=None, test_names=None)
    message = _error(harness_eval.main, ["--model", f"local-dir:{run}", "--dataset", "./ints", *EVAL, "--output", "i"])
    assert message.startswith("data set './ints' has other class names than the checkpoint (0, 1 vs a, b)")
    assert message.endswith("cast its plain integer label column to the checkpoint's classes if they are those, in "
                            "that order (datasets' cast_column with ClassLabel(names=[...]))")


def test_eval_labels_beyond_the_training_classes_are_refused_before_training(tmp_path, monkeypatch):
    """Integer labels 0, 1 to train on and a test label 2: refused before the first step (not an IndexError after an
    epoch)."""
    import timm_rollout.train.loop as loop

    beyond = _dataset(tmp_path / "beyond", train_names=None, test_names=None, test_labels=[0, 1] * 5 + [2, 1])
    monkeypatch.setattr(loop, "validate", lambda *a, **k: pytest.fail("trained before refusing"))
    message = _error(train, [*TRAIN, "--dataset", beyond, "--model-kwargs", "img_size=(16,24)", "patch_size=8",
                             "depth=1", "--output", str(tmp_path / "tr")])
    assert message.startswith("the eval split 'test' has labels up to 2 but the model has 2 classes (0-1)")


def test_rows_without_a_label_are_refused_in_one_line_before_training(tmp_path, monkeypatch):
    """ClassLabel's "no label" (-1) in the test split: training refuses before its first step (not an IndexError
    after an epoch) and an evaluation refuses too (it would score those images against no class)."""
    import timm_rollout.train.loop as loop

    unlabelled = _dataset(tmp_path / "u", test_labels=[0, -1, 1, -1] + [0, 1] * 4)
    monkeypatch.setattr(loop, "validate", lambda *a, **k: pytest.fail("trained before refusing"))
    message = _error(train, [*TRAIN, "--dataset", unlabelled, "--model-kwargs", "img_size=(16,24)", "patch_size=8",
                             "depth=1", "--output", str(tmp_path / "tr")])
    assert message == (f"data set {unlabelled!r}, split 'test': 2 rows have no label (label -1, e.g. row 1); drop "
                       "them first (e.g. ds.filter(lambda y: y >= 0, input_columns='label')) or label them")
    run = _run(tmp_path / "run", "avg", 0)
    assert _error(harness_eval.main, ["--model", f"local-dir:{run}", "--dataset", unlabelled, *EVAL, "--output",
                                      str(tmp_path / "ev")]) == message
    assert not (tmp_path / "tr" / "model.safetensors").exists() and not (tmp_path / "ev").exists()


def test_integer_labels_without_the_top_class_are_scored_against_the_checkpoint(tmp_path):
    """A test split of plain integer labels 0 and 1, and a checkpoint of classes 0, 1 and 2: the labels fit its head,
    so it is evaluated (not refused as a 2-class data set), top-1 as a plain loop over the model gives."""
    labels = [0, 1] * 6
    ints = _dataset(tmp_path / "ints", train_names=None, test_names=None, test_labels=labels)
    run = _run(tmp_path / "run", "avg", 0, names=("0", "1", "2"))
    results = harness_eval.main(["--model", f"local-dir:{run}", "--dataset", ints, *EVAL, "--output",
                                 str(tmp_path / "ev")])
    test = load_image_set(ints, "test")
    model = timm.create_model(f"local-dir:{run}", pretrained=True).eval()
    x = (test.images.float() / 255 - torch.tensor(MEAN)[:, None, None]) / torch.tensor(STD)[:, None, None]
    with torch.no_grad():
        hits = sum(int(p == y) for p, y in zip(model(x).argmax(1).tolist(), labels, strict=True))
    assert results["metrics"]["top1"] == pytest.approx(hits / 12, abs=1e-12)


def test_a_data_card_that_disagrees_with_the_files_names_the_columns(tmp_path):
    folder = tmp_path / "card"
    (folder / "data").mkdir(parents=True)
    split = _split(4, None, ["a", "b"], 0).add_column("extra", [1, 2, 3, 4])
    split.to_parquet(str(folder / "data" / "train-00000-of-00001.parquet"))
    (folder / "README.md").write_text(
        "---\ndataset_info:\n  features:\n  - name: image\n    dtype: image\n  - name: label\n    dtype:\n"
        "      class_label:\n        names:\n          '0': a\n          '1': b\n---\n")
    with pytest.raises(UserError) as e:
        load_image_set(str(folder), "train")
    assert str(e.value) == (f"datasets cannot read the folder {str(folder)!r}: a data file holds the columns image, "
                            "label, extra but its data card (README.md) declares image, label; make README.md's "
                            "dataset_info list the files' columns, or remove it")


def test_data_files_that_order_their_classes_differently_are_refused(tmp_path):
    """A test file whose ClassLabel lists b, a beside a train file's a, b: datasets reads both with one file's names
    (the test labels would be scored against swapped classes), so the folder is refused, naming both files."""
    folder = tmp_path / "order"
    (folder / "data").mkdir(parents=True)
    _split(8, None, ["a", "b"], 0).to_parquet(str(folder / "data" / "train-00000-of-00001.parquet"))
    _split(8, None, ["b", "a"], 1).to_parquet(str(folder / "data" / "test-00000-of-00001.parquet"))
    assert datasets.load_dataset(str(folder))["test"].features["label"].names == ["a", "b"]  # what datasets does
    with pytest.raises(UserError) as e:
        load_image_set(str(folder), "test")
    assert str(e.value) == (f"data set {str(folder)!r}: its files name the classes of column 'label' differently "
                            "(data/test-00000-of-00001.parquet: b, a; data/train-00000-of-00001.parquet: a, b), and "
                            "datasets reads them all with one file's names; give every file one ClassLabel in one "
                            "order (datasets' align_labels_with_mapping) or use save_to_disk")


def test_data_files_whose_column_types_differ_are_named_as_such(tmp_path):
    """Boxes as [x, y, w, h] in the train file and [[x, y, w, h]] in the test file, and a column of integers in one
    and words in the other: datasets cannot cast one to the other; the error names both columns with both files'
    types (as pyarrow reads them) and says to make the files agree, not to pass a folder of parquet files (it is
    one)."""
    folder = tmp_path / "mixed"
    (folder / "data").mkdir(parents=True)
    for split, box, feature, extra in (("train", [0, 0, 8, 8], datasets.Value("float32"), 1),
                                       ("test", [[0, 0, 8, 8]], datasets.Sequence(datasets.Value("float32")), "w")):
        _split(4, None, ["a", "b"], 0).add_column("bbox", [box] * 4, feature=datasets.Sequence(feature)) \
            .add_column("extra", [extra] * 4).to_parquet(str(folder / "data" / f"{split}-00000-of-00001.parquet"))
    with pytest.raises(UserError) as e:
        load_image_set(str(folder), "test")
    types = {(s, c): str(pq.read_schema(folder / "data" / f"{s}-00000-of-00001.parquet").field(c).type)
             for s in ("train", "test") for c in ("bbox", "extra")}
    assert types["train", "bbox"] != types["test", "bbox"] and types["train", "extra"] == "int64"
    test, train = "data/test-00000-of-00001.parquet", "data/train-00000-of-00001.parquet"
    assert str(e.value).startswith(f"datasets cannot read the folder {str(folder)!r} (")
    assert str(e.value).endswith(
        f"): its files disagree on the type of columns 'bbox' ({test}: {types['test', 'bbox']}; {train}: "
        f"{types['train', 'bbox']}), 'extra' ({test}: {types['test', 'extra']}; {train}: int64), and datasets reads "
        "them as one table; give each column one type in every file, or write the data set with save_to_disk")


def test_help_lists_aliases_defaults_and_each_metric_once():
    parser = harness_eval.build_parser()
    assert "cifar10-sample" in parser._option_string_actions["--dataset"].help
    for flag in ("--bank-per-class", "--classes", "--num-classes", "--pool", "--checkpoint"):  # default None
        assert parser._option_string_actions[flag].default is None and "(default: " in \
            parser._option_string_actions[flag].help, flag
    for flag, default in (("--k", 5), ("--bank-k", 20), ("--temperature", 0.07), ("--faithfulness-images", 1000)):
        entry = " ".join(parser.format_help().split(f"\n  {flag} ")[1].split("\n  --")[0].split())
        assert entry.endswith(f"(default: {default})"), (flag, entry)
    shown = compare.build_parser().format_help()
    assert "--metrics METRIC [METRIC ...]" in shown and "{" not in shown
    study = " ".join(study_parser().format_help().split())  # a list default as typed, an empty one not at all
    assert "paired by seed (default: 0)" in study and "(default: )" not in study and "[0]" not in study
    for metric in compare.SHOWABLE:  # once, and the default ones once more in the default
        assert len(re.findall(rf"(?<!\w){metric}(?!\w)", shown)) == 1 + (metric in compare.METRICS), metric


def test_an_evaluation_of_linked_folders_names_them_as_typed_never_by_their_targets(tmp_path, monkeypatch):
    """results.json and features.safetensors name a data set folder in the working directory's tree relative to the
    evaluation, through the symbolic link it was typed through, and one outside the tree by its name only."""
    import shutil

    from safetensors import safe_open

    from timm_rollout.data import SAMPLE_DIR

    real = tmp_path / "machine" / "disk"
    shutil.copytree(SAMPLE_DIR, real / "sample")
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "data").symlink_to(real)
    (tmp_path / "mnt").symlink_to(real)
    monkeypatch.chdir(tmp_path / "tree")
    for typed, recorded in ((tmp_path / "tree" / "data" / "sample", "../../data/sample"),
                            (tmp_path / "mnt" / "sample", ".../sample")):
        out = tmp_path / "tree" / "eval" / typed.parent.name
        harness_eval.main(["--model", "vit_tiny_cifar_cls", "--dataset", str(typed),
                           "--per-class", "2", "--heatmaps", "0", "--save-features", "--device", "cpu",
                           "--output", str(out)])
        results = json.loads((out / "results.json").read_text())
        with safe_open(str(out / "features.safetensors"), framework="pt") as f:
            features = f.metadata()["dataset"]
        assert results["data"]["dataset"] == results["data"]["argument"] == results["args"]["dataset"] == features \
            == recorded
        assert results["args"]["output"] == "."
        assert "disk" not in json.dumps({k: results[k] for k in ("data", "args")})
