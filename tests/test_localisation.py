"""Localisation metrics (harness.localisation) against a pixel-counting loop and hand-made cases, the patch pooling
weights of every readout against the model's own computation, harness.eval end to end with boxes, and the figure."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from timm.models import save_for_hf

from harness import compare
from harness import eval as harness_eval
from harness.features import saliency_maps
from harness.figures import draw_box, plot_heatmaps, plot_object_weights
from harness.localisation import (
    LOCALISATION,
    box_coverage,
    box_mass,
    centres_inside,
    content_weights,
    context_only,
    localisation_metrics,
    mask_fractions,
    object_mass,
    object_share,
    pointing_hits,
    weight_inside_outside,
)
from harness.record import load_results, read_predictions
from timm_rollout import attention_rollout, capture_attention
from timm_rollout.data import load_image_set, normalize
from timm_rollout.errors import UserError

SAMPLE = "cifar10-sample"
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.247, 0.2435, 0.2616)
BOX = torch.tensor([[16.0, 24.0, 16.0, 16.0]])  # exactly patches (rows 3-4, cols 2-3) of an 8x8 grid on 64x64
BOX_PATCHES = [26, 27, 34, 35]


def _random_boxes(n: int, size: tuple[int, int], seed: int) -> torch.Tensor:
    """Integer boxes [x, y, w, h] anywhere from a little outside the image to inside it, some partly outside."""
    g = torch.Generator().manual_seed(seed)
    h, w = size
    xy = torch.randint(-6, max(h, w), (n, 2), generator=g)
    wh = torch.randint(1, max(h, w) // 2 + 8, (n, 2), generator=g)
    return torch.cat([xy, wh], dim=1).float()


@pytest.mark.parametrize(("size", "grid"), [((64, 64), (8, 8)), ((16, 24), (2, 3)), ((32, 32), (8, 8))])
def test_box_coverage_and_centres_against_pixel_counting(size, grid):
    boxes = _random_boxes(40, size, seed=sum(size))
    coverage, inside = box_coverage(boxes, size, grid), centres_inside(boxes, size, grid)
    (h, w), (rows, cols) = size, grid
    ph, pw = h // rows, w // cols
    for n, (x, y, bw, bh) in enumerate(boxes.int().tolist()):
        for r in range(rows):
            for c in range(cols):
                pixels = sum(x <= j < x + bw and y <= i < y + bh
                             for i in range(r * ph, (r + 1) * ph) for j in range(c * pw, (c + 1) * pw))
                assert coverage[n, r * cols + c] == pytest.approx(pixels / (ph * pw), abs=1e-12)
                cy, cx = r * ph + ph / 2, c * pw + pw / 2
                assert bool(inside[n, r * cols + c]) == (x <= cx < x + bw and y <= cy < y + bh)
    assert coverage.sum() > 0 and (coverage < 1).any() and ((coverage > 0) & (coverage < 1)).any()


def test_coverage_by_hand():
    coverage = box_coverage(BOX, (64, 64), (8, 8))[0]
    assert coverage[BOX_PATCHES].tolist() == [1.0] * 4 and coverage.sum() == 4.0
    assert centres_inside(BOX, (64, 64), (8, 8))[0].nonzero().flatten().tolist() == BOX_PATCHES
    half = box_coverage(torch.tensor([[4.0, 0.0, 8.0, 8.0], [2.5, 0.0, 4.0, 8.0]]), (8, 16), (1, 2))
    assert half.tolist() == [[0.5, 0.5], [0.5, 0.0]]
    assert centres_inside(torch.tensor([[4.0, 0.0, 8.0, 8.0]]), (8, 16), (1, 2)).tolist() == [[True, False]]
    with pytest.raises(ValueError, match="does not split"):
        box_coverage(BOX, (64, 60), (8, 8))


def test_pooling_mass_and_inside_outside_by_hand():
    coverage = box_coverage(BOX, (64, 64), (8, 8))
    on_box = torch.zeros(1, 64)
    on_box[0, BOX_PATCHES] = 0.25
    uniform = torch.full((1, 64), 1 / 64)
    assert object_mass(on_box, coverage).item() == pytest.approx(1.0)
    assert object_mass(uniform, coverage).item() == pytest.approx(4 / 64)  # a 16x16 box on 64x64
    inside, outside = weight_inside_outside(on_box, coverage)
    assert (inside.item(), outside.item()) == pytest.approx((16.0, 0.0))  # 0.25 x 64 on each box patch
    assert [v.item() for v in weight_inside_outside(uniform, coverage)] == pytest.approx([1.0, 1.0])
    whole = box_coverage(torch.tensor([[0.0, 0.0, 64.0, 64.0]]), (64, 64), (8, 8))
    assert weight_inside_outside(uniform, whole)[1].isnan().all()  # no outside area: undefined
    big = torch.tensor([[5.0, 9.0, 32.0, 32.0]])  # the clutter set's 32x32 object anywhere on 64x64
    values = localisation_metrics(uniform, {}, big, (64, 64), (8, 8))
    assert values["object_area_fraction"] == pytest.approx(0.25) and values["pointing_chance"] == 0.25
    assert values["pooling_object_mass"] == pytest.approx(0.25) and values["pooling_effective_patches"] == \
        pytest.approx(64.0)


def test_map_box_mass_and_pointing_by_hand():
    coverage, inside = box_coverage(BOX, (64, 64), (8, 8)), centres_inside(BOX, (64, 64), (8, 8))
    maps = torch.zeros(6, 64)
    maps[0, 26] = 3.0  # peak on the object: hit, all mass inside
    maps[1, 0] = 3.0  # peak off the object: miss, no mass inside
    maps[2, [0, 26]] = 3.0  # tied peaks, one inside: half a hit, half the mass
    # maps[3] all zero: every patch ties, 4 of 64 centres inside; mass uniform
    maps[4] = -1.0  # negative values count as 0: the only positive mass sits off the object
    maps[4, 0], maps[4, 26] = 0.5, -7.0
    maps[5, BOX_PATCHES], maps[5, 63] = 1.0, 4.0  # more mass inside, peak outside
    assert pointing_hits(maps, inside.expand(6, -1)).tolist() == [1.0, 0.0, 0.5, 4 / 64, 0.0, 0.0]
    expected = [1.0, 0.0, 0.5, 4 / 64, 0.0, 0.5]
    assert box_mass(maps, coverage.expand(6, -1)).tolist() == pytest.approx(expected)
    values = localisation_metrics(torch.full((6, 64), 1 / 64), {"rollout": maps}, BOX.expand(6, -1), (64, 64),
                                  (8, 8))
    assert tuple(values) == LOCALISATION
    assert values["rollout_box_mass"] == pytest.approx(np.mean(expected))
    assert values["rollout_pointing"] == pytest.approx((1 + 0.5 + 4 / 64) / 6)
    assert values["gradient_rollout_box_mass"] is None  # a map not given


MASK_KEYS = {k for k in LOCALISATION if k.endswith(("fill_mass", "object_share", "content_chance",
                                                    "content_fraction", "context_top1"))}


def _dot(a, b) -> float:
    return sum(float(x) * float(y) for x, y in zip(a, b, strict=True))


def _loop_mask_metrics(weights: np.ndarray, masks: np.ndarray, boxes: np.ndarray, grid: tuple[int, int]) -> dict:
    """Per image, by counting pixels one at a time: the fill mass and object share of ``weights`` (N, P), and the
    content pooling's object mass (against the box) and object share."""
    n, h, w = masks.shape
    rows, cols = grid
    ph, pw = h // rows, w // cols
    out = {"fill": [], "share": [], "chance": [], "content_share": []}
    for i in range(n):
        fill, clutter, obj, box = [], [], [], []
        for r in range(rows):
            for c in range(cols):
                pix = [(y, x) for y in range(r * ph, (r + 1) * ph) for x in range(c * pw, (c + 1) * pw)]
                fill.append(sum(masks[i, y, x] == 0 for y, x in pix) / len(pix))
                clutter.append(sum(masks[i, y, x] == 1 for y, x in pix) / len(pix))
                obj.append(sum(masks[i, y, x] == 2 for y, x in pix) / len(pix))
                bx, by, bw, bh = boxes[i]
                box.append(sum(bx <= x < bx + bw and by <= y < by + bh for y, x in pix) / len(pix))
        content = [1 - f for f in fill]
        u = [v / sum(content) for v in content]
        out["fill"].append(_dot(weights[i], fill))
        out["share"].append(_dot(weights[i], obj) / (_dot(weights[i], obj) + _dot(weights[i], clutter)))
        out["chance"].append(_dot(u, box))
        out["content_share"].append(_dot(u, obj) / (_dot(u, obj) + _dot(u, clutter)))
    return out


