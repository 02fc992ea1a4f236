"""Saliency maps of timm ViT-family models, batched over images: attention, rollout variants, gradient rollout.

Every map is a (B, P) tensor over the patch grid (prefix tokens dropped) that explains the model's own *readout*
``r`` (B, N), the weights with which its classifier reads the final tokens (:func:`readout_row`): one-hot [CLS]
for ``'token'``, ``[0, w]`` with the model's rollout pooling weights for ``'rollout'``, uniform over the patches
for ``'avg'``, and the attention of the pool's one latent query for ``'map'`` (:func:`latent_attention`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from .capture import capture_attention
from .pooling import attention_pool
from .rollout import (
    HEAD_FUSIONS,
    fuse_and_discard,
    fuse_heads,
    patch_weights,
    pooling_weights,
    rollout_layers,
    rollout_options,
    rollout_row,
)

if TYPE_CHECKING:
    from timm.layers import AttentionPoolLatent

DISCARD_RATIOS = (0.5, 0.9)  # besides rollout without discarding
FLOW_SCALE = 1 << 20  # integer capacity of a weight of 1.0 in the max-flow graph
READOUTS = {  # global_pool -> readout name
    "token": "[CLS]", "rollout": "rollout-weights", "avg": "patch-mean", "map": "attention-pool query",
}
MAP_LABELS = {  # the maps the harness draws and scores (readout_maps), in display order
    "rollout": "attention rollout",
    "gradient_rollout": "gradient-weighted rollout",
    "last_layer_attention": "last-layer attention",
}


@dataclass
class AttentionPass:
    """One forward and backward pass (:func:`gradient_pass`): logits, every block's attention (float32, detached),
    the readout and token layout, the explained class and Chefer's gradient-weighted layers."""

    logits: torch.Tensor  # (B, C)
    attentions: list[torch.Tensor]  # L x (B, heads, N, N)
    num_prefix_tokens: int
    readout: torch.Tensor  # (B, N): weights of the final tokens the classifier reads
    readout_name: str
    grid: tuple[int, int]
    target: torch.Tensor  # (B,) int64
    gradient_layers: list[torch.Tensor]  # L x (B, N, N)


def patch_grid(model: nn.Module, image_size: Sequence[int], num_patches: int) -> tuple[int, int]:
    """(rows, cols) of the patch grid for images of ``image_size`` (H, W); checks it has ``num_patches``."""
    embed = getattr(model, "patch_embed", None)
    if embed is not None and hasattr(embed, "dynamic_feat_size"):
        grid = tuple(int(g) for g in embed.dynamic_feat_size(tuple(image_size)))
    elif embed is not None and getattr(embed, "grid_size", None) is not None:
        grid = tuple(int(g) for g in embed.grid_size)
    else:
        side = math.isqrt(num_patches)
        grid = (side, side)
    if grid[0] * grid[1] != num_patches:
        raise ValueError(f"patch grid {grid} does not hold the {num_patches} patch tokens of the attention")
    return grid


def readout_kind(model: nn.Module) -> str:
    """The model's pooling as a readout: ``'token'``, ``'rollout'``, ``'avg'`` or ``'map'`` (ValueError for others)."""
    pool = getattr(model, "global_pool", "token")
    attn_pool = attention_pool(model)
    if pool == "map" and attn_pool is not None:
        from timm.layers import AttentionPoolLatent  # here, so that --help loads no timm

        if not isinstance(attn_pool, AttentionPoolLatent) or attn_pool.latent_len != 1:
            raise ValueError("maps of global_pool 'map' are defined for timm's AttentionPoolLatent with one latent "
                             f"query, not {type(attn_pool).__name__} with latent_len "
                             f"{getattr(attn_pool, 'latent_len', '?')}")
        return pool
    if pool not in READOUTS or pool == "map" or attn_pool is not None \
            or getattr(model, "pool_include_prefix", False):
        raise ValueError(f"maps are defined for global_pool 'token', 'avg', 'rollout' or 'map', not {pool!r}")
    if pool == "token" and getattr(model, "cls_token", None) is None:
        raise ValueError("global_pool='token' without a class token reads no [CLS]; use 'avg'")
    return pool


