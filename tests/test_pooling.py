"""set_pooling on stock timm ViTs (a plain ViT and a register-token ViT): rollout pooling against a plain-loop
rollout over attention recorded by hand, switching back to the stock model exactly, refusals. CPU, float32."""

import pytest
import timm
import torch

from timm_rollout import capture_attention, set_pooling
from timm_rollout.pooling import RolloutPooling

# small stock timm ViTs (random init, no download): a plain one and one with 4 register tokens
STOCK = {
    "vit_small_patch16_224": dict(img_size=64, depth=3),
    "vit_small_patch14_reg4_dinov2": dict(img_size=56, depth=3),
}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=7, **STOCK[name]).eval()
    with torch.no_grad():  # larger queries and keys: peaked attention, so the weights are far from uniform
        for block in model.blocks:
            block.attn.qkv.weight[:2 * model.embed_dim].mul_(4.0)
    return model


def images(name: str) -> torch.Tensor:
    size = STOCK[name]["img_size"]
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))


def hooked_attention(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Each block's softmax(q k^T / sqrt(d)) recomputed by hand from its input, seen by a forward pre-hook."""
    found = []

    def hook(block, args):
        attn = block.attn
        h = block.norm1(args[0])
        b, n, _ = h.shape
        qkv = attn.qkv(h).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        q, k = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])
        found.append((q @ k.transpose(-2, -1) * attn.scale).softmax(-1))

    handles = [b.register_forward_pre_hook(hook) for b in model.blocks]
    try:
        model.forward_features(x)
    finally:
        for handle in handles:
            handle.remove()
    return found


def plain_rollout_pooling(model: torch.nn.Module, x: torch.Tensor, fusion: str = "mean") -> torch.Tensor:
    """[CLS]-row rollout over the patches by plain loops (float64), pooling the final normed patch tokens."""
    prefix = model.num_prefix_tokens
    attentions = hooked_attention(model, x)
    tokens = model.forward_features(x).double()
    out = []
    for i in range(x.shape[0]):
        n = attentions[0].shape[-1]
        r = torch.eye(n, dtype=torch.float64)
        for attn in attentions:
            heads = attn[i].double()
            a = heads.mean(0) if fusion == "mean" else heads.amax(0)
            a = a + torch.eye(n, dtype=torch.float64)
            r = (a / a.sum(-1, keepdim=True)) @ r
        w = r[0, prefix:] / r[0, prefix:].sum()
        out.append(w @ tokens[i, prefix:])
    return torch.stack(out)


@pytest.mark.parametrize("name", list(STOCK))
@pytest.mark.parametrize("fusion", ["mean", "max"])
def test_rollout_pooling_of_a_stock_vit_is_a_plain_loop_rollout(name, fusion):
    model = build(name)
    x = images(name)
    with torch.no_grad():
        want = plain_rollout_pooling(model, x, fusion)
        stock = model.forward_head(model.forward_features(x), pre_logits=True).double()
        assert (want - stock).abs().max() > 1e-2  # rollout pooling differs from the model's own: the test has teeth
        set_pooling(model, "rollout", head_fusion=fusion)
        assert isinstance(model, RolloutPooling) and model.rollout_head_fusion == fusion
        got = model.forward_head(model.forward_features(x), pre_logits=True)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model(x), model.head(model.fc_norm(got)))


@pytest.mark.parametrize("name", list(STOCK))
def test_switching_back_gives_the_stock_model_exactly(name):
    model = build(name)
    x = images(name)
    cls, pool = type(model), model.global_pool
    fused = [b.attn.fused_attn for b in model.blocks]
    keys = set(vars(model))
    with torch.no_grad():
        want = model(x)
        set_pooling(model, "rollout", discard_ratio=0.5)
        assert not any(b.attn.fused_attn for b in model.blocks)
        rolled = model(x)
        set_pooling(model, pool)
        got = model(x)
    assert type(model) is cls and [b.attn.fused_attn for b in model.blocks] == fused
    assert all(not b.attn.attn_drop._forward_hooks for b in model.blocks) and set(vars(model)) == keys
    torch.testing.assert_close(got, want)
    assert not torch.allclose(rolled, want)
    torch.jit.script(model)  # the stock model scripts again


