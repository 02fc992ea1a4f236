"""The clutter generator (timm_rollout.clutter, scripts/make_cluttered.py) and boxes through the loader.

The pasting is checked with images whose pixels name where they come from (class, image, row, column), so every
canvas pixel can be traced back to its source by hand; the written folder on the shipped CIFAR-10 sample.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from timm_rollout.clutter import (
    _CLUTTER,
    CLUTTER,
    OBJECT,
    ClutterRecipe,
    _check_memory,
    _fragment_sources,
    _rng,
    clutter_split,
    make_cluttered,
    object_positions,
    split_file,
)
from timm_rollout.data import SAMPLE_DIR, load_image_set
from timm_rollout.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_cluttered", ROOT / "scripts" / "make_cluttered.py")
make_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_cli)

FILL = (0, 0, 0)  # no source pixel is black: red is 100 + class


def traceable(labels: list[int], size: int = 8, first_index: int = 0) -> torch.Tensor:
    """uint8 (N, 3, size, size) images: red = 100 + class, green = row * size + column, blue = image index."""
    n = len(labels)
    out = torch.empty(n, 3, size, size, dtype=torch.uint8)
    out[:, 0] = (100 + torch.tensor(labels)).view(n, 1, 1)
    out[:, 1] = torch.arange(size * size).view(1, size, size)
    out[:, 2] = (first_index + torch.arange(n)).view(n, 1, 1)
    return out


def test_object_is_pasted_last_at_its_box_and_clutter_comes_from_other_classes_of_the_split() -> None:
    labels = [0, 1, 2] * 30
    images = traceable(labels, first_index=100)  # blue 100..189: this split's images only
    recipe = ClutterRecipe(canvas=24, fragments=6, fragment_size=3, seed=5)
    canvases, boxes, _ = clutter_split(images, torch.tensor(labels), FILL, recipe, "test")
    assert canvases.shape == (90, 3, 24, 24) and boxes.shape == (90, 4)
    for i in range(90):
        x, y, w, h = boxes[i].tolist()
        assert (w, h) == (8, 8) and 0 <= x <= 16 and 0 <= y <= 16
        assert torch.equal(canvases[i, :, y:y + h, x:x + w], images[i])  # never occluded, pixels equal
        outside = torch.ones(24, 24, dtype=torch.bool)
        outside[y:y + h, x:x + w] = False
        pixels = canvases[i][:, outside]  # (3, M)
        clutter = pixels[:, pixels[0] != 0]
        assert len(clutter[0]) > 0
        source_class = clutter[0].long() - 100
        source_index = clutter[2].long() - 100
        assert ((source_class >= 0) & (source_class <= 2)).all() and (source_class != labels[i]).all()
        assert ((source_index >= 0) & (source_index < 90)).all()
        assert torch.equal(torch.tensor(labels)[source_index], source_class)  # the pixel is that image's
        assert (pixels[:, pixels[0] == 0] == 0).all()  # the rest is the fill colour
        assert len(clutter[0]) <= 6 * 9  # at most k crops of f x f


def test_mask_says_where_every_pixel_comes_from() -> None:
    """Fill pixels hold the fill colour, object pixels are exactly the box and hold the object, and every clutter
    pixel traces back to the fragment pasted there: a crop of an image of another class, at the pixel's offset."""
    labels = [0, 1, 2] * 20
    images = traceable(labels)
    recipe = ClutterRecipe(canvas=24, fragments=12, fragment_size=3, seed=7)
    canvases, boxes, masks = clutter_split(images, torch.tensor(labels), FILL, recipe, "test")
    assert masks.shape == (60, 24, 24) and masks.dtype == torch.uint8 and set(masks.unique().tolist()) == {0, 1, 2}
    for i in range(60):
        x, y, w, h = boxes[i].tolist()
        box = torch.zeros(24, 24, dtype=torch.bool)
        box[y:y + h, x:x + w] = True
        assert torch.equal(masks[i] == OBJECT, box)
        assert torch.equal(canvases[i][:, box].reshape(3, h, w), images[i])
        assert (canvases[i][:, masks[i] == 0] == 0).all()  # fill pixels hold the fill colour (black)
        for py, px in torch.nonzero(masks[i] == CLUTTER).tolist():
            red, green, blue = canvases[i, :, py, px].tolist()
            assert red != 0 and red - 100 != labels[i]  # a pixel of an image of another class
            assert labels[blue] == red - 100  # of that image: blue names it
            sy, sx = divmod(green, 8)  # and of the pixel it names in that image
            assert images[blue, 1, sy, sx] == green
    # The masks follow the draws: the same seed at another fragment count keeps the object's pixels.
    _, _, none = clutter_split(images, torch.tensor(labels), FILL, ClutterRecipe(24, 0, 3, seed=7), "test")
    assert torch.equal(none == OBJECT, masks == OBJECT) and not (none == CLUTTER).any()


