"""Deletion/insertion curves: a planted-evidence model checked by plain loops, and the full run on a real ViT."""

import json

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from harness.faithfulness import (
    _random_ranks,
    evaluate_faithfulness,
    faithfulness_curves,
    perturbation_probabilities,
    plot_faithfulness,
    ranks,
    step_counts,
)

GRID = (4, 4)
PATCH = 4


class PlantedEvidence(nn.Module):
    """Class 0's logit counts bright patches (mean > 0.5); class 1's is a constant 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        patch_means = F.avg_pool2d(x.mean(dim=1, keepdim=True), PATCH).flatten(1)
        evidence = F.relu(patch_means - 0.5).sum(dim=1)
        return torch.stack([3 * evidence, torch.ones_like(evidence)], dim=1)


@pytest.fixture(scope="module")
def planted():
    """Noise images with 4 bright patches each at random places; the map scores exactly those patches."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(12, 3, 16, 16, generator=gen) - 0.5) * 0.6
    scores = torch.zeros(12, 16)
    for i in range(12):
        for patch in torch.randperm(16, generator=gen)[:4].tolist():
            r, c = divmod(patch, GRID[1])
            x[i, :, r * PATCH:(r + 1) * PATCH, c * PATCH:(c + 1) * PATCH] = 1.0
            scores[i, patch] = 1.0
    return x, scores


def loop_curve(model, x, rank, removed_if) -> np.ndarray:
    """Mean probability of the intact prediction at each step, by plain loops over images and patches."""
    p = GRID[0] * GRID[1]
    with torch.no_grad():
        pred = model(x).argmax(dim=1)
        curve = []
        for k in step_counts(p):
            probs = []
            for i in range(len(x)):
                img = x[i].clone()
                for patch in range(p):
                    if removed_if(int(rank[i, patch]), k):
                        r, c = divmod(patch, GRID[1])
                        img[:, r * PATCH:(r + 1) * PATCH, c * PATCH:(c + 1) * PATCH] = 0.0
                probs.append(float(model(img[None]).softmax(dim=1)[0, pred[i]]))
            curve.append(np.mean(probs))
    return np.array(curve)


def test_steps_and_ranks():
    assert step_counts(64) == [0, 6, 13, 19, 26, 32, 38, 45, 51, 58, 64]
    assert step_counts(196)[1] == 20 and step_counts(196)[-1] == 196
    assert ranks(torch.tensor([[0.1, 0.9, 0.5, 0.9]])).tolist() == [[3, 0, 2, 1]]  # ties keep patch order


def test_planted_evidence_map_beats_random(planted):
    x, scores = planted
    model = PlantedEvidence()
    result = faithfulness_curves(model, x, model(x), {"planted": scores}, GRID, seeds=(0, 1, 2), batch_size=50)
    map_, rand = result["maps"]["planted"], result["maps"]["random"]
    assert map_["deletion_curve"][0] > 0.99 and map_["deletion_curve"][-1] == pytest.approx(1 / (1 + np.e), abs=1e-5)
    assert map_["deletion_auc"] < rand["deletion_auc"] - 0.2
    assert map_["insertion_auc"] > rand["insertion_auc"] + 0.15
    assert result["vs_random"]["planted"]["deletion_auc_lower_by"] > 0.2
    assert rand["deletion_auc_std"] > 0 and set(rand["per_seed"]) == {"0", "1", "2"}
    # 9 inner steps x (2 curves for the map + 1 pass set per seed) per image
    assert result["forward_passes"]["perturbed"] == 12 * 9 * (2 + 3)
    # independent route: plain loops, and the trapezoid rule over the actual fractions
    r = ranks(scores)
    deletion = loop_curve(model, x, r, lambda rank, k: rank < k)
    insertion = loop_curve(model, x, r, lambda rank, k: rank >= k)
    np.testing.assert_allclose(map_["deletion_curve"], deletion, atol=1e-5)
    np.testing.assert_allclose(map_["insertion_curve"], insertion, atol=1e-5)
    fractions = np.array(step_counts(16)) / 16
    assert map_["deletion_auc"] == pytest.approx(np.trapezoid(deletion, fractions), abs=1e-4)