def test_mask_metrics_against_a_plain_loop():
    g = torch.Generator().manual_seed(3)
    n, size, grid = 12, (16, 24), (2, 3)
    masks = torch.randint(0, 3, (n, *size), generator=g, dtype=torch.uint8)
    boxes = _random_boxes(n, size, seed=5)
    weights = torch.rand(n, 6, generator=g, dtype=torch.float64)
    weights /= weights.sum(dim=1, keepdim=True)
    fractions = mask_fractions(masks, grid)
    want = _loop_mask_metrics(weights.numpy(), masks.numpy(), boxes.int().numpy(), grid)
    coverage = box_coverage(boxes, size, grid)
    assert object_mass(weights, fractions[..., 0]).tolist() == pytest.approx(want["fill"], abs=1e-12)
    assert object_share(weights, fractions).tolist() == pytest.approx(want["share"], abs=1e-12)
    assert object_mass(content_weights(fractions), coverage).tolist() == pytest.approx(want["chance"], abs=1e-12)
    assert object_share(content_weights(fractions), fractions).tolist() == pytest.approx(want["content_share"],
                                                                                          abs=1e-12)
    values = localisation_metrics(weights, {"rollout": weights}, boxes, size, grid, masks)
    assert values["pooling_fill_mass"] == pytest.approx(np.mean(want["fill"]), abs=1e-12)
    assert values["rollout_fill_mass"] == pytest.approx(np.mean(want["fill"]), abs=1e-12)  # the same weights
    assert values["pooling_object_share"] == pytest.approx(np.mean(want["share"]), abs=1e-12)
    assert values["content_chance"] == pytest.approx(np.mean(want["chance"]), abs=1e-12)
    assert values["object_content_fraction"] == pytest.approx(np.mean(want["content_share"]), abs=1e-12)


