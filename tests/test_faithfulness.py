"""Deletion/insertion faithfulness: random tie-breaks, both removals against plain loops, the paired score against
scipy, and the full run on a real ViT."""

import json

import numpy as np
import pytest
import timm
import torch
from scipy import stats

from harness.faithfulness import (
    embed_patches,
    evaluate_faithfulness,
    faithfulness_curves,
    paired_score,
    random_ranks,
    ranks,
    removal_probabilities,
    step_counts,
)
from harness.features import saliency_maps
from harness.figures import plot_faithfulness
from timm_rollout import capture_attention, patch_weights, rollout_cls_row
from timm_rollout.data import load_image_set, normalize


def tiny(name: str, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, num_classes=10, **{"depth": 2, **kwargs}).eval()


@pytest.fixture(scope="module")
def sample():
    data = load_image_set("cifar10-sample", "test")
    return data.images[:6], data.labels[:6]


def _x(model, images) -> torch.Tensor:
    return normalize(images, model.pretrained_cfg["mean"], model.pretrained_cfg["std"])


def test_steps_and_ranks_keep_distinct_scores_in_order():
    assert step_counts(64) == [0, 6, 13, 19, 26, 32, 38, 45, 51, 58, 64]
    assert step_counts(196)[1] == 20 and step_counts(196)[-1] == 196
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.3], [4.0, 3.0, 2.0, 1.0]])
    for seed in range(5):
        assert ranks(scores, seed).tolist() == [[3, 0, 1, 2], [0, 1, 2, 3]]


def test_ties_are_broken_at_random():
    flat = torch.zeros(4000, 8)
    a, b = ranks(flat, 0), ranks(flat, 1)
    assert not torch.equal(a, b) and torch.equal(a, ranks(flat, 0))  # seeded
    assert torch.equal(a.sort(dim=1).values, torch.arange(8).expand(4000, 8))  # each row a permutation
    first = np.bincount(a.argmin(dim=1).numpy(), minlength=8)  # the patch ranked first in each row
    assert stats.chisquare(first).pvalue > 1e-3, first  # uniform over the 8 patches, not patch 0
    partial = torch.tensor([[0.9, 0.5, 0.5, 0.1]]).expand(200, 4)  # ties only between patches 1 and 2
    r = ranks(partial, 3)
    assert (r[:, 0] == 0).all() and (r[:, 3] == 3).all()
    assert 50 < int((r[:, 1] == 1).sum()) < 150
    assert torch.equal(random_ranks(200, 4, 3), ranks(torch.zeros(200, 4), 3))


@pytest.mark.cuda
def test_ranks_stay_on_the_inputs_device():
    scores = torch.rand(3, 16, device="cuda")
    r = ranks(scores, 0)
    assert r.device == scores.device and torch.equal(r.cpu(), ranks(scores.cpu(), 0))


def _pixel_loop(model, x, rank, k, target) -> np.ndarray:
    """Mean-colour fill by hand: zero the pixels of every patch ranked below k, one image at a time."""
    out = []
    with torch.no_grad():
        for i in range(len(x)):
            img = x[i].clone()
            for patch in range(64):
                if int(rank[i, patch]) < k:
                    r, c = divmod(patch, 8)
                    img[:, r * 4:(r + 1) * 4, c * 4:(c + 1) * 4] = 0.0
            out.append(float(model(img[None]).softmax(dim=1)[0, target[i]]))
    return np.array(out)


def _drop_loop(model, x, rank, k, target) -> np.ndarray:
    """Token drop by hand: [CLS] + its position, then each kept patch token + its own position, one image at a time."""
    out = []
    with torch.no_grad():
        for i in range(len(x)):
            h = model.patch_embed(x[i:i + 1])[0]
            tokens = [model.cls_token[0, 0] + model.pos_embed[0, 0]]
            tokens += [h[j] + model.pos_embed[0, 1 + j] for j in range(64) if int(rank[i, j]) >= k]
            seq = torch.stack(tokens)[None]
            with capture_attention(model) as cap:
                h = model.norm(model.blocks(seq))
            if model.global_pool == "rollout":  # pooling by hand: rollout [CLS] row over the kept patches
                w = patch_weights(rollout_cls_row(cap.attentions, num_prefix_tokens=1), 1)
                pooled = (w[:, :, None] * h[:, 1:]).sum(dim=1)
            else:
                pooled = h[:, 0]
            logits = model.head(pooled)
            out.append(float(logits.softmax(dim=1)[0, target[i]]))
    return np.array(out)


