"""Representation metrics as pure functions of (features, labels): k-NN accuracy, linear probe, centroid
geometry, silhouette; their definitions for the model cards (:data:`METRIC_DEFINITIONS`).

Every function L2-normalises its inputs first, so cosine similarity is an inner product; neighbour searches are
exact (faiss ``IndexFlatIP`` on float32). Definitions: harness/README.md, "Metrics".
"""

from __future__ import annotations

import os

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from harness.localisation import LOCALISATION
from timm_rollout.accuracy import topk_hits as _topk_hits

__all__ = [
    "ACCURACIES",
    "BANK_K",
    "KNN_K",
    "LINEAR_PROBE",
    "LOCALISATION",
    "METRIC_DEFAULTS",
    "METRIC_DEFINITIONS",
    "POOLING_DIAGNOSTICS",
    "SILHOUETTE_SAMPLE_SIZE",
    "TEMPERATURE",
    "accuracy",
    "angles",
    "centroid_metrics",
    "centroids",
    "cosine_matrix",
    "default_threads",
    "knn_bank",
    "knn_bank_predictions",
    "knn_loo",
    "knn_loo_predictions",
    "knn_original",
    "l2_normalize",
    "linear_probe",
    "linear_probe_predictions",
    "lone_classes",
    "original_metrics",
    "search",
    "silhouette",
    "topk_hits",
    "whitening",
]

SILHOUETTE_SAMPLE_SIZE = 10_000
# The accuracy metrics of an evaluation; each has per-image predictions (top5: per-image hits).
ACCURACIES = ("top1", "top5", "linear_probe", "knn_loo", "knn_bank")
# The k-NN settings of harness.eval: neighbours of the leave-one-out and the bank k-NN, and the bank's vote
# temperature.
KNN_K, BANK_K, TEMPERATURE = 5, 20, 0.07
METRIC_DEFAULTS = {"k": KNN_K, "bank_k": BANK_K, "temperature": TEMPERATURE}
# How uniform the rollout pooling weights of a backbone are (timm_rollout.rollout), means over the images.
POOLING_DIAGNOSTICS = ("rollout_effective_patches", "rollout_cosine_to_mean")
# scikit-learn LogisticRegression settings of the linear probe (fixed, no search: deterministic and fast).
LINEAR_PROBE = {"C": 1.0, "solver": "lbfgs", "max_iter": 1000, "tol": 1e-4}

ArrayLike = np.ndarray | torch.Tensor


def _numpy(x: ArrayLike) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def default_threads() -> int:
    """faiss OpenMP threads: one per core torch uses, but 1 while the 1-minute load exceeds the cores (threads
    waiting at every barrier made two threads 2x slower than one on a busy 2-core machine)."""
    cores = os.cpu_count() or 1
    if os.getloadavg()[0] > cores:
        return 1
    return max(1, min(torch.get_num_threads(), cores))


def l2_normalize(features: ArrayLike) -> np.ndarray:
    """Row-wise L2-normalised, C-contiguous float32 copy of ``features`` (N, D)."""
    x = np.ascontiguousarray(_numpy(features), dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"features must be (N, D), got shape {x.shape}")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.ascontiguousarray(x / np.maximum(norms, 1e-12), dtype=np.float32)


