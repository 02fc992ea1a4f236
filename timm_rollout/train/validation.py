"""The evaluation after each training epoch: loss and top-1/top-5 accuracy on the eval split, split across ranks.

(The full evaluation of a trained model, k-NN, probe and geometry included, is ``harness.eval``.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..accuracy import topk_hits
from ..data import normalize
from ..device import autocast
from ..rollout import cosine_to_mean, effective_patches
from .distributed import Dist, reduce_sum

EVAL_BATCH = 500


def _eval_pass(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits, and for a rollout-pooled model the batch sums of its pooling diagnostics from that same pass."""
    if getattr(model, "global_pool", None) != "rollout":
        return model(x), None
    tokens = model.forward_features(x)
    weights = model.rollout_weights(tokens)
    logits = model.forward_head(tokens)
    patches = tokens[:, model.num_prefix_tokens:]
    return logits, torch.stack([effective_patches(weights).sum(), cosine_to_mean(patches, weights).sum()])


@torch.no_grad()
def validate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, mean, std, d: Dist,
             amp_dtype: torch.dtype | None) -> dict[str, float]:
    """Eval loss and top-1/top-5 accuracy (%; top-5 only with more than 5 classes) of ``model`` (and a rollout-pooled
    model's pooling diagnostics), each rank taking every ``world``-th image; one all-reduce and one host sync per
    evaluation."""
    was_training = model.training
    model.eval()
    count, images, labels = len(labels), images[d.rank::d.world], labels[d.rank::d.world]  # count: all ranks
    sums = torch.zeros(5, dtype=torch.float64, device=d.device)  # loss, top-1, top-5, effective patches, cosine
    pooled, classes = False, 0
    for start in range(0, len(labels), EVAL_BATCH):
        x = normalize(images[start:start + EVAL_BATCH].to(d.device, non_blocking=True), mean, std)
        y = labels[start:start + EVAL_BATCH].to(d.device, non_blocking=True)
        with autocast(d.device, amp_dtype):
            logits, diagnostics = _eval_pass(model, x)
        logits = logits.float()
        classes = logits.shape[1]
        hits = [topk_hits(logits, y, k).sum().double() for k in (1, 5) if k < classes]  # top-5 with over 5 classes
        sums[:1 + len(hits)] += torch.stack([F.cross_entropy(logits, y, reduction="sum").double(), *hits])
        if diagnostics is not None:
            sums[3:] += diagnostics.double()
            pooled = True
    sums = reduce_sum(sums, d).cpu()
    model.train(was_training)
    loss, top1, top5, patches, cosine = (sums / max(count, 1)).tolist()
    out = {"eval_loss": loss, "eval_top1": 100 * top1, **({"eval_top5": 100 * top5} if classes > 5 else {})}
    return {**out, "rollout_effective_patches": patches, "rollout_cosine_to_mean": cosine} if pooled else out