def test_refusals_name_the_reason():
    model = build("vit_small_patch16_224")
    with pytest.raises(ValueError, match="unknown pooling 'attention'"):
        set_pooling(model, "attention")
    with pytest.raises(ValueError, match="unknown head_fusion"):
        set_pooling(model, "rollout", head_fusion="median")
    with pytest.raises(ValueError, match="not rollout options"):
        set_pooling(model, "avg", head_fusion="max")
    with pytest.raises(ValueError, match="create it with global_pool='map'"):
        set_pooling(model, "map")
    no_cls = timm.create_model("vit_small_patch16_224", img_size=32, depth=1, class_token=False, global_pool="avg")
    with pytest.raises(ValueError, match="needs a class token"):
        set_pooling(no_cls, "rollout")
    with pytest.raises(ValueError, match="not a timm VisionTransformer"):
        set_pooling(torch.nn.Linear(2, 2), "avg")
    set_pooling(model, "rollout")
    with pytest.raises(RuntimeError, match=r"cannot be TorchScript-compiled.*torch\.compile"):
        torch.jit.script(model)


def test_fine_tune_a_stock_vit_from_a_local_file_with_rollout_pooling(tmp_path, capsys):
    """train --model <stock ViT> --pool rollout --pretrained-file: starts from the file's weights (position
    embedding resampled to 32x32, a new 10-class head), trains, and reloads with timm and with load_model."""
    from safetensors.torch import save_file

    from timm_rollout import train
    from timm_rollout.loading import load_model

    torch.manual_seed(0)
    source = timm.create_model("vit_small_patch16_224", img_size=64, patch_size=8, depth=2, num_classes=1000)
    save_file(source.state_dict(), str(tmp_path / "pretrained.safetensors"))
    run = tmp_path / "run"
    train.main(["--model", "vit_small_patch16_224", "--model-kwargs", "img_size=32", "patch_size=8", "depth=2",
                "--pool", "rollout", "--pool-kwargs", "head_fusion=max", "--pretrained-file",
                str(tmp_path / "pretrained.safetensors"), "--dataset", "cifar10-sample", "--max-train-samples", "128",
                "--max-eval-samples", "50", "--batch-size", "64", "--epochs", "1", "--lr", "1e-4", "--device", "cpu",
                "--amp", "none", "--workers", "1", "--no-progress", "--output", str(run)])
    notes = [line for line in capsys.readouterr().err.splitlines() if "resampled" in line]
    assert notes == ["note: --pretrained-file's position embedding resampled by timm from (1, 65, 384) to (1, 17, "
                     "384) to fit --model-kwargs"]  # 8x8 patches + [CLS] -> 4x4 + [CLS]; the patch size is kept
    loaded = timm.create_model(f"local-dir:{run}", pretrained=True).eval()  # timm's own loader: as trained
    assert isinstance(loaded, RolloutPooling) and loaded.rollout_head_fusion == "max" and loaded.num_classes == 10
    assert loaded.pretrained_cfg["input_size"] == (3, 32, 32) and tuple(loaded.pretrained_cfg["mean"]) == (0.5,) * 3
    fresh = timm.create_model("vit_small_patch16_224", img_size=64, patch_size=8, depth=2)
    for name in ("blocks.1.attn.qkv.weight", "blocks.0.mlp.fc1.weight"):  # started from the file, moved a little
        trained, start = loaded.state_dict()[name], source.state_dict()[name]
        assert (trained - start).norm() < 0.05 * (fresh.state_dict()[name] - start).norm()
    model, info = load_model(f"local-dir:{run}")  # the project's loader builds the same
    assert isinstance(model, RolloutPooling) and model.rollout_head_fusion == "max" and info["global_pool"] == "rollout"
    by_hand = timm.create_model("vit_small_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10).eval()
    by_hand.load_state_dict(loaded.state_dict())
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = set_pooling(by_hand, "rollout", head_fusion="max")(x)
        assert torch.equal(model(x), want) and torch.equal(loaded(x), want)


@pytest.mark.parametrize("name", list(STOCK))
def test_assigning_rollout_to_a_stock_vits_global_pool_is_set_pooling(name):
    """``model.global_pool = 'rollout'`` on a stock timm ViT pools it as set_pooling does (timm alone takes the
    string and fails on the next forward), and assigning its own pooling back gives the stock model exactly; a
    model rollout cannot pool is refused at the assignment, unchanged."""
    model, reference = build(name), set_pooling(build(name), "rollout")
    x = images(name)
    with torch.no_grad():
        stock = model(x)
        model.global_pool = "rollout"
        assert isinstance(model, RolloutPooling) and model.global_pool == "rollout"
        assert torch.equal(model(x), reference(x)) and not torch.allclose(model(x), stock)
        torch.testing.assert_close(model.forward_head(model.forward_features(x), pre_logits=True).double(),
                                   plain_rollout_pooling(model, x), rtol=1e-4, atol=1e-5)
        model.global_pool = "token"
        assert type(model) is type(build(name)) and torch.equal(model(x), stock)
    no_cls = timm.create_model(name, class_token=False, global_pool="avg", **STOCK[name])
    with pytest.raises(ValueError, match="rollout pooling needs a class token"):
        no_cls.global_pool = "rollout"
    assert no_cls.global_pool == "avg" and not isinstance(no_cls, RolloutPooling)
    assert torch.jit.script(build(name).eval())(x).shape == stock.shape  # TorchScript of the stock model as before


def test_tokens_changed_in_place_are_refused_however_they_were_changed():
    """The version counter misses inference tensors and ``.data``: the tokens are compared bit for bit."""
    name = "vit_small_patch16_224"
    model = set_pooling(build(name), "rollout")
    x = images(name)
    with torch.no_grad():
        want = plain_rollout_pooling(model, x)
    for context in (torch.inference_mode, torch.no_grad, torch.enable_grad):
        with context():
            tokens = model.forward_features(x)
            torch.testing.assert_close(model.forward_head(tokens, pre_logits=True).double(), want, rtol=1e-4, atol=1e-5)
            before = tokens.data[1, 3, 5].item()
            tokens.data[1, 3, 5] = before + 1.0
            with pytest.raises(RuntimeError, match="changed in place after forward_features"):
                model.forward_head(tokens)
            tokens.data[1, 3, 5] = before  # the same bits again: the pass's own tokens, pooled right
            torch.testing.assert_close(model.forward_head(tokens, pre_logits=True).double(), want, rtol=1e-4, atol=1e-5)
    with torch.inference_mode():
        tokens = model.forward_features(x)
        tokens.mul_(2.0)  # an inference tensor has no version counter
        with pytest.raises(RuntimeError, match="changed in place after forward_features"):
            model.forward_head(tokens)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_forward_features_keeps_every_pass(backend):
    """torch.compile(model.forward_features) called several times: each tokens pool with their own pass (with
    inductor under no_grad, only the last pass used to be kept)."""
    torch._dynamo.reset()
    name = "vit_small_patch16_224"
    model = set_pooling(build(name), "rollout")
    inputs = [images(name), 3.0 * images(name).flip(0), images(name).flip(-1)]
    compiled = torch.compile(model.forward_features, backend=backend)
    with torch.no_grad():
        tokens = [compiled(x) for x in inputs]  # the first passes of a fresh model, as a user would
        want = [plain_rollout_pooling(model, x) for x in inputs]
        for t, w in zip(tokens, want, strict=True):
            torch.testing.assert_close(model.forward_head(t, pre_logits=True).double(), w, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(want[0], want[1])


def test_changed_rollout_options_refuse_tokens_of_an_earlier_pass():
    name = "vit_small_patch16_224"
    model = set_pooling(build(name), "rollout")
    x = images(name)
    with torch.no_grad():
        want = plain_rollout_pooling(model, x, "max")
        tokens = model.forward_features(x)
        set_pooling(model, "rollout")  # the same options: the pass still pools
        model.forward_head(tokens)
        set_pooling(model, "rollout", head_fusion="max")
        with pytest.raises(RuntimeError, match=r"rollout options changed \(set_pooling\) after forward_features"):
            model.forward_head(tokens)
        model.rollout_head_fusion = "mean"  # back to the pass's options, by hand: it pools again
        model.forward_head(tokens)
        set_pooling(model, "rollout", head_fusion="max")
        got = model.forward_head(model.forward_features(x), pre_logits=True)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["vit_small_patch16_224", "vit_tiny_cifar_rollout"])
def test_a_rollout_pooled_model_pickles_and_loads_into_a_working_model(name):
    """pickle and torch.save of the user's own model object (a stock timm ViT's pooled class is made at run time)."""
    import io
    import pickle

    import timm_rollout  # noqa: F401  (registers the tiny model)

    if name in STOCK:
        model, x = set_pooling(build(name), "rollout", head_fusion="max"), images(name)
    else:
        torch.manual_seed(0)
        model = timm.create_model(name, depth=2, rollout_head_fusion="max").eval()
        x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = plain_rollout_pooling(model, x, "max")
        live = model.forward_features(x)  # a live pass is not pickled
        buffer = io.BytesIO()
        torch.save(model, buffer)
        copies = [pickle.loads(pickle.dumps(model)), torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)]
        for copy in copies:
            assert type(copy) is type(model) and copy.rollout_head_fusion == "max"
            assert "_rollout_passes" not in vars(copy)
            got = copy.forward_head(copy.forward_features(x), pre_logits=True)
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(copy(x), model(x))
            with pytest.raises(RuntimeError, match="takes the very tensor"):
                copy.forward_head(live)  # the original's pass is not the copy's
            set_pooling(copy, "token")
            assert type(copy) is model._stock_class and not any(b.attn.attn_drop._forward_hooks for b in copy.blocks)
    model.forward_head(live)