def test_mask_metrics_by_hand():
    """A 4x4 canvas of four 2x2 patches: the object (patch 0), fill (1), half clutter half fill (2), clutter (3)."""
    mask = torch.tensor([[2, 2, 0, 0], [2, 2, 0, 0], [1, 0, 1, 1], [1, 0, 1, 1]], dtype=torch.uint8)[None]
    box = torch.tensor([[0.0, 0.0, 2.0, 2.0]])
    pooling = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    maps = torch.tensor([[0.0, 3.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]])  # the second: all its mass on fill
    values = localisation_metrics(pooling, {"rollout": maps[:1]}, box, (4, 4), (2, 2), mask)
    # content weights (1 - fill) / sum = [1, 0, 0.5, 1] / 2.5; the object is patch 0
    assert values["content_chance"] == pytest.approx(0.4)
    assert values["object_content_fraction"] == pytest.approx(0.4 / (0.4 + 0.2 * 0.5 + 0.4))
    assert values["pooling_fill_mass"] == pytest.approx(0.5) and values["pooling_object_share"] == pytest.approx(1.0)
    assert values["pooling_object_mass"] == pytest.approx(0.5) and values["object_area_fraction"] == 0.25
    assert values["rollout_fill_mass"] == pytest.approx(0.75) and values["rollout_object_share"] == 0.0
    uniform = localisation_metrics(torch.full((1, 4), 0.25), {}, box, (4, 4), (2, 2), mask)
    assert uniform["pooling_fill_mass"] == pytest.approx(0.375)
    assert uniform["pooling_object_share"] == pytest.approx(0.25 / (0.25 + 0.125 + 0.25))
    both = localisation_metrics(pooling.expand(2, -1), {"rollout": maps}, box.expand(2, -1), (4, 4), (2, 2),
                                mask.expand(2, -1, -1))
    assert both["rollout_object_share"] == 0.0  # the all-fill map has no share: left out of the mean, not 0/0
    assert both["rollout_fill_mass"] == pytest.approx((0.75 + 1.0) / 2)


