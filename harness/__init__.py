"""Evaluation harness: pooled-feature metrics (faiss k-NN, centroid geometry, silhouette), figures, comparisons."""

import timm_rollout  # noqa: F401  (first: a broken torch/torchvision install is then named in one line)
