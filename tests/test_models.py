"""The three registered models: timm behaviour, pooling switchable at run time, attention lifetime, EMA copies,
checkpoint swaps, fp32 rollout under autocast, errors."""

import pytest
import timm
import torch
from timm.layers import use_fused_attn
from timm.utils import ModelEmaV3

import timm_rollout
from timm_rollout import capture_attention, patch_weights, rollout_cls_row
from timm_rollout.models import RolloutPooledVisionTransformer

NAMES = ("vit_tiny_cifar_cls", "vit_tiny_cifar_gap", "vit_tiny_cifar_rollout")


def make(name: str, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, **kwargs)


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def test_registered_with_timm_and_study_architecture():
    assert timm.list_models("vit_tiny_cifar*") == list(NAMES)
    for name in NAMES:
        model = make(name)
        assert isinstance(model, timm_rollout.RolloutVisionTransformer)
        assert model.patch_embed.num_patches == 64 and model.num_prefix_tokens == 1
        assert model.embed_dim == model.num_features == 128 and len(model.blocks) == 6
        assert model.blocks[0].attn.num_heads == 4 and model.blocks[0].mlp.fc1.out_features == 512
        assert model.pos_drop.p == model.blocks[0].attn.attn_drop.p == model.blocks[0].mlp.drop1.p == 0.1
        assert model.blocks[0].attn.proj_drop.p == 0.1 and model.blocks[0].norm1.eps == 1e-5
        assert model.num_classes == 100 and model.head.out_features == 100
        cfg = model.pretrained_cfg
        assert cfg["input_size"] == (3, 32, 32) and cfg["fixed_input_size"] and cfg["crop_pct"] == 1.0
        assert cfg["mean"] == (0.5071, 0.4865, 0.4409) and cfg["std"] == (0.2673, 0.2564, 0.2762)
        assert cfg["first_conv"] == "patch_embed.proj" and cfg["classifier"] == "head"
        assert not cfg.get("hf_hub_id") and not cfg.get("url")
    assert make("vit_tiny_cifar_cls").global_pool == "token"
    assert make("vit_tiny_cifar_rollout").global_pool == "rollout"
    gap = make("vit_tiny_cifar_gap")
    # mean of the final *normed* patch tokens: timm's fc_norm (a LayerNorm after pooling) stays off
    assert gap.global_pool == "avg" and isinstance(gap.fc_norm, torch.nn.Identity)
    assert isinstance(gap.norm, torch.nn.LayerNorm)


def test_defaults_can_be_overridden():
    model = make("vit_tiny_cifar_rollout", num_classes=10, embed_dim=192, drop_path_rate=0.1, attn_drop_rate=0.0)
    assert model.head.out_features == 10 and model.num_features == 192
    assert model.blocks[-1].drop_path1.drop_prob == pytest.approx(0.1)
    assert model.blocks[0].attn.attn_drop.p == 0.0
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize("train", [False, True])
def test_rollout_pooling_is_rollout_weighted_mean_of_patch_tokens(images, train):
    model = make("vit_tiny_cifar_rollout").train(train)
    with capture_attention(model) as cap:
        tokens = model.forward_features(images)
        pooled = model.forward_head(tokens, pre_logits=True)
    # attention is recorded before dropout: clean row-stochastic distributions even in train mode
    for attn in cap.attentions:
        torch.testing.assert_close(attn.sum(-1), torch.ones(attn.shape[:-1]))
    weights = patch_weights(rollout_cls_row(cap.attentions))
    assert weights.shape == (3, 64) and (weights > 0).all()
    want = (weights.unsqueeze(-1) * tokens[:, 1:]).sum(1)
    torch.testing.assert_close(pooled, want, rtol=1e-5, atol=1e-6)
    assert pooled.shape == (3, 128)