@pytest.mark.parametrize("name", ["vit_tiny_cifar_cls", "vit_tiny_cifar_rollout"])
def test_removals_match_plain_loops(sample, name):
    model = tiny(name)
    x = _x(model, sample[0][:3])
    rank = random_ranks(3, 64, 7)
    target = torch.tensor([1, 4, 7])
    tokens, fill = embed_patches(model, x, batch_size=2, device=torch.device("cpu"), dtype=None)
    counts = [[0, 13, 51, 63], [13, 40]]
    orders = [rank, random_ranks(3, 64, 8)]
    fused = [block.attn.fused_attn for block in model.blocks]
    for mode, loop in (("mean", _pixel_loop), ("drop", _drop_loop)):
        got = removal_probabilities(model, tokens, fill, orders, counts, target, mode=mode, batch_size=2)
        for order, ks, values in zip(orders, counts, got, strict=True):
            want = np.stack([loop(model, x, order, k, target) for k in ks], axis=1)
            np.testing.assert_allclose(values.numpy(), want, atol=1e-5, rtol=1e-4, err_msg=mode)
    assert [block.attn.fused_attn for block in model.blocks] == fused  # restored: the model's own setting


def test_paired_score_is_a_t_interval_over_the_kept_images():
    gen = np.random.default_rng(0)
    map_auc, random_auc = gen.uniform(0, 1, 50), gen.uniform(0, 1, 50)
    p_intact, p_removed = gen.uniform(0.3, 1, 50), gen.uniform(0, 0.4, 50)
    drop = p_intact - p_removed
    got = paired_score(map_auc, random_auc, p_intact, p_removed, min_drop=0.05)
    kept = drop >= 0.05
    v = (map_auc - random_auc)[kept] / drop[kept]
    assert got["n"] == kept.sum() and got["excluded"] == (~kept).sum() > 0
    assert got["mean"] == pytest.approx(v.mean(), abs=1e-5)
    lo, hi = stats.ttest_1samp(v, 0.0).confidence_interval(0.95)
    assert got["ci95"] == pytest.approx([lo, hi], abs=1e-5)
    assert paired_score(map_auc[:1], random_auc[:1], [0.9], [0.1])["ci95"] is None


def test_curves_and_paired_score_of_one_image_by_hand(sample):
    model = tiny("vit_tiny_cifar_cls")
    x = _x(model, sample[0][:1])
    found = saliency_maps(model, x, device=torch.device("cpu"))
    result = faithfulness_curves(model, x, found.logits, found.maps, seeds=(1, 2), tie_seed=4, min_drop=-1.0)
    block = result["fills"]["mean"]
    pred = found.logits.argmax(dim=1)
    rank = ranks(found.maps["rollout"], 4)
    inner = step_counts(64)[1:-1]
    deletion = [_pixel_loop(model, x, rank, k, pred)[0] for k in inner]
    np.testing.assert_allclose(block["maps"]["rollout"]["deletion_curve"][1:-1], deletion, atol=1e-5)
    insertion = [_pixel_loop(model, x, 63 - rank, 64 - k, pred)[0] for k in inner]  # reveal the top k
    np.testing.assert_allclose(block["maps"]["rollout"]["insertion_curve"][1:-1], insertion, atol=1e-5)
    for mode, fill in result["fills"].items():
        drop = result["original_probability"] - fill["all_removed_probability"]
        per_seed = [fill["maps"]["random"]["per_seed"][s]["deletion_auc"] for s in ("1", "2")]
        rand = np.mean(per_seed)
        spread = abs(per_seed[0] - per_seed[1]) / np.sqrt(2)  # the sample std of two values, by hand
        assert fill["maps"]["random"]["deletion_auc_std"] == pytest.approx(spread, abs=1e-9)
        for name in found.maps:
            want = (fill["maps"][name]["deletion_auc"] - rand) / drop
            # unrounded AUCs and probabilities: the one-image score equals its formula to float64 rounding
            assert fill["paired"][name]["deletion"]["mean"] == pytest.approx(want, rel=1e-6, abs=1e-9), (mode, name)


@pytest.mark.parametrize("name", ["vit_tiny_cifar_cls", "vit_tiny_cifar_rollout"])
def test_evaluate_faithfulness_on_a_real_vit(tmp_path, sample, name):
    images, labels = sample
    model = tiny(name)
    n = 3
    result = evaluate_faithfulness(model, images[:n], labels[:n], model.pretrained_cfg["mean"],
                                   model.pretrained_cfg["std"], batch_size=128, seeds=(1, 2))
    assert set(result["fills"]) == {"mean", "drop"}
    assert result["forward_passes"] == {"perturbed": 2 * n * 9 * (3 * 2 + 2), "all_removed": 2, "forward_backward": n,
                                        "total_forward": n + 2 * n * 9 * 8 + 2}
    for block in result["fills"].values():
        assert list(block["maps"]) == ["rollout", "gradient_rollout", "last_layer_attention", "random"]
        for summary in block["maps"].values():
            assert summary["deletion_curve"][0] == pytest.approx(result["original_probability"], abs=1e-5)
            assert summary["deletion_curve"][-1] == pytest.approx(block["all_removed_probability"], abs=1e-5)
            assert summary["insertion_curve"][0] == pytest.approx(block["all_removed_probability"], abs=1e-5)
            assert len(summary["insertion_curve"]) == 11
    x = _x(model, images[:n])
    with torch.no_grad():
        pred = model(x).argmax(dim=1)
        mean_fill = model(torch.zeros(1, 3, 32, 32)).softmax(dim=1)[0, pred]  # all patches the mean colour
        prefix_only = (model.cls_token + model.pos_embed[:, :1])  # every patch token dropped
        if name == "vit_tiny_cifar_cls":
            empty = model.forward_head(model.norm(model.blocks(prefix_only))).softmax(dim=1)[0, pred]
        else:  # rollout pooling over no patch token: the empty sum, so the head sees 0
            empty = model.head.bias.softmax(dim=0)[pred]
    assert result["fills"]["mean"]["all_removed_probability"] == pytest.approx(float(mean_fill.mean()), abs=1e-5)
    assert result["fills"]["drop"]["all_removed_probability"] == pytest.approx(float(empty.mean()), abs=1e-5)
    assert result["wall_time_s"] > 0 and 0 <= result["original_top1"] <= 1
    assert plot_faithfulness(result, tmp_path / "faithfulness.png", "tiny ViT").stat().st_size > 10_000


