"""Evaluation harness: pooled-feature metrics (faiss k-NN, centroid geometry, silhouette), figures, comparisons."""