def _plain_rollout_weights(attentions: list[torch.Tensor], fusion: str, ratio: float) -> torch.Tensor:
    """The [CLS] rollout row over the patches by plain loops over images, layers and entries (float64)."""
    out = []
    for b in range(attentions[0].shape[0]):
        r = torch.eye(65, dtype=torch.float64)
        for attn in attentions:
            heads = attn[b].double()
            a = {"mean": heads.mean(0), "max": heads.amax(0), "min": heads.amin(0)}[fusion].clone()
            entries = sorted((a[i, j].item(), i, j) for i in range(1, 65) for j in range(1, 65) if i != j)
            for _, i, j in entries[:int(len(entries) * ratio)]:
                a[i, j] = 0.0
            a = a + torch.eye(65, dtype=torch.float64)
            r = (a / a.sum(-1, keepdim=True)) @ r
        row = r[0, 1:]
        out.append(row / row.sum())
    return torch.stack(out)


@pytest.mark.parametrize(("fusion", "ratio"), [("max", 0.9), ("min", 0.0), ("mean", 0.5)])
def test_rollout_options_are_model_arguments_pooling_as_a_plain_loop(images, tmp_path, fusion, ratio):
    from timm_rollout.checkpoint import save_model

    model = make("vit_tiny_cifar_rollout", num_classes=10, rollout_head_fusion=fusion,
                 rollout_discard_ratio=ratio).eval()
    with torch.no_grad():  # larger queries and keys: peaked attention, on which the options matter
        for block in model.blocks:
            block.attn.qkv.weight[:256].mul_(8.0)
    with torch.no_grad(), capture_attention(model) as cap:
        tokens = model.forward_features(images)
        pooled = model.forward_head(tokens, pre_logits=True)
    weights = _plain_rollout_weights(cap.attentions, fusion, ratio)
    torch.testing.assert_close(pooled.double(), (weights.unsqueeze(-1) * tokens[:, 1:].double()).sum(1),
                               rtol=1e-5, atol=1e-6)
    plain = patch_weights(rollout_cls_row(cap.attentions)).double()
    assert (weights - plain).abs().max() > 2e-4  # the options change the weights: the check above has teeth
    save_model(tmp_path, model, [], (0.5,) * 3, (0.5,) * 3)  # config.json records the options
    back = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    assert (back.rollout_head_fusion, back.rollout_discard_ratio) == (fusion, ratio)
    torch.testing.assert_close(back(images), model(images))


@pytest.mark.parametrize(("name", "pool", "options"), [("vit_tiny_cifar_cls", "rollout", {"head_fusion": "max",
                                                                                          "discard_ratio": 0.9}),
                                                     ("vit_tiny_cifar_cls", "avg", {}),
                                                     ("vit_tiny_cifar_rollout", "max", {})])
def test_a_model_saved_after_set_pooling_reloads_pooling_as_it_was(images, tmp_path, name, pool, options):
    """``train --pool ... --pool-kwargs ...`` switches pooling after building: the export must record the switch."""
    from timm_rollout.checkpoint import save_model
    from timm_rollout.loading import load_model

    model = timm_rollout.set_pooling(make(name, num_classes=10).eval(), pool, **options)
    with torch.no_grad():
        for block in model.blocks:  # peaked attention, on which the rollout options matter
            block.attn.qkv.weight[:256].mul_(8.0)
    save_model(tmp_path, model, [], (0.5,) * 3, (0.5,) * 3)
    for back in (timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval(),
                 load_model(f"local-dir:{tmp_path}")[0]):
        assert back.global_pool == pool
        assert (back.rollout_head_fusion, back.rollout_discard_ratio) == (model.rollout_head_fusion,
                                                                          model.rollout_discard_ratio)
        torch.testing.assert_close(back(images), model(images))
    if options:  # the options change the logits: the comparison above has teeth
        plain = timm_rollout.set_pooling(make(name, num_classes=10).eval(), pool)
        plain.load_state_dict(model.state_dict())
        assert (plain(images) - model(images)).abs().max() > 1e-4


@pytest.mark.parametrize(("kwargs", "match"), [({"rollout_head_fusion": "median"}, "unknown head_fusion"),
                                               ({"rollout_discard_ratio": 1.0}, "discard_ratio")])
def test_bad_rollout_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        timm.create_model("vit_tiny_cifar_rollout", **kwargs)


