"""Benchmark the harness's metric stage: faiss against scikit-learn on the same k-NN search and vote.

    python scripts/bench_harness.py [--queries 10000] [--bank 50000]

Times the bank k-NN (k=20, exp(sim/0.07) votes) and the leave-one-out 5-NN on random clustered features, faiss
(``harness.metrics``) against scikit-learn's brute-force ``KNeighborsClassifier``, checks they agree, and prints
the speed ratios. Feature extraction is timed by ``scripts/bench_faithfulness.py`` (its inference row) and
``scripts/bench_models.py --infer-batches``.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from _bench import machine_line, timed

from harness import metrics
from timm_rollout.cli import CliParser, positive_int, run_cli


def _features(n: int, dim: int, classes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian clusters around random class centres: k-NN accuracy well between chance and 1."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, size=n)
    centres = rng.normal(size=(classes, dim))
    return (centres[labels] * 0.35 + rng.normal(size=(n, dim))).astype(np.float32), labels


def _sklearn_bank(bank, bank_y, queries, query_y, k: int, temperature: float) -> float:
    from sklearn.neighbors import KNeighborsClassifier  # here, so that --help loads no scikit-learn

    clf = KNeighborsClassifier(n_neighbors=k, algorithm="brute", metric="cosine",
                               weights=lambda d: np.exp((1.0 - d) / temperature)).fit(bank, bank_y)
    return float((clf.predict(queries) == query_y).mean())


def _sklearn_loo(features, labels, k: int) -> float:
    """Leave-one-out k-NN with scikit-learn: k+1 neighbours, drop self by index, majority vote, ties by sum."""
    from sklearn.neighbors import KNeighborsClassifier

    clf = KNeighborsClassifier(n_neighbors=k + 1, algorithm="brute", metric="cosine").fit(features, labels)
    dist, ids = clf.kneighbors(features)
    n = len(features)
    drop = ids == np.arange(n)[:, None]
    drop[~drop.any(axis=1), -1] = True
    ids, sims = ids[~drop].reshape(n, k), 1.0 - dist[~drop].reshape(n, k)
    classes = int(labels.max()) + 1
    counts = np.zeros((n, classes))
    summed = np.zeros((n, classes))
    rows = np.repeat(np.arange(n), k)
    np.add.at(counts, (rows, labels[ids].ravel()), 1.0)
    np.add.at(summed, (rows, labels[ids].ravel()), sims.ravel())
    pred = np.where(counts == counts.max(axis=1, keepdims=True), summed, -np.inf).argmax(axis=1)
    return float((pred == labels).mean())


def bench_metrics(queries: int, bank: int, dim: int) -> None:
    x, y = _features(queries + bank, dim, 10)
    xq, yq, xb, yb = x[:queries], y[:queries], x[queries:], y[queries:]
    print(f"metric stage: {queries} queries, {bank} bank features, dim {dim}, 10 classes")
    rows = [
        ("bank k-NN (k=20, T=0.07)", lambda: metrics.knn_bank(xb, yb, xq, yq, 20, 0.07),
         lambda: _sklearn_bank(xb, yb, xq, yq, 20, 0.07)),
        ("leave-one-out 5-NN", lambda: metrics.knn_loo(xq, yq, 5), lambda: _sklearn_loo(xq, yq, 5)),
    ]
    for label, ours, theirs in rows:
        a, t_faiss = timed(ours)
        b, t_sklearn = timed(theirs)
        agree = "agree" if abs(a - b) < 1e-3 else f"DIFFER ({a:.4f} vs {b:.4f})"
        print(f"    {label:26s} faiss {t_faiss:6.2f} s   sklearn {t_sklearn:6.2f} s   "
              f"ratio {t_sklearn / t_faiss:5.1f}x   accuracy {a:.4f} ({agree})")
    nb, nq = metrics.l2_normalize(xb), metrics.l2_normalize(xq)
    candidates = sorted({1, min(torch.get_num_threads(), os.cpu_count() or 1)})
    times = {t: timed(metrics.search, nb, nq, 20, t)[1] for t in candidates}
    print("    bank search alone by faiss threads: " + ", ".join(f"{t}: {s:.2f} s" for t, s in times.items())
          + f" (default here now: {metrics.default_threads()}, 1-min load {os.getloadavg()[0]:.1f})")
    _, t_centroid = timed(metrics.centroid_metrics, xq, yq)
    _, t_sil = timed(metrics.silhouette, xq, yq)
    print(f"    centroid metrics {t_centroid:.2f} s, silhouette {t_sil:.2f} s")


def main(argv: list[str] | None = None) -> None:
    p = CliParser(prog="python scripts/bench_harness.py", description=__doc__.split("\n")[0])
    p.add_argument("--queries", type=positive_int, default=10_000)
    p.add_argument("--bank", type=positive_int, default=50_000)
    p.add_argument("--dim", type=positive_int, default=128)
    args = p.parse_args(argv)
    print(machine_line(torch.device("cpu")))
    bench_metrics(args.queries, args.bank, args.dim)


if __name__ == "__main__":
    run_cli(main)