def latent_attention(pool: AttentionPoolLatent, tokens: torch.Tensor) -> torch.Tensor:
    """Attention of ``pool``'s latent query over the (B, T, D) ``tokens`` it pools, mean over heads: (B, T),
    recomputed in float32 from the pool's own layers (its fused path never forms the matrix)."""
    with torch.autocast(tokens.device.type, enabled=False):
        b, t, _ = tokens.shape
        x = tokens.float()
        if pool.pos_embed is not None:
            x = x + pool.pos_embed.float().unsqueeze(0)
        heads, dim = pool.num_heads, pool.head_dim
        q = pool.q(pool.latent.float().expand(b, -1, -1)).reshape(b, pool.latent_len, heads, dim).transpose(1, 2)
        k = pool.kv(x).reshape(b, t, 2, heads, dim)[:, :, 0].transpose(1, 2)
        q, k = pool.q_norm(q), pool.k_norm(k)
        attn = ((q * pool.scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # (B, heads, latents, T)
    return attn.mean(dim=(1, 2))


def readout_row(kind: str, attentions: Sequence[torch.Tensor], num_prefix_tokens: int,
                pool_attention: torch.Tensor | None = None, head_fusion: str = "mean",
                discard_ratio: float = 0.0) -> torch.Tensor:
    """(B, N) readout weights of pooling ``kind`` (module docstring); for ``'map'``, ``pool_attention`` (B, T) from
    :func:`latent_attention` on the last T tokens."""
    first = attentions[0]
    b, n = first.shape[0], first.shape[-1]
    row = torch.zeros(b, n, dtype=torch.float32, device=first.device)
    if kind == "token":
        row[:, 0] = 1.0
    elif kind == "rollout":
        detached = [a.detach() for a in attentions]
        row[:, num_prefix_tokens:] = pooling_weights(detached, num_prefix_tokens, head_fusion, discard_ratio)
    elif kind == "map":
        row[:, n - pool_attention.shape[1]:] = pool_attention.detach().float()
    else:
        row[:, num_prefix_tokens:] = 1.0 / (n - num_prefix_tokens)
    return row


@contextmanager
def _pool_input(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Record the tokens the learned attention pool the model applies (:func:`attention_pool`) receives in the
    ``with`` body."""
    found: list[torch.Tensor] = []
    attn_pool = attention_pool(model)
    if attn_pool is None:
        yield found
        return
    handle = attn_pool.register_forward_pre_hook(lambda module, args: found.append(args[0].detach()))
    try:
        yield found
    finally:
        handle.remove()


@contextmanager
def _rollout_grad(model: nn.Module) -> Iterator[None]:
    """Let gradients flow through a rollout-pooled model's pooling weights for the duration."""
    had = getattr(model, "rollout_grad", None)
    if had is not None:
        model.rollout_grad = True
    try:
        yield
    finally:
        if had is not None:
            model.rollout_grad = had


def _pass(model: nn.Module, x: torch.Tensor, cap, logits: torch.Tensor, pool_tokens: list[torch.Tensor],
          target: torch.Tensor, grads: Sequence[torch.Tensor]) -> AttentionPass:
    attentions = [a.detach().float() for a in cap.attentions]
    n = attentions[0].shape[-1]
    prefix = cap.num_prefix_tokens
    grid = patch_grid(model, x.shape[-2:], n - prefix)
    kind = readout_kind(model)
    pool_attention = latent_attention(model.attn_pool, pool_tokens[-1]) if kind == "map" else None
    readout = readout_row(kind, attentions, prefix, pool_attention, *rollout_options(model))
    return AttentionPass(logits.detach().float(), attentions, prefix, readout, READOUTS[kind], grid, target.detach(),
                         gradient_layers(attentions, grads))


def readout_attention(p: AttentionPass, layer: int = -1, head_fusion: str = "mean", head: int | None = None
                      ) -> torch.Tensor:
    """``r · fuse_heads(A_layer)`` over the patches (``layer`` 0-based, negative from the end; ``head``: that head's
    attention alone): (B, P)."""
    attn = p.attentions[layer]
    fused = fuse_heads(attn if head is None else attn[:, head:head + 1], head_fusion)  # (B, N, N)
    return (p.readout.unsqueeze(1) @ fused).squeeze(1)[:, p.num_prefix_tokens:]


def rollout_map(p: AttentionPass, head_fusion: str = "mean", discard_ratio: float = 0.0) -> torch.Tensor:
    """Readout row of the attention rollout (Abnar & Zuidema 2020) over the patch columns, renormalised: (B, P)."""
    row = rollout_row(p.attentions, p.readout, head_fusion, discard_ratio, p.num_prefix_tokens)
    return patch_weights(row, p.num_prefix_tokens)


def rollout_buildup(p: AttentionPass, head_fusion: str = "mean", discard_ratio: float = 0.0) -> torch.Tensor:
    """``r Â_l ... Â_1`` for l = 1..L (the rollout after each layer), patch columns renormalised: (B, L, P). Each
    layer is fused (and its lowest entries discarded) once, then rolled out as one head."""
    fused = [fuse_and_discard(a, head_fusion, discard_ratio, p.num_prefix_tokens)[:, None] for a in p.attentions]
    rows = [rollout_row(fused[:depth], p.readout, "mean", 0.0, p.num_prefix_tokens)
            for depth in range(1, len(p.attentions) + 1)]
    return torch.stack([patch_weights(r, p.num_prefix_tokens) for r in rows], dim=1)


def gradient_layers(attentions: Sequence[torch.Tensor], gradients: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Chefer's per-layer ``Ā_l = mean_heads((grad_l ⊙ A_l)⁺)``: L x (B, N, N) from L x (B, heads, N, N)."""
    return [(g.float() * a.float()).clamp(min=0).mean(dim=1) for a, g in zip(attentions, gradients, strict=True)]


def chefer_row(layers: Sequence[torch.Tensor], row: torch.Tensor) -> torch.Tensor:
    """``row @ R``, ``R = (I + Ā_L) ... (I + Ā_1)`` (Chefer's ``R ← R + Ā R``, no row normalisation): (B, N)."""
    out = row.expand(layers[0].shape[0], -1).unsqueeze(1)
    for a in reversed(layers):
        out = out + out @ a
    return out.squeeze(1)


def gradient_pass(model: nn.Module, x: torch.Tensor, target_class: int | torch.Tensor | None = None) -> AttentionPass:
    """Forward + one backward of the summed target logits; ``target_class``: None for each image's predicted
    class, an int for all images, or a (B,) tensor."""
    readout_kind(model)  # fail before the pass
    x = x.detach().clone().requires_grad_(True)  # a graph exists even when the parameters are frozen
    with torch.enable_grad(), _rollout_grad(model), capture_attention(model) as cap, \
            _pool_input(model) as pool_tokens:
        logits = model(x)
    if target_class is None:
        target = logits.detach().argmax(dim=1)
    else:
        target = torch.as_tensor(target_class, dtype=torch.int64, device=logits.device).expand(logits.shape[0])
        if int(target.min()) < 0 or int(target.max()) >= logits.shape[1]:
            raise ValueError(f"target class {target_class} is outside the model's {logits.shape[1]} classes")
    score = logits.gather(1, target[:, None]).sum()
    grads = torch.autograd.grad(score, cap.attentions)
    return _pass(model, x, cap, logits, pool_tokens, target, grads)


def gradient_rollout(p: AttentionPass) -> torch.Tensor:
    """Chefer et al. 2021's gradient-weighted rollout ``r R`` for the target-class logit over the patch columns,
    unnormalised: (B, P). With rollout pooling the gradient includes the path through the pooling weights."""
    return chefer_row(p.gradient_layers, p.readout)[:, p.num_prefix_tokens:]


def readout_maps(p: AttentionPass) -> dict[str, torch.Tensor]:
    """The maps the harness draws and scores (keys of :data:`MAP_LABELS`), each (B, P): one implementation each."""
    return {"rollout": rollout_map(p, "mean"), "gradient_rollout": gradient_rollout(p),
            "last_layer_attention": readout_attention(p, -1)}


def attention_flow(p: AttentionPass, index: int = 0) -> torch.Tensor:
    """Attention flow (max-flow, Abnar & Zuidema 2020) from the readout to each input patch of image ``index``:
    edges token i (layer l) -> token j (layer l-1) of capacity ``Â_l[i, j]``, a source feeding the readout with
    capacities ``r``; (P,) flows renormalised to sum 1, one scipy max-flow per patch."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import maximum_flow

    layers = [a[index : index + 1] for a in p.attentions]
    mats = [m[0].cpu().double().numpy() for m in rollout_layers(layers, "mean", 0.0, p.num_prefix_tokens)]
    n, depth = mats[0].shape[0], len(mats)
    source = (depth + 1) * n
    rows, cols, caps = [], [], []
    for lay, m in enumerate(mats, start=1):
        i, j = np.nonzero(m)
        rows.append(lay * n + i)
        cols.append((lay - 1) * n + j)
        caps.append(m[i, j])
    q = p.readout[index].cpu().double().numpy()
    top = np.nonzero(q)[0]
    rows.append(np.full(len(top), source))
    cols.append(depth * n + top)
    caps.append(q[top])
    cap = np.rint(np.concatenate(caps) * FLOW_SCALE).astype(np.int32)
    graph = coo_matrix((cap, (np.concatenate(rows), np.concatenate(cols))), shape=(source + 1, source + 1)).tocsr()
    flows = [maximum_flow(graph, source, j).flow_value for j in range(p.num_prefix_tokens, n)]
    values = torch.tensor(flows, dtype=torch.float64)
    return (values / values.sum()).float()


@dataclass
class Explanation:
    """Named (B, P) maps in display order, the rollout build-up (B, L, P), and what was explained."""

    maps: dict[str, torch.Tensor]
    buildup: torch.Tensor
    logits: torch.Tensor
    target: torch.Tensor
    grid: tuple[int, int]
    readout: str


def explain(
    model: nn.Module,
    x: torch.Tensor,
    *,
    target_class: int | torch.Tensor | None = None,
    flow: bool = False,
) -> Explanation:
    """Every map for normalised images ``x`` (B, 3, H, W) in one forward + backward pass, keyed by figure title;
    ``flow`` adds the (slow) attention flow of each image."""
    model.eval()
    p = gradient_pass(model, x, target_class)
    name = p.readout_name
    depth = len(p.attentions)
    maps: dict[str, torch.Tensor] = {f"last-layer {name} attention (layer {depth})": readout_attention(p, -1)}
    for layer in sorted({0, (depth - 1) // 2} - {depth - 1}):  # the first and middle layers
        maps[f"{name} attention, layer {layer + 1}"] = readout_attention(p, layer)
    for fusion in HEAD_FUSIONS:
        maps[f"rollout, {fusion} of heads"] = rollout_map(p, fusion)
    for ratio in DISCARD_RATIOS:
        maps[f"rollout, mean of heads, discard {ratio:g}"] = rollout_map(p, "mean", ratio)
    maps["gradient-weighted rollout (Chefer)"] = gradient_rollout(p)
    if flow:
        maps["attention flow (max-flow)"] = torch.stack([attention_flow(p, i) for i in range(x.shape[0])])
    return Explanation(maps, rollout_buildup(p), p.logits, p.target, p.grid, name)
