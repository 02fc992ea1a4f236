"""Evaluation harness: pooled-feature metrics (faiss k-NN, centroid geometry, silhouette), figures, comparisons."""

import timm_rollout  # noqa: F401  (first: a broken torch/torchvision install is then named in one line)

__all__ = ["Evaluation", "evaluate"]


def __getattr__(name: str):  # harness.evaluate and harness.Evaluation load harness.eval when first used (light --help)
    if name in __all__:
        from harness import eval as evaluation
        return getattr(evaluation, name)  # Evaluation: harness.record's, as harness.eval imports it
    raise AttributeError(f"module 'harness' has no attribute {name!r}")
