"""harness.metrics against independent recomputations (plain numpy loops, scikit-learn, known answers)."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import silhouette_score
from sklearn.neighbors import KNeighborsClassifier

from harness import metrics


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 5, size=300)
    centres = rng.normal(size=(5, 16))
    features = centres[labels] * 0.8 + rng.normal(size=(300, 16))  # separable but overlapping classes
    return features.astype(np.float32), labels


def _unit(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _loop_knn_loo(features: np.ndarray, labels: np.ndarray, k: int) -> float:
    """Plain-loop leave-one-out k-NN: exclude the query by index, majority vote, ties by summed similarity."""
    x = _unit(features)
    correct = 0
    for i in range(len(x)):
        sims = x @ x[i]
        order = [j for j in np.argsort(-sims, kind="stable") if j != i][:k]
        votes: dict[int, list[float]] = {}
        for j in order:
            votes.setdefault(int(labels[j]), []).append(float(sims[j]))
        best = max(votes.items(), key=lambda kv: (len(kv[1]), sum(kv[1]), -kv[0]))[0]
        correct += best == labels[i]
    return correct / len(x)


@pytest.mark.parametrize("k", [1, 5])
def test_knn_original_counts_the_query_like_a_plain_loop(data, k):
    """The original study's k-NN: the query is its own first neighbour (so k=1 is always right)."""
    features, labels = data
    x = _unit(features)
    correct = 0
    for i in range(len(x)):
        sims = x @ x[i]
        order = [i, *[j for j in np.argsort(-sims, kind="stable") if j != i]][:k]
        votes: dict[int, list[float]] = {}
        for j in order:
            votes.setdefault(int(labels[j]), []).append(float(sims[j]))
        correct += max(votes.items(), key=lambda kv: (len(kv[1]), sum(kv[1]), -kv[0]))[0] == labels[i]
    assert metrics.knn_original(features, labels, k) == pytest.approx(correct / len(x), abs=1e-12)
    assert metrics.original_metrics(features, labels)["knn_original"] == metrics.knn_original(features, labels)
    assert metrics.knn_original(features, labels, 5) >= metrics.knn_loo(features, labels, 4) - 1e-12


@pytest.mark.parametrize("k", [1, 5, 8])
def test_knn_loo_matches_plain_loops(data, k):
    features, labels = data
    assert metrics.knn_loo(features, labels, k) == pytest.approx(_loop_knn_loo(features, labels, k), abs=1e-12)


def test_knn_loo_never_counts_the_query():
    # Each query's nearest other point has the other class: counting itself (k=1) would score 100%.
    features = np.array([[1.0, 0.0], [0.99, 0.14], [0.0, 1.0], [0.14, 0.99]], dtype=np.float32)
    labels = np.array([0, 1, 0, 1])
    assert metrics.knn_loo(features, labels, k=1) == 0.0
    # k=2: the query itself would tie-break its own vote; without it, its class loses on both pairs.
    assert metrics.knn_loo(features, labels, k=2) == pytest.approx(_loop_knn_loo(features, labels, 2))


def test_knn_loo_drops_self_by_index_with_duplicates():
    # Exact duplicates with different labels: dropping "similarity 1" would drop the twin too.
    rng = np.random.default_rng(1)
    base = rng.normal(size=(20, 8)).astype(np.float32)
    features = np.concatenate([base, base])
    labels = np.concatenate([np.zeros(20, int), np.ones(20, int)])
    assert metrics.knn_loo(features, labels, k=1) == 0.0  # every point's neighbour is its twin of the other class
    assert metrics.knn_loo(features, labels, k=3) == pytest.approx(_loop_knn_loo(features, labels, 3))


def test_knn_loo_ties_go_to_larger_summed_similarity():
    # k=2 around the query: one neighbour of each class; class 1's is closer, so class 1 wins the tie.
    features = np.array([[1.0, 0.0], [0.9, 0.1], [0.8, -0.6], [-1.0, 0.0], [-1.0, 0.05]], dtype=np.float32)
    labels = np.array([1, 1, 0, 0, 0])
    x = metrics.l2_normalize(features)
    ids = metrics.search(x, x, 3)[1]
    assert set(ids[0, 1:].tolist()) == {1, 2}
    # Points 0 and 1 tie 1-1 and win by similarity (a lowest-class-id rule would give 2/5); point 2 loses 0-2.
    assert metrics.knn_loo(features, labels, k=2) == pytest.approx(0.8)
    assert _loop_knn_loo(features, labels, 2) == pytest.approx(0.8)


