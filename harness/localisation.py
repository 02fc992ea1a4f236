"""Does a pooling find the object? Patch weights and saliency maps scored against each image's object box.

Pure functions of boxes, content masks and (N, P) patch maps; the metrics are defined in harness/README.md
("Metrics", from ``pooling_object_mass`` on). A box is ``[x, y, w, h]`` in pixels (COCO order) covering [x, x + w)
x [y, y + h), pixel i spanning [i, i + 1); patches are row-major over the (rows, cols) grid, as timm orders patch
tokens. A metric that cannot be computed on every evaluated image (no object taken out, no fill told from clutter
by foreground masks) is None rather than a mean over the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from timm_rollout.explain import MAP_LABELS
from timm_rollout.masks import BACKGROUND, CLUTTER, FILL, OBJECT
from timm_rollout.rollout import effective_patches

__all__ = ["LOCALISATION", "box_coverage", "box_mass", "centres_inside", "content_weights", "context_only",
           "fixed_map", "localisation_metrics", "map_shares", "mask_fractions", "object_mass", "object_share",
           "pointing_hits", "weight_inside_outside"]

# results.json["metrics"] keys of localisation_metrics, in report order: means over the images. The mask keys
# (fill mass, content chance, object shares, context top-1) are None for images without content masks.
LOCALISATION = (
    "pooling_object_mass", "object_area_fraction", "content_chance", "position_prior_mass",
    "pooling_fixed_object_mass", "pooling_fill_mass", "pooling_object_share", "object_content_fraction",
    "context_top1", "pooling_weight_inside", "pooling_weight_outside", "pooling_effective_patches", "pointing_chance",
    *(f"{name}_{what}" for name in MAP_LABELS
      for what in ("box_mass", "fixed_box_mass", "fill_mass", "object_share", "pointing")),
)


def _patch_edges(image_size: Sequence[int], grid: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Top and left pixel edges of the patch rows and columns (float64) and the patch height and width."""
    (h, w), (rows, cols) = image_size, grid
    if h % rows or w % cols:
        raise ValueError(f"a {h}x{w} image does not split into a {rows}x{cols} grid of equal patches")
    ph, pw = h // rows, w // cols
    return (torch.arange(rows, dtype=torch.float64) * ph, torch.arange(cols, dtype=torch.float64) * pw,
            float(ph), float(pw))


def box_coverage(boxes: torch.Tensor, image_size: Sequence[int], grid: Sequence[int]) -> torch.Tensor:
    """(N, P) fraction of each patch's area covered by the image's box; ``boxes`` (N, 4) ``[x, y, w, h]`` pixels,
    ``image_size`` (H, W), ``grid`` (rows, cols). Float64; parts of a box outside the image count for nothing."""
    tops, lefts, ph, pw = _patch_edges(image_size, grid)
    b = boxes.double()
    x0, y0, x1, y1 = b[:, 0:1], b[:, 1:2], b[:, 0:1] + b[:, 2:3], b[:, 1:2] + b[:, 3:4]
    over_y = (torch.minimum(y1, tops + ph) - torch.maximum(y0, tops)).clamp(min=0) / ph  # (N, rows)
    over_x = (torch.minimum(x1, lefts + pw) - torch.maximum(x0, lefts)).clamp(min=0) / pw  # (N, cols)
    return (over_y[:, :, None] * over_x[:, None, :]).flatten(1)


def centres_inside(boxes: torch.Tensor, image_size: Sequence[int], grid: Sequence[int]) -> torch.Tensor:
    """(N, P) bool: whether each patch's centre lies in the image's box [x, x + w) x [y, y + h)."""
    tops, lefts, ph, pw = _patch_edges(image_size, grid)
    b = boxes.double()
    cy, cx = tops + ph / 2, lefts + pw / 2
    in_y = (cy >= b[:, 1:2]) & (cy < b[:, 1:2] + b[:, 3:4])
    in_x = (cx >= b[:, 0:1]) & (cx < b[:, 0:1] + b[:, 2:3])
    return (in_y[:, :, None] & in_x[:, None, :]).flatten(1)