def test_cls_pooling_is_final_cls_token(images):
    model = make("vit_tiny_cifar_cls").eval()
    tokens = model.forward_features(images)
    torch.testing.assert_close(model.forward_head(tokens, pre_logits=True), tokens[:, 0])


def attached_tensors(model: torch.nn.Module) -> dict[str, tuple]:
    """Shape of every tensor a module attribute holds (directly or in a list/tuple/dict), except parameters."""
    found = {}
    for module_name, module in model.named_modules():
        for key, value in vars(module).items():
            if key in ("_parameters", "_modules"):
                continue
            items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else [value]
            for i, item in enumerate(items):
                if isinstance(item, torch.Tensor):
                    found[f"{module_name or 'model'}.{key}[{i}]"] = tuple(item.shape)
    return found


@pytest.mark.parametrize("name", NAMES)
def test_no_attention_stays_attached_after_a_pass(images, name):
    model = make(name, depth=2).eval()
    rollout = name.endswith("rollout")
    with torch.no_grad():
        model(images)
        assert attached_tensors(model) == {}  # model(x) keeps nothing
        assert model.__dict__.get("_rollout_passes", {}) == {}
        tokens = model.forward_features(images)
        assert attached_tensors(model) == {}  # no attention: only the (B, P) weights, tied to these tokens
        passes = list(model.__dict__.get("_rollout_passes", {}).values())
        assert [(p.ref() is tokens, tuple(p.weights.shape)) for p in passes] == ([(True, (3, 64))] if rollout else [])
        model.forward_head(tokens)
        model.forward_intermediates(images)
        assert attached_tensors(model) == {}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rollout_grad", [False, True])
def test_no_attention_stays_attached_after_a_checkpointed_training_step(images, name, rollout_grad):
    model = make(name, depth=2, rollout_grad=rollout_grad).train()
    model.set_grad_checkpointing(True)
    torch.manual_seed(0)
    model(images).logsumexp(-1).sum().backward()  # backward re-runs every block (recomputation)
    assert attached_tensors(model) == {}
    assert model.blocks[0].attn.qkv.weight.grad.abs().sum() > 0


def test_forward_head_pools_only_tokens_of_a_pass_with_that_pass_weights(images):
    model = make("vit_tiny_cifar_rollout", depth=2).eval()
    with pytest.raises(RuntimeError, match="takes the very tensor its forward_features"):
        model.forward_head(torch.randn(3, 65, 128))
    other = torch.randn_like(images)
    with torch.no_grad(), capture_attention(model) as cap:
        t1 = model.forward_features(images)
    want = (patch_weights(rollout_cls_row(cap.attentions)).unsqueeze(-1) * t1[:, 1:]).sum(1)
    with torch.no_grad():  # the sequence that used to pool t1 with the other pass's attention
        model.forward_intermediates(other, intermediates_only=True)
        model.forward_intermediates(other)  # its final tokens are dropped at once
        t2 = model.forward_features(other)
        model(other)
        pooled = model.forward_head(t1, pre_logits=True)
        torch.testing.assert_close(pooled, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model.forward_head(t1, pre_logits=True), want)  # again: same pass, same weights
        assert not torch.allclose(model.forward_head(t2, pre_logits=True), want)
        with pytest.raises(RuntimeError, match="takes the very tensor"):
            model.forward_head(t1[:2])  # a slice is another tensor
        with pytest.raises(RuntimeError, match="takes the very tensor"):
            model.forward_head(t1.clone())
        t1.mul_(2.0)
        with pytest.raises(RuntimeError, match="changed in place"):
            model.forward_head(t1)
    final, _ = model.forward_intermediates(images, stop_early=True, indices=[0])  # not every block ran
    with pytest.raises(RuntimeError, match="takes the very tensor"):
        model.forward_head(final)


