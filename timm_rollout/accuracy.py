"""Top-k hits, the one definition the trainer's evaluation and the harness's metrics share."""

from __future__ import annotations

import torch


def topk_hits(logits: torch.Tensor, labels: torch.Tensor, k: int = 1) -> torch.Tensor | None:
    """(N,) bool: whether each row's label is among its ``k`` highest logits; None unless there are more than k classes
    (with k or fewer, every label is)."""
    if logits.shape[1] <= k:
        return None
    return (logits.topk(k, dim=1).indices == labels.to(logits.device)[:, None]).any(dim=1)
