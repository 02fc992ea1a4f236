"""Build a timm model and load its weights, with one-line errors for every user mistake.

``model`` is a registered timm name, ``hf-hub:org/name`` or ``local-dir:PATH``; ``checkpoint`` is a
``.safetensors`` file or a ``save_for_hf`` folder (e.g. a training output folder). Parameter names and shapes are
checked before ``timm.models.load_checkpoint``, so a mismatch is named. Pickled checkpoints are never unpickled.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import zipfile
from pathlib import Path
from typing import Any

import timm
import torch
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError
from safetensors import SafetensorError, safe_open
from timm.layers import PatchEmbed
from timm.models import load_checkpoint, parse_model_name
from torch import nn

from .cli import kwarg
from .errors import UserError
from .models import record_input_size
from .online import hub_or_cache
from .pooling import POOLED_ARCHITECTURE, STOCK_ARCHITECTURE, pool_name, stock_architecture
from .records import CONFIG_FILE, RESUME_FILE, WEIGHTS_FILE, sha256_file

PICKLE_SUFFIXES = (".pth", ".pt", ".bin", ".tar", ".ckpt", ".pkl")
CONVERT_HINT = "convert it with scripts/convert_checkpoint.py (pickled checkpoints are never loaded)"
# Reconstruction arguments that describe the head/pooling rather than the architecture.
_HEAD_ARGS = ("num_classes", "global_pool")


def _check_registered(name: str) -> None:
    if timm.is_model(name):
        return
    close = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; list them with timm.list_models()"
    raise UserError(f"unknown model {name!r}{hint}")


def _rejected(arch: str, kwargs: dict[str, Any], error: Exception, fix: str = "fix or drop the model arguments",
              lead: str | None = None) -> UserError:
    """The error for model arguments ``arch`` rejects: ending with ``fix``, or ``lead`` (a fix first) and the reason."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if lead:
        return UserError(f"{lead} ({reason})")
    shown = {k: v for k, v in kwargs.items() if k not in ("pretrained", "pretrained_cfg_overlay")}
    return UserError(f"{arch} cannot be built with {shown} ({reason}); {fix}")


_SIZE_MISMATCH = re.compile(r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from "
                            r"checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)")
_KEYS = re.compile(r"(Missing|Unexpected) key\(s\) in state_dict: \"([^\"]+)\"")


def _weights_mismatch(error: Exception) -> str | None:
    """What torch's ``load_state_dict`` reports first in ``error``: a parameter's shapes in the weights and the
    model, or a parameter only one of them has; None when ``error`` is no such report."""
    text = str(error)
    if "Error(s) in loading state_dict" not in text:
        return None
    size, key = _SIZE_MISMATCH.search(text), _KEYS.search(text)
    if size:
        return f"their shapes differ (e.g. {size.group(1)}: {size.group(2)} in the weights, {size.group(3)} in the " \
               "model)"
    if key:
        held, lacks = ("model", "weights") if key.group(1) == "Missing" else ("weights", "model")
        return f"their parameters differ (e.g. {key.group(2)} is in the {held}, not in the {lacks})"
    return "their parameters differ"


def create_model(arch: str, fix: str = "fix or drop the model arguments",
                 weights_fix: str = "pass weights of this model", lead: str | None = None, **kwargs: Any) -> nn.Module:
    """``timm.create_model`` for a registered ``arch``; arguments the model rejects are a one-line UserError ending
    with ``fix`` (or starting with ``lead``: :func:`_rejected`), and pretrained weights (``pretrained=True``) that do
    not fit the model one ending with ``weights_fix``."""
    try:
        net = timm.create_model(arch, **kwargs)
    except (TypeError, ValueError, AssertionError, RuntimeError) as e:
        mismatch = _weights_mismatch(e)
        if mismatch is not None and kwargs.get("pretrained"):
            shown = {k: v for k, v in kwargs.items() if k not in ("pretrained", "pretrained_cfg_overlay")}
            raise UserError(f"the pretrained weights do not fit {arch} built with {shown}: {mismatch}; {weights_fix}"
                            ) from None
        raise _rejected(arch, kwargs, e, fix, lead) from None
    record_input_size(net)
    return net