def mask_fractions(masks: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
    """(N, P, 4) float64 share of each patch's pixels that are fill, clutter, object and background (indexed by
    those values), from uint8 (N, H, W) ``masks``; patches row-major over ``grid`` (rows, cols)."""
    n, h, w = masks.shape
    _patch_edges((h, w), grid)
    rows, cols = grid
    counts = [(masks == value).reshape(n, rows, h // rows, cols, w // cols).sum(dim=(2, 4), dtype=torch.int64)
              for value in (FILL, CLUTTER, OBJECT, BACKGROUND)]
    return torch.stack(counts, dim=-1).flatten(1, 2).double() / ((h // rows) * (w // cols))


def context_only(images: torch.Tensor, labels: torch.Tensor, masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 (N, C, H, W) ``images`` with the object taken out, and (N,) bool whether it all was: each pixel that
    ``masks`` (N, H, W) marks as object takes the same pixel of the first image of the same one of the (N,)
    ``labels``, in index order cyclically after the image, whose mask shows no object there. An image keeps an
    object pixel only when every other image of its class shows object there too (e.g. a class of one image)."""
    if labels.shape != images.shape[:1] or masks.shape != (images.shape[0], *images.shape[2:]):
        raise ValueError(f"context_only needs (N,) labels and (N, H, W) masks for (N, C, H, W) images; got "
                         f"{tuple(labels.shape)}, {tuple(masks.shape)} for {tuple(images.shape)}")
    out, todo = images.clone(), masks == OBJECT
    for label in labels.unique():
        members = (labels == label).nonzero().flatten()
        for shift in range(1, len(members)):
            left = todo[members].flatten(1).any(dim=1).nonzero().flatten()  # positions in members still to do
            if not len(left):
                break
            at, donors = members[left], members[(left + shift) % len(members)]
            take = todo[at] & (masks[donors] != OBJECT)
            out[at] = torch.where(take[:, None], images[donors], out[at])
            todo[at] &= ~take
    return out, ~todo.flatten(1).any(dim=1)


def content_weights(fractions: torch.Tensor) -> torch.Tensor:
    """(N, P) weights of the content pooling: each patch by its share of non-fill pixels, summing to 1 per image
    (NaN for an image of fill only). ``fractions``: :func:`mask_fractions`."""
    content = 1 - fractions[..., FILL]
    return content / content.sum(dim=-1, keepdim=True)


def object_share(weights: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
    """Per image sum_p w_p o_p / sum_p w_p (o_p + k_p + b_p): the weight on the object as a share of the weight on
    content (object, clutter and a foreground mask's background); NaN where no weight falls on content."""
    w = weights.double()
    on_object = (w * fractions[..., OBJECT]).sum(dim=-1)
    content = fractions[..., OBJECT] + fractions[..., CLUTTER] + fractions[..., BACKGROUND]
    on_content = (w * content).sum(dim=-1)
    return torch.where(on_content > 0, on_object / on_content, torch.nan)


def object_mass(weights: torch.Tensor, coverage: torch.Tensor) -> torch.Tensor:
    """Per image sum_p w_p c_p of (N, P) ``weights`` and ``coverage`` (float64): the weight on the object."""
    return (weights.double() * coverage.double()).sum(dim=-1)


def map_shares(maps: torch.Tensor) -> torch.Tensor:
    """(N, P) saliency maps as shares summing to 1 per image: negative values clamped to 0 (the harness's maps
    are non-negative by construction, so this only guards), a map without positive mass taken as uniform."""
    m = maps.double().clamp(min=0)
    total = m.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, m / total.clamp(min=torch.finfo(torch.float64).tiny), 1.0 / m.shape[-1])


def fixed_map(weights: torch.Tensor) -> torch.Tensor:
    """(N, P) per-image weights -> the (N, P) image-blind map that gives every image their mean over the images,
    normalised to sum to 1 (float64): for pooling weights or map shares, the average map used as a fixed one; for
    box coverage, the position prior (where objects usually are)."""
    mean = weights.double().mean(dim=0)
    return (mean / mean.sum()).expand_as(weights)


def box_mass(maps: torch.Tensor, coverage: torch.Tensor) -> torch.Tensor:
    """Per image the share of the (N, P) map's mass inside the box: :func:`object_mass` of :func:`map_shares`."""
    return object_mass(map_shares(maps), coverage)


def pointing_hits(maps: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """Per image the pointing-game hit (float64, 0 or 1 without ties): the fraction of the map's maximal patches
    (after clamping at 0, as :func:`map_shares`) whose centres are ``inside`` the box (:func:`centres_inside`)."""
    m = maps.double().clamp(min=0)
    top = m == m.max(dim=-1, keepdim=True).values
    return (top & inside).sum(dim=-1).double() / top.sum(dim=-1)


def weight_inside_outside(weights: torch.Tensor, coverage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per image the mean of P w_p over the covered area, P sum_p w_p c_p / sum_p c_p, and over the uncovered
    area, P sum_p w_p (1 - c_p) / sum_p (1 - c_p): 1 and 1 for uniform weights; NaN where an area is empty."""
    w, c = weights.double(), coverage.double()
    p = c.shape[-1]
    covered, uncovered = c.sum(dim=-1), (1 - c).sum(dim=-1)
    inside = p * (w * c).sum(dim=-1) / covered
    outside = p * (w * (1 - c)).sum(dim=-1) / uncovered
    return torch.where(covered > 0, inside, torch.nan), torch.where(uncovered > 0, outside, torch.nan)


def _mean(values: torch.Tensor) -> float | None:
    """Mean over the images where the value is defined; None where it is nowhere."""
    finite = values[~values.isnan()]
    return float(finite.mean()) if finite.numel() else None


def _mask_values(pooling: torch.Tensor, maps: Mapping[str, torch.Tensor], fractions: torch.Tensor,
                 coverage: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-image values of the mask metrics."""
    content = content_weights(fractions)
    values = {"content_chance": object_mass(content, coverage),
              "pooling_fill_mass": object_mass(pooling, fractions[..., FILL]),
              "pooling_object_share": object_share(pooling, fractions),
              "object_content_fraction": object_share(content, fractions)}
    for name, m in maps.items():
        values[f"{name}_fill_mass"] = object_mass(map_shares(m), fractions[..., FILL])
        values[f"{name}_object_share"] = object_share(map_shares(m), fractions)
    if (fractions[..., BACKGROUND] > 0).any():  # fill not told from clutter: no metric that needs the fill
        values = {k: v for k, v in values.items() if not k.endswith(("fill_mass", "content_chance"))}
    return values


def localisation_metrics(pooling: torch.Tensor, maps: Mapping[str, torch.Tensor], boxes: torch.Tensor,
                         image_size: Sequence[int], grid: Sequence[int], masks: torch.Tensor | None = None,
                         context_hits: torch.Tensor | None = None) -> dict[str, float | None]:
    """The :data:`LOCALISATION` metrics, means over the images, of the (N, P) ``pooling`` weights (rows sum to 1)
    and saliency ``maps`` by name, against (N, 4) ``boxes`` and, where given, (N, H, W) content ``masks`` and the
    (N,) top-1 ``context_hits`` on each image's :func:`context_only` (else those metrics are None)."""
    coverage = box_coverage(boxes, image_size, grid)
    inside = centres_inside(boxes, image_size, grid)
    uniform = torch.full_like(coverage, 1.0 / coverage.shape[-1])
    w_in, w_out = weight_inside_outside(pooling, coverage)
    values = {
        "pooling_object_mass": object_mass(pooling, coverage), "object_area_fraction": object_mass(uniform, coverage),
        "position_prior_mass": object_mass(fixed_map(coverage), coverage),
        "pooling_fixed_object_mass": object_mass(fixed_map(pooling), coverage),
        "pooling_weight_inside": w_in, "pooling_weight_outside": w_out,
        "pooling_effective_patches": effective_patches(pooling.double()).double(),
        "pointing_chance": inside.double().mean(dim=-1),
    }
    for name, m in maps.items():
        values[f"{name}_box_mass"] = box_mass(m, coverage)
        values[f"{name}_fixed_box_mass"] = object_mass(fixed_map(map_shares(m)), coverage)
        values[f"{name}_pointing"] = pointing_hits(m, inside)
    if masks is not None:
        values |= _mask_values(pooling, maps, mask_fractions(masks, grid), coverage)
    if context_hits is not None:
        values["context_top1"] = context_hits.double()
    return {key: _mean(values[key]) if key in values else None for key in LOCALISATION}