def test_position_nulls_against_a_plain_loop():
    """position_prior_mass, pooling_fixed_object_mass and <map>_fixed_box_mass: each image-blind map built by
    averaging per patch in a plain loop, then its mass on each image's box by pixel counting."""
    g = torch.Generator().manual_seed(7)
    n, size, grid = 15, (16, 24), (2, 3)
    boxes = _random_boxes(n, size, seed=9)
    weights = torch.rand(n, 6, generator=g, dtype=torch.float64)
    weights /= weights.sum(dim=1, keepdim=True)
    maps = torch.rand(n, 6, generator=g, dtype=torch.float64) * 5  # shares: each map divided by its sum
    (h, w), (rows, cols) = size, grid
    ph, pw = h // rows, w // cols
    cover = [[sum(bx <= x < bx + bw and by <= y < by + bh for y in range(r * ph, (r + 1) * ph)
                  for x in range(c * pw, (c + 1) * pw)) / (ph * pw) for r in range(rows) for c in range(cols)]
             for bx, by, bw, bh in boxes.int().tolist()]

    def fixed(rows_: list[list[float]]) -> list[float]:
        mean = [sum(r[p] for r in rows_) / len(rows_) for p in range(6)]
        return [m / sum(mean) for m in mean]

    def mass(fixed_map_: list[float]) -> float:
        return sum(_dot(fixed_map_, c) for c in cover) / n

    shares = [[v / sum(row) for v in row] for row in maps.tolist()]
    values = localisation_metrics(weights, {"rollout": maps}, boxes, size, grid)
    assert values["position_prior_mass"] == pytest.approx(mass(fixed(cover)), abs=1e-12)
    assert values["pooling_fixed_object_mass"] == pytest.approx(mass(fixed(weights.tolist())), abs=1e-12)
    assert values["rollout_fixed_box_mass"] == pytest.approx(mass(fixed(shares)), abs=1e-12)


def test_position_nulls_by_hand():
    """Two 4x4 images of four 2x2 patches, objects in patch 0 and in patch 1. The position prior is (1/2, 1/2, 0,
    0): half its mass on each object. A pooling that always looks at patch 0 scores 0.5 per image, all of it
    position (its fixed map equals it); one that follows the object scores 1, of which 0.5 is position and 0.5
    depends on the image. A fixed central map would score whatever it puts on patches 0 and 1 only."""
    boxes = torch.tensor([[0.0, 0.0, 2.0, 2.0], [2.0, 0.0, 2.0, 2.0]])
    stuck = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    follows = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    values = localisation_metrics(stuck, {"rollout": follows}, boxes, (4, 4), (2, 2))
    assert values["position_prior_mass"] == pytest.approx(0.5) and values["object_area_fraction"] == 0.25
    assert values["pooling_object_mass"] == pytest.approx(0.5) == values["pooling_fixed_object_mass"]
    assert values["rollout_box_mass"] == pytest.approx(1.0) and values["rollout_fixed_box_mass"] == pytest.approx(0.5)
    assert localisation_metrics(follows, {}, boxes, (4, 4), (2, 2))["pooling_fixed_object_mass"] == pytest.approx(0.5)


def _loop_context_only(images: np.ndarray, labels: np.ndarray, masks: np.ndarray) -> tuple[np.ndarray, list[bool]]:
    """context_only pixel by pixel: each object pixel from the first image of the label after this one (cyclic
    index order) that shows no object there."""
    out, whole = images.copy(), []
    for i in range(len(images)):
        members = [j for j in range(len(images)) if labels[j] == labels[i]]
        k = members.index(i)
        order = members[k + 1:] + members[:k]
        done = True
        for y, x in zip(*np.nonzero(masks[i] == 2), strict=True):
            donor = next((j for j in order if masks[j, y, x] != 2), None)
            if donor is None:
                done = False
            else:
                out[i, :, y, x] = images[donor, :, y, x]
        whole.append(done)
    return out, whole


def test_context_only_against_a_plain_loop():
    g = torch.Generator().manual_seed(7)
    n, size = 15, (10, 12)
    images = torch.randint(0, 256, (n, 3, *size), generator=g, dtype=torch.uint8)
    masks = torch.randint(0, 2, (n, *size), generator=g, dtype=torch.uint8)
    for i, (y, x) in enumerate(torch.randint(0, 7, (n, 2), generator=g).tolist()):  # overlapping objects
        masks[i, y:y + 4, x:x + 5] = 2
    labels = torch.randint(0, 4, (n,), generator=g)
    labels[-1] = 9  # a class of one image: nothing can take its object out
    found, whole = context_only(images, labels, masks)
    want, want_whole = _loop_context_only(images.numpy(), labels.numpy(), masks.numpy())
    assert np.array_equal(found.numpy(), want) and whole.tolist() == want_whole
    assert not whole[-1] and torch.equal(found[-1], images[-1]) and whole[:-1].any()
    assert torch.equal(found.permute(0, 2, 3, 1)[masks != 2], images.permute(0, 2, 3, 1)[masks != 2])


