"""FastDropout: same distribution as nn.Dropout, consistent gradient masks, hooks kept by use_fast_dropout."""

from __future__ import annotations

import math

import pytest
import timm
import torch
from torch import nn

import timm_rollout
from timm_rollout.dropout import FastDropout, use_fast_dropout

N = 1 << 20


def realised_p(p: float) -> float:
    """The drop probability FastDropout(p) realises on CPU (its docstring): the keep rate quantised to 1/65536."""
    return 1.0 - round((1.0 - p) * 65536) / 65536


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_mean_and_variance_match_nn_dropout(p: float) -> None:
    torch.manual_seed(0)
    x = torch.full((N,), 2.0)
    fast, ref = FastDropout(p)(x), nn.Dropout(p)(x)
    # Bernoulli(keep) * 2 / keep: mean 2, variance 4 * p / (1 - p); compare both with theory within 5 SE.
    for out, q in ((fast, realised_p(p)), (ref, p)):
        var = 4.0 * q / (1.0 - q)
        assert abs(out.mean().item() - 2.0) < 5 * math.sqrt(var / N)
        assert out.var().item() == pytest.approx(var, rel=0.02)  # the standard error is about 0.3 %
        values = torch.unique(out)
        assert torch.allclose(values, torch.tensor([0.0, 2.0 / (1.0 - q)]))
    assert abs(fast.var().item() - ref.var().item()) / ref.var().item() < 0.02


def test_realised_p_and_every_bit_slice_is_uniform() -> None:
    torch.manual_seed(1)
    kept = FastDropout(0.5)(torch.ones(4 * N)) != 0
    # The four 16-bit slices of each 64-bit draw each keep half of their elements.
    for slot in range(4):
        frac = kept[slot::4].float().mean().item()
        assert abs(frac - 0.5) < 5 * math.sqrt(0.25 / N)


def test_gradient_uses_the_forward_mask_and_scale() -> None:
    torch.manual_seed(2)
    x = (torch.rand(64, 65, 128) + 0.5).requires_grad_()
    drop = FastDropout(0.1)
    y = drop(x)
    g = torch.randn_like(y)
    y.backward(g)
    kept = y.detach() != 0
    scale = 1.0 / (1.0 - realised_p(0.1))
    torch.testing.assert_close(y.detach(), torch.where(kept, x.detach() * scale, 0.0))
    torch.testing.assert_close(x.grad, torch.where(kept, g * scale, 0.0))


def test_eval_is_identity_and_seed_reproduces_mask() -> None:
    x = torch.randn(8, 100)
    drop = FastDropout(0.3).eval()
    assert torch.equal(drop(x), nn.Dropout(0.3).eval()(x))
    drop.train()
    torch.manual_seed(3)
    a = drop(x)
    torch.manual_seed(3)
    assert torch.equal(a, drop(x))


@pytest.mark.parametrize("shape", [(7,), (2, 3), (3, 65, 128)])
def test_torchscript_and_fx_draw_the_same_masks_as_eager(shape) -> None:
    from timm.models import get_notrace_modules
    from torchvision.models.feature_extraction import NodePathTracer  # the tracer timm's FX tests use

    drop = FastDropout(0.3).train()
    scripted = torch.jit.script(drop)  # TorchScript has no dtype view: its masks come from bit shifts
    net = nn.Sequential(nn.Identity(), drop)
    traced = torch.fx.GraphModule(net, NodePathTracer(leaf_modules=get_notrace_modules()).trace(net))
    assert any(n.op == "call_module" and n.target == "1" for n in traced.graph.nodes)  # a leaf, as timm traces it
    x = torch.randn(shape)
    outs = []
    for run in (drop, scripted, traced):
        torch.manual_seed(4)
        outs.append(run(x))
    assert (outs[0] == 0).any() or x.numel() < 8
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_use_fast_dropout_swaps_in_place_and_keeps_hooks() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2), nn.Dropout(0.0))
    seen = []
    model[1].register_forward_pre_hook(lambda m, args: seen.append("pre"))
    model[1].register_forward_hook(lambda m, args, out: seen.append("post"))
    keys = list(model.state_dict())
    first = model[1]
    assert use_fast_dropout(model) == 1
    assert model[1] is first and type(model[1]) is FastDropout and isinstance(model[1], nn.Dropout)
    assert type(model[2]) is nn.Dropout  # p=0 left alone
    model(torch.randn(2, 4))
    assert seen == ["pre", "post"] and list(model.state_dict()) == keys


def test_rollout_model_uses_fast_dropout_and_still_records_attention() -> None:
    model = timm.create_model("vit_tiny_cifar_rollout", num_classes=10, depth=2).train()
    drops = [m for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    assert drops and all(type(m) is FastDropout for m in drops)
    torch.manual_seed(0)
    x = torch.randn(4, 3, 32, 32)
    with timm_rollout.capture_attention(model) as cap:
        out = model(x)
    assert out.shape == (4, 10) and torch.isfinite(out).all()  # rollout pooling raises without recorded attention
    # Hooks on attn_drop see the attention before dropout: rows are still probability distributions.
    for attn in cap.attentions:
        torch.testing.assert_close(attn.sum(-1), torch.ones(attn.shape[:-1]))
