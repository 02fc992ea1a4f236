"""Image classification data through Hugging Face ``datasets``, decoded once into a uint8 tensor.

``load_image_set`` resolves an alias, a Hub id or a local folder, finds the image and label columns, and decodes
every image once into a (N, 3, H, W) uint8 RGB tensor, cached as safetensors in the ``datasets`` cache (keyed by
the split's fingerprint and, for a local folder, its files), so a second load takes a fraction of a second.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .atomic import atomic_path
from .errors import UserError
from .masks import read_localisation

SAMPLE_DIR = Path(__file__).parent / "data" / "cifar10_sample"


@dataclass(frozen=True)
class DatasetSpec:
    """Where a data set lives: Hub id or local folder, an optional config, and a preferred label column."""

    path: str
    config: str | None = None
    label_column: str | None = None
    stats_key: str | None = None


ALIASES: dict[str, DatasetSpec] = {
    "cifar10": DatasetSpec("uoft-cs/cifar10", stats_key="cifar10"),
    "cifar100": DatasetSpec("uoft-cs/cifar100", label_column="fine_label", stats_key="cifar100"),
    "svhn": DatasetSpec("ufldl-stanford/svhn", config="cropped_digits", stats_key="svhn"),
    "cifar10-sample": DatasetSpec(str(SAMPLE_DIR), stats_key="cifar10"),
}

# Per-channel mean/std of the train splits (population std over all pixels). CIFAR-10's std is about
# (0.247, 0.243, 0.261); the widely copied (0.2023, 0.1994, 0.2010) is the mean of per-image stds.
KNOWN_STATS: dict[str, tuple[tuple[float, float, float], tuple[float, float, float]]] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
}
_HUB_TO_STATS = {spec.path: spec.stats_key for spec in ALIASES.values() if spec.stats_key}

IMAGE_COLUMNS = ("img", "image")
LABEL_COLUMNS = ("label", "fine_label", "labels")
CACHE_VERSION = 1
# What makes a folder a data set: datasets' save_to_disk markers, or data files load_dataset reads as images.
SAVED_MARKERS = {"dataset_dict.json", "state.json"}
DATA_SUFFIXES = {".parquet", ".arrow", ".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


@dataclass
class ImageSet:
    """A decoded image classification split held in memory."""

    images: torch.Tensor  # uint8 (N, 3, H, W) RGB, CPU
    labels: torch.Tensor  # int64 (N,)
    class_names: list[str]
    dataset: str  # resolved Hub id or local path (provenance)
    split: str
    fingerprint: str  # datasets' fingerprint of the split (provenance)
    boxes: torch.Tensor | None = None  # float32 (N, 4) object box [x, y, w, h] in pixels (COCO order), if any
    # uint8 (N, H, W) masks, if any, in the encoding of timm_rollout.masks: 0 fill, 1 clutter, 2 object, 3 background
    # (a foreground mask's 0: fill or clutter, not told apart); mask_convention: what the column held
    masks: torch.Tensor | None = None
    mask_convention: str | None = None  # 'clutter' (0 fill, 1 clutter, 2 object) or 'foreground' (0, 1 object)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @cached_property
    def content(self) -> str:
        """:func:`content_hash` of the pixels and labels: the same data wherever its files lie (datasets'
        fingerprint names how the files were found, not what they hold)."""
        return content_hash(self.images, self.labels)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def subset(self, indices: torch.Tensor) -> ImageSet:
        """The images at ``indices``; provenance is kept and the fingerprint names the subset (its size and a hash
        of its indices), so two draws of one size, e.g. with two seeds, never pass for the same images."""
        indices = torch.as_tensor(indices, dtype=torch.int64)
        drawn = hashlib.sha256(indices.numpy().tobytes()).hexdigest()[:16]
        return ImageSet(
            self.images[indices], self.labels[indices], list(self.class_names), self.dataset, self.split,
            f"{self.fingerprint}[{len(indices)}:{drawn}]" if len(indices) != len(self) else self.fingerprint,
            None if self.boxes is None else self.boxes[indices],
            None if self.masks is None else self.masks[indices], self.mask_convention,
        )


def content_hash(images: torch.Tensor, labels: torch.Tensor, boxes: torch.Tensor | None = None) -> str:
    """sha256 of a split's decoded uint8 pixels, int64 labels and (when given) int64 boxes: what any machine
    reproduces, whatever bytes its PNG encoder and parquet writer produce."""
    digest = hashlib.sha256(images.contiguous().numpy().tobytes())
    digest.update(labels.to(torch.int64).numpy().tobytes())
    if boxes is not None:
        digest.update(boxes.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()


def box_hash(boxes: torch.Tensor) -> str:
    """sha256 of object boxes (N, 4) as float64: two evaluations scored the same objects only when it is equal."""
    return hashlib.sha256(boxes.to(torch.float64).contiguous().numpy().tobytes()).hexdigest()


def resolve_dataset(dataset: str) -> DatasetSpec:
    """Alias, existing local folder, or Hub id -> :class:`DatasetSpec`."""
    if dataset in ALIASES:
        return ALIASES[dataset]
    local = Path(dataset).expanduser()
    if local.exists():
        if not local.is_dir():
            raise UserError(f"--dataset {dataset} is a file; pass the folder that holds the data set")
        if not _looks_like_dataset(local):
            raise UserError(f"--dataset {dataset} is not a data set folder: it must hold a datasets save_to_disk "
                            f"folder (dataset_dict.json), .parquet/.arrow files or images in class folders, as "
                            f"../shared/data/cifar10 does; or pass one of {', '.join(ALIASES)}")
        return DatasetSpec(str(local.resolve()))
    if dataset.startswith((".", "/", "~")) or dataset.count("/") > 1:
        raise UserError(
            f"no data set folder at {dataset}; pass an existing folder, a Hub id or one of {', '.join(ALIASES)}"
        )
    return DatasetSpec(dataset, stats_key=_HUB_TO_STATS.get(dataset))


def dataset_arg(value: str) -> str:
    """``value`` once it names an alias, a Hub id or a folder holding a data set; nothing is loaded (for CLIs)."""
    resolve_dataset(value)
    return value


def _looks_like_dataset(folder: Path, max_depth: int = 3, max_entries: int = 10_000) -> bool:
    """True when ``folder`` holds a ``save_to_disk`` marker, parquet/arrow files or images (within a few levels)."""
    seen = 0
    for root, dirs, files in os.walk(folder):
        if SAVED_MARKERS & set(files) or any(Path(f).suffix.lower() in DATA_SUFFIXES for f in files):
            return True
        seen += len(files) + len(dirs)
        if seen > max_entries or len(Path(root).relative_to(folder).parts) >= max_depth:
            dirs.clear()
    return False


def _files_key(folder: Path) -> str:
    """16 hex digits that change when a file under ``folder`` is added, removed or rewritten (``datasets`` keys a
    local folder's cache by its name and card, not its files)."""
    digest, seen = hashlib.sha256(), set()
    for root, dirs, files in os.walk(folder, followlinks=True):
        if os.path.realpath(root) in seen:  # a link back up the tree
            dirs.clear()
            continue
        seen.add(os.path.realpath(root))
        dirs[:] = sorted(d for d in dirs if d != ".git")
        for name in sorted(files):
            path = Path(root, name)
            try:
                st = path.stat()
            except OSError:  # a dangling link: nothing datasets could read
                continue
            digest.update(f"{path.relative_to(folder).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\0"
                          f"{st.st_ctime_ns}\0{st.st_ino}\n".encode())
    return digest.hexdigest()[:16]


def _source_exists(record: Path) -> bool:
    """Whether the folder a ``source`` record of the local-folder cache names still exists."""
    try:
        return Path(record.read_text()).exists()
    except OSError:  # removed meanwhile by another process
        return True


def _local_key(folder: Path) -> str:
    """``<place>-<files>``: where the folder lies and what its files are (:func:`_files_key`). Caches that can never
    be read again are removed: those of the folder's earlier files, and those of folders that no longer exist."""
    import datasets

    source = str(folder.resolve())
    place, files = hashlib.sha256(source.encode()).hexdigest()[:16], _files_key(folder)
    cache = Path(datasets.config.HF_DATASETS_CACHE)
    stale = [p.parent for p in (cache / "timm_rollout_local").glob("*/source") if not _source_exists(p)]
    stale += [p for p in (cache / "timm_rollout_local" / place).glob("*") if p.name not in (files, "source")]
    for old in stale:
        shutil.rmtree(old, ignore_errors=True)
    gone = {p.name for p in stale if p.parent.name == "timm_rollout_local"}
    for old in (cache / "timm_rollout_decoded").glob("*"):
        parts = old.name.split("-")
        if (place in parts and files not in parts) or gone & set(parts):
            old.unlink(missing_ok=True)
    (cache / "timm_rollout_local" / place).mkdir(parents=True, exist_ok=True)
    (cache / "timm_rollout_local" / place / "source").write_text(source)
    return f"{place}-{files}"


def _empty(features):
    """A split without rows, of these ``features`` (``datasets`` itself cannot read one back)."""
    import datasets

    return datasets.Dataset.from_dict({column: [] for column in features}, features=features)


def _load_saved(local: Path):
    """A ``save_to_disk`` folder's splits; a split saved without rows, which ``load_from_disk`` fails on
    (IndexError), comes back empty."""
    import datasets

    def split(folder: Path):
        if json.loads((folder / "state.json").read_text())["_data_files"]:
            return datasets.load_from_disk(str(folder))
        return _empty(datasets.DatasetInfo.from_directory(str(folder)).features)

    if (local / "dataset_dict.json").is_file():
        names = json.loads((local / "dataset_dict.json").read_text())["splits"]
        return datasets.DatasetDict({name: split(local / name) for name in names})
    return datasets.DatasetDict({"train": split(local)})


def _load_files(path: str, config: str | None, cache: Path):
    """The splits ``load_dataset`` finds in a folder of data files; a split whose files hold no rows, on which
    ``load_dataset`` fails ('corresponds to no data'), comes back empty."""
    import datasets

    try:
        return datasets.load_dataset(path, config, cache_dir=str(cache))
    except ValueError as e:
        if "corresponds to no data" not in str(e):
            raise
    builder = datasets.load_dataset_builder(path, config, cache_dir=str(cache))
    builder.download_and_prepare()
    return datasets.DatasetDict({name: builder.as_dataset(split=name) if info.num_examples else
                                 _empty(builder.info.features) for name, info in builder.info.splits.items()})


def _check_file_classes(local: Path, name: str) -> None:
    """Refuse parquet files whose ClassLabel columns name other classes, or the same in another order: datasets reads
    every file of a folder with one file's features, so the others' labels would be scored against wrong classes."""
    import pyarrow.parquet as pq

    seen: dict[str, tuple[Path, list[str]]] = {}
    for path in sorted(local.rglob("*.parquet")):
        meta = (pq.read_schema(path).metadata or {}).get(b"huggingface")
        columns = json.loads(meta).get("info", {}).get("features", {}) if meta else {}
        for column, feature in columns.items():
            if not isinstance(feature, dict) or feature.get("_type") != "ClassLabel":
                continue
            first = seen.setdefault(column, (path, feature.get("names", [])))
            if first[1] != feature.get("names", []):
                raise UserError(
                    f"data set {name!r}: its files name the classes of column {column!r} differently "
                    f"({first[0].relative_to(local)}: {_few(first[1])}; {path.relative_to(local)}: "
                    f"{_few(feature.get('names', []))}), and datasets reads them all with one file's names; give every "
                    "file one ClassLabel in one order (datasets' align_labels_with_mapping) or use save_to_disk")


def _load_local(spec: DatasetSpec, name: str, key: str):
    """Splits of a local folder (its ``datasets`` cache under ``key``); what ``datasets`` cannot read is a UserError."""
    import datasets

    local = Path(spec.path)
    _check_file_classes(local, name)
    try:
        if SAVED_MARKERS & {p.name for p in local.iterdir()}:
            return _load_saved(local)
        place, files = key.split("-")
        return _load_files(spec.path, spec.config,
                           Path(datasets.config.HF_DATASETS_CACHE) / "timm_rollout_local" / place / files)
    except Exception as e:  # the folder is the user's: any failure to read it is theirs to fix, not a traceback
        raise _unreadable(e, name, local) from None


def _unreadable(error: Exception, name: str, local: Path) -> UserError:
    """The one-line error for a folder ``datasets`` cannot read, with the cause it gives under its own error (e.g.
    data files whose columns differ from those the data card, or the first file, declares)."""
    cause = error
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    files, declared = getattr(cause, "table_column_names", None), getattr(cause, "requested_column_names", None)
    if files is not None and declared is not None and set(files) != set(declared):
        card = "dataset_info" in ((local / "README.md").read_text(errors="replace")
                                  if (local / "README.md").is_file() else "")
        where = "its data card (README.md) declares" if card else "its first data file holds"
        fix = "make README.md's dataset_info list the files' columns, or remove it" if card \
            else "give every data file the same columns"
        return UserError(f"datasets cannot read the folder {name!r}: a data file holds the columns {', '.join(files)} "
                         f"but {where} {', '.join(declared)}; {fix}")
    reason = "; ".join(f"{type(e).__name__}: {str(e).strip().splitlines()[0][:150]}" if str(e).strip()
                       else type(e).__name__ for e in dict.fromkeys((error, cause)))
    differ = _type_mismatch(local)
    if differ is not None:
        return UserError(f"datasets cannot read the folder {name!r} ({reason}): {differ}, and datasets reads them as "
                         "one table; give each column one type in every file, or write the data set with save_to_disk")
    has_files = any(p.suffix in DATA_SUFFIXES for p in local.rglob("*")) if local.is_dir() else False
    fix = "give its data files the same columns with the same types (datasets reads them as one table), or write " \
        "it with save_to_disk" if has_files else \
        "pass a folder written by save_to_disk or holding .parquet/.arrow files or class folders of images"
    return UserError(f"datasets cannot read the folder {name!r} ({reason}); {fix}")


def _type_mismatch(local: Path) -> str | None:
    """The columns whose arrow type differs between parquet files of ``local``, each said with two of its files."""
    import pyarrow.parquet as pq

    seen: dict[str, tuple[Path, str]] = {}
    differ: dict[str, str] = {}
    for path in sorted(local.rglob("*.parquet")) if local.is_dir() else []:
        for field in pq.read_schema(path):
            first = seen.setdefault(field.name, (path, str(field.type)))
            if first[1] != str(field.type) and field.name not in differ:
                differ[field.name] = (f"{field.name!r} ({first[0].relative_to(local)}: {first[1]}; "
                                      f"{path.relative_to(local)}: {field.type})")
    if not differ:
        return None
    return f"its files disagree on the type of column{'s' * (len(differ) > 1)} {', '.join(differ.values())}"


def _load_splits(spec: DatasetSpec, name: str):
    """``DatasetDict`` of every split and the key its decoded tensors are cached under besides the fingerprint
    (:func:`_local_key` of a local folder); without network a Hub data set loads from the local cache at once."""
    import datasets

    from .online import hub_or_cache

    if Path(spec.path).is_dir():
        key = _local_key(Path(spec.path))
        return _load_local(spec, name, key), key
    with hub_or_cache() as online:
        try:
            return datasets.load_dataset(spec.path, spec.config), ""
        except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as e:
            where, also = ("is found neither on the Hugging Face Hub nor in the local cache", ", an existing Hub id") \
                if online else ("is not in the local cache and the Hugging Face Hub is offline or unreachable", "")
            what = f"data set {name!r} ({spec.path})" if name in ALIASES else \
                f"no folder {name!r} exists in {Path.cwd()}, and as a Hub id it"  # e.g. data/cifar10 without ./
            raise UserError(
                f"{what} {where} ({type(e).__name__}); pass a local data set folder "
                f"(e.g. ../shared/data/cifar10){also} or cifar10-sample (shipped with the package)"
            ) from None


def _pick_column(features: dict, named: str | None, preferred: Sequence[str], kind: str, feature_type: type,
                 flag: str) -> str:
    columns = list(features)
    if named is not None:
        if named not in features:
            raise UserError(f"no {kind} column {named!r}; the columns are {', '.join(columns)}: pass one with {flag}")
        return named
    for col in preferred:
        if col in features:
            return col
    typed = [c for c, f in features.items() if isinstance(f, feature_type)]
    if len(typed) == 1:
        return typed[0]
    raise UserError(f"cannot find the {kind} column among {', '.join(columns)}; name it with {flag}")


def _damaged(where: str, row: int, cell: dict, error: Exception) -> UserError:
    """The one-line error for an image that does not decode: its row, its file where ``datasets`` kept the path."""
    path = cell.get("path")
    reason = str(error).strip().splitlines()[0][:120] if str(error).strip() else type(error).__name__
    return UserError(f"{where}: the image of row {row}{f' ({path})' if path else ''} does not decode ({reason}): "
                     "the file is damaged or not an image; re-download it, or remove it from the data set")


def _decode_rgb(cells: list[dict], where: str = "data set") -> torch.Tensor:
    """Decode image cells (``{'bytes', 'path'}``) to uint8 (N, 3, H, W) RGB: JPEGs in one batched libjpeg call,
    other formats through PIL; an image that does not decode is a :class:`UserError` naming its row and file."""
    from PIL import Image
    from torchvision.io import ImageReadMode, decode_jpeg

    raw = [c["bytes"] if c["bytes"] is not None else Path(c["path"]).read_bytes() for c in cells]
    decoded: list[torch.Tensor | None] = [None] * len(raw)
    jpeg_idx = [i for i, b in enumerate(raw) if b[:2] == b"\xff\xd8"]
    buffers = [torch.frombuffer(bytearray(raw[i]), dtype=torch.uint8) for i in jpeg_idx]
    try:
        jpegs = decode_jpeg(buffers, mode=ImageReadMode.RGB) if buffers else []
    except RuntimeError:  # one bad file fails the batch: find it
        for i, buffer in zip(jpeg_idx, buffers, strict=True):
            try:
                decode_jpeg(buffer, mode=ImageReadMode.RGB)
            except RuntimeError as e:
                raise _damaged(where, i, cells[i], e) from None
        raise
    for i, img in zip(jpeg_idx, jpegs, strict=True):
        decoded[i] = img
    for i, b in enumerate(raw):
        if decoded[i] is None:
            try:
                arr = np.asarray(Image.open(io.BytesIO(b)).convert("RGB"))
            except (OSError, ValueError) as e:  # truncated, corrupt, not an image
                raise _damaged(where, i, cells[i], e) from None
            decoded[i] = torch.from_numpy(arr.copy()).permute(2, 0, 1)
    shapes = {tuple(t.shape) for t in decoded}
    if len(shapes) > 1:
        raise UserError(
            f"images have different sizes ({', '.join('x'.join(map(str, s[1:])) for s in sorted(shapes)[:3])}); "
            "resize the data set to one size first (e.g. with datasets' map)"
        )
    return torch.stack(decoded).contiguous()


def _decoded_tensors(
    split_ds, key: str, image_column: str, label_column: str, where: str = "data set"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and labels of a split, from the decoded-tensor cache when it holds them under ``key``."""
    import datasets
    from safetensors.torch import load_file, save_file

    name = f"v{CACHE_VERSION}-{key}-{image_column}-{label_column}.safetensors"
    cache = Path(datasets.config.HF_DATASETS_CACHE) / "timm_rollout_decoded" / name
    if cache.exists():
        tensors = load_file(str(cache))
        return tensors["images"], tensors["labels"]
    raw = split_ds.select_columns([image_column, label_column]).cast_column(image_column, datasets.Image(decode=False))
    table = raw.with_format("arrow")[:]  # raw bytes, no PIL decoding
    cells = table.column(image_column).to_pylist()
    labels = torch.tensor(table.column(label_column).to_numpy(zero_copy_only=False), dtype=torch.int64)
    images = _decode_rgb(cells, where)
    try:
        with atomic_path(cache) as tmp:
            save_file({"images": images, "labels": labels}, str(tmp))
    except OSError:
        pass  # a read-only cache only costs the decode next time
    return images, labels


def split_names(dataset: str) -> list[str]:
    """The splits of ``dataset`` (alias, Hub id or local folder)."""
    return list(_load_splits(resolve_dataset(dataset), dataset)[0])


def load_image_set(
    dataset: Any,
    split: str = "train",
    *,
    image_column: str | None = None,
    label_column: str | None = None,
    boxes: bool = False,
    split_flag: str = "--split",
    box_format: str | None = None,
) -> ImageSet:
    """Load one split of an image classification data set (an alias of :data:`ALIASES`, a Hub id or a local
    folder, or a loaded ``datasets`` Dataset or DatasetDict) as decoded uint8 RGB tensors; columns are detected
    unless named. ``boxes``: also read the ``bbox`` (in ``box_format``, default xywh) and ``mask`` columns
    (:mod:`timm_rollout.masks`). ``split_flag``: the flag that names ``split``, for errors."""
    import datasets

    if isinstance(dataset, str):
        spec = resolve_dataset(dataset)
        splits, key = _load_splits(spec, dataset)
    else:  # an object: named by its builder (or "in memory"); its fingerprint and content hash say what it holds
        splits = dataset if isinstance(dataset, datasets.DatasetDict) else {split: dataset}
        spec = DatasetSpec(f"{next(iter(splits.values())).info.dataset_name or 'datasets'} (in memory)", None, None)
        dataset, key = spec.path, ""
    if split not in splits:
        raise UserError(f"data set {dataset!r} has no split {split!r}; its splits are {', '.join(splits)}: name one "
                        f"with {split_flag}")
    ds = splits[split]
    if not len(ds):
        full = [s for s in splits if len(splits[s])]
        fix = f"name a split that has rows with {split_flag} ({', '.join(full)}), or add images to {split!r}" \
            if full else "add images to the data set"
        raise UserError(f"data set {dataset!r}: split {split!r} has no rows (its files hold no images); {fix}")
    features = ds.features
    img_col = _pick_column(features, image_column, IMAGE_COLUMNS, "image", datasets.Image, "--image-column")
    if not isinstance(features[img_col], datasets.Image):
        raise UserError(f"column {img_col!r} holds {type(features[img_col]).__name__}, not images; "
                        "name the image column with --image-column")
    lbl_col = _pick_column(features, label_column or spec.label_column, LABEL_COLUMNS, "label",
                           datasets.ClassLabel, "--label-column")
    if lbl_col == img_col:
        raise UserError(f"column {img_col!r} would be both the images and the labels; name the label column with "
                        f"--label-column (or the image column with --image-column): the columns are "
                        f"{', '.join(features)}")
    images, labels = _decoded_tensors(ds, f"{ds._fingerprint}{key and '-' + key}", img_col, lbl_col,
                                      f"data set {dataset!r}, split {split!r}")
    _check_labelled(labels, dataset, split, lbl_col)
    feature = features[lbl_col]
    if isinstance(feature, datasets.ClassLabel):
        class_names = list(feature.names)
    else:
        class_names = [str(i) for i in range(int(labels.max()) + 1 if len(labels) else 0)]
    located = read_localisation(ds, dataset, tuple(images.shape[2:]), box_format) if boxes else (None, None, None)
    return ImageSet(images, labels, class_names, spec.path, split, ds._fingerprint, *located)


def _check_labelled(labels: torch.Tensor, dataset: str, split: str, column: str) -> None:
    """Refuse negative labels (datasets' ClassLabel stores "no label" as -1): no class to train on or score against."""
    missing = torch.nonzero(labels < 0).flatten()
    if len(missing):
        raise UserError(f"data set {dataset!r}, split {split!r}: {len(missing)} rows have no label (label "
                        f"{int(labels[missing[0]])}, e.g. row {int(missing[0])}); drop them first (e.g. "
                        f"ds.filter(lambda y: y >= 0, input_columns={column!r})) or label them")


def _few(names: Sequence[str]) -> str:
    return ", ".join(map(str, names[:4])) + (", ..." if len(names) > 4 else "")


def check_class_names(names: Sequence[str], expected: Sequence[str], what: str, whose: str, fix: str) -> None:
    """A one-line error ending with ``fix`` when the class ``names`` of ``what`` (e.g. the eval split) differ from
    ``expected``, those of ``whose`` (e.g. the train split, or the checkpoint): labels are class indices, so the same
    classes in another order would be scored against each other. Only the names both lists have are compared (the
    labels' range is checked on its own)."""
    n = min(len(names), len(expected))
    if list(names[:n]) == list(expected[:n]):
        return
    how = f"lists the classes of {whose} in another order" if sorted(names[:n]) == sorted(expected[:n]) \
        else f"has other class names than {whose}"
    raise UserError(f"{what} {how} ({_few(names)} vs {_few(expected)}): labels are class indices, so its images would "
                    f"be scored against the wrong classes; {fix}")


def balanced_indices(
    labels: torch.Tensor,
    *,
    per_class: int | None = None,
    total: int | None = None,
    classes: Sequence[int] | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """Sorted int64 indices of a seeded, class-balanced random subset: ``per_class`` images of each class, or
    ``total`` split evenly (the first ``total % k`` classes get one more); with neither, every image of ``classes``."""
    labels = torch.as_tensor(labels).cpu()
    classes = sorted(int(c) for c in (labels.unique().tolist() if classes is None else classes))
    if not classes:
        raise UserError("no classes to sample from: the data set is empty")
    if total is not None:
        if total < len(classes):
            raise UserError(f"asked for {total} images but there are {len(classes)} classes; ask for at least "
                            f"{len(classes)} so each class gets one")
        counts = [total // len(classes) + (i < total % len(classes)) for i in range(len(classes))]
    else:
        counts = [per_class] * len(classes)
    gen = torch.Generator().manual_seed(seed)
    chosen = []
    for cls, count in zip(classes, counts, strict=True):
        idx = torch.nonzero(labels == cls).flatten()
        if count is None:
            chosen.append(idx)
            continue
        if count > len(idx):
            smallest = min(int((labels == c).sum()) for c in classes)
            raise UserError(
                f"class {cls} has only {len(idx)} images, fewer than the {count} asked for; ask for at most "
                f"{smallest} per class ({smallest * len(classes)} in total)"
            )
        chosen.append(idx[torch.randperm(len(idx), generator=gen)[:count]])
    return torch.cat(chosen).sort().values.to(torch.int64)


def compute_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and population std of uint8 (N, C, H, W) images in [0, 1] units, from exact histograms."""
    values = torch.arange(256, dtype=torch.float64)
    hist = torch.stack([torch.bincount(images[:, c].reshape(-1), minlength=256) for c in range(images.shape[1])])
    hist = hist.double() / hist.sum(dim=1, keepdim=True)
    mean = hist @ values
    std = (hist @ values.square() - mean.square()).clamp_min(0).sqrt()
    return tuple((mean / 255).tolist()), tuple((std / 255).tolist())


def normalization_stats(
    dataset: str, train: ImageSet | None = None
) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """Mean/std for ``dataset``: the known values for CIFAR-10/100 and SVHN, else computed from its train split."""
    key = ALIASES[dataset].stats_key if dataset in ALIASES else _HUB_TO_STATS.get(dataset)
    if key is not None:
        return KNOWN_STATS[key]
    if train is None:
        train = load_image_set(dataset, "train")
    mean, std = compute_stats(train.images)
    return tuple(round(m, 4) for m in mean), tuple(round(s, 4) for s in std)


def normalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 (B, 3, H, W) on any device -> float32 ``(x / 255 - mean) / std``."""
    m, s = _stats_on(tuple(map(float, mean)), tuple(map(float, std)), images.device)
    return (images.float() / 255.0 - m) / s


@lru_cache(maxsize=16)
def _stats_on(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(1, C, 1, 1) float32 mean and std on ``device``, built once: no host-to-device copy per batch."""
    return tuple(torch.tensor(v, dtype=torch.float32, device=device).view(1, -1, 1, 1) for v in (mean, std))
