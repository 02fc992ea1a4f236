"""Crash-safe training checkpoints with no pickle: timm's HF export (``save_model``) and a one-file resume state
(``save_resume``: tensors in ``resume.safetensors``, the JSON part in its metadata, one atomic rename).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from timm.models import save_for_hf
from torch import nn

from .atomic import atomic_path, publish, write_json
from .pooling import export_config, option_model_args
from .records import CONFIG_FILE, MODEL_FILES

TRAINED_INPUT = {"crop_pct": 1.0, "crop_mode": "center"}  # the pixels as they are, as the tiny models' configs say


def save_model(
    out: str | os.PathLike, model: nn.Module, class_names: Sequence[str], mean: Sequence[float],
    std: Sequence[float], input_size: Sequence[int] | None = None,
) -> None:
    """Export ``model`` to ``out`` as timm's HF layout, with class names and the input training saw: mean/std,
    ``crop_pct`` 1.0 at ``input_size`` (the training images' (C, H, W)), and no source checkpoint ``tag``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model_config = {"label_names": list(class_names)} if len(class_names) == model.num_classes else None
    data_config = {"mean": tuple(mean), "std": tuple(std), **TRAINED_INPUT,
                   **({"input_size": tuple(int(s) for s in input_size)} if input_size is not None else {})}
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=".export-"))
    try:
        save_for_hf(model, tmp, model_config=model_config, model_args=option_model_args(model) or None,
                    safe_serialization=True, data_config=data_config)
        config = json.loads((tmp / CONFIG_FILE).read_text(encoding="utf-8"))
        exported = dict(export_config(config, model))
        exported["pretrained_cfg"] = {k: v for k, v in exported["pretrained_cfg"].items() if k != "tag"}
        if exported != config:  # no source tag; a stock ViT pooled by set_pooling: named so that timm rebuilds it so
            write_json(tmp / CONFIG_FILE, exported)
        for name in MODEL_FILES:
            publish(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _split_optimizer(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors, scalars = {}, {}
    for idx, per_param in state["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{idx}.{key}"] = value
            else:
                scalars[f"{idx}.{key}"] = value
    groups = []  # a tensor in a param group (timm's LAMB keeps its step there) is stored as a tensor too
    for i, group in enumerate(state["param_groups"]):
        tensors.update({f"group.{i}.{k}": v for k, v in group.items() if isinstance(v, torch.Tensor)})
        groups.append({k: v for k, v in group.items() if not isinstance(v, torch.Tensor)})
    return tensors, {"param_groups": groups, "scalars": scalars}


def save_resume(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    ema: nn.Module | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> None:
    """Atomically write everything needed to continue training into one safetensors file."""
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    if ema is not None:
        tensors.update({f"ema.{k}": v for k, v in ema.state_dict().items()})
    optim_tensors, optim_json = _split_optimizer(optimizer.state_dict())
    tensors.update(optim_tensors)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    doc = {"meta": meta, "optimizer": optim_json, "scaler": scaler.state_dict() if scaler is not None else None}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"resume": json.dumps(doc)})


def load_resume(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: nn.Module | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> dict[str, Any]:
    """Restore the states written by :func:`save_resume` in place; returns its ``meta`` dict."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        doc = json.loads(f.metadata()["resume"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}

    def part(prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

    model.load_state_dict(part("model."))
    if ema is not None:
        ema.load_state_dict(part("ema."))
    state: dict[int, dict[str, Any]] = {}
    for key, value in part("optim.").items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    for key, value in doc["optimizer"]["scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    groups = doc["optimizer"]["param_groups"]
    for group in groups:
        for k, v in group.items():
            if k != "params" and isinstance(v, list):
                group[k] = tuple(v)  # JSON turned tuples (e.g. Adam's betas) into lists
    for key, value in part("group.").items():
        idx, name = key.split(".", 1)
        groups[int(idx)][name] = value
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    if scaler is not None and doc["scaler"] is not None:
        scaler.load_state_dict(doc["scaler"])
    return doc["meta"]