def test_no_leftovers_dead_passes_and_empty_sinks():
    name = "vit_small_patch16_224"
    model = build(name)
    x = images(name)
    drops = [b.attn.attn_drop for b in model.blocks]
    with torch.no_grad():
        with capture_attention(model):
            model(x)
        assert not any("_attention_sinks" in vars(d) for d in drops)  # capture_attention leaves none
        set_pooling(model, "rollout")
        tokens = model.forward_features(x)
        weights = model.rollout_weights(tokens)
        assert len(model.__dict__["_rollout_passes"]) == 1
        del tokens  # a dead pass's weights go with its tokens, not at the next forward_features
        assert model.__dict__["_rollout_passes"] == {} and weights.shape == (2, 16)
        model(x)
        set_pooling(model, "token")
    assert not any("_attention_sinks" in vars(d) for d in drops)  # switching back leaves none


def fresh_stock(model: torch.nn.Module, name: str, **kwargs) -> torch.nn.Module:
    """An independent reference: a fresh stock model with ``model``'s weights, never pooled."""
    fresh = timm.create_model(name, pretrained=False, num_classes=7, **STOCK[name], **kwargs).eval()
    fresh.load_state_dict(model.state_dict())
    return fresh


@pytest.mark.parametrize("how", ["bound", "compiled"])
def test_forward_features_bound_while_rollout_pooled_follows_a_switch_back(how):
    torch._dynamo.reset()
    name = "vit_small_patch16_224"
    model = set_pooling(build(name), "rollout")
    x = images(name)
    features = model.forward_features if how == "bound" else torch.compile(model.forward_features, backend="aot_eager")
    forward = model.forward
    with torch.no_grad():
        features(x)
        set_pooling(model, "token")
        stock = fresh_stock(model, name)
        torch.testing.assert_close(features(x), stock.forward_features(x))  # was: no attribute '_rollout_pass'
        torch.testing.assert_close(forward(x), stock(x))


