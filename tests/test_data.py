"""Data loading on real CIFAR-10: decoding, column detection, errors, balanced subsets, stats, augmentation.

The shipped sample serves every test but the three that compare with the full data set (``cifar10`` fixture).
"""

from __future__ import annotations

import io
from pathlib import Path

import datasets
import huggingface_hub
import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image

from timm_rollout import online
from timm_rollout.augment import random_crop_flip
from timm_rollout.data import (
    KNOWN_STATS,
    SAMPLE_DIR,
    balanced_indices,
    compute_stats,
    dataset_arg,
    load_image_set,
    normalization_stats,
    normalize,
)
from timm_rollout.errors import UserError


@pytest.fixture(scope="session")
def cifar_test(cifar10: Path):
    """The full CIFAR-10 test split (skips without it)."""
    return load_image_set(str(cifar10), "test")


@pytest.fixture(scope="session")
def sample_test():
    """The 1,000 test images of the shipped sample."""
    return load_image_set("cifar10-sample", "test")


def test_cifar10_decodes_like_datasets_and_pil(cifar_test, cifar10: Path) -> None:
    assert cifar_test.images.shape == (10000, 3, 32, 32) and cifar_test.images.dtype == torch.uint8
    assert cifar_test.labels.dtype == torch.int64
    assert cifar_test.labels.bincount().tolist() == [1000] * 10
    assert cifar_test.class_names[:3] == ["airplane", "automobile", "bird"] and len(cifar_test.class_names) == 10
    assert cifar_test.dataset == str(cifar10.resolve()) and cifar_test.split == "test" and cifar_test.fingerprint
    ref = datasets.load_dataset(str(cifar10), split="test")
    for i in (0, 17, 9999):
        row = ref[i]
        want = np.asarray(row["img"].convert("RGB")).transpose(2, 0, 1)
        assert np.array_equal(cifar_test.images[i].numpy(), want)
        assert cifar_test.labels[i].item() == row["label"]


def test_second_load_comes_from_cache_with_same_content(sample_test) -> None:
    again = load_image_set("cifar10-sample", "test")
    assert torch.equal(again.images, sample_test.images) and torch.equal(again.labels, sample_test.labels)
    assert again.fingerprint == sample_test.fingerprint
    ref = datasets.load_dataset(str(SAMPLE_DIR), split="test")  # the cache holds what datasets decodes
    for i in (0, 17, 999):
        row = ref[i]
        want = np.asarray(row["img"].convert("RGB")).transpose(2, 0, 1)
        assert np.array_equal(again.images[i].numpy(), want) and again.labels[i].item() == row["label"]


def test_sample_is_balanced_and_made_of_real_cifar10_test_images(cifar_test) -> None:
    sample = load_image_set("cifar10-sample", "test")
    assert len(sample) == 1000 and sample.labels.bincount().tolist() == [100] * 10
    assert sample.class_names == cifar_test.class_names
    full = {(img.numpy().tobytes(), int(lbl)) for img, lbl in zip(cifar_test.images, cifar_test.labels, strict=True)}
    assert all((img.numpy().tobytes(), int(lbl)) in full for img, lbl in zip(sample.images, sample.labels, strict=True))
    train = load_image_set("cifar10-sample", "train")
    assert len(train) == 2000 and train.labels.bincount().tolist() == [200] * 10


def _png(mode: str, color) -> dict:
    buf = io.BytesIO()
    Image.new(mode, (8, 8), color).save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


@pytest.fixture(scope="module")
def odd_dataset(tmp_path_factory) -> Path:
    """A saved DatasetDict with `image`/`fine_label` columns, grayscale and RGBA images, and an extra column."""
    feats = datasets.Features({
        "image": datasets.Image(),
        "fine_label": datasets.ClassLabel(names=["a", "b"]),
        "note": datasets.Value("string"),
    })
    rows = {"image": [_png("L", 77), _png("RGBA", (10, 20, 30, 40)), _png("RGB", (1, 2, 3))],
            "fine_label": [0, 1, 1], "note": ["x", "y", "z"]}
    path = tmp_path_factory.mktemp("odd") / "ds"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows, features=feats)}).save_to_disk(str(path))
    return path


def test_columns_detected_and_grayscale_rgba_converted(odd_dataset: Path) -> None:
    s = load_image_set(str(odd_dataset))
    assert s.images.shape == (3, 3, 8, 8) and s.class_names == ["a", "b"] and s.labels.tolist() == [0, 1, 1]
    assert s.images[0, :, 0, 0].tolist() == [77, 77, 77]
    assert s.images[1, :, 0, 0].tolist() == [10, 20, 30]
    assert s.images[2, :, 3, 5].tolist() == [1, 2, 3]


def test_loader_errors_name_the_fix(odd_dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserError, match=r"no label column 'label'; the columns are image, fine_label, note"):
        load_image_set(str(odd_dataset), label_column="label")
    with pytest.raises(UserError, match=r"no split 'test'; its splits are train"):
        load_image_set(str(odd_dataset), "test")
    with pytest.raises(UserError, match="not images"):
        load_image_set(str(odd_dataset), image_column="note")
    with pytest.raises(UserError, match="no data set folder"):
        load_image_set("./no/such/folder")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match=r"not in the local cache and the Hugging Face Hub is offline.*cifar10-sample"):
        load_image_set("no-such-user/no-such-dataset")