def test_context_only_by_hand():
    """Two 2x4 images of one class, objects on the left and on the right half: each takes the other's half; the
    third image, alone in its class, keeps its object and is not whole."""
    images = torch.arange(3 * 3 * 2 * 4, dtype=torch.uint8).reshape(3, 3, 2, 4)
    masks = torch.tensor([[[2, 2, 1, 0]] * 2, [[0, 1, 2, 2]] * 2, [[2, 0, 0, 0]] * 2], dtype=torch.uint8)
    found, whole = context_only(images, torch.tensor([5, 5, 1]), masks)
    assert torch.equal(found[0, :, :, :2], images[1, :, :, :2]) and torch.equal(found[0, :, :, 2:], images[0, :, :, 2:])
    assert torch.equal(found[1, :, :, 2:], images[0, :, :, 2:]) and torch.equal(found[1, :, :, :2], images[1, :, :, :2])
    assert torch.equal(found[2], images[2]) and whole.tolist() == [True, True, False]
    values = localisation_metrics(torch.full((3, 4), 0.25), {}, torch.tensor([[0.0, 0, 2, 2]] * 3), (2, 4), (1, 4),
                                  masks, torch.tensor([1.0, 0.0, 1.0]))
    assert values["context_top1"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match=r"\(N,\) labels"):
        context_only(images, torch.tensor([[5], [5], [1]]), masks)


def _sharpened(name: str, **kwargs) -> torch.nn.Module:
    """An untrained depth-2 model whose attention is sharpened (q, k weights x10), so weights are far from uniform."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, depth=2, **kwargs).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[:256].mul_(10.0)
    return model


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _pooled(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        tokens = model.forward_features(x)
        return tokens, model.forward_head(tokens, pre_logits=True)


@pytest.mark.parametrize("name", ["vit_tiny_cifar_rollout", "vit_tiny_cifar_gap"])
def test_pooling_weights_reproduce_the_pooled_features(name, images):
    model = _sharpened(name)
    weights = saliency_maps(model, images, device=torch.device("cpu")).pooling
    tokens, pooled = _pooled(model, images)
    torch.testing.assert_close((weights[:, :, None] * tokens[:, 1:]).sum(dim=1), pooled, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(3))
    perplexity = torch.exp(-(weights * weights.log()).sum(dim=1))
    assert (perplexity < 60).all() if name.endswith("rollout") else torch.equal(weights, torch.full((3, 64), 1 / 64))


def test_cls_pooling_weights_are_its_post_hoc_rollout_row(images):
    model = _sharpened("vit_tiny_cifar_cls")
    weights = saliency_maps(model, images, device=torch.device("cpu")).pooling
    with torch.inference_mode(), capture_attention(model) as cap:
        model(images)
    row = attention_rollout(cap.attentions)[:, 0, 1:]
    torch.testing.assert_close(weights, row / row.sum(dim=1, keepdim=True), atol=1e-6, rtol=1e-5)


def test_map_pooling_weights_are_its_pool_attention_recomputed_by_hand(images):
    model = _sharpened("vit_tiny_cifar_cls", global_pool="map")
    pool = model.attn_pool
    with torch.no_grad():  # sharpen the pool's attention too: far from uniform
        pool.latent.mul_(30.0)
        pool.kv.weight[:pool.num_heads * pool.head_dim].mul_(10.0)
    assert pool.pos_embed is None and isinstance(pool.q_norm, torch.nn.Identity) and not model.pool_include_prefix
    tokens, pooled = _pooled(model, images)
    t = tokens[:, 1:]  # the pool reads the patch tokens
    heads, d = pool.num_heads, pool.head_dim
    with torch.no_grad():
        q = (pool.latent[0, 0] @ pool.q.weight.T + pool.q.bias).view(heads, d)
        kv = t @ pool.kv.weight.T + pool.kv.bias
        k, v = kv[..., :heads * d].view(3, 64, heads, d), kv[..., heads * d:].view(3, 64, heads, d)
        attn = (torch.einsum("hd,bthd->bht", q, k) / math.sqrt(d)).softmax(dim=-1)  # (B, heads, T)
        mixed = pool.proj(torch.einsum("bht,bthd->bhd", attn, v).reshape(3, heads * d))
        out = mixed + pool.mlp(pool.norm(mixed))
    torch.testing.assert_close(out, pooled, atol=1e-5, rtol=1e-4)  # these are the weights the pool mixes with
    weights = saliency_maps(model, images, device=torch.device("cpu")).pooling
    torch.testing.assert_close(weights, attn.mean(dim=1), atol=1e-6, rtol=1e-5)
    assert torch.exp(-(weights * weights.log()).sum(dim=1)).min() < 60  # the check has teeth


def _box_of(index: int) -> list[float]:
    """A box per split index, some reaching past the 32x32 image's bottom edge."""
    return [float(index % 9), float(2 * index % 11), float(8 + index % 17), float(12 + index % 13)]