def test_threads_sharing_a_model_pool_each_with_their_own_pass(images):
    """A model served from several threads at once: each pass records, keeps and pools its own attention."""
    import threading

    model = make("vit_tiny_cifar_rollout", depth=2).eval()
    inputs = [images, 4.0 * images.flip(0)]  # different attention, so a mixed pass shows
    with torch.no_grad():
        want = [(model.rollout_weights(model.forward_features(x)), model(x)) for x in inputs]
    assert not torch.allclose(want[0][0], want[1][0])
    wrong, failed = [], []

    def serve(i: int) -> None:
        try:
            for _ in range(25):
                with torch.no_grad():
                    tokens = model.forward_features(inputs[i])
                    weights, logits = model.rollout_weights(tokens), model(inputs[i])
                if not (torch.allclose(weights, want[i][0]) and torch.allclose(logits, want[i][1], atol=1e-6)):
                    wrong.append(i)
        except RuntimeError as e:
            failed.append(str(e))

    threads = [threading.Thread(target=serve, args=(i,)) for i in (0, 1, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (wrong, failed) == ([], [])
    assert attached_tensors(model) == {} and all(not d.__dict__.get("_attention_sinks") for d in
                                                 (b.attn.attn_drop for b in model.blocks))


def test_rollout_weights_of_a_pass_and_none_after_model_call(images):
    model = make("vit_tiny_cifar_rollout", depth=2).eval()
    with torch.no_grad(), capture_attention(model) as cap:
        tokens = model.forward_features(images)
        logits = model(images)
    torch.testing.assert_close(model.rollout_weights(tokens), patch_weights(rollout_cls_row(cap.attentions)))
    passes = list(model.__dict__["_rollout_passes"].values())
    assert passes[0].ref() is tokens and len(passes) == 1
    assert logits.shape == (3, 100)  # model(x) pooled its own pass and kept no weights of it


def test_cls_and_gap_run_fused_attention_and_rollout_the_explicit_path(images):
    for name in NAMES:
        model = make(name, depth=2).eval()
        fused = [b.attn.fused_attn for b in model.blocks]
        assert fused == [not name.endswith("rollout") and use_fused_attn()] * 2
        assert all(len(b.attn.attn_drop._forward_hooks) == int(name.endswith("rollout")) for b in model.blocks)
        with torch.no_grad():
            want = model(images)
            with capture_attention(model):  # the explicit path meanwhile, for any model
                assert not any(b.attn.fused_attn for b in model.blocks)
                got = model(images)
        assert [b.attn.fused_attn for b in model.blocks] == fused
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_global_pool_assignment_switches_pooling_and_back(images):
    model = make("vit_tiny_cifar_cls", num_classes=10, depth=2).eval()
    gap = make("vit_tiny_cifar_gap", num_classes=10, depth=2).eval()
    gap.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        tokens = model.forward_features(images)
        model.global_pool = "rollout"  # post-hoc rollout readout of a CLS-trained backbone
        assert type(model) is RolloutPooledVisionTransformer and not model.blocks[0].attn.fused_attn
        with capture_attention(model) as cap:
            pooled = model.forward_head(model.forward_features(images), pre_logits=True)
        want = (patch_weights(rollout_cls_row(cap.attentions)).unsqueeze(-1) * tokens[:, 1:]).sum(1)
        torch.testing.assert_close(pooled, want, rtol=1e-5, atol=1e-6)
        model.global_pool = "avg"
        assert type(model) is timm_rollout.RolloutVisionTransformer
        assert model.blocks[0].attn.fused_attn == use_fused_attn()
        assert all(len(b.attn.attn_drop._forward_hooks) == 0 for b in model.blocks)
        torch.testing.assert_close(model(images), gap(images))
        model.global_pool = "token"
        torch.testing.assert_close(model.forward_head(model.forward_features(images), pre_logits=True), tokens[:, 0])


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.cuda),
])
def test_rollout_weights_are_float32_under_bf16_autocast(images, device):
    model = make("vit_tiny_cifar_rollout", depth=2).eval().to(device)
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16), capture_attention(model) as cap:
        got = model.rollout_weights(model.forward_features(images.to(device)))
    if device == "cpu":  # CPU autocast leaves softmax in bf16 (CUDA autocast runs it in fp32)
        assert cap.attentions[0].dtype == torch.bfloat16
    want = patch_weights(rollout_cls_row([a.float() for a in cap.attentions]))  # fp32, no autocast
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_rollout_weights_are_a_readout_unless_asked(images):
    grads = {}
    for flag in (False, True):
        model = make("vit_tiny_cifar_rollout", rollout_grad=flag).eval()
        model(images).logsumexp(-1).sum().backward()
        grads[flag] = model.blocks[0].attn.qkv.weight.grad.clone()
    assert not torch.allclose(grads[False], grads[True])
    torch.testing.assert_close(
        make("vit_tiny_cifar_rollout", rollout_grad=True).eval()(images),
        make("vit_tiny_cifar_rollout").eval()(images),
    )