def painted_one_by_one(images: torch.Tensor, labels: torch.Tensor, fill: tuple, recipe: ClutterRecipe,
                       split: str) -> tuple[np.ndarray, np.ndarray]:
    """The reference: the same draws as :func:`clutter_split`, each canvas painted in a plain loop, fragment after
    fragment, then its object. A mixture: each canvas's count drawn from its own stream, the largest dose's
    fragments drawn for every canvas, the first ``count`` of them painted."""
    n, _, h, w = images.shape
    doses = sorted({recipe.fragments} if isinstance(recipe.fragments, int) else set(recipe.fragments))
    counts = [doses[j] for j in _rng(recipe.seed, split, 2).integers(0, len(doses), n)] if len(doses) > 1 \
        else [doses[0]] * n
    lab, k, f, c = labels.numpy(), max(doses), recipe.fragment_size, recipe.canvas
    pos = object_positions(n, (h, w), recipe, split)
    rng = _rng(recipe.seed, split, _CLUTTER)
    src = _fragment_sources(lab, rng.integers(0, (n - np.bincount(lab)[lab])[:, None], (n, k)))
    crop = np.stack([rng.integers(0, h - f + 1, (n, k)), rng.integers(0, w - f + 1, (n, k))], axis=-1)
    at = rng.integers(0, c - f + 1, (n, k, 2))
    out = np.empty((n, 3, c, c), np.uint8)
    out[:] = np.asarray(fill, np.uint8)[:, None, None]
    masks = np.zeros((n, c, c), np.uint8)
    for i in range(n):
        for t in range(counts[i]):
            (sy, sx), (cy, cx), j = at[i, t], crop[i, t], src[i, t]
            out[i, :, sy:sy + f, sx:sx + f] = images[j, :, cy:cy + f, cx:cx + f].numpy()
            masks[i, sy:sy + f, sx:sx + f] = CLUTTER
        x, y = pos[i]
        out[i, :, y:y + h, x:x + w] = images[i].numpy()
        masks[i, y:y + h, x:x + w] = OBJECT
    return out, masks


@pytest.mark.parametrize("recipe", [ClutterRecipe(24, 40, 3, seed=2), ClutterRecipe(16, 5, 8, seed=1),
                                    ClutterRecipe(8, 3, 8, seed=0), ClutterRecipe(20, 0, 4, seed=3),
                                    ClutterRecipe(24, (0, 4, 40), 3, seed=2), ClutterRecipe(16, (5, 0), 8, seed=1)])
