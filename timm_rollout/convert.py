"""Import the original study's checkpoints into timm format (``model.safetensors`` + ``config.json``).

The original plain PyTorch ViT (conv patch embedding, [CLS], learned position embedding, pre-norm blocks on
``nn.MultiheadAttention``, MLP ``Sequential(Linear, GELU, Dropout, Linear, Dropout)``, final LayerNorm, linear
head) saved its two files in one of two key layouts (``_LAYOUT_NAMES``). ``MultiheadAttention``'s packed
in-projection rows ``[q; k; v]`` are exactly timm's ``attn.qkv`` rows, so the weight is renamed, not reordered.
The number of heads is not stored in a state dict and must be given (the study used 4).
"""

from __future__ import annotations

import math
import os
import pickle
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from .errors import UserError

POOLING_MODELS = {"cls": "vit_tiny_cifar_cls", "rollout": "vit_tiny_cifar_rollout"}

# Words in a file name that give away the pooling of the original study's two checkpoints.
_POOLING_WORDS = {"rollout": ("rollout",), "cls": ("cls", "baseline", "token")}

_BLOCK_RULES = [
    (r"blocks\.(\d+)\.attn\.in_proj_(weight|bias)", r"blocks.\1.attn.qkv.\2"),
    (r"blocks\.(\d+)\.attn\.out_proj\.(weight|bias)", r"blocks.\1.attn.proj.\2"),
    (r"blocks\.(\d+)\.mlp\.0\.(weight|bias)", r"blocks.\1.mlp.fc1.\2"),
    (r"blocks\.(\d+)\.mlp\.3\.(weight|bias)", r"blocks.\1.mlp.fc2.\2"),
    (r"norm\.(weight|bias)", r"norm.\1"),
    (r"head\.(weight|bias)", r"head.\1"),
]

# Names of the patch embedding, [CLS] token, position embedding and the two block norms per layout.
_LAYOUT_NAMES = {
    "new": dict(patch="patch", cls="cls", pos="pos", n1="n1", n2="n2"),
    "old": dict(patch="patch_embed", cls="cls_token", pos="pos_embed", n1="norm1", n2="norm2"),
}


def _layout_rules(layout: str) -> list[tuple[re.Pattern, str]]:
    """(original key regex, timm key template) pairs; the first rule that fully matches a key wins."""
    n = _LAYOUT_NAMES[layout]
    rules = [
        (rf"{n['patch']}\.(weight|bias)", r"patch_embed.proj.\1"),
        (n["cls"], "cls_token"),
        (n["pos"], "pos_embed"),
        (rf"blocks\.(\d+)\.{n['n1']}\.(weight|bias)", r"blocks.\1.norm1.\2"),
        (rf"blocks\.(\d+)\.{n['n2']}\.(weight|bias)", r"blocks.\1.norm2.\2"),
        *_BLOCK_RULES,
    ]
    return [(re.compile(pattern), template) for pattern, template in rules]