def test_ema_copy_pools_with_its_own_attention(images):
    model = make("vit_tiny_cifar_rollout").eval()
    ema = ModelEmaV3(model, decay=0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    reference = make("vit_tiny_cifar_rollout").eval()
    reference.load_state_dict(ema.module.state_dict())
    other = torch.randn_like(images)
    model.forward_features(other)  # the live model records attention for other images
    torch.testing.assert_close(ema.module(images), reference(images))
    assert not torch.allclose(model(images), ema.module(images))


@pytest.mark.parametrize("source", NAMES)
def test_checkpoint_swaps_between_poolings(images, source):
    trained = make(source, num_classes=10).eval()
    outputs = {}
    for name in NAMES:
        model = timm.create_model(name, num_classes=10).eval()
        model.load_state_dict(trained.state_dict(), strict=True)
        assert model.state_dict().keys() == trained.state_dict().keys()
        torch.testing.assert_close(model.forward_features(images), trained.forward_features(images))
        outputs[name] = model(images)
    torch.testing.assert_close(outputs[source], trained(images))
    assert not torch.allclose(outputs["vit_tiny_cifar_cls"], outputs["vit_tiny_cifar_gap"])
    assert not torch.allclose(outputs["vit_tiny_cifar_gap"], outputs["vit_tiny_cifar_rollout"])


def test_timm_vit_interface(images):
    model = make("vit_tiny_cifar_rollout").eval()
    final, intermediates = model.forward_intermediates(images)
    assert final.shape == (3, 65, 128) and len(intermediates) == 6 and intermediates[0].shape == (3, 128, 8, 8)
    assert {"pos_embed", "cls_token"} <= model.no_weight_decay()
    model.reset_classifier(10)
    assert model.global_pool == "rollout" and model.head.out_features == 10 and model(images).shape == (3, 10)
    model.reset_classifier(5, global_pool="avg")
    assert model.global_pool == "avg" and model(images).shape == (3, 5)
    cls_model = make("vit_tiny_cifar_cls")
    cls_model.reset_classifier(7, global_pool="rollout")
    assert cls_model.global_pool == "rollout" and cls_model(images).shape == (3, 7)


@pytest.mark.parametrize("name", NAMES)
def test_grad_checkpointing_gives_same_outputs_and_gradients(images, name):
    model = make(name).eval()
    model(images).sum().backward()
    want = model.blocks[0].attn.qkv.weight.grad.clone()
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(images).sum().backward()
    torch.testing.assert_close(model.blocks[0].attn.qkv.weight.grad, want, rtol=1e-4, atol=1e-6)


def test_torch_compile_gives_same_outputs(images):
    torch._dynamo.reset()
    model = make("vit_tiny_cifar_rollout", depth=2).eval()
    with torch.no_grad():
        want = model(images)
        compiled = torch.compile(model, backend="aot_eager")
        torch.testing.assert_close(compiled(images), want)
        torch.testing.assert_close(compiled(images.flip(0)), model(images.flip(0)))


@pytest.mark.parametrize("name", NAMES)
def test_wrong_image_size_is_a_one_line_error(name):
    model = make(name, depth=1)  # timm's own strict_img_size check in PatchEmbed (scriptable)
    with pytest.raises(AssertionError, match=r"^Input height \(64\) doesn't match model \(32\)\.$"):
        model(torch.randn(1, 3, 64, 48))
