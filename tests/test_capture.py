"""capture_attention on stock timm ViTs: real attention, unchanged outputs, model left as found."""

import pytest
import timm
import torch
from timm.layers import use_fused_attn

from timm_rollout import attention_modules, capture_attention
from timm_rollout.capture import fused_attention, set_fused_attention


def hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize(
    ("name", "kwargs", "size", "prefix"),
    [
        ("vit_small_patch16_224", dict(depth=3), 224, 1),
        ("vit_base_patch16_reg4_gap_256", dict(depth=2, embed_dim=192, num_heads=3), 256, 4),
    ],
)
def test_capture_on_stock_timm_vit(name, kwargs, size, prefix):
    torch.manual_seed(0)
    model = timm.create_model(name, **kwargs).eval()
    for m in attention_modules(model):
        m.fused_attn = True
    x = torch.randn(2, 3, size, size)
    hooks_before = hook_count(model)
    with torch.no_grad():
        want = model(x)
        with capture_attention(model) as cap:
            got = model(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert cap.num_prefix_tokens == prefix
    n = prefix + (size // 16) ** 2
    heads = model.blocks[0].attn.num_heads
    assert len(cap.attentions) == len(model.blocks)
    for attn in cap.attentions:
        assert attn.shape == (2, heads, n, n)
        torch.testing.assert_close(attn.sum(-1), torch.ones(2, heads, n))
    # the recorded attention is what the block computed from its own input (not the embedding)
    blk = model.blocks[1]
    with torch.no_grad(), capture_attention(model) as cap:
        tokens = model.forward_intermediates(x, indices=[0], intermediates_only=True, output_fmt="NLC",
                                             return_prefix_tokens=True)
    patches, prefix_tokens = tokens[0]
    h = blk.norm1(torch.cat([prefix_tokens, patches], dim=1))
    q, k, _ = blk.attn.qkv(h).reshape(2, n, 3, heads, -1).permute(2, 0, 3, 1, 4)
    manual = ((q * blk.attn.scale) @ k.transpose(-2, -1)).softmax(-1)
    torch.testing.assert_close(cap.attentions[1], manual, rtol=1e-4, atol=1e-6)
    # left as found
    assert all(m.fused_attn for m in attention_modules(model))
    assert hook_count(model) == hooks_before
    assert not any(m.attn_drop.__dict__.get("_attention_sinks") for m in attention_modules(model))


def test_capture_keeps_last_forward_and_graph():
    model = timm.create_model("vit_tiny_cifar_rollout", depth=2).eval()
    x = torch.randn(1, 3, 32, 32, requires_grad=True)
    with capture_attention(model) as cap:
        model(torch.randn(1, 3, 32, 32))
        model(x)
        attns = cap.attentions
        grad = torch.autograd.grad(attns[-1][0, 0, 0, 1], x)[0]
    assert grad.abs().sum() > 0
    assert cap.attentions[0] is attns[0]


def test_capture_needs_a_forward_pass():
    model = timm.create_model("vit_tiny_cifar_cls", depth=1)
    with capture_attention(model) as cap, pytest.raises(RuntimeError, match="run a forward pass inside"):
        _ = cap.attentions


def test_capture_on_model_without_attention_is_a_one_line_error():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
    with pytest.raises(ValueError, match=r"^Sequential has no timm attention blocks .*VisionTransformer-family"):
        with capture_attention(model):
            pass


def test_set_fused_attention_switches_every_block_but_a_rollout_pooled_model_stays_explicit():
    cls = timm.create_model("vit_tiny_cifar_cls", num_classes=10, depth=2).eval()
    assert set_fused_attention(cls, False) == [use_fused_attn()] * 2  # the settings it had, for a restore
    assert [b.attn.fused_attn for b in cls.blocks] == [False, False]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        explicit = cls(x)
        set_fused_attention(cls, True)
        assert [b.attn.fused_attn for b in cls.blocks] == [True, True]
        torch.testing.assert_close(cls(x), explicit, rtol=1e-5, atol=1e-5)  # the same function, another kernel
    rollout = timm.create_model("vit_tiny_cifar_rollout", num_classes=10, depth=2)
    set_fused_attention(rollout, True)
    assert [b.attn.fused_attn for b in rollout.blocks] == [False, False]  # its pooling reads the attention
    before = [b.attn.fused_attn for b in cls.blocks]
    with fused_attention(cls, False):
        assert [b.attn.fused_attn for b in cls.blocks] == [False, False]
    assert [b.attn.fused_attn for b in cls.blocks] == before


def test_progress_bars_come_from_one_helper_that_draws_only_on_a_terminal():
    """Every bar goes through timm_rollout.progress (off unless stderr is a TTY), so log files hold no bars."""
    import io
    import re
    from pathlib import Path

    from timm_rollout.progress import progress

    root = Path(__file__).resolve().parents[1]
    calls = [str(p.relative_to(root)) for folder in ("timm_rollout", "harness", "scripts")
             for p in sorted((root / folder).rglob("*.py")) if re.search(r"\btqdm\(", p.read_text(encoding="utf-8"))]
    assert calls == ["timm_rollout/progress.py"]
    log = io.StringIO()  # not a terminal: nothing drawn
    assert list(progress(range(3), file=log, desc="x")) == [0, 1, 2] and log.getvalue() == ""


def _tiny_vit() -> torch.nn.Module:
    """A small stock timm ViT on the fused attention path (the setting the model must get back)."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=5).eval()
    set_fused_attention(model, True)
    return model


def _fresh_copy(model: torch.nn.Module) -> torch.nn.Module:
    """An independent reference: a fresh stock model with ``model``'s weights, never captured."""
    fresh = _tiny_vit()
    fresh.load_state_dict(model.state_dict())
    return fresh


def _left_clean(model: torch.nn.Module) -> None:
    assert type(model).__name__ == "VisionTransformer"
    assert [m.fused_attn for m in attention_modules(model)] == [True, True]
    assert hook_count(model) == 0 and set(vars(model)) == set(vars(_tiny_vit()))
    assert all(set(vars(m)) == set(vars(f)) for m, f in zip(model.modules(), _tiny_vit().modules(), strict=True))


def test_set_pooling_inside_capture_attention_stays_rollout_pooled_after_it():
    """The capture releases only its own hold: the model made rollout-pooled inside keeps recording after exit,
    and switching it back later restores the fused setting it had before the capture."""
    from timm_rollout import set_pooling

    model = _tiny_vit()
    reference = set_pooling(_fresh_copy(model), "rollout")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with capture_attention(model) as cap:
            set_pooling(model, "rollout")
            inside = model(x)
        assert len(cap.attentions) == 2
        assert [m.fused_attn for m in attention_modules(model)] == [False, False]
        torch.testing.assert_close(inside, reference(x))
        torch.testing.assert_close(model(x), reference(x))  # used to fail: fused again, nothing recorded
        torch.testing.assert_close(model.forward_head(model.forward_features(x)), reference(x))
        set_pooling(model, "token")
        torch.testing.assert_close(model(x), set_pooling(reference, "token")(x))
    _left_clean(model)


def test_switching_back_inside_capture_attention_keeps_capturing_and_restores_the_stock_setting():
    from timm_rollout import set_pooling

    model = set_pooling(_tiny_vit(), "rollout")
    reference = _fresh_copy(model)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with capture_attention(reference) as want:
            stock = reference(x)
        with capture_attention(model) as cap:
            set_pooling(model, "token")
            got = model(x)
        torch.testing.assert_close(got, stock, rtol=1e-4, atol=1e-5)
        for a, b in zip(cap.attentions, want.attentions, strict=True):  # the pass after the switch was recorded
            torch.testing.assert_close(a, b)
    _left_clean(model)  # the stock model's own (fused) setting, not the rollout model's explicit one