def test_canvases_equal_painting_each_canvas_in_a_plain_loop(recipe: ClutterRecipe) -> None:
    """Every fragment of every canvas painted at once equals painting canvas after canvas, fragment after fragment
    (dense overlaps: a later fragment covers an earlier one, the object covers all), pixels and masks."""
    labels = torch.tensor([0, 1, 2, 2, 1] * 12)
    images = torch.randint(0, 256, (60, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    canvases, _, masks = clutter_split(images, labels, (9, 8, 7), recipe, "train")
    want, want_masks = painted_one_by_one(images, labels, (9, 8, 7), recipe, "train")
    np.testing.assert_array_equal(canvases.numpy(), want)
    np.testing.assert_array_equal(masks.numpy(), want_masks)


def test_one_fragment_is_one_crop_of_fragment_size_from_a_random_spot() -> None:
    labels = [0, 1] * 100
    images = traceable(labels)
    recipe = ClutterRecipe(canvas=40, fragments=1, fragment_size=4, seed=0)
    canvases, boxes, _ = clutter_split(images, torch.tensor(labels), FILL, recipe, "train")
    spots = set()
    for i in range(200):
        x, y, w, h = boxes[i].tolist()
        mask = canvases[i, 0] != 0
        mask[y:y + h, x:x + w] = False
        ys, xs = torch.nonzero(mask, as_tuple=True)
        if len(ys) < 16:
            continue  # the object covers part of the crop
        assert len(ys) == 16 and ys.max() - ys.min() == 3 and xs.max() - xs.min() == 3  # one 4x4 square
        top, left = int(ys.min()), int(xs.min())
        crop = canvases[i, :, top:top + 4, left:left + 4]
        j = int(crop[2, 0, 0])
        pos = int(crop[1, 0, 0])
        sy, sx = divmod(pos, 8)
        assert torch.equal(crop, images[j, :, sy:sy + 4, sx:sx + 4])  # a crop of image j at (sy, sx)
        spots.add((sy, sx))
    assert len(spots) > 10  # crops come from many spots, not a fixed one


def test_objects_and_places_depend_on_the_seed_not_on_the_fragments() -> None:
    labels = torch.tensor([0, 1, 2, 3] * 50)
    images = traceable(labels.tolist())
    clean, boxes0, _ = clutter_split(images, labels, FILL, ClutterRecipe(32, 0, 4, seed=3), "test")
    busy, boxes16, _ = clutter_split(images, labels, FILL, ClutterRecipe(32, 16, 4, seed=3), "test")
    _, other_seed, _ = clutter_split(images, labels, FILL, ClutterRecipe(32, 16, 4, seed=4), "test")
    _, other_split, _ = clutter_split(images, labels, FILL, ClutterRecipe(32, 16, 4, seed=3), "train")
    assert torch.equal(boxes0, boxes16) and not torch.equal(boxes0, other_seed) and not torch.equal(boxes0, other_split)
    assert (clean != 0).any(dim=1).flatten(1).sum(1).tolist() == [64] * 200  # no clutter: the object alone on the fill
    assert not torch.equal(clean, busy)
    # Uniform integer positions over [0, canvas - 8]: every value reached, mean near the middle (12).
    xy = boxes0[:, :2].double()
    assert set(boxes0[:, 0].tolist()) == set(range(25)) and abs(xy.mean().item() - 12) < 1.0


def test_bad_recipes_and_sources_are_one_line_errors(tmp_path: Path, capsys) -> None:
    labels = torch.tensor([0, 1])
    images = traceable([0, 1], size=8)
    with pytest.raises(UserError, match="do not fit on a 6x6 canvas"):
        clutter_split(images, labels, FILL, ClutterRecipe(canvas=6, fragments=0), "train")
    with pytest.raises(UserError, match="larger than the 16-pixel canvas"):
        ClutterRecipe(canvas=16, fragment_size=20).check((8, 8))
    with pytest.raises(UserError, match="one class only"):
        clutter_split(images, torch.tensor([1, 1]), FILL, ClutterRecipe(16, 2, 4), "train")
    if hasattr(os, "sysconf"):  # the memory check reads the RAM size from sysconf (Linux, macOS)
        with pytest.raises(UserError, match="pass a smaller --canvas or --per-class N"):
            _check_memory(10**6, 1024)  # 6 TB of canvases, on any machine
    _check_memory(10**4, 64)
    with pytest.raises(UserError, match="unlabelled images"):
        clutter_split(images, torch.tensor([-1, -1]), FILL, ClutterRecipe(16, 0, 4), "test")

    def image_folder(name: str, sides: dict[tuple[str, str], int]) -> str:
        for (split, cls), side in sides.items():
            (tmp_path / name / split / cls).mkdir(parents=True)
            Image.new("RGB", (side, side), (9, 9, 9)).save(tmp_path / name / split / cls / "0.png")
        return str(tmp_path / name)

    mixed = image_folder("mixed", {("train", "a"): 8, ("train", "b"): 9})
    across = image_folder("across", {("train", "a"): 8, ("train", "b"): 8, ("test", "a"): 9, ("test", "b"): 9})
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "README.md").write_text("a user's own notes")
    lonely = image_folder("lonely", {("train", "a"): 8, ("train", "b"): 8, ("test", "a"): 8})
    cases = [
        (["--dataset", "cifar10-sample", "--fragment-size", "65"], "larger than the 64-pixel canvas"),
        (["--dataset", "cifar10-sample", "--canvas", "31", "--fragments", "0"], "do not fit on a 31x31 canvas"),
        (["--dataset", mixed], "images have different sizes"),
        (["--dataset", across, "--fragments", "0"], "the splits' images have different sizes (train 8x8, test 9x9)"),
        (["--dataset", lonely, "--fragment-size", "4"], "split 'test' has one class only"),
        (["--dataset", str(SAMPLE_DIR), "--output", str(SAMPLE_DIR / "clutter")], "inside the source data set"),
        (["--dataset", "cifar10-sample", "--output", str(SAMPLE_DIR / "clutter")], "inside the source data set"),
        (["--dataset", "cifar10-sample", "--fragments", "257"], "--fragments: must be an integer in [0, 256]"),
        (["--dataset", "cifar10-sample", "--output", str(busy)], "holds files this script did not write"),
    ]
    if Path("/proc/self").is_dir():  # a folder no one can create files in (as root too): the OS refuses
        cases.append((["--dataset", "cifar10-sample", "--per-class", "1", "--output", "/proc/clutter"], "/proc"))
    for argv, message in cases:
        out = [] if "--output" in argv else ["--output", str(tmp_path / "out")]
        with pytest.raises(SystemExit) as exit_info:
            make_cli.run_cli(make_cli.main, [*argv, *out])
        lines = capsys.readouterr().err.strip().splitlines()  # datasets' own progress bars may come first
        assert exit_info.value.code == 2 and lines[-1].startswith("error: ") and message in lines[-1]
        assert not any("Traceback" in line for line in lines)
    assert not (SAMPLE_DIR / "clutter").exists() and not (tmp_path / "out").exists()  # nothing written
    assert [f.name for f in busy.iterdir()] == ["README.md"]  # the user's own file is left as it was
    assert (busy / "README.md").read_text() == "a user's own notes"


def test_written_folder_is_byte_deterministic_and_loads_offline_with_boxes(tmp_path: Path) -> None:
    recipe = ClutterRecipe(canvas=48, fragments=4, fragment_size=6, seed=1)
    counts = make_cluttered("cifar10-sample", tmp_path / "a", recipe, per_class=3)
    make_cluttered("cifar10-sample", tmp_path / "b", recipe, per_class=3)
    make_cluttered("cifar10-sample", tmp_path / "b", recipe, per_class=3)  # a folder it wrote is overwritten
    assert counts == {"train": 30, "test": 30}
    for name in (split_file("train"), split_file("test"), "README.md"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    ds = datasets.load_dataset(str(tmp_path / "a"))  # offline: datasets finds the splits by the file names
    assert set(ds) == {"train", "test"} and ds["test"].features["label"].names[:2] == ["airplane", "automobile"]
    source = load_image_set("cifar10-sample", "test")
    loaded = load_image_set(str(tmp_path / "a"), "test", boxes=True)
    assert loaded.images.shape == (30, 3, 48, 48) and loaded.boxes.dtype == torch.float32
    assert loaded.boxes.tolist() == ds["test"]["bbox"]
    card = (tmp_path / "a" / "README.md").read_text()
    assert source.fingerprint in card and "4 crops of 6x6 pixels" in card
    # Each object is a source image of its label, at its box, byte for byte.
    from timm_rollout.data import balanced_indices

    picked = source.subset(balanced_indices(source.labels, per_class=3, seed=1))
    assert torch.equal(loaded.labels, picked.labels)
    for i, (x, y, w, h) in enumerate(loaded.boxes.long().tolist()):
        assert torch.equal(loaded.images[i, :, y:y + h, x:x + w], picked.images[i])
    assert torch.equal(loaded.subset(torch.tensor([2, 0])).boxes, loaded.boxes[[2, 0]])
    # The mask column decodes to what the canvas shows: the object's pixels are its box, fill holds the fill colour.
    assert loaded.masks.shape == (30, 48, 48) and torch.equal(loaded.subset(torch.tensor([1])).masks, loaded.masks[[1]])
    colour = card.split("mean colour RGB (")[1].split(")")[0]
    fill = torch.tensor([int(v) for v in colour.split(", ")], dtype=torch.uint8)
    for i, (x, y, w, h) in enumerate(loaded.boxes.long().tolist()):
        assert int((loaded.masks[i] == OBJECT).sum()) == w * h and (loaded.masks[i, y:y + h, x:x + w] == OBJECT).all()
        assert (loaded.images[i][:, loaded.masks[i] == 0] == fill[:, None]).all()
    assert load_image_set(str(tmp_path / "a"), "test").masks is None  # only the harness reads it


def test_plain_datasets_loads_each_folder_of_one_name_as_written(tmp_path: Path, monkeypatch) -> None:
    """Two outputs named `data` in different places, and one written again, load their own canvases with plain
    ``datasets.load_dataset`` and its default cache (a card with a ``configs:`` block made datasets key the cache by
    the folder's name: both loaded the first one's images). The shipped sample's card names no files either."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))

    def first_bytes(folder: Path) -> bytes:
        return datasets.load_dataset(str(folder), split="test").cast_column("image", datasets.Image(decode=False))[
            0]["image"]["bytes"]

    one, two = tmp_path / "exp1" / "data", tmp_path / "exp2" / "data"
    make_cluttered("cifar10-sample", one, ClutterRecipe(fragments=2, seed=0), per_class=1)
    make_cluttered("cifar10-sample", two, ClutterRecipe(fragments=6, seed=0), per_class=1)
    assert first_bytes(one) != first_bytes(two)
    make_cluttered("cifar10-sample", one, ClutterRecipe(fragments=6, seed=0), per_class=1)  # written again
    assert first_bytes(one) == first_bytes(two)
    assert "configs:" not in (SAMPLE_DIR / "README.md").read_text()
    assert set(datasets.load_dataset(str(SAMPLE_DIR))) == {"train", "test"}


def test_card_names_the_canvas_content_hash_of_the_decoded_files(tmp_path: Path) -> None:
    """The card's canvas sha256 equals one computed by hand from the parquet files decoded with PIL: pixels as uint8
    (N, 3, H, W), labels and boxes as int64, in that order."""
    import hashlib
    import io

    import numpy as np

    make_cluttered("cifar10-sample", tmp_path, ClutterRecipe(canvas=40, fragments=3, seed=2), per_class=2)
    card = (tmp_path / "README.md").read_text()
    for split in ("train", "test"):
        ds = datasets.load_dataset(str(tmp_path), split=split)
        pixels = np.stack([np.asarray(Image.open(io.BytesIO(row["image"]["bytes"]))).transpose(2, 0, 1)
                           for row in ds.cast_column("image", datasets.Image(decode=False))])
        digest = hashlib.sha256(np.ascontiguousarray(pixels).tobytes())
        digest.update(np.asarray(ds["label"], dtype=np.int64).tobytes())
        digest.update(np.asarray(ds["bbox"], dtype=np.int64).tobytes())
        row = next(ln for ln in card.splitlines() if ln.startswith(f"| {split} |"))
        assert row.rstrip(" |").endswith(digest.hexdigest()), (split, row)


def test_loader_keeps_one_box_per_image_and_refuses_others(tmp_path: Path) -> None:
    img = Image.new("RGB", (8, 8))
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    cell = {"bytes": buf.getvalue(), "path": None}

    def write(name: str, boxes: list) -> str:
        feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"]),
                                   "bbox": datasets.List(datasets.List(datasets.Value("float32")))})
        folder = tmp_path / name
        folder.mkdir()
        datasets.Dataset.from_dict({"image": [cell] * len(boxes), "label": [0, 1][: len(boxes)], "bbox": boxes},
                                   features=feats).to_parquet(str(folder / "train.parquet"))
        return str(folder)

    nested = load_image_set(write("nested", [[[1, 2, 3, 4]], [[0, 0, 8, 8]]]), "train", boxes=True)
    assert nested.boxes.tolist() == [[1, 2, 3, 4], [0, 0, 8, 8]]
    edge = load_image_set(write("edge", [[[0.5, 0, 8, 8]], [[-0.5, 7, 1, 1.5]]]), "train", boxes=True)
    assert edge.boxes.tolist() == [[0.5, 0, 8, 8], [-0.5, 7, 1, 1.5]]  # past the border by less than a pixel
    odd = (("two", [[0, 0, 8, 8], [1, 1, 2, 2]]), ("nan", [[0, 0, float("nan"), 8]]),
           ("inf", [[0, 0, float("inf"), 8]]), ("flat", [[0, 0, 8, 0]]), ("none", None), ("three", [[1]]),
           ("xyxy", [[2, 2, 8, 8]]), ("fraction", [[0.1, 0.2, 0.5, 0.5]]), ("left", [[-2, 0, 4, 4]]),
           ("below", [[0, 5, 4, 5]]))  # the last four: another format's boxes, not inside the 8x8 image
    for name, second in odd:
        folder = write(name, [[[1, 2, 3, 4]], second])
        with pytest.raises(UserError, match="row 1 of column 'bbox'") as refused:
            load_image_set(folder, "train", boxes=True)
        assert "\n" not in str(refused.value)
        assert load_image_set(folder, "train").boxes is None  # training and the rest leave the column alone
    assert load_image_set("cifar10-sample", "test", boxes=True).boxes is None


def test_card_command_names_every_recipe_flag_and_remakes_the_same_files(tmp_path: Path) -> None:
    """A command typed with abbreviations (argparse takes unique prefixes) and without --seed or --fragment-size is
    written into the card with every recipe flag spelled out, and running the card's command as written makes the
    same files byte for byte."""
    import shlex

    make_cli.main(["--dataset", "cifar10-sample", "--per", "1", "--fragments=2", "--can", "40",
                   "--output", str(tmp_path / "a")])
    card = (tmp_path / "a" / "README.md").read_text()
    line = next(ln.strip() for ln in card.splitlines() if ln.strip().startswith("python scripts/make_cluttered.py"))
    assert line == shlex.join(["python", "scripts/make_cluttered.py", "--dataset", "cifar10-sample", "--fragments", "2",
                               "--fragment-size", "8", "--canvas", "40", "--seed", "0", "--per-class", "1",
                               "--output", str(tmp_path / "a")])
    argv = shlex.split(line)[2:]
    argv[argv.index("--output") + 1] = str(tmp_path / "b")
    make_cli.main(argv)
    for name in (split_file("train"), split_file("test")):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_a_mixture_draws_each_canvas_dose_and_keeps_the_objects_in_their_places(tmp_path: Path) -> None:
    """A mixture of doses: the same objects in the same places as every fixed dose of the seed, doses drawn about
    uniformly, a canvas drawn at 0 free of clutter, more clutter at higher doses; the written folder is
    byte-deterministic and plain datasets reads each canvas's dose."""
    from timm_rollout.clutter import DOSE_COLUMN, fragment_counts
    from timm_rollout.clutter import FILL as FILL_MARK

    labels = torch.tensor([0, 1, 2, 3] * 100)
    images = traceable(labels.tolist())
    mix = ClutterRecipe(32, (0, 16, 4, 64), 4, seed=3)
    assert mix.doses == (0, 4, 16, 64) and mix.mixture and not ClutterRecipe(32, (16, 16), 4).mixture
    _, boxes, masks = clutter_split(images, labels, FILL, mix, "test")
    counts = fragment_counts(400, mix, "test")
    _, boxes16, _ = clutter_split(images, labels, FILL, ClutterRecipe(32, 16, 4, seed=3), "test")
    assert torch.equal(boxes, boxes16)
    assert set(counts.tolist()) == set(mix.doses)
    assert all(abs(int((counts == d).sum()) - 100) < 35 for d in mix.doses)  # 100 expected, sd 8.7
    assert set(masks[torch.from_numpy(counts == 0)].unique().tolist()) == {FILL_MARK, OBJECT}
    clutter = [float((masks[torch.from_numpy(counts == d)] == CLUTTER).float().mean()) for d in mix.doses]
    assert clutter[0] == 0 and clutter[1] < clutter[2] < clutter[3]

    argv = ["--dataset", str(SAMPLE_DIR), "--fragments", "0", "16", "64", "--per-class", "3", "--splits", "test"]
    make_cli.main([*argv, "--output", str(tmp_path / "a")])
    make_cli.main([*argv, "--output", str(tmp_path / "b")])
    assert (tmp_path / "a" / split_file("test")).read_bytes() == (tmp_path / "b" / split_file("test")).read_bytes()
    assert not (tmp_path / "a" / split_file("train")).exists()
    card = (tmp_path / "a" / "README.md").read_text()
    assert "0, 16 or 64 (drawn uniformly per canvas" in card and "--fragments 0 16 64" in card
    assert "--splits test" in card
    loaded = datasets.load_dataset(str(tmp_path / "a"), split="test")
    recipe = ClutterRecipe(64, (0, 16, 64), 8, seed=0)
    assert loaded[DOSE_COLUMN] == fragment_counts(30, recipe, "test").tolist()
    fixed = tmp_path / "c"  # one split written: the fill colour is still the train split's, as with every split
    make_cli.main(["--dataset", str(SAMPLE_DIR), "--fragments", "0", "--per-class", "3", "--output", str(fixed)])
    only = tmp_path / "d"
    make_cli.main(["--dataset", str(SAMPLE_DIR), "--fragments", "0", "--per-class", "3", "--splits", "test",
                   "--output", str(only)])
    assert (fixed / split_file("test")).read_bytes() == (only / split_file("test")).read_bytes()
    with pytest.raises(UserError, match="no split 'val'; pass --splits among train, test"):
        make_cli.main(["--dataset", str(SAMPLE_DIR), "--splits", "val", "--output", str(tmp_path / "e")])