def search(
    bank: np.ndarray, queries: np.ndarray, k: int, threads: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-``k`` inner-product search of ``queries`` in ``bank`` (both normalised float32): (similarities,
    indices), each (Q, k), best first."""
    import faiss  # here, so that --help loads no faiss

    if k > bank.shape[0]:
        raise ValueError(f"k={k} neighbours requested from a bank of {bank.shape[0]} features")
    previous = faiss.omp_get_max_threads()  # restored after: faiss shares torch's threads, which it would slow
    faiss.omp_set_num_threads(threads or default_threads())
    try:
        index = faiss.IndexFlatIP(bank.shape[1])
        index.add(bank)
        return index.search(queries, k)
    finally:
        faiss.omp_set_num_threads(previous)


def _vote(neighbour_labels: np.ndarray, weights: np.ndarray, num_classes: int) -> np.ndarray:
    """Per-query class scores (Q, C): the sum of ``weights`` of neighbours of each class."""
    q = neighbour_labels.shape[0]
    flat = (np.arange(q)[:, None] * num_classes + neighbour_labels).ravel()
    return np.bincount(flat, weights=weights.ravel(), minlength=q * num_classes).reshape(q, num_classes)


def _majority(neighbour_labels: np.ndarray, sims: np.ndarray, num_classes: int) -> np.ndarray:
    """Majority vote; ties go to the class with the larger summed similarity (then the lower class id)."""
    counts = _vote(neighbour_labels, np.ones_like(sims, dtype=np.float64), num_classes)
    summed = _vote(neighbour_labels, sims.astype(np.float64), num_classes)
    best = counts == counts.max(axis=1, keepdims=True)
    return np.where(best, summed, -np.inf).argmax(axis=1)


def _drop_self(ids: np.ndarray, sims: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Remove each query's own index from its k+1 neighbours (by index: exact duplicates tie with the query, which
    may then fall out of its own list; such rows drop their last neighbour instead)."""
    n = ids.shape[0]
    drop = ids == np.arange(n)[:, None]
    drop[~drop.any(axis=1), -1] = True
    keep = ~drop
    k = ids.shape[1] - 1
    return ids[keep].reshape(n, k), sims[keep].reshape(n, k)


def accuracy(predictions: ArrayLike, labels: ArrayLike) -> float:
    """Fraction of ``predictions`` equal to ``labels``."""
    return float((_numpy(predictions) == _numpy(labels).astype(np.int64)).mean())


def knn_loo_predictions(features: ArrayLike, labels: ArrayLike, k: int = KNN_K) -> np.ndarray:
    """Leave-one-out k-NN prediction of each point within one set: majority vote of its ``k`` nearest other
    points (cosine), ties to the class with the larger summed similarity."""
    x = l2_normalize(features)
    y = _numpy(labels).astype(np.int64)
    if x.shape[0] <= k:
        raise ValueError(f"leave-one-out {k}-NN needs more than {k} points, got {x.shape[0]}")
    sims, ids = search(x, x, k + 1)
    ids, sims = _drop_self(ids, sims)
    return _majority(y[ids], sims, int(y.max()) + 1)


def knn_loo(features: ArrayLike, labels: ArrayLike, k: int = KNN_K) -> float:
    """Leave-one-out k-NN accuracy (:func:`knn_loo_predictions`)."""
    return accuracy(knn_loo_predictions(features, labels, k), labels)


def knn_bank_predictions(
    bank_features: ArrayLike, bank_labels: ArrayLike, query_features: ArrayLike, k: int = BANK_K,
    temperature: float = TEMPERATURE,
) -> np.ndarray:
    """DINO-style weighted k-NN prediction of each query: its ``k`` nearest bank features (cosine) vote for
    their class with weight ``exp(similarity / temperature)``."""
    bank = l2_normalize(bank_features)
    queries = l2_normalize(query_features)
    yb = _numpy(bank_labels).astype(np.int64)
    sims, ids = search(bank, queries, k)
    scores = _vote(yb[ids], np.exp(sims.astype(np.float64) / temperature), int(yb.max()) + 1)
    return scores.argmax(axis=1)


def knn_bank(
    bank_features: ArrayLike,
    bank_labels: ArrayLike,
    query_features: ArrayLike,
    query_labels: ArrayLike,
    k: int = BANK_K,
    temperature: float = TEMPERATURE,
) -> float:
    """DINO-style weighted k-NN accuracy of the queries against the bank (:func:`knn_bank_predictions`)."""
    return accuracy(knn_bank_predictions(bank_features, bank_labels, query_features, k, temperature), query_labels)


def whitening(features: np.ndarray, floor: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """PCA whitening of ``features`` (N, D): their mean and the (D, D) map ``(x - mean) @ W`` that gives unit
    covariance, eigenvalues floored at ``floor`` times the largest (near-constant dimensions are not blown up)."""
    mean = features.mean(axis=0, dtype=np.float64)
    eigval, eigvec = np.linalg.eigh(np.cov(features - mean, rowvar=False))
    eigval = np.maximum(eigval, floor * max(float(eigval.max()), 1e-12))
    return mean.astype(np.float32), (eigvec / np.sqrt(eigval)).astype(np.float32)


def linear_probe_predictions(bank_features: ArrayLike, bank_labels: ArrayLike, query_features: ArrayLike,
                             threads: int | None = None) -> np.ndarray:
    """Class predicted for each query by a :data:`LINEAR_PROBE` logistic regression fitted on the bank's features,
    whitened with the bank's statistics (:func:`whitening`: lbfgs then converges in several times fewer
    iterations). BLAS threads are capped (default :func:`default_threads`): oversubscribed, the fit ran 8x slower."""
    from sklearn.linear_model import LogisticRegression  # here, so that --help loads no scikit-learn

    bank = l2_normalize(bank_features)
    queries = l2_normalize(query_features)
    with threadpool_limits(threads or default_threads()):
        mean, w = whitening(bank)
        probe = LogisticRegression(**LINEAR_PROBE).fit((bank - mean) @ w, _numpy(bank_labels).astype(np.int64))
        return probe.predict((queries - mean) @ w)


def linear_probe(bank_features: ArrayLike, bank_labels: ArrayLike, query_features: ArrayLike,
                 query_labels: ArrayLike) -> float:
    """Accuracy of :func:`linear_probe_predictions` on the queries."""
    return accuracy(linear_probe_predictions(bank_features, bank_labels, query_features), query_labels)


def centroids(features: ArrayLike, labels: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Class ids present (sorted) and the mean of their normalised features (not renormalised), (C, D)."""
    x = l2_normalize(features).astype(np.float64)
    y = _numpy(labels).astype(np.int64)
    classes = np.unique(y)
    return classes, np.stack([x[y == c].mean(axis=0) for c in classes])


def angles(x: np.ndarray, direction: np.ndarray) -> np.ndarray:
    """Angle (radians) between each unit row of ``x`` and the unit vector ``direction``: atan2(|x - (x.u)u|,
    x.u), accurate near 0 where arccos is not."""
    cos = x @ direction
    sin = np.linalg.norm(x - cos[:, None] * direction[None], axis=1)
    return np.arctan2(sin, cos)


def lone_classes(labels: ArrayLike) -> np.ndarray:
    """Class ids (sorted) with exactly one image: they have a direction but no spread around it, so the intra-class
    metrics leave them out (their angle of 0 would lower ``intra`` and raise ``ratio`` without a word)."""
    classes, counts = np.unique(_numpy(labels).astype(np.int64), return_counts=True)
    return classes[counts == 1]


def _classes(features: ArrayLike, labels: ArrayLike) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Normalised float64 features, int64 labels, the classes present and their centroids; at least two classes."""
    x = l2_normalize(features).astype(np.float64)
    y = _numpy(labels).astype(np.int64)
    classes, cents = centroids(x, y)
    if len(classes) < 2:
        raise ValueError("centroid metrics need at least two classes")
    return x, y, classes, cents


def _intra(x: np.ndarray, y: np.ndarray, classes: np.ndarray, spread) -> float | None:
    """Mean over the classes with two or more images of ``spread(their features, class index)``; None without any."""
    lone = set(lone_classes(y).tolist())
    values = [spread(x[y == c], i) for i, c in enumerate(classes) if int(c) not in lone]
    return float(np.mean(values)) if values else None


def centroid_metrics(features: ArrayLike, labels: ArrayLike) -> dict[str, float | None]:
    """``intra``, ``inter`` and their ``ratio``: class geometry as angles (radians) on the unit sphere;
    ``intra`` and ``ratio`` None when no class has two images (:func:`lone_classes` are left out of ``intra``)."""
    x, y, classes, cents = _classes(features, labels)
    dirs = cents / np.maximum(np.linalg.norm(cents, axis=1, keepdims=True), 1e-12)
    intra = _intra(x, y, classes, lambda xc, i: angles(xc, dirs[i]).mean())
    a, b = np.triu_indices(len(classes), k=1)
    inter = float(np.mean([angles(dirs[[i]], dirs[j])[0] for i, j in zip(a, b, strict=True)]))
    return {"intra": intra, "inter": inter, "ratio": None if intra is None else inter / intra}


def knn_original(features: ArrayLike, labels: ArrayLike, k: int = KNN_K) -> float:
    """The original study's k-NN accuracy: the ``k`` nearest points (cosine) of the set *including the query
    itself* vote (:func:`_majority`), so a query always votes for its own label once; above :func:`knn_loo`."""
    x = l2_normalize(features)
    y = _numpy(labels).astype(np.int64)
    if x.shape[0] < k:
        raise ValueError(f"{k}-NN needs at least {k} points, got {x.shape[0]}")
    sims, ids = search(x, x, k)
    return accuracy(_majority(y[ids], sims, int(y.max()) + 1), y)


def original_metrics(features: ArrayLike, labels: ArrayLike) -> dict[str, float | None]:
    """The original study's definitions (``*_original``), only to set our numbers beside its table; its geometry
    mixes units (Euclidean distances to the centroid within classes, cosine distances between centroids) and its
    k-NN counts the query (:func:`knn_original`; None below ``KNN_K`` points)."""
    x, y, classes, cents = _classes(features, labels)
    intra = _intra(x, y, classes, lambda xc, i: np.linalg.norm(xc - cents[i], axis=1).mean())
    pairs = np.triu_indices(len(classes), k=1)
    inter = float((1.0 - cosine_matrix(cents)[pairs]).mean())
    return {"intra_original": intra, "inter_original": inter,
            "ratio_original": None if intra is None else inter / intra,
            "knn_original": knn_original(x, y) if len(y) >= KNN_K else None}


def cosine_matrix(vectors: ArrayLike) -> np.ndarray:
    """Pairwise cosine similarity (C, C) of the rows of ``vectors`` (e.g. class centroids)."""
    v = _numpy(vectors).astype(np.float64)
    v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    return v @ v.T


def silhouette(
    features: ArrayLike, labels: ArrayLike, seed: int = 0, sample_size: int = SILHOUETTE_SAMPLE_SIZE
) -> tuple[float, int | None]:
    """scikit-learn's silhouette score (Euclidean on normalised features), on a seeded sample of ``sample_size``
    above that many points: (score, the sample size, None when every point was scored)."""
    from sklearn.metrics import silhouette_score

    x = l2_normalize(features)
    y = _numpy(labels).astype(np.int64)
    sample = sample_size if x.shape[0] > sample_size else None
    return float(silhouette_score(x, y, metric="euclidean", sample_size=sample, random_state=seed)), sample


def topk_hits(logits: ArrayLike, labels: ArrayLike, k: int = 1) -> np.ndarray | None:
    """Per row, whether its label is among the ``k`` highest logits; None unless there are more than k classes."""
    hits = _topk_hits(torch.as_tensor(_numpy(logits)), torch.as_tensor(_numpy(labels).astype(np.int64)), k)
    return None if hits is None else hits.numpy()


# Definitions of the metrics of python -m harness.eval (harness/README.md "Metrics"), for the model cards
# (harness.hub), all on L2-normalised pooled features; {k}, {bank_k} and {temperature} are filled from results.json
# (METRIC_DEFAULTS otherwise). The original study's mixed-unit geometry (*_original) is left off the cards.
METRIC_DEFINITIONS = {
    "top1": "top-1 accuracy (fraction) of the model's own classifier head",
    "top5": "top-5 accuracy (fraction) of the model's own classifier head",
    "linear_probe": (
        "accuracy of a linear probe on the frozen features: scikit-learn multinomial logistic regression (L2, C = 1, "
        "lbfgs) trained on the train-split bank features, centred and PCA-whitened with the bank's statistics"
    ),
    "knn_loo": (
        "leave-one-out k-NN accuracy inside the evaluated set (cosine similarity, k = {k}, majority vote, ties to "
        "the class with the larger summed similarity, then the lower class id; a query is never its own neighbour)"
    ),
    "knn_bank": (
        "k-NN accuracy of the evaluated images against a bank of train-split features (k = {bank_k}, votes "
        "weighted by exp(similarity / {temperature}), as in DINO)"
    ),
    "intra": (
        "mean over classes of the mean angle (radians) between a class's features and its direction, the "
        "renormalised mean of its features (lower: tighter), over the classes with at least two evaluated images"
    ),
    "inter": "mean over class pairs of the angle (radians) between their directions",
    "ratio": "inter / intra, unitless (higher: better separated classes; unchanged when every angle is scaled)",
    "silhouette": (
        "scikit-learn silhouette score, Euclidean on the normalised features (in [-1, 1]; above 10,000 points on a "
        "seeded sample of 10,000)"
    ),
    "rollout_effective_patches": (
        "mean over images of exp(entropy) of the rollout pooling weights over the patches (the [CLS] row of the "
        "attention rollout, renormalised over the patches; for a model that does not pool by rollout, the weights "
        "rollout pooling would use): the number of patches for uniform weights, 1 for a single patch"
    ),
    "rollout_cosine_to_mean": (
        "mean over images of the cosine between the rollout-pooled and the mean-pooled final patch tokens"
    ),
    # Localisation, on data sets with object boxes: c_p is the fraction of patch p inside the image's box.
    "pooling_object_mass": "mean over images of the share of the pooling weights on the object's box (sum of w_p c_p)",
    "object_area_fraction": "the box's share of the image (the same sum for uniform weights): the chance level",
    "pooling_weight_inside": "mean over images of the pooling weight x number of patches over the box (1 = uniform)",
    "pooling_weight_outside": "mean over images of the pooling weight x number of patches off the box (1 = uniform)",
    "pooling_effective_patches": "mean over images of exp(entropy) of the weights the model pools the patches with",
    "pointing_chance": "fraction of patches whose centre lies in the box: the pointing game of a uniform map",
    "position_prior_mass": (
        "object mass of an image-blind map equal to the mean box coverage per patch over the evaluated images: what "
        "knowing only where objects usually are scores"
    ),
    "pooling_fixed_object_mass": (
        "object mass of the pooling weights averaged over the evaluated images, used as one fixed map: the part of "
        "pooling_object_mass that does not depend on the image"
    ),
    # Content masks (0 fill, 1 clutter, 2 object per pixel): f_p, k_p, o_p the shares of patch p's pixels.
    "pooling_fill_mass": "mean over images of the share of the pooling weights on flat fill (sum of w_p f_p)",
    "content_chance": (
        "object mass of weights that only avoid flat fill (each patch by its share of non-fill pixels): the chance "
        "level of a pooling that treats clutter and object alike"
    ),
    "pooling_object_share": (
        "mean over images of the pooling weight on the object over the weight on object and clutter"
    ),
    "object_content_fraction": "the same share for the fill-avoiding weights of content_chance: its chance level",
    "context_top1": (
        "top-1 with each object replaced by the clutter of other images of its class there: what the model reads "
        "off the context (chance if it reads the object)"
    ),
    "<map>_box_mass": "mean over images of the share of the {map} map's mass on the object's box",
    "<map>_fixed_box_mass": "object mass of the {map} map's shares averaged over the images, used as one fixed map",
    "<map>_fill_mass": "mean over images of the share of the {map} map's mass on flat fill (content masks)",
    "<map>_object_share": (
        "mean over images of the {map} map's mass on the object over its mass on object and clutter (content masks)"
    ),
    "<map>_pointing": (
        "pointing game of the {map} map: the fraction of images whose maximal patch has its centre in the box "
        "(tied maxima count the fraction of them inside)"
    ),
}