def check_input_size(model: nn.Module, images: torch.Tensor, fix: str) -> None:
    """A one-line error when a fixed-size model cannot take the data set's (N, C, H, W) ``images`` (``fix`` ends it),
    or when its patches do not tile them (:func:`_check_patches`)."""
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    built = getattr(getattr(model, "patch_embed", None), "img_size", None)  # timm ViTs: the size it was built for
    want = tuple(built) if built is not None else tuple(cfg.get("input_size", ())[1:])
    got = tuple(images.shape[-2:])
    if cfg.get("fixed_input_size") and want and want != got:
        raise UserError(f"the data set's images are {got[0]}x{got[1]} but {cfg.get('architecture')} takes "
                        f"{want[0]}x{want[1]}; {fix}")
    _check_patches(model, got)


def _check_patches(model: nn.Module, size: tuple[int, int]) -> None:
    """A one-line error when a timm patch embedding's patches do not tile images of ``size`` (H, W): its conv would
    see only their top-left part (or pad them), so no patch map, heatmap or localisation metric would line up with
    the image."""
    embed = getattr(model, "patch_embed", None)
    if not isinstance(embed, PatchEmbed):
        return
    (h, w), (ph, pw) = size, tuple(embed.patch_size)
    if h % ph == 0 and w % pw == 0:
        return
    if getattr(embed, "dynamic_img_pad", False):
        seen = f"pads them to {-(-h // ph) * ph}x{-(-w // pw) * pw}"
    else:
        seen = f"sees only their top-left {h // ph * ph}x{w // pw * pw} pixels"
    fits = [min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - p), -d))  # the nearest divisor
            for n, p in ((h, ph), (w, pw))]
    raise UserError(f"patch size {ph}x{pw} does not divide the {h}x{w} images: the patch embedding {seen}, so no map "
                    f"or localisation metric would line up with the image; use a patch size that divides them (e.g. "
                    f"{kwarg('patch_size', fits)})")


def check_model(name: str, kwargs: dict[str, Any] | None = None) -> None:
    """Fail fast on a model name or model arguments that timm rejects, built on the meta device (failures only
    the meta device causes are left to the real build); ``hf-hub:`` names are checked when they are loaded."""
    try:
        source, model_id = parse_model_name(name)
    except ValueError as e:
        raise UserError(str(e)) from None
    if source == "local-dir":
        if not (Path(model_id) / CONFIG_FILE).is_file():
            raise UserError(f"local-dir:{model_id} is not a folder with {CONFIG_FILE}; pass a training output folder")
        return
    if source is not None:
        return
    _check_registered(model_id)
    kwargs = kwargs or {}
    try:
        with torch.device("meta"):
            timm.create_model(model_id, **kwargs)
    except (TypeError, ValueError, AssertionError) as e:
        raise _rejected(model_id, kwargs, e) from None
    except (RuntimeError, NotImplementedError):
        pass


def _hub_folder(repo: str) -> Path:
    """Local snapshot folder holding ``config.json`` and ``model.safetensors`` of a Hub repo (cache first)."""
    from timm.models._hub import download_from_hf

    try:
        with hub_or_cache():
            config = download_from_hf(repo, CONFIG_FILE)
            download_from_hf(repo, WEIGHTS_FILE)
    except LocalEntryNotFoundError:
        raise UserError(
            f"hf-hub:{repo} is not in the local Hugging Face cache and the Hub is unreachable (offline); "
            "download it where there is network or use local-dir:PATH"
        ) from None
    except RepositoryNotFoundError:
        raise UserError(f"hf-hub:{repo} does not exist on the Hub (or is private); check the repo id") from None
    except EntryNotFoundError:
        raise UserError(f"hf-hub:{repo} lacks {CONFIG_FILE} or {WEIGHTS_FILE} (timm safetensors export)") from None
    return Path(config).parent


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        _weights_in(folder)  # no weights either: say what the folder holds
        raise UserError(f"{folder} has no {CONFIG_FILE}; pass its {WEIGHTS_FILE} file as the checkpoint") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); re-export the model with timm.models.save_for_hf") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} holds a JSON {type(config).__name__}, not a timm config; re-export the model with "
                        "timm.models.save_for_hf")
    return config


