"""The checks of timm's own model suite (tests/test_models.py of timm 1.0.31) on our three models.

timm's suite only asserts shapes and the absence of NaNs; here each check compares with an independent route
(eager vs scripted vs traced outputs, the head applied to the pre-logits, forward_features vs intermediates).
TorchScript and FX are checked for the CLS and patch-mean models: the rollout model pools by attention it
records with hooks during the pass, which neither a scripted nor a traced graph runs (see timm_rollout/README.md).
"""

import pytest
import timm
import torch
from timm.models import get_notrace_functions, get_notrace_modules
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

import timm_rollout  # noqa: F401  (registers the models)

NAMES = ("vit_tiny_cifar_cls", "vit_tiny_cifar_gap", "vit_tiny_cifar_rollout")
STOCK = NAMES[:2]  # TorchScript and FX, as for a stock timm ViT
TRACER = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions(),
              param_shapes_constant=True)  # what timm's FX tests trace with


def make(name: str, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, **{"depth": 2, **kwargs})


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("name", NAMES)
def test_backward_reaches_every_parameter(name, x):
    model = make(name, num_classes=42).train()
    out = model(x)
    assert out.shape == (2, 42) and torch.isfinite(out).all()
    out.mean().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0] == []


@pytest.mark.parametrize("name", NAMES)
def test_features_head_pre_logits_and_reset_classifier(name, x):
    model = make(name).eval()
    state = model.state_dict()
    cfg = model.pretrained_cfg
    assert cfg["classifier"] + ".weight" in state and cfg["first_conv"] + ".weight" in state
    with torch.no_grad():
        tokens = model.forward_features(x)
        pre = model.forward_head(tokens, pre_logits=True)
        assert tokens.shape == (2, 65, model.num_features) and pre.shape == (2, model.head_hidden_size)
        torch.testing.assert_close(model(x), model.head(pre))  # logits = head(pre-logits) of the same pass
        model.reset_classifier(0)
        assert model.num_classes == 0 and isinstance(model.head, torch.nn.Identity)
        torch.testing.assert_close(model(x), pre)
        headless = make(name, num_classes=0).eval()
        headless.load_state_dict({k: v for k, v in state.items() if not k.startswith("head.")}, strict=True)
        torch.testing.assert_close(headless(x), pre)


@pytest.mark.parametrize("name", NAMES)
def test_forward_intermediates_features_only_and_grad_checkpointing(name, x):
    model = make(name, depth=6).eval()
    with torch.no_grad():
        final, intermediates = model.forward_intermediates(x)
        torch.testing.assert_close(final, model.forward_features(x))
        assert len(intermediates) == 6 and all(t.shape == (2, 128, 8, 8) for t in intermediates)
        tokens = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
        first = model.blocks[0](tokens)[:, 1:].transpose(1, 2).reshape(2, 128, 8, 8)
        torch.testing.assert_close(intermediates[0], first)
        features = make(name, depth=6, features_only=True, feature_cls="getter").eval()
        got = features(x)
        assert len(got) == len(features.feature_info.channels()) == 3  # the default: the last 3 blocks
        for a, b in zip(got, intermediates[-3:], strict=True):
            torch.testing.assert_close(a, b)
        logits = model(x)
        model.set_grad_checkpointing(True)
        checkpointed = model.forward_intermediates(x)[0]
        torch.testing.assert_close(checkpointed, final, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model.forward_head(checkpointed), logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", STOCK)
def test_torchscript_matches_eager_in_eval_and_training(name, x):
    with timm.layers.set_layer_config(scriptable=True):
        model = make(name).eval()
    scripted = torch.jit.script(model)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x))
    model.train()
    scripted.train()
    outs = []
    for run in (model, scripted):
        torch.manual_seed(5)
        outs.append(run(x))
    torch.testing.assert_close(outs[1], outs[0])  # the same dropout masks from the same seed


def _fx_model(model: torch.nn.Module) -> torch.nn.Module:
    """timm's FX route: torchvision's feature extractor returning the last node, with timm's leaf modules."""
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=TRACER)
    return create_feature_extractor(model, train_return_nodes=[train_nodes[-1]], eval_return_nodes=[eval_nodes[-1]],
                                    tracer_kwargs=TRACER)


@pytest.mark.parametrize("name", STOCK)
def test_fx_feature_extraction_matches_eager(name, x):
    model = make(name).eval()
    with torch.inference_mode():
        want = model(x)
        (got,) = _fx_model(model)(x).values()
        assert torch.equal(got, want)
        blocks = create_feature_extractor(model, return_nodes={"blocks.0": "b0", "norm": "final"}, tracer_kwargs=TRACER)
        out = blocks(x)
        final, intermediates = model.forward_intermediates(x, output_fmt="NLC", return_prefix_tokens=True)
        torch.testing.assert_close(out["final"], final)
        torch.testing.assert_close(out["b0"][:, 1:], intermediates[0][0])
        scripted = torch.jit.script(_fx_model(model))  # timm's FX + TorchScript check
        (got,) = scripted(x).values()
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", STOCK)
def test_fx_training_graph_draws_the_same_masks_and_backpropagates(name, x):
    model = make(name, num_classes=42).train()
    fx = _fx_model(model)
    outs = []
    for run in (model, fx):
        torch.manual_seed(6)
        out = run(x)
        outs.append(out if isinstance(out, torch.Tensor) else next(iter(out.values())))
    torch.testing.assert_close(outs[1], outs[0])
    outs[1].mean().backward()
    assert [n for n, p in fx.named_parameters() if p.grad is None] == []