def test_eval_with_boxes_end_to_end(tmp_path, tmp_path_factory, monkeypatch):
    torch.manual_seed(0)
    run = tmp_path_factory.mktemp("runs") / "gap"
    save_for_hf(timm.create_model("vit_tiny_cifar_gap", num_classes=10, depth=1), run, safe_serialization=True,
                data_config=dict(mean=MEAN, std=STD))

    def with_boxes(*args, **kwargs):
        data = load_image_set(*args, **kwargs)
        return dataclasses.replace(data, boxes=torch.tensor([_box_of(i) for i in range(len(data))]))

    drawn = []

    def recorded(images, *args, **kwargs):  # the heatmaps' images, their titles and the boxes outlined on them
        drawn.append((images, args[1], args[-1]))
        return plot_heatmaps(images, *args, **kwargs)

    monkeypatch.setattr(harness_eval, "load_image_set", with_boxes)
    monkeypatch.setattr(harness_eval, "plot_heatmaps", recorded)
    results = harness_eval.main(["--model", "vit_tiny_cifar_gap", "--checkpoint", str(run), "--dataset", SAMPLE,
                                 "--per-class", "2", "--heatmaps", "3", "--device", "cpu", "--amp", "none",
                                 "--output", str(tmp_path)])
    sample = load_image_set(SAMPLE, "test")
    (images, titles, boxes), = drawn
    for image, title, box in zip(images, titles, boxes, strict=True):  # each outline is its image's box
        index = next(i for i in range(len(sample)) if torch.equal(sample.images[i], image))
        assert box.tolist() == pytest.approx(list(_box_of(index)))
        assert title.endswith(f"(#{index})")  # the figure names the split's image it shows
    found = results["metrics"]
    assert set(LOCALISATION) <= set(found)
    assert all((found[k] is None) == (k in MASK_KEYS) for k in LOCALISATION)  # no content masks: no mask metrics
    areas = []
    for i in read_predictions(tmp_path)["index"]:  # the box's pixels inside the 32x32 image, counted
        x, y, w, h = (int(v) for v in _box_of(i))
        areas.append(sum(x <= c < x + w and y <= r < y + h for r in range(32) for c in range(32)) / 1024)
    assert found["object_area_fraction"] == pytest.approx(np.mean(areas), abs=1e-9)
    assert found["pooling_object_mass"] == pytest.approx(np.mean(areas), abs=1e-6)  # patch mean: uniform weights
    assert (found["pooling_weight_inside"], found["pooling_weight_outside"]) == pytest.approx((1.0, 1.0), abs=1e-5)
    assert found["pooling_effective_patches"] == pytest.approx(64.0, abs=1e-3)
    assert all(0 <= found[k] <= 1 for k in LOCALISATION if k.endswith(("_box_mass", "_pointing")))
    assert "localisation" in results["timing"]
    summary = compare.summarise(load_results([tmp_path]), LOCALISATION)
    assert summary[0].mean["object_area_fraction"] == found["object_area_fraction"]
    assert compare.build_parser().parse_args([str(tmp_path), "--output", str(tmp_path / "cmp"), "--metrics",
                                              *LOCALISATION]).metrics == list(LOCALISATION)


