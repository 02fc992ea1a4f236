"""Rollout maths against a plain-loop reference and its own invariants."""

import pytest
import torch

from timm_rollout import attention_rollout, fuse_heads, patch_weights, rollout_cls_row


def random_attention(batch: int, heads: int, n: int, layers: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(batch, heads, n, n, generator=g).softmax(dim=-1) for _ in range(layers)]


def loop_rollout(attentions, head_fusion="mean", discard_ratio=0.0, prefix=1):
    """Reference: one image at a time, plain Python loops over entries."""
    batch, heads, n, _ = attentions[0].shape
    out = []
    for b in range(batch):
        result = None
        for attn in attentions:
            fused = [[0.0] * n for _ in range(n)]
            for i in range(n):
                for j in range(n):
                    vals = [float(attn[b, h, i, j]) for h in range(heads)]
                    fused[i][j] = {"mean": sum(vals) / heads, "max": max(vals), "min": min(vals)}[head_fusion]
            candidates = sorted((fused[i][j], i, j) for i in range(prefix, n) for j in range(prefix, n) if i != j)
            for _, i, j in candidates[: int(len(candidates) * discard_ratio)]:
                fused[i][j] = 0.0
            a = [[fused[i][j] + (1.0 if i == j else 0.0) for j in range(n)] for i in range(n)]
            a = [[v / sum(row) for v in row] for row in a]
            if result is None:
                result = a
            else:
                result = [[sum(a[i][k] * result[k][j] for k in range(n)) for j in range(n)] for i in range(n)]
        out.append(result)
    return torch.tensor(out)


@pytest.mark.parametrize("head_fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("discard_ratio", [0.0, 0.5])
def test_rollout_matches_plain_loops(head_fusion, discard_ratio):
    attentions = random_attention(batch=3, heads=2, n=6, layers=3)
    got = attention_rollout(attentions, head_fusion=head_fusion, discard_ratio=discard_ratio)
    want = loop_rollout(attentions, head_fusion, discard_ratio)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("discard_ratio", [0.3, 0.9])
def test_discard_breaks_ties_like_the_plain_loop(discard_ratio):
    # attention on a coarse grid (as bf16 attention is): many entries tie at the discard threshold; exactly
    # int(count * ratio) are dropped, the tied ones in row-major order
    attentions = [(a * 8).round() / 8 for a in random_attention(batch=2, heads=2, n=7, layers=2, seed=3)]
    fused = fuse_heads(attentions[0], "max")[:, 1:, 1:]
    off = fused[:, ~torch.eye(6, dtype=torch.bool)]
    threshold = off.sort(dim=1).values[:, int(30 * discard_ratio) - 1]
    assert ((off == threshold[:, None]).sum(1) > 1).all()  # the case under test: ties at the threshold
    got = attention_rollout(attentions, head_fusion="max", discard_ratio=discard_ratio)
    torch.testing.assert_close(got, loop_rollout(attentions, "max", discard_ratio).float(), rtol=1e-5, atol=1e-6)


def test_rollout_rows_are_distributions():
    rollout = attention_rollout(random_attention(2, 4, 9, 5), head_fusion="max", discard_ratio=0.9)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(2, 9))
    assert (rollout >= 0).all()


def test_mean_fusion_is_half_identity_plus_half_attention():
    attentions = random_attention(1, 3, 5, 1)
    want = (attentions[0].mean(1) + torch.eye(5)) / 2
    torch.testing.assert_close(attention_rollout(attentions), want)


def test_discard_is_per_image_and_spares_prefix_and_diagonal():
    a = random_attention(1, 2, 7, 2, seed=1)
    b = random_attention(1, 2, 7, 2, seed=2)
    batched = attention_rollout([torch.cat([x, y]) for x, y in zip(a, b, strict=True)], discard_ratio=0.6)
    torch.testing.assert_close(batched[0], attention_rollout(a, discard_ratio=0.6)[0])
    torch.testing.assert_close(batched[1], attention_rollout(b, discard_ratio=0.6)[0])
    # one layer, everything discardable dropped except prefix row/column and the diagonal
    layer = attention_rollout(a[:1], discard_ratio=0.99)[0]
    fused = fuse_heads(a[0])[0]
    assert (layer[0] > 0).all() and (layer[:, 0] > 0).all() and (layer.diagonal() > 0).all()
    off = layer[1:, 1:] - torch.diag(layer.diagonal()[1:])
    assert (off > 0).sum() == 1  # 30 candidates, int(30 * 0.99) = 29 dropped
    assert off.argmax() == (fused[1:, 1:] - torch.diag(fused.diagonal()[1:])).argmax()


@pytest.mark.parametrize("head_fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("discard_ratio", [0.0, 0.3])
def test_fast_cls_row_equals_row_of_full_product(head_fusion, discard_ratio):
    attentions = random_attention(4, 4, 65, 6)
    full = attention_rollout(attentions, head_fusion, discard_ratio)[:, 0]
    fast = rollout_cls_row(attentions, head_fusion, discard_ratio)
    torch.testing.assert_close(fast, full, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("head_fusion", ["mean", "max"])
def test_rollout_runs_in_float32_under_bf16_autocast(head_fusion):
    attentions = random_attention(4, 4, 65, 6)
    want_row = rollout_cls_row(attentions, head_fusion)
    want_full = attention_rollout(attentions, head_fusion)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        row = rollout_cls_row(attentions, head_fusion)
        full = attention_rollout(attentions, head_fusion)
    assert row.dtype == full.dtype == torch.float32
    torch.testing.assert_close(row, want_row, rtol=0, atol=1e-6)  # a bf16 matmul is off by ~1e-3
    torch.testing.assert_close(full, want_full, rtol=0, atol=1e-6)


def test_patch_weights_drop_prefix_columns_and_sum_to_one():
    row = rollout_cls_row(random_attention(2, 2, 10, 3))
    w = patch_weights(row, num_prefix_tokens=2)
    assert w.shape == (2, 8)
    torch.testing.assert_close(w.sum(-1), torch.ones(2))
    torch.testing.assert_close(w, row[:, 2:] / row[:, 2:].sum(-1, keepdim=True))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(head_fusion="median"), "unknown head_fusion 'median'; use one of mean, max, min"),
        (dict(discard_ratio=1.0), r"discard_ratio must be in \[0, 1\), got 1.0"),
        (dict(discard_ratio=-0.1), r"discard_ratio must be in \[0, 1\), got -0.1"),
        (dict(discard_ratio="0.5"), r"discard_ratio must be a number in \[0, 1\), got '0.5'; e.g. discard_ratio=0.9"),
        (dict(discard_ratio=True), r"discard_ratio must be a number in \[0, 1\), got True; e.g. discard_ratio=0.9"),
        (dict(discard_ratio=float("nan")), r"discard_ratio must be in \[0, 1\), got nan"),
        (dict(head_fusion=["mean"]), r"unknown head_fusion \['mean'\]; use one of mean, max, min"),
    ],
)
def test_bad_options_give_one_line_errors(kwargs, message):
    attentions = random_attention(1, 1, 3, 1)
    for fn in (attention_rollout, rollout_cls_row):
        with pytest.raises(ValueError, match=f"^{message}$"):
            fn(attentions, **kwargs)