def test_tokens_of_the_stock_forward_features_are_refused_naming_it():
    name = "vit_small_patch16_224"
    model = build(name)
    features = model.forward_features  # bound while stock
    set_pooling(model, "rollout")
    refusal = r"the stock forward_features made them .*bound or compiled"
    with torch.no_grad(), pytest.raises(RuntimeError, match=refusal):
        model.forward_head(features(images(name)))


@pytest.mark.parametrize(("options", "match"), [
    (dict(grad="no"), "grad .* must be True or False, got 'no'"),
    (dict(grad=1), "grad .* must be True or False, got 1"),
    (dict(discard_ratio="0.5"), "discard_ratio must be a number in \\[0, 1\\), got '0.5'"),
    (dict(discard_ratio=True), "discard_ratio must be a number"),
    (dict(discard_ratio=1.0), "discard_ratio must be in \\[0, 1\\)"),
    (dict(discard_ratio=float("nan")), "discard_ratio must be in \\[0, 1\\)"),
    (dict(head_fusion=1), "unknown head_fusion 1"),  # (timm.create_model drops None-valued kwargs)
])
def test_rollout_option_values_are_checked_by_set_pooling_and_by_the_tiny_models(options, match):
    import timm_rollout  # noqa: F401  (registers the tiny models)

    model = build("vit_small_patch16_224")
    keys = set(vars(model))
    with pytest.raises(ValueError, match=match) as refused:
        set_pooling(model, "rollout", **options)
    assert "\n" not in str(refused.value) and type(model).__name__ == "VisionTransformer" and set(vars(model)) == keys
    (key, value), = options.items()
    with pytest.raises(ValueError, match=match):
        timm.create_model("vit_tiny_cifar_rollout", depth=1, **{f"rollout_{key}": value})