def _weights_in(folder: Path) -> Path:
    weights = folder / WEIGHTS_FILE
    if weights.is_file():
        return weights
    pickles = sorted(p.name for p in folder.iterdir() if p.name.lower().endswith(PICKLE_SUFFIXES))
    if pickles:
        raise UserError(f"{folder} holds only pickled weights ({', '.join(pickles)}); {CONVERT_HINT}")
    raise UserError(f"{folder} has no {WEIGHTS_FILE}; {_what_is_in(folder)}")


def _what_is_in(folder: Path, shown: int = 3) -> str:
    """What a folder without ``model.safetensors`` holds instead, and what to pass: its run folders, its other
    safetensors files, or a training output folder or ``.safetensors`` file from elsewhere."""
    runs = sorted(p for p in folder.iterdir() if (p / WEIGHTS_FILE).is_file())
    files = sorted(p for p in folder.iterdir() if p.suffix == ".safetensors" and p.name != RESUME_FILE and p.is_file())

    def listed(paths: list[Path]) -> str:
        return ", ".join(map(str, paths[:shown])) + (f" and {len(paths) - shown} more" if len(paths) > shown else "")

    if runs:
        return f"it holds folders that do: pass one of them ({listed(runs)})"
    if files:
        return f"it holds {listed(files)}: pass {'that file' if len(files) == 1 else 'one of those files'} itself"
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    held = f"it holds {', '.join(entries[:5])}{' ...' if len(entries) > 5 else ''}, no weights" if entries \
        else "it is empty"
    return f"{held}; pass a training output folder ({WEIGHTS_FILE} + {CONFIG_FILE}) or a .safetensors file"


def _resolve_checkpoint(checkpoint: str | Path) -> tuple[Path, dict[str, Any] | None]:
    """(weights file, timm config or None) for a checkpoint file or folder."""
    path = Path(checkpoint)
    if path.is_dir():
        return _weights_in(path), _read_config(path)
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist; pass a .safetensors file or a training output folder")
    if path.name.lower().endswith(PICKLE_SUFFIXES):
        raise UserError(f"{path} is a pickled checkpoint; {CONVERT_HINT}")
    if path.suffix != ".safetensors":
        raise UserError(f"checkpoint {path} is not a .safetensors file; pass a .safetensors file or a folder")
    return path, None


def pretrained_overlay(path: str | Path) -> dict[str, Any]:
    """``pretrained_cfg_overlay`` that makes ``timm.create_model(..., pretrained=True)`` start from local weights (a
    safetensors file or folder, or a timm checkpoint read weights-only), adapted by timm as Hub weights are."""
    path = Path(path)
    if path.is_dir() or path.suffix == ".safetensors":
        file = _resolve_checkpoint(path)[0]
        _checkpoint_shapes(file)  # a readable safetensors file, or a one-line error
        state = timm.models.load_state_dict(str(file))
    else:
        if not _torch_file(path):
            raise UserError(f"{path} is not a weights file; pass a .safetensors file, a training output folder or a "
                            "timm checkpoint (.pth, .pt)")
        try:
            state = timm.models.load_state_dict(str(path), weights_only=True)
        except Exception as e:  # any failure to parse the file (read weights-only, never unpickled)
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"{path} is not a weights-only checkpoint ({reason[:120]}); {CONVERT_HINT}") from None
    heads = [v.shape[0] for k, v in state.items() if k.endswith("head.weight") and v.dim() == 2]
    return {"state_dict": state, **({"num_classes": heads[-1]} if heads else {})}