def test_folder_that_is_not_a_data_set(tmp_path: Path) -> None:
    """Before anything is loaded: empty folders and folders of other files; then a corrupt saved data set."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")
    (tmp_path / "run" / "log.csv").write_text("epoch,loss\n1,2\n")
    (tmp_path / "empty").mkdir()
    for name in ("run", "empty"):
        with pytest.raises(UserError, match=r"is not a data set folder: it must hold .*dataset_dict.json.*parquet"):
            dataset_arg(str(tmp_path / name))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "dataset_dict.json").write_text("{")
    assert dataset_arg(str(broken)) == str(broken)  # looks like one: datasets decides
    with pytest.raises(UserError, match=r"datasets cannot read the folder .*broken' \(JSONDecodeError"):
        load_image_set(str(broken))


def test_hub_data_set_without_network_uses_only_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """No network: one failed probe switches datasets to offline mode (cache only) instead of retrying."""
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(online, "hub_reachable", lambda: False)
    seen = []
    real = datasets.load_dataset

    def spy(*args, **kwargs):
        seen.append((args[0], datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE))
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    repo = "timm-rollout-tests/never-cached"  # the same path as the aliases, for a repo no cache can hold
    with pytest.raises(UserError, match=r"is not in the local cache and the Hugging Face Hub is offline or "
                                        r"unreachable.*\.\./shared/data/cifar10.*cifar10-sample"):
        load_image_set(repo)
    assert seen == [(repo, True, True)]
    assert not datasets.config.HF_HUB_OFFLINE and not huggingface_hub.constants.HF_HUB_OFFLINE  # restored


def test_balanced_indices() -> None:
    labels = torch.tensor([0] * 50 + [1] * 30 + [2] * 20)
    idx = balanced_indices(labels, per_class=10, seed=1)
    assert idx.dtype == torch.int64 and torch.equal(idx, idx.sort().values)
    assert labels[idx].bincount().tolist() == [10, 10, 10] and len(idx.unique()) == 30
    assert torch.equal(idx, balanced_indices(labels, per_class=10, seed=1))
    assert not torch.equal(idx, balanced_indices(labels, per_class=10, seed=2))
    assert labels[balanced_indices(labels, total=32)].bincount().tolist() == [11, 11, 10]
    assert labels[balanced_indices(labels, per_class=5, classes=[0, 2])].bincount().tolist() == [5, 0, 5]
    with pytest.raises(UserError, match=r"class 2 has only 20 images.*at most 20 per class \(60 in total\)"):
        balanced_indices(labels, per_class=25)


def test_a_subsets_fingerprint_names_its_images_not_only_their_number(sample_test) -> None:
    """Two draws of one size (two seeds) are other images: their fingerprints differ; the same draw agrees."""
    draws = [balanced_indices(sample_test.labels, per_class=5, seed=seed) for seed in (0, 1, 0)]
    a, b, again = (sample_test.subset(i).fingerprint for i in draws)
    assert len(draws[0]) == len(draws[1]) and not torch.equal(draws[0], draws[1])
    assert a != b and a == again and a.startswith(f"{sample_test.fingerprint}[50:")
    assert sample_test.subset(torch.arange(len(sample_test))).fingerprint == sample_test.fingerprint


def test_known_stats_match_the_full_test_split(cifar_test) -> None:
    """The known CIFAR-10 std is close to the full test split's computed one (a JPEG copy)."""
    np.testing.assert_allclose(compute_stats(cifar_test.images)[1], KNOWN_STATS["cifar10"][1], atol=4e-3)


def test_stats_and_normalize(sample_test) -> None:
    mean, std = normalization_stats("cifar10")
    assert mean == KNOWN_STATS["cifar10"][0] and std[0] == pytest.approx(0.247, abs=1e-3)
    assert normalization_stats("cifar10-sample") == KNOWN_STATS["cifar10"]
    # Computed stats against a numpy recomputation.
    m, s = compute_stats(sample_test.images)
    arr = sample_test.images.numpy().astype(np.float64) / 255
    np.testing.assert_allclose(m, arr.mean(axis=(0, 2, 3)), atol=1e-9)
    np.testing.assert_allclose(s, arr.std(axis=(0, 2, 3)), atol=1e-9)
    x = normalize(sample_test.images[:4], mean, std)
    want = (arr[:4] - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]
    assert x.dtype == torch.float32
    np.testing.assert_allclose(x.numpy(), want, atol=1e-5)