def _short_list(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def guess_pooling(path: str | os.PathLike) -> str:
    """``'rollout'`` or ``'cls'`` from words in the file name; a :class:`UserError` when it cannot tell."""
    name = Path(path).name.lower()
    found = sorted(p for p, words in _POOLING_WORDS.items() if any(w in name for w in words))
    if len(found) != 1:
        why = "both poolings" if found else "no pooling"
        raise UserError(f"file name {Path(path).name!r} names {why}; pass --pooling cls or --pooling rollout")
    return found[0]


def load_original(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a state dict (unwrapped from ``'model'`` or ``'state_dict'``) with ``torch.load(weights_only=True)``:
    anything that would need arbitrary unpickling is refused."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} not found; give the path of the original .pth file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"WeightsUnpickler error: (.+?)(?: was not an allowed global|\n|$)", str(e))
        reason = found.group(1).strip() if found else type(e).__name__
        raise UserError(
            f"{path} holds more than plain tensors ({reason}) and is refused, as nothing is unpickled; "
            "re-save just the weights with torch.save(model.state_dict(), path)"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:  # truncated or not a torch.save file at all
        raise UserError(f"{path} is not a readable torch.save checkpoint ({type(e).__name__}: "
                        f"{str(e).split('. ')[0] or 'empty'}); check the file is complete") from None
    for wrapper in ("model", "state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(wrapper), dict):
            obj = obj[wrapper]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UserError(f"{path} is not a state dict of tensors; save it with torch.save(model.state_dict(), path)")
    return obj


def detect_layout(state_dict: dict[str, torch.Tensor]) -> str:
    """``'new'`` (``patch.weight``) or ``'old'`` (``patch_embed.weight``) key layout."""
    for layout, names in _LAYOUT_NAMES.items():
        if f"{names['patch']}.weight" in state_dict:
            return layout
    raise UserError(
        "not an original-study state dict: neither patch.weight nor patch_embed.weight found "
        f"(keys: {_short_list(sorted(state_dict))})"
    )


def map_keys(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename the original keys to timm ``VisionTransformer`` keys; unknown keys are a :class:`UserError`."""
    layout = detect_layout(state_dict)
    rules = _layout_rules(layout)
    out, unknown = {}, []
    for key, value in state_dict.items():
        for pattern, template in rules:
            if pattern.fullmatch(key):
                out[pattern.sub(template, key)] = value
                break
        else:
            unknown.append(key)
    if unknown:
        raise UserError(f"unknown keys for the {layout!r} original layout: {_short_list(sorted(unknown))}")
    return out


def infer_model_args(timm_state: dict[str, torch.Tensor], num_heads: int) -> dict:
    """Architecture arguments for ``timm.create_model`` read from a timm-keyed state dict's shapes."""
    needed = ("patch_embed.proj.weight", "pos_embed", "blocks.0.mlp.fc1.weight", "head.weight")
    missing = [k for k in needed if k not in timm_state]
    if missing:
        raise UserError(f"state dict lacks {', '.join(missing)}; is it a complete model checkpoint?")
    embed_dim, in_chans, patch, _ = timm_state["patch_embed.proj.weight"].shape
    grid = math.isqrt(timm_state["pos_embed"].shape[1] - 1)  # a grid that is not square fails the shape check
    depth = len({k.split(".")[1] for k in timm_state if k.startswith("blocks.")})
    if embed_dim % num_heads:
        raise UserError(f"embed dim {embed_dim} is not divisible by --num-heads {num_heads}")
    return dict(
        img_size=grid * patch,
        patch_size=patch,
        in_chans=in_chans,
        embed_dim=embed_dim,
        depth=depth,
        num_heads=num_heads,
        mlp_ratio=timm_state["blocks.0.mlp.fc1.weight"].shape[0] / embed_dim,
        num_classes=timm_state["head.weight"].shape[0],
    )


def convert_checkpoint(
    src: str | os.PathLike,
    output: str | os.PathLike,
    pooling: str,
    num_heads: int = 4,
    label_names: Sequence[str] | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> torch.nn.Module:
    """Convert the original study's ``src`` state dict into a timm folder ``output`` (training's export,
    :func:`timm_rollout.checkpoint.save_model`) with its ``mean``/``std`` (default: the model's); returns the model."""
    from .checkpoint import save_model  # here, so that --help loads no timm
    from .loading import create_model

    if pooling not in POOLING_MODELS:
        raise UserError(f"unknown pooling {pooling!r}; use one of {', '.join(POOLING_MODELS)}")
    state = map_keys(load_original(src))
    args = infer_model_args(state, num_heads)
    if label_names and len(label_names) != args["num_classes"]:
        raise UserError(f"{len(label_names)} label names for a head with {args['num_classes']} classes")
    model = create_model(POOLING_MODELS[pooling], **args)
    expected = model.state_dict()
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        what = f"lacks weights for: {_short_list(missing)}" if missing else f"has extra weights: {_short_list(extra)}"
        raise UserError(f"original checkpoint {what}")
    bad = [f"{k} {tuple(v.shape)} vs {tuple(expected[k].shape)}" for k, v in state.items()
           if v.shape != expected[k].shape]
    if bad:
        raise UserError(f"shape mismatch (original vs timm): {_short_list(bad, 3)}")
    model.load_state_dict(state)
    cfg = model.pretrained_cfg
    save_model(output, model, list(label_names or []), mean or cfg["mean"], std or cfg["std"])
    return model.eval()