def _torch_file(path: Path) -> bool:
    """Whether ``path`` is laid out as ``torch.save`` writes (a zip archive, or a legacy pickle stream); read by its
    first bytes only, never unpickled."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return zipfile.is_zipfile(f) or f.read(1) == b"\x80"


def pretrained_config(path: str | Path, arch: str) -> dict[str, Any]:
    """What the weights at ``path`` were trained with: the ``model_args``, (stock) ``architecture`` and
    ``mean``/``std`` of their run's config (a folder's ``config.json``, or the one beside a weights file), else
    ``arch``'s registered mean/std (and no architecture)."""
    path = Path(path)
    config = (_read_config(path) if path.is_dir() else _config_beside(path)) or {}
    saved, registered = config.get("pretrained_cfg") or {}, timm.models.get_pretrained_cfg(arch)
    stats = {}
    if "mean" in saved and "std" in saved:
        stats = {"mean": tuple(saved["mean"]), "std": tuple(saved["std"])}
    elif registered is not None:
        stats = {"mean": tuple(registered.mean), "std": tuple(registered.std)}
    return {"model_args": dict(config.get("model_args") or {}), "architecture": stock_architecture(config), **stats}


def _checkpoint_shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    """Parameter shapes from the safetensors header; fails cleanly on corrupt or truncated files."""
    try:
        with safe_open(str(weights), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except SafetensorError as e:
        raise UserError(f"{weights} is not a readable safetensors file ({e}); re-save or re-download it") from None


def _check_match(model: nn.Module, shapes: dict[str, tuple[int, ...]], name: str, weights: Path,
                 config: dict[str, Any] | None) -> None:
    """One-line description of every way the checkpoint's parameters differ from the model's."""
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(own.keys() - shapes.keys())
    unexpected = sorted(shapes.keys() - own.keys())
    resized = [f"{k} {shapes[k]} vs {own[k]}" for k in sorted(own.keys() & shapes.keys()) if own[k] != shapes[k]]
    problems = []
    if missing:
        problems.append(f"{len(missing)} parameters missing from the checkpoint (e.g. {', '.join(missing[:3])})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected in it (e.g. {', '.join(unexpected[:3])})")
    if resized:
        problems.append(f"shapes differ (checkpoint vs model): {'; '.join(resized[:3])}")
    if not problems:
        return
    trained = (config or {}).get("architecture")
    if trained and trained != name:
        counts = ", ".join(f"{len(k)} {what}" for k, what in ((missing, "missing"), (unexpected, "unexpected"),
                                                               (resized, "of other shapes")) if k)
        raise UserError(f"pass --model {trained} (or local-dir:{weights.parent}): --checkpoint {weights.parent} was "
                        f"saved as {trained}, whose parameters {name} does not have ({counts})")
    raise UserError(f"checkpoint {weights} does not match {name}: {'; '.join(problems)}; pass the training folder "
                    "that holds it (its config.json builds the model), or the --model (and --model-kwargs, where the "
                    "command has them) it was trained with")


def _as_trained(arch: str, config: dict[str, Any] | None) -> str:
    """``arch``, or the architecture the checkpoint's config names when that is ``arch`` rollout-pooled
    (:data:`~timm_rollout.pooling.POOLED_ARCHITECTURE`): a stock ViT's own checkpoint builds the model it trained."""
    config = config or {}
    stock = (config.get("model_args") or {}).get(STOCK_ARCHITECTURE)
    return POOLED_ARCHITECTURE if config.get("architecture") == POOLED_ARCHITECTURE and stock == arch else arch


def _model_args(config: dict[str, Any] | None, arch: str) -> dict[str, Any]:
    """Architecture arguments saved in the checkpoint's config; head arguments only for its own architecture
    (the pooling of ``model_args``, where timm recorded the one it was built with, else the top-level one)."""
    if not config:
        return {}
    args = dict(config.get("model_args") or {})
    pool = args.get("global_pool", config.get("global_pool"))
    for key in _HEAD_ARGS:
        args.pop(key, None)
    if config.get("architecture") == arch and pool is not None:
        args["global_pool"] = pool
    if "img_size" in args:
        args["img_size"] = tuple(args["img_size"]) if isinstance(args["img_size"], list) else args["img_size"]
    return args


def _cfg_overlay(config: dict[str, Any] | None, num_classes: int) -> dict[str, Any]:
    """pretrained_cfg entries carried by the checkpoint (mean/std, input, label names) for the built model."""
    overlay: dict[str, Any] = {"num_classes": num_classes}
    if not config:
        return overlay
    saved = config.get("pretrained_cfg") or {}
    for key in ("mean", "std", "interpolation", "crop_pct", "crop_mode", "input_size"):
        if key in saved:
            overlay[key] = tuple(saved[key]) if isinstance(saved[key], list) else saved[key]
    labels = config.get("label_names") or saved.get("label_names")
    if labels is not None:
        overlay["label_names"] = list(labels.values()) if isinstance(labels, dict) else list(labels)
    return overlay


def _resolve_source(model: str, checkpoint: str | Path | None) -> tuple[str, dict[str, Any] | None, Path | None]:
    """(architecture, timm config or None, weights file or None) for a model name and optional checkpoint."""
    try:
        source, model_id = parse_model_name(model)
    except ValueError as e:
        raise UserError(str(e)) from None
    config: dict[str, Any] | None = None
    weights: Path | None = None
    if source is None:
        arch = model_id
    else:
        folder = _hub_folder(model_id) if source == "hf-hub" else Path(model_id)
        if not folder.is_dir():
            raise UserError(f"local-dir:{model_id} is not a folder; pass one holding {CONFIG_FILE} + {WEIGHTS_FILE}")
        config = _read_config(folder)
        arch = str(config.get("architecture") or "")
        if not arch:
            raise UserError(f"{folder / CONFIG_FILE} names no architecture; re-export with timm.models.save_for_hf")
        if checkpoint is None:
            weights = _weights_in(folder)
    _check_registered(arch)
    if checkpoint is not None:
        weights, config = _checkpoint_for(model, arch, config, checkpoint)
    return arch, config, weights


def _checkpoint_for(model: str, arch: str, own: dict[str, Any] | None,
                    checkpoint: str | Path) -> tuple[Path, dict[str, Any] | None]:
    """(weights file, config to build with) for ``checkpoint`` loaded into ``model``: the checkpoint's (or its run
    folder's) config, else ``own`` (the config of an ``hf-hub:``/``local-dir:`` name), which it must match."""
    weights, config = _resolve_checkpoint(checkpoint)
    folder = Path(checkpoint) if config is not None else weights.parent
    trained = config if config is not None else _config_beside(weights)
    if own is None:
        return weights, trained
    if trained is not None and _built_as(trained) != _built_as(own):
        raise UserError(f"{model} is {_built_as(own)[0]} but --checkpoint {checkpoint} was trained as "
                        f"{_built_as(trained)[0]} (architecture, model arguments or pooling differ); evaluate "
                        f"it as local-dir:{folder}, or as --model {arch} --checkpoint {folder} for "
                        f"a readout with {arch}'s own pooling")
    return weights, trained or own


def _config_beside(weights: Path) -> dict[str, Any] | None:
    """The timm config in a weights file's folder (a run folder), or None when it has none."""
    return _read_config(weights.parent) if (weights.parent / CONFIG_FILE).is_file() else None


def _built_as(config: dict[str, Any]) -> tuple[str, dict[str, Any], Any]:
    """What a timm config builds: architecture, model arguments other than the class count, and pooling."""
    args = {k: v for k, v in (config.get("model_args") or {}).items() if k != "num_classes"}
    return str(config.get("architecture")), args, config.get("global_pool")


def _classifier(arch: str, config: dict[str, Any] | None) -> str:
    """The classifier's module name: the checkpoint config's, else the registered architecture's, else ``head``."""
    saved = ((config or {}).get("pretrained_cfg") or {}).get("classifier")
    registered = timm.models.get_pretrained_cfg(arch)
    return saved or (registered.to_dict().get("classifier") if registered is not None else None) or "head"


def _config_fix(arch: str, config: dict[str, Any] | None, weights: Path | None,
                from_config: list[str]) -> tuple[str, str | None]:
    """The end of the error for model arguments ``arch`` rejects (where those not typed by the caller come from: the
    checkpoint's config), or for a checkpoint saved with another model, the error's start (the model to load)."""
    if not from_config:
        return "fix or drop the model arguments", None
    folder = weights.parent if weights is not None else Path("RUN")
    trained = stock_architecture(config or {})
    if trained and trained != arch:
        return "", (f"pass --model local-dir:{folder} (or --model {trained}): --checkpoint {folder} was saved with "
                    f"{trained}, whose model arguments {arch} does not take")
    return (f"the model arguments {from_config} come from the checkpoint's config, {folder / CONFIG_FILE}; re-export "
            "the model with timm.models.save_for_hf"), None


def build_meta(model: str, checkpoint: str | Path | None = None) -> nn.Module | None:
    """The model :func:`load_model` builds for ``model`` and ``checkpoint``, on the meta device and without weights:
    what it is, known before any work; None where timm cannot build it there (:func:`load_model` then says why)."""
    arch, config, _ = _resolve_source(model, checkpoint)
    arch = _as_trained(arch, config)
    try:
        with torch.device("meta"):
            return timm.create_model(arch, **_model_args(config, arch))
    except (TypeError, ValueError, AssertionError, RuntimeError, NotImplementedError):
        return None


def load_model(
    model: str,
    checkpoint: str | Path | None = None,
    *,
    num_classes: int | None = None,
    device: str | torch.device = "cpu",
    **model_kwargs: Any,
) -> tuple[nn.Module, dict[str, Any]]:
    """Build ``model`` in eval mode on ``device``, with ``checkpoint``'s weights if given (the class count from
    its head); returns the model and its provenance (paths, sha256, class count, label names, mean and std)."""
    arch, config, weights = _resolve_source(model, checkpoint)
    saved = _model_args(config, arch := _as_trained(arch, config))
    kwargs = {**saved, **model_kwargs}
    shapes = None
    if weights is not None:
        shapes = _checkpoint_shapes(weights)
        found = shapes.get(f"{_classifier(arch, config)}.weight", (None,))[0]
        if num_classes is not None and found is not None and found != num_classes:
            raise UserError(
                f"checkpoint has {found} classes, model built with {num_classes}; "
                f"pass --num-classes {found} or drop it"
            )
        num_classes = found if found is not None else num_classes
    if num_classes is not None:
        kwargs["num_classes"] = num_classes

    fix, lead = _config_fix(arch, config, weights, sorted(set(saved) - set(model_kwargs)))
    net = create_model(arch, fix, lead=lead, pretrained=False,
                       pretrained_cfg_overlay=_cfg_overlay(config, num_classes), **kwargs)
    if weights is not None:
        _check_match(net, shapes, arch, weights, config)
        load_checkpoint(net, str(weights), strict=True)
    net = net.to(device).eval()

    info = module_info(net, model, arch, sha256_file(weights) if weights is not None else None)
    return net, {**info, "checkpoint": str(checkpoint) if checkpoint is not None else None,
                 "weights": str(weights) if weights is not None else None,
                 "checkpoint_architecture": (config or {}).get("architecture"),
                 "model_args": {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}}


def module_info(net: nn.Module, name: str | None = None, architecture: str | None = None,
                sha256: str | None = None) -> dict[str, Any]:
    """A model's provenance as :func:`load_model` records it; for a model object (no ``sha256`` of a file), the
    sha256 of its weights: each tensor's name, dtype, shape and bytes in ``state_dict`` order."""
    cfg = net.pretrained_cfg
    architecture = architecture or cfg.get("architecture") or type(net).__name__
    if sha256 is None and name is None:
        digest = hashlib.sha256()
        for key, tensor in net.state_dict().items():
            flat = tensor.detach().cpu().contiguous().reshape(-1)
            digest.update(f"{key}\0{flat.dtype}\0{tuple(tensor.shape)}\0".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        sha256 = digest.hexdigest()
    return {"name": name or architecture, "architecture": architecture, "checkpoint": None, "weights": None,
            "sha256": sha256, "checkpoint_architecture": None, "num_classes": int(net.num_classes),
            "global_pool": pool_name(net), "model_args": {}, "label_names": cfg.get("label_names"),
            "mean": list(cfg["mean"]), "std": list(cfg["std"]), "input_size": list(cfg["input_size"])}