def test_random_insertion_is_the_reversed_order_revealed(planted):
    x, _ = planted
    model = PlantedEvidence()
    result = faithfulness_curves(model, x, model(x), {}, GRID, seeds=(5,))
    r = _random_ranks(len(x), 16, 5)
    reversed_rank = 15 - r  # the reverse permutation: its most salient patch is r's least
    insertion = loop_curve(model, x, reversed_rank, lambda rank, k: rank >= k)
    deletion = loop_curve(model, x, r, lambda rank, k: rank < k)
    np.testing.assert_allclose(result["maps"]["random"]["insertion_curve"], insertion, atol=1e-5)
    np.testing.assert_allclose(result["maps"]["random"]["deletion_curve"], deletion, atol=1e-5)


def test_evaluate_faithfulness_on_a_real_vit(tmp_path):
    from timm_rollout.data import load_image_set

    data = load_image_set("cifar10-sample", "test")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_cifar_rollout", num_classes=10, depth=2).eval()
    cfg = model.pretrained_cfg
    n = 4
    result = evaluate_faithfulness(model, data.images[:n], data.labels[:n], cfg["mean"], cfg["std"],
                                   batch_size=128, seeds=(0, 1))
    assert set(result["maps"]) == {"rollout_weights", "last_cls_attention", "gradient_rollout", "random"}
    assert result["forward_passes"] == {"perturbed": n * 9 * (3 * 2 + 2), "all_removed": 1, "forward_backward": n,
                                        "total_forward": n + n * 9 * 8 + 1}
    for summary in result["maps"].values():
        assert summary["deletion_curve"][0] == pytest.approx(result["original_probability"], abs=1e-5)
        assert summary["deletion_curve"][-1] == pytest.approx(result["all_removed_probability"], abs=1e-5)
        assert summary["insertion_curve"][0] == pytest.approx(result["all_removed_probability"], abs=1e-5)
        assert len(summary["insertion_curve"]) == 11
    assert result["wall_time_s"] > 0 and 0 <= result["original_top1"] <= 1
    # the removed-patch fill is the model's mean colour: a fully removed image is all zeros after normalisation
    with torch.no_grad():
        probs = model(torch.zeros(1, 3, 32, 32)).softmax(dim=1)[0]
        pred = model((data.images[:n].float() / 255 - torch.tensor(cfg["mean"]).view(3, 1, 1))
                     / torch.tensor(cfg["std"]).view(3, 1, 1)).argmax(dim=1)
    assert result["all_removed_probability"] == pytest.approx(float(probs[pred].mean()), abs=1e-5)
    path = plot_faithfulness(result, tmp_path / "faithfulness.png", "tiny ViT")
    assert path.stat().st_size > 10_000


def test_eval_cli_writes_faithfulness(tmp_path):
    from harness.eval import main

    out = tmp_path / "eval"
    results = main(["--model", "vit_tiny_cifar_rollout", "--dataset", "cifar10-sample", "--per-class", "2",
                    "--heatmaps", "0", "--faithfulness", "--faithfulness-images", "3", "--output", str(out)])
    faith = results["faithfulness"]
    assert faith["num_images"] == 3 and faith["seeds"] == [0, 1, 2]
    assert json.loads((out / "results.json").read_text())["faithfulness"]["maps"].keys() == faith["maps"].keys()
    assert (out / "faithfulness.png").exists() and "faithfulness.png" in results["outputs"]["figures"]


def test_perturbed_passes_of_a_cls_model_run_fused_with_the_same_probabilities():
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_cifar_cls", num_classes=10, depth=2).eval()
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    removed = torch.rand(3, 2, 64, generator=torch.Generator().manual_seed(3)) < 0.5
    target = torch.tensor([1, 4, 7])
    got = perturbation_probabilities(model, x, removed, (8, 8), target, batch_size=4)
    assert all(block.attn.fused_attn is False for block in model.blocks)  # restored: the model's own setting
    keep = (~removed).view(3, 2, 1, 8, 8).repeat_interleave(4, dim=3).repeat_interleave(4, dim=4).float()
    with torch.no_grad():
        want = torch.stack([model(x * keep[:, j]).softmax(dim=1)[torch.arange(3), target] for j in range(2)], dim=1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
