"""harness.metrics against independent recomputations (plain numpy loops, scikit-learn) on random features."""

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


def test_centroid_metrics_match_plain_loops(data):
    features, labels = data
    got = metrics.centroid_metrics(features, labels)
    x = _unit(features)
    classes = sorted(set(labels.tolist()))
    cents = {c: x[labels == c].mean(axis=0) for c in classes}
    intra = np.mean([np.mean([np.linalg.norm(v - cents[c]) for v in x[labels == c]]) for c in classes])
    pairs = [(a, b) for i, a in enumerate(classes) for b in classes[i + 1:]]
    inter = np.mean([
        1 - cents[a] @ cents[b] / (np.linalg.norm(cents[a]) * np.linalg.norm(cents[b])) for a, b in pairs
    ])
    assert got["intra"] == pytest.approx(intra, rel=1e-6)
    assert got["inter"] == pytest.approx(inter, rel=1e-6)
    assert got["ratio"] == pytest.approx(inter / intra, rel=1e-6)


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


def test_topk_accuracy_matches_loops():
    rng = np.random.default_rng(2)
    logits, labels = rng.normal(size=(50, 7)), rng.integers(0, 7, size=50)
    for k in (1, 5):
        expected = np.mean([y in np.argsort(-row)[:k] for row, y in zip(logits, labels, strict=True)])
        assert metrics.topk_accuracy(logits, labels, k) == pytest.approx(expected)
    assert metrics.topk_accuracy(logits[:, :3], labels, 5) is None


def test_faiss_thread_setting_leaves_torch_threads_alone(data):
    """torch and faiss can share one OpenMP runtime: the search must restore the thread count it changed."""
    import torch

    before = torch.get_num_threads()
    x = metrics.l2_normalize(data[0])
    metrics.search(x, x, 3, threads=1)
    assert torch.get_num_threads() == before