def test_random_crop_flip_matches_per_image_torchvision(sample_test) -> None:
    images = sample_test.images[:64]
    gen = torch.Generator().manual_seed(0)
    out = random_crop_flip(images, padding=4, hflip=0.5, generator=gen)
    gen = torch.Generator().manual_seed(0)  # replay the same draws for a plain loop
    offsets = torch.randint(0, 9, (2, 64), generator=gen)
    flips = torch.rand(64, generator=gen) < 0.5
    for i in range(64):
        want = TF.crop(TF.pad(images[i], [4]), int(offsets[0, i]), int(offsets[1, i]), 32, 32)
        if flips[i]:
            want = TF.horizontal_flip(want)
        assert torch.equal(out[i], want)
    assert 10 < int(flips.sum()) < 54
    assert torch.equal(random_crop_flip(images, padding=0, hflip=0.0), images)


def _image_folder(root: Path, fmt: str) -> Path:
    """An ``imagefolder`` data set (train split only) of six 8x8 images in two classes."""
    rng = np.random.default_rng(0)
    for name in ("cat", "dog"):
        (root / "train" / name).mkdir(parents=True)
        for i in range(3):
            pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "train" / name / f"{i}.{fmt}", quality=95)
    return root


@pytest.mark.parametrize("fmt", ["png", "jpg"])  # PIL decodes the PNGs, libjpeg the JPEGs in one batch
def test_a_damaged_image_is_named_by_row_and_file(tmp_path: Path, fmt: str) -> None:
    """A truncated file is a one-line error naming the split, the row and the file, and saying what to do; the
    file system is not blamed."""
    folder = _image_folder(tmp_path / "ds", fmt)
    bad = folder / "train" / "cat" / f"1.{fmt}"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    with pytest.raises(UserError) as e:
        load_image_set(str(folder), "train")
    message = str(e.value)
    assert message.startswith(f"data set {str(folder)!r}, split 'train': the image of row 1 ({bad}) does not decode")
    assert message.endswith("the file is damaged or not an image; re-download it, or remove it from the data set")
    assert "\n" not in message and "disk space" not in message
    bad.unlink()
    assert len(load_image_set(str(folder), "train")) == 5


@pytest.mark.parametrize("columns", [{"label_column": "image"}, {"image_column": "image", "label_column": "image"}])
def test_the_image_column_as_the_labels_is_a_one_line_error_naming_the_flag(tmp_path: Path, columns: dict) -> None:
    """An imagefolder (columns image, label) with its image column named as the labels: one line naming the fix."""
    folder = _image_folder(tmp_path / "ds", "png")
    with pytest.raises(UserError) as e:
        load_image_set(str(folder), "train", **columns)
    assert str(e.value) == ("column 'image' would be both the images and the labels; name the label column with "
                            "--label-column (or the image column with --image-column): the columns are image, label")


def test_a_missing_split_names_the_commands_flag(tmp_path: Path) -> None:
    folder = _image_folder(tmp_path / "ds", "png")
    with pytest.raises(UserError) as e:
        load_image_set(str(folder), "test", split_flag="--bank-split")
    assert str(e.value).endswith("has no split 'test'; its splits are train: name one with --bank-split")
    with pytest.raises(UserError) as e:
        load_image_set(str(folder), "test")
    assert str(e.value).endswith(": name one with --split")


def _with_an_empty_split(folder: Path, layout: str) -> str:
    """A data set of 4 images in `train` and none in `test`: a save_to_disk folder or a folder of parquet files."""
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    train = datasets.Dataset.from_dict({"image": [_png("RGB", (i, 0, 0)) for i in range(4)], "label": [0, 1, 0, 1]},
                                       features=feats)
    empty = datasets.Dataset.from_dict({"image": [], "label": []}, features=feats)
    if layout == "saved":
        datasets.DatasetDict({"train": train, "test": empty}).save_to_disk(str(folder))
    else:
        folder.mkdir()
        train.to_parquet(str(folder / "train.parquet"))
        empty.to_parquet(str(folder / "test.parquet"))
    return str(folder)


@pytest.mark.parametrize("layout", ["saved", "parquet"])
def test_an_empty_split_is_named_as_such_and_the_other_splits_load(tmp_path: Path, layout: str) -> None:
    """datasets fails on the whole data set (save_to_disk: IndexError; parquet: 'corresponds to no data'): the
    split with rows loads, the empty one is one line naming it and the splits that have rows."""
    folder = _with_an_empty_split(tmp_path / "ds", layout)
    assert load_image_set(folder, "train").images[:, 0, 0, 0].tolist() == [0, 1, 2, 3]
    with pytest.raises(UserError) as e:
        load_image_set(folder, "test", split_flag="--eval-split")
    assert str(e.value) == (f"data set {folder!r}: split 'test' has no rows (its files hold no images); name a split "
                            "that has rows with --eval-split (train), or add images to 'test'")


def test_a_path_like_name_of_no_folder_says_so_and_what_the_hub_said(tmp_path: Path, monkeypatch) -> None:
    """``data/cifar10`` (no ./) where there is no such folder is tried as a Hub id; the message says both."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError) as e:
        load_image_set("data/cifar10")
    assert str(e.value).startswith(f"no folder 'data/cifar10' exists in {tmp_path}, and as a Hub id it is not in the "
                                   "local cache and the Hugging Face Hub is offline or unreachable")