@pytest.mark.parametrize(("attr", "value", "match"), [
    ("rollout_grad", "no", "rollout_grad must be True or False, got 'no'"),
    ("rollout_discard_ratio", "0.9", "discard_ratio must be a number in \\[0, 1\\), got '0.9'"),
    ("rollout_head_fusion", "median", "unknown head_fusion 'median'"),
])
def test_rollout_options_assigned_to_the_model_directly_are_checked_at_the_next_pass(attr, value, match):
    """Past set_pooling's check: ``model.rollout_grad = 'no'`` (truthy) would let gradients through silently."""
    import timm_rollout  # noqa: F401  (registers the tiny models)

    model = timm.create_model("vit_tiny_cifar_rollout", depth=1)
    setattr(model, attr, value)
    with pytest.raises(ValueError, match=match):
        model(torch.randn(1, 3, 32, 32))


def test_rollout_option_values_are_stored_as_their_types():
    import numpy as np

    model = set_pooling(build("vit_small_patch16_224"), "rollout", discard_ratio=np.float32(0.5), grad=True)
    assert type(model.rollout_discard_ratio) is float and model.rollout_discard_ratio == 0.5 and model.rollout_grad


@pytest.mark.parametrize("how", ["set_pooling", "assignment", "reset_classifier"])
def test_every_way_back_to_a_timm_pooling_gives_the_stock_model_exactly(how):
    """set_pooling, ``model.global_pool = 'avg'`` and ``reset_classifier(n, global_pool='avg')``: one code path."""
    name = "vit_small_patch16_224"
    model = build(name)
    stock = fresh_stock(model, name, global_pool="avg", fc_norm=False)  # the same modules, pooled by avg
    set_pooling(model, "rollout", head_fusion="max", discard_ratio=0.5, grad=True)
    if how == "set_pooling":
        set_pooling(model, "avg")
    elif how == "assignment":
        model.global_pool = "avg"
    else:
        model.reset_classifier(7, global_pool="avg")
        model.head.load_state_dict(stock.head.state_dict())
    assert type(model) is type(stock) and set(vars(model)) == set(vars(stock))  # no rollout_* options left
    assert [b.attn.fused_attn for b in model.blocks] == [b.attn.fused_attn for b in stock.blocks]
    assert not any(b.attn.attn_drop._forward_hooks for b in model.blocks)
    with torch.no_grad():
        torch.testing.assert_close(model(images(name)), stock(images(name)))