def test_knn_bank_matches_sklearn_and_loops(data):
    features, labels = data
    bank, bank_y, queries, query_y = features[:200], labels[:200], features[200:], labels[200:]
    k, t = 20, 0.07
    ours = metrics.knn_bank(bank, bank_y, queries, query_y, k=k, temperature=t)
    clf = KNeighborsClassifier(n_neighbors=k, algorithm="brute", metric="cosine",
                               weights=lambda d: np.exp((1.0 - d) / t)).fit(bank, bank_y)
    assert ours == pytest.approx(float((clf.predict(queries) == query_y).mean()), abs=1e-12)
    xb, xq = _unit(bank), _unit(queries)
    correct = 0
    for q, y in zip(xq, query_y, strict=True):
        sims = xb @ q
        scores = np.zeros(5)
        for j in np.argsort(-sims)[:k]:
            scores[bank_y[j]] += np.exp(sims[j] / t)
        correct += scores.argmax() == y
    assert ours == pytest.approx(correct / len(xq), abs=1e-12)


def _circle(degrees: list[float]) -> np.ndarray:
    rad = np.deg2rad(degrees)
    return np.stack([np.cos(rad), np.sin(rad)], axis=1)


def test_rescaled_two_class_layout_keeps_its_ratio():
    """Two classes on a circle, each symmetric about its direction, and the same layout with every angle halved
    (same shape, smaller scale): intra 7.5 deg -> 3.75 deg, inter 120 deg -> 60 deg, ratio 16 both times. The
    original study's mixed units give two different ratios for the same shape."""
    layout = [50.0, 55.0, 65.0, 70.0, -70.0, -65.0, -55.0, -50.0]
    labels = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    full = metrics.centroid_metrics(_circle(layout), labels)
    half = metrics.centroid_metrics(_circle([a / 2 for a in layout]), labels)
    assert full["intra"] == pytest.approx(np.deg2rad(7.5)) and full["inter"] == pytest.approx(np.deg2rad(120.0))
    assert half["intra"] == pytest.approx(np.deg2rad(3.75)) and half["inter"] == pytest.approx(np.deg2rad(60.0))
    assert half["ratio"] == pytest.approx(full["ratio"], rel=1e-6)  # features are float32
    assert full["ratio"] == pytest.approx(16.0, rel=1e-6)
    orig_full = metrics.original_metrics(_circle(layout), labels)
    orig_half = metrics.original_metrics(_circle([a / 2 for a in layout]), labels)
    assert orig_full["ratio_original"] > 1.5 * orig_half["ratio_original"]


def test_a_class_with_one_image_is_left_out_of_intra_but_not_of_inter():
    """Three classes on the circle, by hand: class 0 at 0 +- 10 deg, class 1 at 90 +- 20 deg, class 2 one image at
    200 deg. intra = (10 + 20) / 2 = 15 deg (a lone image has no spread; counted as 0 it would give 10 deg), inter
    = mean(90, 160, 110) = 120 deg over all three directions, ratio 8. The original study's intra is the mean of
    the chord lengths sin 10 deg and sin 20 deg to the (not renormalised) centroids."""
    features, labels = _circle([-10.0, 10.0, 70.0, 110.0, 200.0]), np.array([0, 0, 1, 1, 2])
    assert metrics.lone_classes(labels).tolist() == [2]
    got = metrics.centroid_metrics(features, labels)
    assert got["intra"] == pytest.approx(np.deg2rad(15.0)) and got["inter"] == pytest.approx(np.deg2rad(120.0))
    assert got["ratio"] == pytest.approx(8.0, rel=1e-6)
    original = metrics.original_metrics(features, labels)
    assert original["intra_original"] == pytest.approx((np.sin(np.deg2rad(10)) + np.sin(np.deg2rad(20))) / 2)
    lone = metrics.centroid_metrics(_circle([0.0, 90.0]), np.array([0, 1]))  # no class has a spread
    assert lone["intra"] is None and lone["ratio"] is None and lone["inter"] == pytest.approx(np.pi / 2)
    assert metrics.original_metrics(_circle([0.0, 90.0]), np.array([0, 1]))["ratio_original"] is None


def test_centroid_metrics_match_plain_loops(data):
    """Angles by arccos in plain loops: feature to class direction, direction to direction."""
    features, labels = data
    got = metrics.centroid_metrics(features, labels)
    x = _unit(features)
    classes = sorted(set(labels.tolist()))
    dirs = {c: x[labels == c].mean(axis=0) / np.linalg.norm(x[labels == c].mean(axis=0)) for c in classes}
    intra = np.mean([np.mean([np.arccos(np.clip(v @ dirs[c], -1, 1)) for v in x[labels == c]]) for c in classes])
    pairs = [(a, b) for i, a in enumerate(classes) for b in classes[i + 1:]]
    inter = np.mean([np.arccos(np.clip(dirs[a] @ dirs[b], -1, 1)) for a, b in pairs])
    assert got["intra"] == pytest.approx(intra, rel=1e-9)
    assert got["inter"] == pytest.approx(inter, rel=1e-9)
    assert got["ratio"] == pytest.approx(inter / intra, rel=1e-9)