def test_box_outline_runs_along_the_boxs_outer_pixel_edges():
    """imshow puts pixel (x, y) at x - 0.5 .. x + 0.5: a box [2, 3, 4, 5] covers pixels 2..5 and 3..7."""
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    ax.imshow(np.zeros((10, 10)))
    draw_box(ax, torch.tensor([2.0, 3.0, 4.0, 5.0]))
    (outline,) = ax.patches
    corners = outline.get_patch_transform().transform([(0, 0), (1, 1)])
    assert corners.tolist() == [[1.5, 2.5], [5.5, 7.5]] and not outline.get_fill()


def test_object_weights_figure(tmp_path):
    values = {"cls": [(1.3, 0.9), (1.2, 0.93)], "gap": [(1.0, 1.0)] * 3, "rollout": [(1.1, 0.97), (1.05, 0.98)]}
    path = plot_object_weights(values, tmp_path / "object_weights.png", "Pooling weight on the object")
    with Image.open(path) as img:
        assert img.format == "PNG" and img.width > 300


def test_eval_with_content_masks_and_compare_pairing_an_older_record_by_content(tmp_path, monkeypatch):
    """harness.eval on cluttered canvases with masks: the mask metrics of the uniform (gap) pooling against pixels
    counted by hand. Then a record from before the schema (no content hashes) of the same evaluation, whose folder
    was written again (another datasets fingerprint, the same canvases): compare refuses to pair it with a new
    evaluation (nothing shows the same pixels); with its content hashes recorded it pairs them by content."""
    import json
    import os

    from timm_rollout.clutter import ClutterRecipe, make_cluttered, split_file

    monkeypatch.chdir(tmp_path)  # the data and the evaluations in one tree: recorded relative to each other
    make_cluttered(SAMPLE, tmp_path / "c", ClutterRecipe(fragments=24, seed=0), per_class=64)
    torch.manual_seed(0)
    run = tmp_path / "gap"
    save_for_hf(timm.create_model("vit_tiny_cifar_gap", num_classes=10, img_size=64, patch_size=8, depth=1), run,
                safe_serialization=True, data_config=dict(mean=MEAN, std=STD))
    argv = ["--model", "vit_tiny_cifar_gap", "--checkpoint", str(run), "--dataset", str(tmp_path / "c"),
            "--heatmaps", "0", "--device", "cpu", "--amp", "none"]
    full = harness_eval.main([*argv, "--output", str(tmp_path / "new")])
    data = load_image_set(str(tmp_path / "c"), "test", boxes=True)
    masks, boxes = data.masks.numpy(), data.boxes.int().numpy()
    want = _loop_mask_metrics(np.full((len(data), 64), 1 / 64), masks, boxes, (8, 8))
    found = full["metrics"]
    assert found["pooling_fill_mass"] == pytest.approx(np.mean(want["fill"]), abs=1e-6)
    assert found["pooling_fill_mass"] == pytest.approx((masks == 0).mean(), abs=1e-6)  # uniform: the fill's area
    assert found["pooling_object_share"] == pytest.approx(np.mean(want["share"]), abs=1e-6)
    assert found["content_chance"] == pytest.approx(np.mean(want["chance"]), abs=1e-12)
    assert found["object_content_fraction"] == pytest.approx(np.mean(want["content_share"]), abs=1e-12)
    assert found["content_chance"] > found["object_area_fraction"] == pytest.approx(0.25)  # the stricter null
    assert full["data"]["content"] == data.content
    context, whole = _loop_context_only(data.images.numpy(), data.labels.numpy(), masks)
    model = timm.create_model(f"local-dir:{run}", pretrained=True).eval()
    with torch.no_grad():
        logits = model((torch.from_numpy(context).float() / 255 - torch.tensor(MEAN)[:, None, None])
                       / torch.tensor(STD)[:, None, None])
    hits = (logits.argmax(dim=1) == data.labels).numpy()
    assert all(whole) and found["context_top1"] == pytest.approx(hits.mean(), abs=1e-12)
    few = harness_eval.main([*argv, "--per-class", "8", "--output", str(tmp_path / "few")])["metrics"]
    assert few["context_top1"] is None and few["content_chance"] is not None  # some objects stay: no mean of the rest

    old = tmp_path / "old"
    old.mkdir()
    for name in ("results.json", "predictions.json.gz"):
        (old / name).write_bytes((tmp_path / "new" / name).read_bytes())
    record = json.loads((old / "results.json").read_text())
    del record["schema"]
    for key in ("split_content", "content"):
        del record["data"][key]
    (old / "results.json").write_text(json.dumps(record))
    for split in ("train", "test"):  # written again: datasets gives the folder another fingerprint
        os.utime(tmp_path / "c" / split_file(split), (1e9, 1e9))
    assert load_image_set(str(tmp_path / "c"), "test").fingerprint != record["data"]["fingerprint"]
    again = harness_eval.main([*argv, "--output", str(tmp_path / "again")])
    with pytest.raises(UserError, match="evaluated on different data"):
        compare.compare_groups(*compare.summarise(load_results([old, tmp_path / "again"]),
                                                  label=lambda r: r["path"]))
    record["data"].update(split_content=full["data"]["split_content"], content=full["data"]["content"])
    (old / "results.json").write_text(json.dumps(record))  # an evaluation that recorded its content hashes
    assert full["data"]["content"] == again["data"]["content"]
    compare.compare_groups(*compare.summarise(load_results([old, tmp_path / "again"]),
                                              label=lambda r: r["path"]))  # the same content: paired


