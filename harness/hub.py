"""Share a training output folder on the Hugging Face Hub: model card, upload folder, upload.

The uploaded folder holds exactly ``model.safetensors`` and ``config.json`` as the training run wrote
them with ``timm.models.save_for_hf`` (timm's format, loadable with ``hf-hub:``/``local-dir:``), plus a
``README.md`` model card. timm's ``push_to_hf_hub`` is not used for the upload because it re-serialises
the model (pickled ``.bin`` too, by default) and never replaces an existing card; its ``generate_readme``
renders the card (:func:`model_card`), to which :func:`render_card` adds the evaluation.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import HfApi, constants, get_token

from harness.metrics import METRIC_DEFAULTS, METRIC_DEFINITIONS
from harness.record import read_results
from timm_rollout import online
from timm_rollout.atomic import atomic_path, write_text
from timm_rollout.data import ALIASES
from timm_rollout.errors import UserError
from timm_rollout.explain import MAP_LABELS
from timm_rollout.pooling import OPTIONS, POOLED_ARCHITECTURE, attention_free, built_pool, pool_name
from timm_rollout.records import (
    ARGS_FILE,
    CARD_FILE,
    CONFIG_FILE,
    SUMMARY_FILE,
    WEIGHTS_FILE,
    code_label,
    code_labels,
    data_card_title,
    resolve_recorded,
    sha256_file,
)

__all__ = [
    "UPLOAD_FILES",
    "check_eval_matches",
    "describe_model",
    "model_card",
    "normalisation_mismatch",
    "prepare_upload_folder",
    "read_run",
    "render_card",
    "upload_folder",
    "write_upload_folder",
]

UPLOAD_FILES = (WEIGHTS_FILE, CONFIG_FILE, CARD_FILE)
# pickled weights left in the repo by earlier uploads (e.g. timm's push_to_hf_hub) are deleted in the same commit
PICKLE_PATTERNS = ("*.bin", "*.pth", "*.pt", "*.ckpt", "*.pkl")

# what each pooling reads out; the rollout options' meaning (their values follow on the card's pooling line)
POOLING_TEXT = {
    "token": "the final [CLS] token",
    "avg": "the mean of the final patch tokens",
    "rollout": (
        "the mean of the final patch tokens weighted by the [CLS] row of the attention rollout: each layer's "
        "attention fused over heads by rollout_head_fusion, the weakest rollout_discard_ratio of its patch-to-patch "
        "attention discarded, plus identity, row-normalised, multiplied over layers; the prefix-token columns dropped "
        "and the row renormalised; rollout_grad: whether training sent gradients through these weights"
    ),
    "map": (
        "timm's learned attention pooling (global_pool='map', AttentionPoolLatent): one learned latent query "
        "attends over the final patch tokens, followed by a projection and a residual MLP"
    ),
}
RECIPE = ("epochs", "batch_size", "opt", "lr", "weight_decay", "sched", "warmup_epochs", "min_lr", "crop_padding",
          "hflip", "smoothing", "mixup", "cutmix", "drop_path", "model_ema", "amp", "seed", "mean", "std")

ABNAR_ZUIDEMA_2020 = """@inproceedings{abnar-zuidema-2020-quantifying,
  title = {Quantifying Attention Flow in Transformers},
  author = {Abnar, Samira and Zuidema, Willem},
  booktitle = {Proceedings of the 58th Annual Meeting of the Association for Computational Linguistics (ACL)},
  year = {2020},
  pages = {4190--4197},
  doi = {10.18653/v1/2020.acl-main.385},
  eprint = {2005.00928},
  archivePrefix = {arXiv}
}"""

TIMM_CITATION = """@misc{rw2019timm,
  author = {Ross Wightman},
  title = {PyTorch Image Models},
  year = {2019},
  publisher = {GitHub},
  journal = {GitHub repository},
  doi = {10.5281/zenodo.4414861},
  howpublished = {\\url{https://github.com/huggingface/pytorch-image-models}}
}"""

LICENSE = "apache-2.0"


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); re-create the {what}") from None


def read_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The files of a training output folder that the card uses: config, train_args, summary (optional ones None)."""
    run = Path(run_dir)
    if not run.is_dir():
        raise UserError(f"run folder {run} does not exist; pass a training output folder (--output of training)")
    missing = [name for name in (WEIGHTS_FILE, CONFIG_FILE) if not (run / name).is_file()]
    if missing:
        raise UserError(
            f"{run} has no {' or '.join(missing)}; pass a finished training output folder "
            "(written by timm.models.save_for_hf)"
        )
    optional = {"train_args": run / ARGS_FILE, "summary": run / SUMMARY_FILE}
    found = {k: _read_json(p, k) if p.is_file() else None for k, p in optional.items()}
    if found["train_args"] and found["train_args"].get("dataset_resolved"):  # newer records: relative to the run
        found["train_args"]["dataset_resolved"] = resolve_recorded(found["train_args"]["dataset_resolved"], run)
    return {"config": _read_json(run / CONFIG_FILE, "model export"), **found}


def check_eval_matches(run_dir: str | os.PathLike, results: dict[str, Any]) -> None:
    """Refuse an evaluation whose recorded weights hash differs from the run's ``model.safetensors``."""
    recorded = results["model"].get("sha256")
    if recorded and recorded != sha256_file(Path(run_dir) / WEIGHTS_FILE):
        raise UserError(
            f"results.json evaluated other weights (sha256 {str(recorded)[:12]}...) than {run_dir}/{WEIGHTS_FILE}; "
            "pass the --eval folder of this run"
        )


def describe_model(model: torch.nn.Module) -> dict[str, Any]:
    """Facts of a timm model for the card, read off the model: architecture, the timm ``class`` it is or derives
    from, pooling (with the rollout options), parameter count, image size and classes, and the name timm must know
    to rebuild it (``registered_name``: None for a plain timm model); a ViT's sizes and block parts under
    ``layout``; ``vit`` False for a model that is no ViT (a CNN), its image size the one its config names."""
    from timm.layers import to_2tuple  # here, so that --help loads no timm

    from timm_rollout.models import RolloutVisionTransformer

    stock = next(c for c in type(model).__mro__ if c.__module__.startswith("timm.") or c is torch.nn.Module)
    architecture = model.pretrained_cfg.get("architecture", stock.__name__)
    facts = {"architecture": architecture, "class": stock.__name__,
             "params": sum(p.numel() for p in model.parameters()), "num_classes": model.num_classes}
    if attention_free(model) is not None:
        return {**facts, "vit": False, "study_model": False, "registered_name": None, "pooling": pool_name(model),
                "img_size": tuple(model.pretrained_cfg["input_size"][1:])}
    block = model.blocks[0]
    study = isinstance(model, RolloutVisionTransformer)
    norm, act, qkv = getattr(block, "norm1", None), getattr(block.mlp, "act", None), getattr(block.attn, "qkv", None)
    return {
        **facts,
        "study_model": study,
        "registered_name": architecture if study else POOLED_ARCHITECTURE if built_pool(model) != model.global_pool
        else None,
        "pooling": str(model.global_pool),
        **{attr: getattr(model, attr, default) for attr, default in OPTIONS.values()},
        "img_size": to_2tuple(model.patch_embed.img_size),  # an int on some (XCiT)
        "layout": {
            "patch_size": to_2tuple(model.patch_embed.patch_size),
            "embed_dim": model.embed_dim,
            "depth": len(model.blocks),
            "num_heads": block.attn.num_heads,
            "mlp_hidden": getattr(getattr(block.mlp, "fc1", None), "out_features", None),
            "block": type(block).__name__,  # timm's pre-norm Block, or another class
            "norm": type(norm).__name__ if norm is not None else None,
            "norm_eps": getattr(norm, "eps", None),
            "activation": type(act).__name__ if act is not None else None,
            "gelu_approximate": getattr(act, "approximate", None),
            "qkv_bias": (qkv.bias is not None or getattr(block.attn, "q_bias", None) is not None) if qkv is not None
            else None,
            "num_prefix_tokens": int(getattr(model, "num_prefix_tokens", 1)),
            "num_reg_tokens": int(getattr(model, "num_reg_tokens", 0) or 0),
            "norm_before_pool": not isinstance(getattr(model, "norm", None), (torch.nn.Identity, type(None))),
            "fc_norm": not isinstance(getattr(model, "fc_norm", None), (torch.nn.Identity, type(None))),
        },
    }


def _pooling(facts: dict[str, Any]) -> str:
    """The card's pooling line: the pooling's name, what it reads out and, for rollout, its options' values."""
    pooling = facts["pooling"]
    if facts.get("vit") is False:
        return f"{pooling}: timm global pooling {pooling!r} of its final feature map"
    text = f"{pooling}: {POOLING_TEXT.get(pooling, f'timm global pooling {pooling!r}')}"
    if pooling == "rollout":
        text += ". This model: " + ", ".join(f"{attr}={facts[attr]!r}" for attr, _ in OPTIONS.values())
    return text


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _is_local(dataset: str) -> bool:
    return dataset.startswith((".", "/", "~")) or ("/" in dataset and Path(dataset).exists())


def _hub_dataset(train_args: dict[str, Any]) -> str | None:
    """The Hub data set a run trained on (the card's ``datasets:``), or None for a local one. Where training found
    it (``dataset_resolved``: an absolute path for a local folder) decides; a local folder named as an alias of
    a Hub set (``../data/cifar10``) is a copy of that set."""
    dataset = str(train_args.get("dataset") or "")
    where = str(train_args.get("dataset_resolved") or dataset)
    if dataset in ALIASES:
        return None if Path(ALIASES[dataset].path).is_absolute() else dataset
    if Path(where).is_absolute() or _is_local(where):
        name = Path(where).name
        return name if name in ALIASES and not Path(ALIASES[name].path).is_absolute() else None
    return where or None


def _dataset_arg(train_args: dict[str, Any]) -> str:
    """The ``--dataset`` that evaluates the model on the data it was trained on, for a card's reader."""
    dataset = str(train_args.get("dataset") or "")
    if not dataset:
        return "DATASET"
    if dataset in ALIASES:
        return dataset
    return _hub_dataset(train_args) or f"PATH/{Path(str(train_args.get('dataset_resolved') or dataset)).name}"


def _recipe(train_args: dict[str, Any]) -> dict[str, str]:
    """The card's training recipe: the run's training flags and image counts as train_args.json names them; the
    warmup is the one the run used (``--warmup-epochs`` clipped to its length)."""
    used = train_args.get("warmup_epochs_used")
    train_args = {**train_args, **({"warmup_epochs": used} if used is not None else {})}
    keys = [*RECIPE, *(k for k in train_args if "images" in k or "samples" in k)]
    return {k: _fmt(train_args[k]) for k in keys if train_args.get(k) is not None}


def normalisation_mismatch(config: dict[str, Any], train_args: dict[str, Any] | None) -> str | None:
    """Why the exported mean/std differ from those training used (None when they agree or are unknown)."""
    saved = config.get("pretrained_cfg") or {}
    for key in ("mean", "std"):
        used, exported = (train_args or {}).get(key), saved.get(key)
        if used is not None and exported is not None and [round(float(v), 4) for v in used] != [
            round(float(v), 4) for v in exported
        ]:
            return f"config.json {key} {exported} differs from the training {key} {used}"
    return None


def model_card(
    repo_id: str,
    facts: dict[str, Any],
    train_args: dict[str, Any] | None = None,
    summary: dict[str, Any] | None = None,
    selection: str | None = None,
) -> dict[str, Any]:
    """A card in the dict format of timm's ``generate_readme``, which renders it (metadata, description, details,
    usage, citations); ``selection`` says how the run was picked among several (e.g. the seeds of a study arm)."""
    train_args = train_args or {}
    vit = facts.get("vit") is not False
    layout = {k: v for k, v in facts.get("layout", {}).items() if v is not None}
    details: dict[str, Any] = {
        "Model Type": "Image classification / feature backbone",
        "Architecture": {"name": facts["architecture"], "timm class": facts["class"], **layout},
        "Pooling": _pooling(facts),
        "Params (M)": f"{facts['params'] / 1e6:.3f}",
        "Image size": "x".join(str(s) for s in facts["img_size"]),
        "Classes": facts["num_classes"],
        "License": f"{LICENSE} (the weights; the training images keep their own terms)",
    }
    if selection:
        details["Selection"] = selection
    hub_set = _hub_dataset(train_args)
    where = str(train_args.get("dataset_resolved") or train_args.get("dataset") or "")
    if hub_set:
        details["Dataset"] = hub_set
    elif where:  # not a Hub data set: kept out of the card's `datasets:` metadata
        title = data_card_title(where) if Path(where).is_dir() else None
        details["Training data"] = f"a local data set folder, {Path(where).name}" + (f" ({title})" if title else "")
    if recipe := _recipe(train_args):
        details["Training recipe"] = recipe
    if summary:
        split = train_args.get("eval_split") or "evaluation"
        details[f"Training summary (summary.json; train_loss and eval_* of the last epoch, eval_* on the {split} "
                f"split, top-1/top-5 in %; best_eval_top1: the highest {split}-split top-1 of any epoch, picked on "
                "that split, so optimistic, not a held-out figure)"] = {
            k: _fmt(v) for k, v in summary.items() if isinstance(v, (int, float, str))}
    if isinstance(train_args.get("versions"), dict):
        details["Software"] = train_args["versions"]
    epochs = "; ".join(f"{label}: {n} epochs" for label, n in ((summary or {}).get("code") or {}).items())
    details["Code"] = {"training": epochs or code_labels([train_args]), "card": code_label()}
    return {
        "tags": ["image-classification", "timm", *(["vision-transformer", "attention-rollout"] if vit else [])],
        "license": LICENSE,
        "description": _description(facts, details["Image size"], train_args),
        "details": details,
        "usage": _usage(repo_id, _dataset_arg(train_args), facts),
        "citation": [*([ABNAR_ZUIDEMA_2020] if vit else []), TIMM_CITATION],
    }


def _description(facts: dict[str, Any], size: str, train_args: dict[str, Any]) -> str:
    """What the model is: a study arm (the tiny models), or the stock timm ViT (or other model) that was trained, and
    from what."""
    pooled = f"classifies from its {facts['pooling']} pooling (see Pooling)"
    if facts.get("study_model"):
        return (f"A tiny Vision Transformer for {size} images that {pooled}. It is one arm of the timm-rollout study "
                "(does attention-rollout pooling help a tiny ViT?): [CLS] token, patch mean, rollout-weighted patch "
                "tokens and learned attention pooling, differing only in pooling.")
    start = ("fine-tuned from pretrained weights" if train_args.get("pretrained_file") else
             "trained from random initialisation" if "pretrained_file" in train_args else "trained")
    kind = "Vision Transformer" if facts.get("vit") is not False else facts["class"]
    return (f"timm's {facts['architecture']} {kind} ({facts['params'] / 1e6:.1f}M parameters), built for "
            f"{size} images, {start} with timm-rollout; it {pooled}.")


def _import_text(facts: dict[str, Any]) -> tuple[str, str]:
    """(sentence, import line) of the usage: what importing ``timm_rollout`` gives timm for this model."""
    name = facts.get("registered_name")
    if facts.get("study_model"):
        return ("The architecture lives in the `timm_rollout` package: import it before creating the model, so that\n"
                "timm knows `vit_tiny_cifar_cls` / `vit_tiny_cifar_gap` / `vit_tiny_cifar_rollout`.",
                "import timm_rollout  # registers the architecture with timm")
    if name == POOLED_ARCHITECTURE:
        arch, pool = facts["architecture"], facts["pooling"]
        return (f"The model is timm's `{arch}` pooled with `{pool}`, unlike the layout it was built with. Its\n"
                f"`config.json` names it `{name}`, which the `timm_rollout` package registers: import it before\n"
                f"creating the model, and timm builds `{arch}` with these weights and its `{pool}` pooling\n"
                f"(`timm_rollout.set_pooling`). Without the import, timm stops at `Unknown model ({name})`.",
                f"import timm_rollout  # registers {name}: {arch} pooled by {pool}")
    return (f"A plain timm `{facts['architecture']}`: timm alone rebuilds it (`timm_rollout` runs the harness).", "")


def _usage(repo_id: str, dataset: str, facts: dict[str, Any]) -> str:
    sentence, line = _import_text(facts)
    imports = "\n".join(["import timm", "import torch", "from PIL import Image", *([line] if line else [])])
    return f"""{sentence}

```python
{imports}

model = timm.create_model("hf-hub:{repo_id}", pretrained=True).eval()
transform = timm.data.create_transform(**timm.data.resolve_data_config({{}}, model=model))
labels = model.pretrained_cfg.get("label_names")
img = Image.open("image.png").convert("RGB")  # 3-channel RGB, as in training (grayscale, palette, RGBA too)

with torch.no_grad():
    probs = model(transform(img).unsqueeze(0)).softmax(-1)
    features = model.forward_head(model.forward_features(transform(img).unsqueeze(0)), pre_logits=True)
```

Evaluate it with the project's harness on the data it was trained on: `python -m harness.eval --model
hf-hub:{repo_id} --dataset {dataset}`.
"""


def _evaluation(results: dict[str, Any]) -> str:
    metrics, data = results["metrics"], results.get("data", {})
    config = {k: v for k, v in results.get("config", {}).items() if k in METRIC_DEFAULTS and v is not None}
    params = {**METRIC_DEFAULTS, **config}
    rows = []
    for key, definition in METRIC_DEFINITIONS.items():  # a <map>_ key defines that metric of every saliency map
        suffix = key.removeprefix("<map>")
        found = [f"{m}{suffix}" for m in MAP_LABELS if f"{m}{suffix}" in metrics] if suffix != key else [key]
        rows += [f"| {k} | {_fmt(metrics[k])} | {definition.format(**params, map=k.removesuffix(suffix))} |"
                 for k in found if metrics.get(k) is not None]
    if data.get("mask_convention") == "foreground":  # 0 is all that is not the object: background, not clutter
        rows = [row.replace("clutter", "background") for row in rows]
    if data.get("dataset") and _is_local(str(data["dataset"])):  # a local folder: by its name
        data = {**data, "dataset": Path(str(data["dataset"])).name}
    named = (("dataset", "data set"), ("split", "split"), ("num_images", "images:"))
    where = ", ".join(f"{label} {data[key]}" for key, label in named if data.get(key) is not None)
    text = "\n## Evaluation\n\n"
    text += "Metrics of `python -m harness.eval`" + (f" ({where})" if where else "") + f" by {code_labels([results])}, "
    text += "computed on the L2-normalised pooled features `forward_head(forward_features(x), pre_logits=True)`.\n\n"
    if rows:
        text += "| Metric | Value | Definition |\n|---|---|---|\n" + "\n".join(rows) + "\n"
    else:
        text += "results.json holds none of the harness metrics.\n"
    return text


def render_card(card: dict[str, Any], repo_id: str, results: dict[str, Any] | None = None) -> str:
    """README.md text: timm's ``generate_readme`` of the card, the evaluation of ``results`` (if any) before the
    citations."""
    from timm.models._hub import generate_readme

    text = generate_readme(card, repo_id.split("/")[-1])
    if results is None:
        return text
    head, citation, citations = text.partition("\n## Citation\n")
    return head + _evaluation(results) + citation + citations


def prepare_upload_folder(run_dir: str | os.PathLike, out_dir: str | os.PathLike, readme: str) -> list[Path]:
    """Write the exact upload folder: the run's weights and config, and the card. Returns the files, sorted."""
    run, out = Path(run_dir).resolve(), Path(out_dir).resolve()
    if out == run:
        raise UserError("the upload folder must differ from the run folder; choose another --output")
    if out.is_dir():
        others = sorted(p.name for p in out.iterdir() if p.name not in UPLOAD_FILES)
        if others:
            raise UserError(f"{out} already holds other files ({', '.join(others[:5])}); choose an empty --output")
    out.mkdir(parents=True, exist_ok=True)
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        with atomic_path(out / name) as tmp:
            shutil.copyfile(run / name, tmp)
    write_text(out / CARD_FILE, readme)
    return sorted(out / name for name in UPLOAD_FILES)


def upload_folder(folder: str | os.PathLike, repo_id: str, private: bool = False, commit_message: str = "") -> str:
    """Create ``repo_id`` if needed and upload ``folder`` to it, deleting pickled weights; returns the repo URL.

    Offline mode and a missing token are one-line errors before any request; so is any failure of the Hub.
    """
    if constants.HF_HUB_OFFLINE:
        raise UserError("HF_HUB_OFFLINE is set: unset it to upload, or use --dry-run --output DIR to write the folder")
    if not online.hub_reachable():
        raise UserError(f"the Hub ({constants.ENDPOINT}) is unreachable; check the network, or use --dry-run --output "
                        "DIR to write the folder")
    token = get_token()
    if not token:
        raise UserError("no Hugging Face token: run `hf auth login` or set HF_TOKEN (a token with write access)")
    api = HfApi(token=token, library_name="timm-rollout")
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(
            repo_id=url.repo_id,
            folder_path=str(folder),
            commit_message=commit_message or "Upload model",
            delete_patterns=list(PICKLE_PATTERNS),
        )
    except Exception as e:  # network, auth, permission, rate limit: nothing local to debug
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(
            f"upload to {repo_id} failed ({type(e).__name__}: {reason}); check the network, the token's write "
            "access and the repo id"
        ) from e
    return str(url)


def write_upload_folder(run_dir: str | os.PathLike, out_dir: str | os.PathLike, repo_id: str,
                        eval_dir: str | os.PathLike | None = None, selection: str | None = None,
                        ) -> tuple[list[Path], str]:
    """The upload folder of a training run for ``repo_id``: weights, config and a model card (with the metrics of
    ``eval_dir``'s results.json, which must have evaluated these weights; ``selection``: how this run was picked
    among others). The card's architecture facts come from the run loaded as ``local-dir:``. Returns the files and
    the architecture."""
    run = Path(run_dir)
    record = read_run(run)
    results = read_results(eval_dir) if eval_dir else None
    if results is not None:
        check_eval_matches(run, results)
    if record["summary"] is None:
        print(f"warning: {run} has no summary.json (unfinished run?); the card has no final metrics", file=sys.stderr)
    mismatch = normalisation_mismatch(record["config"], record["train_args"])
    if mismatch:
        print(f"warning: {mismatch}; timm's transforms for this model will use config.json's", file=sys.stderr)
    from timm_rollout.loading import load_model

    facts = describe_model(load_model(f"local-dir:{run.resolve()}")[0])
    card = model_card(repo_id, facts, record["train_args"], record["summary"], selection)
    return prepare_upload_folder(run, out_dir, render_card(card, repo_id, results)), facts["architecture"]
