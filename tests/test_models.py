"""The two registered models: timm behaviour, rollout pooling, EMA copies, checkpoint swaps, errors."""

import pytest
import timm
import torch
from timm.utils import ModelEmaV3

import timm_rollout
from timm_rollout import capture_attention, patch_weights, rollout_cls_row
from timm_rollout.capture import MODEL_SLOT

NAMES = ("vit_tiny_cifar_cls", "vit_tiny_cifar_rollout")


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


def test_cls_pooling_is_final_cls_token(images):
    model = make("vit_tiny_cifar_cls").eval()
    tokens = model.forward_features(images)
    torch.testing.assert_close(model.forward_head(tokens, pre_logits=True), tokens[:, 0])


def test_recorded_attention_is_released_after_each_forward(images):
    for name in NAMES:
        model = make(name).eval()
        for _ in range(3):
            model(images)
        assert all(getattr(b.attn.attn_drop, MODEL_SLOT) is None for b in model.blocks)


def test_forward_head_without_forward_features_says_what_to_do(images):
    model = make("vit_tiny_cifar_rollout")
    with pytest.raises(RuntimeError, match="call forward_features"):
        model.forward_head(torch.randn(3, 65, 128))


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


def test_checkpoint_swaps_between_poolings(images):
    cls_model = make("vit_tiny_cifar_cls", num_classes=10).eval()
    rollout_model = timm.create_model("vit_tiny_cifar_rollout", num_classes=10).eval()
    rollout_model.load_state_dict(cls_model.state_dict(), strict=True)
    assert cls_model.state_dict().keys() == rollout_model.state_dict().keys()
    torch.testing.assert_close(rollout_model.forward_features(images), cls_model.forward_features(images))
    rollout_model.rollout_weights()  # release the recorded attention
    assert not torch.allclose(rollout_model(images), cls_model(images))


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


def test_wrong_image_size_is_a_one_line_error():
    model = make("vit_tiny_cifar_rollout")
    message = r"^model expects \(B, C, 32, 32\) images, got 64x48; resize inputs to 32x32 or create the model"
    with pytest.raises(ValueError, match=message):
        model(torch.randn(1, 3, 64, 48))