def test_original_metrics_match_plain_loops(data):
    features, labels = data
    got = metrics.original_metrics(features, labels)
    x = _unit(features)
    classes = sorted(set(labels.tolist()))
    cents = {c: x[labels == c].mean(axis=0) for c in classes}
    intra = np.mean([np.mean([np.linalg.norm(v - cents[c]) for v in x[labels == c]]) for c in classes])
    pairs = [(a, b) for i, a in enumerate(classes) for b in classes[i + 1:]]
    inter = np.mean([
        1 - cents[a] @ cents[b] / (np.linalg.norm(cents[a]) * np.linalg.norm(cents[b])) for a, b in pairs
    ])
    assert got["intra_original"] == pytest.approx(intra, rel=1e-6)
    assert got["inter_original"] == pytest.approx(inter, rel=1e-6)
    assert got["ratio_original"] == pytest.approx(inter / intra, rel=1e-6)


def test_angles_are_accurate_near_zero():
    u = np.array([1.0, 0.0])
    x = _circle([1e-6, 0.0, 180.0])
    assert metrics.angles(x, u) == pytest.approx([np.deg2rad(1e-6), 0.0, np.pi], rel=1e-9, abs=1e-15)


def _separable(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Four classes around orthogonal directions with a wide margin: any sound linear probe is perfect."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, size=n)
    return (np.eye(16)[labels] * 3.0 + rng.normal(scale=0.2, size=(n, 16))).astype(np.float32), labels


def test_linear_probe_known_answer_and_sklearn_route():
    """Separable data: perfect on clean queries, and exactly 1 - flipped when 10% of query labels are wrong."""
    bank, bank_y = _separable(400, 0)
    queries, query_y = _separable(200, 1)
    assert metrics.linear_probe(bank, bank_y, queries, query_y) == 1.0
    flipped = query_y.copy()
    flipped[:20] = (flipped[:20] + 1) % 4
    assert metrics.linear_probe(bank, bank_y, queries, flipped) == pytest.approx(0.9)


def test_linear_probe_matches_an_independent_sklearn_pipeline(data):
    """Overlapping classes: the probe's predictions equal a Normalizer -> PCA(whiten) -> LogisticRegression
    pipeline's (the documented settings; PCA's rotation differs, the L2 penalty does not see it), and its
    accuracy is far above chance."""
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import Normalizer

    features, labels = data
    bank, bank_y, queries, query_y = features[:200], labels[:200], features[200:], labels[200:]
    ours = metrics.linear_probe_predictions(bank, bank_y, queries)
    ref = make_pipeline(Normalizer(), PCA(whiten=True), LogisticRegression(C=1.0, max_iter=1000, tol=1e-4))
    theirs = ref.fit(bank.astype(np.float64), bank_y).predict(queries.astype(np.float64))
    assert (ours == theirs).mean() >= 0.99
    assert metrics.accuracy(ours, query_y) > 0.5  # 5 classes: chance is 0.2
    assert metrics.linear_probe_predictions(bank, bank_y, queries).tolist() == ours.tolist()  # deterministic


def test_whitening_gives_unit_covariance(data):
    x = metrics.l2_normalize(data[0])
    mean, w = metrics.whitening(x)
    assert np.cov(((x - mean) @ w).astype(np.float64), rowvar=False) == pytest.approx(np.eye(16), abs=1e-4)
    flat = np.concatenate([x[:, :15], np.full((len(x), 1), 0.5, np.float32)], axis=1)  # a constant dimension
    assert np.isfinite(metrics.whitening(flat)[1]).all()


def test_per_image_predictions_agree_with_the_accuracies(data):
    features, labels = data
    loo = metrics.knn_loo_predictions(features, labels, 5)
    assert loo.shape == labels.shape and metrics.accuracy(loo, labels) == metrics.knn_loo(features, labels, 5)
    bank = metrics.knn_bank_predictions(features[:200], labels[:200], features[200:])
    assert metrics.accuracy(bank, labels[200:]) == metrics.knn_bank(features[:200], labels[:200], features[200:],
                                                                     labels[200:])


def test_cosine_matrix_of_centroids(data):
    features, labels = data
    classes, cents = metrics.centroids(features, labels)
    assert classes.tolist() == [0, 1, 2, 3, 4]
    cos = metrics.cosine_matrix(cents)
    for i in range(5):
        for j in range(5):
            a, b = cents[i], cents[j]
            assert cos[i, j] == pytest.approx(a @ b / np.linalg.norm(a) / np.linalg.norm(b), abs=1e-9)


def test_silhouette_matches_definition_and_samples_above_limit(data):
    features, labels = data
    score, sample = metrics.silhouette(features, labels)
    assert sample is None
    x = _unit(features)
    dist = np.linalg.norm(x[:, None] - x[None], axis=-1)
    values = []
    for i in range(len(x)):
        same = labels == labels[i]
        a = dist[i, same].sum() / (same.sum() - 1)
        b = min(dist[i, labels == c].mean() for c in set(labels.tolist()) if c != labels[i])
        values.append((b - a) / max(a, b))
    assert score == pytest.approx(np.mean(values), abs=1e-5)
    sampled, size = metrics.silhouette(features, labels, seed=3, sample_size=100)
    assert size == 100
    assert sampled == pytest.approx(silhouette_score(x, labels, sample_size=100, random_state=3), abs=1e-5)


def test_topk_hits_match_loops():
    rng = np.random.default_rng(2)
    logits, labels = rng.normal(size=(50, 7)), rng.integers(0, 7, size=50)
    for k in (1, 5):
        hits = [y in np.argsort(-row)[:k] for row, y in zip(logits, labels, strict=True)]
        assert metrics.topk_hits(logits, labels, k).tolist() == hits


def test_faiss_thread_setting_leaves_torch_threads_alone(data):
    """torch and faiss can share one OpenMP runtime: the search must restore the thread count it changed."""
    import torch

    before = torch.get_num_threads()
    x = metrics.l2_normalize(data[0])
    metrics.search(x, x, 3, threads=1)
    assert torch.get_num_threads() == before


def test_effective_patches_is_the_perplexity_of_the_weights():
    import math

    import torch

    from timm_rollout.rollout import effective_patches

    rng = np.random.default_rng(3)
    raw = rng.random((5, 64)) ** 4
    raw[1, 10:] = 0.0  # zeros count as 0 log 0 = 0
    w = torch.tensor(raw / raw.sum(axis=1, keepdims=True), dtype=torch.float32)
    want = [math.exp(-sum(p * math.log(p) for p in row if p > 0)) for row in w.double().tolist()]
    np.testing.assert_allclose(effective_patches(w).numpy(), want, rtol=1e-5)
    edges = torch.stack([torch.full((64,), 1 / 64), torch.eye(64)[7]])
    np.testing.assert_allclose(effective_patches(edges).numpy(), [64.0, 1.0], rtol=1e-5)


def test_cosine_to_mean_and_pooling_weights_against_plain_routes():
    import torch

    from timm_rollout import attention_rollout
    from timm_rollout.rollout import cosine_to_mean, pooling_weights

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(3, 16, 8, generator=gen)
    w = torch.rand(3, 16, generator=gen) ** 3
    w = w / w.sum(dim=1, keepdim=True)
    got = cosine_to_mean(tokens, w).numpy()
    for i in range(3):
        pooled = sum(float(w[i, p]) * tokens[i, p].double().numpy() for p in range(16))
        mean = tokens[i].double().numpy().mean(axis=0)
        want = pooled @ mean / (np.linalg.norm(pooled) * np.linalg.norm(mean))
        assert abs(got[i] - want) < 1e-5
    np.testing.assert_allclose(cosine_to_mean(tokens, torch.full((3, 16), 1 / 16)).numpy(), 1.0, rtol=1e-6)
    big = torch.randn(64, 64, 128, generator=gen)  # the training log computes it inside CPU bf16 autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = cosine_to_mean(big, torch.full((64, 64), 1 / 64))
    assert under.dtype == torch.float32 and float((under - 1).abs().max()) < 1e-6
    attn = [torch.rand(3, 2, 17, 17, generator=gen).softmax(dim=-1) for _ in range(3)]
    for fusion, ratio in (("mean", 0.0), ("max", 0.5), ("min", 0.9)):
        row = attention_rollout(attn, fusion, ratio)[:, 0, 1:]  # the full matrix product, [CLS] row
        torch.testing.assert_close(pooling_weights(attn, 1, fusion, ratio), row / row.sum(dim=1, keepdim=True))


def test_relative_to_uniform_scale_and_one_colour_range():
    import torch

    from harness.figures import relative_to_uniform, shared_range

    maps = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.1, 0.1, 0.2], [3.0, 1.0, 0.0, 0.0]])
    want = [[v / sum(row) * len(row) for v in row] for row in maps.tolist()]  # share of the total x P
    np.testing.assert_allclose(relative_to_uniform(maps).numpy(), want, rtol=1e-6)
    assert relative_to_uniform(torch.zeros(1, 4)).tolist() == [[0.0] * 4]  # an empty map stays 0, no NaN
    assert shared_range([relative_to_uniform(maps), torch.ones(2, 4)]) == (0.0, 3.0)
    assert shared_range([torch.ones(2, 4)]) == (0.0, 2.0)  # near-uniform maps keep a range that shows it