def test_same_images_pairs_by_content_where_both_records_hold_it_else_by_fingerprint():
    """Each part (evaluated images, bank) by content when both records have it, else by fingerprint: the same
    content under two fingerprints pairs; a bank known by content in one record only pairs by its fingerprint."""
    def images(fp, bank_fp, content=None, bank_content=None):
        return compare.evaluated_images({"data": {"fingerprint": fp, "subset_fingerprint": fp, "split_content":
                                                  content, "content": content,
                                                  "bank": {"fingerprint": bank_fp, "content": bank_content}}})

    old, rewritten = images("a", "b", "C", None), images("x", "y", "C", "D")
    assert compare.same_images(old, rewritten) == (True, False)  # the bank: fingerprints b and y differ
    assert compare.same_images(old, images("x", "b", "C", "D")) == (True, True)  # the bank by fingerprint
    assert compare.same_images(rewritten, images("z", "w", "C", "D")) == (True, True)  # all by content
    assert compare.same_images(rewritten, images("x", "y", "E", "D")) == (False, False)  # other data, same name
    assert compare.same_images(images("a", "b"), images("a", "b", "C", "D")) == (True, True)  # no content: names


def test_eval_of_a_model_built_with_map_and_trained_with_rollout_scores_its_rollout_weights(tmp_path, monkeypatch):
    """A ViT built with ``global_pool='map'`` and saved rollout-pooled (as ``--pool rollout`` trains it) is evaluated
    by its rollout readout, heatmaps and boxes included (it used to crash): the object mass is its rollout weights
    on the box's pixels, counted in a plain loop."""
    from timm_rollout import set_pooling
    from timm_rollout.checkpoint import save_model

    model = set_pooling(_sharpened("vit_tiny_cifar_cls", global_pool="map"), "rollout")
    save_model(tmp_path / "run", model, load_image_set(SAMPLE, "test").class_names, MEAN, STD)

    def with_boxes(*args, **kwargs):
        data = load_image_set(*args, **kwargs)
        return dataclasses.replace(data, boxes=torch.tensor([_box_of(i) for i in range(len(data))]))

    monkeypatch.setattr(harness_eval, "load_image_set", with_boxes)
    found = harness_eval.main(["--model", f"local-dir:{tmp_path / 'run'}", "--dataset", SAMPLE, "--per-class", "2",
                               "--heatmaps", "2", "--device", "cpu", "--amp", "none",
                               "--output", str(tmp_path / "eval")])["metrics"]
    sample = load_image_set(SAMPLE, "test")
    index = read_predictions(tmp_path / "eval")["index"]
    with torch.inference_mode():
        weights = model.rollout_weights(model.forward_features(normalize(sample.images[index], MEAN, STD)))
    masses = []
    for w, i in zip(weights.tolist(), index, strict=True):
        x, y, bw, bh = (int(v) for v in _box_of(i))
        masses.append(sum(w[8 * (r // 4) + c // 4] / 16 for r in range(y, min(y + bh, 32))
                          for c in range(x, min(x + bw, 32))))  # each pixel of the box: 1/16 of its patch's weight
    assert found["pooling_object_mass"] == pytest.approx(np.mean(masses), abs=1e-6)
    assert found["rollout_effective_patches"] < 60  # sharpened weights: the mass above is not the uniform one
    assert (tmp_path / "eval" / "heatmaps.png").is_file()