def test_a_learned_attention_pool_over_no_patch_pools_an_empty_weighted_sum(sample):
    """Independent route: one token whose value vector is 0, so the pool's attention over it alone is exactly the
    empty weighted sum; timm's own pool, fc_norm and head then give the all-dropped probability."""
    images, labels = sample
    model = tiny("vit_tiny_cifar_cls", global_pool="map")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # timm initialises biases and the head to 0, under which every empty pooling looks alike
        for p in [*model.attn_pool.parameters(), *model.fc_norm.parameters(), *model.head.parameters()]:
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    result = evaluate_faithfulness(model, images[:2], labels[:2], model.pretrained_cfg["mean"],
                                   model.pretrained_cfg["std"], batch_size=128, seeds=(1,))
    pool, d = model.attn_pool, model.embed_dim
    with torch.no_grad():
        silent = torch.linalg.solve(pool.kv.weight[d:].double(), -pool.kv.bias[d:].double()).float()
        assert float(pool.kv(silent)[d:].abs().max()) < 1e-5
        pred = model(_x(model, images[:2])).argmax(dim=1)
        empty = model.head(model.fc_norm(pool(silent[None, None]))).softmax(dim=1)[0, pred]
        assert float((empty - model.head.bias.softmax(dim=0)[pred]).abs().max()) > 1e-3  # not the plain empty sum
    assert result["fills"]["drop"]["all_removed_probability"] == pytest.approx(float(empty.mean()), abs=1e-5)


def test_eval_cli_writes_faithfulness(tmp_path):
    from harness.eval import main

    out = tmp_path / "eval"
    results = main(["--model", "vit_tiny_cifar_rollout", "--dataset", "cifar10-sample", "--per-class", "2",
                    "--heatmaps", "0", "--faithfulness", "--faithfulness-images", "2", "--device", "cpu",
                    "--amp", "none", "--output", str(out)])
    faith = results["faithfulness"]
    assert faith["num_images"] == 2 and faith["seeds"] == [1, 2, 3] and faith["tie_seed"] == 0
    assert faith["readout"] == "rollout-weights"
    saved = json.loads((out / "results.json").read_text())["faithfulness"]
    assert saved["fills"]["drop"]["paired"].keys() == faith["fills"]["drop"]["paired"].keys()
    assert (out / "faithfulness.png").exists() and "faithfulness.png" in results["outputs"]["figures"]


def test_rollout_pooling_in_place_of_a_learned_attention_pool_pools_no_patch_to_zero(sample):
    """A model built with ``global_pool='map'`` and pooled by rollout never runs its attention pool: with every patch
    removed its pooled feature is the empty weighted sum, 0, and the head reads that (not the pool's output of 0)."""
    from timm_rollout import set_pooling

    images, labels = sample
    model = tiny("vit_tiny_cifar_cls", global_pool="map")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the pool's projection and MLP would move an empty sum away from 0
        for p in [*model.attn_pool.parameters(), *model.head.parameters()]:
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    set_pooling(model, "rollout")
    result = evaluate_faithfulness(model, images[:2], labels[:2], model.pretrained_cfg["mean"],
                                   model.pretrained_cfg["std"], batch_size=128, seeds=(1,))
    with torch.no_grad():
        pred = model(_x(model, images[:2])).argmax(dim=1)
        empty = model.head(torch.zeros(1, model.embed_dim)).softmax(dim=1)[0, pred]
        pooled_by_map = model.head(model.attn_pool(torch.zeros(1, 1, model.embed_dim))).softmax(dim=1)[0, pred]
        assert float((empty - pooled_by_map).abs().max()) > 1e-3  # the check tells the two apart
    assert result["fills"]["drop"]["all_removed_probability"] == pytest.approx(float(empty.mean()), abs=1e-6)
