"""set_pooling on every VisionTransformer-family class timm registers: right (equal to a plain-loop reference) or
refused with a one-line ValueError. CPU, float32 models, float64 references, random init, nothing downloaded.

*Family* here: a registered timm model class whose constructor sets ``num_prefix_tokens`` (or that has it as a
class attribute), the timm convention for a model that prepends class/register tokens to its patch tokens.
``set_pooling`` refuses any model without that attribute, so no class outside the family can be pooled.

The classes are enumerated, not listed: every registered entry point is called with timm's builder replaced
(nothing is built), which gives its class and constructor arguments. Each family class is taken once per block
and attention type it is registered with (the ``block_fn``, ``attn_layer`` and ``attn_type`` arguments), in its
smallest variant (least ``embed_dim``, then ``depth``), built with ``img_size=32`` and ``depth=2`` where its
constructor takes them. A variant without a class token is refused for rollout; where the class takes
``class_token``, it is built again with one and checked too.

The reference recomputes each block's attention by hand, in float64, from the q and k (and mask or relative
position bias) that the stock model hands to ``F.scaled_dot_product_attention`` on its fused path, and rolls it
out with plain loops: it shares nothing with the recorder hooks, the explicit attention path or
``timm_rollout.rollout``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from unittest import mock

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.models.beit import Beit
from timm.models.eva import Eva
from timm.models.vision_transformer import VisionTransformer
from timm.models.vision_transformer_relpos import VisionTransformerRelPos

from timm_rollout import set_pooling
from timm_rollout.capture import fused_attention
from timm_rollout.pooling import RolloutPooling

TINY = {"img_size": 32, "depth": 2}
VARIES = ("block_fn", "attn_layer", "attn_type")  # constructor arguments that change the block or attention
POOLED_HEADS = (VisionTransformer, Eva, Beit, VisionTransformerRelPos)  # must be accepted in their plain variants
# timm poolings by their plain definitions (patch tokens after the prefix tokens)
TIMM_POOLS = {"avg": lambda t, p: t[:, p:].mean(1), "max": lambda t, p: t[:, p:].amax(1), "token": lambda t, p: t[:, 0]}


class _Built(Exception):
    pass


def _capture(cls: type, variant: str, pretrained: bool, **kwargs) -> None:
    raise _Built(cls, kwargs)


def registered_classes() -> dict[str, tuple[type, dict]]:
    """Every registered model's class and constructor arguments, read without building anything."""
    found = {}
    modules = [m for name, m in list(sys.modules.items())
               if name.startswith("timm.models.") and hasattr(m, "build_model_with_cfg")]
    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(mock.patch.object(module, "build_model_with_cfg", _capture))
        for name in timm.list_models():
            if timm.models.model_entrypoint(name).__module__.startswith("timm_rollout"):
                continue  # this package's models: the tiny ViTs, and timm_rollout_pooled (a stock ViT it names)
            try:
                with torch.device("meta"):  # entry points that build a backbone first build it here
                    timm.models.model_entrypoint(name)()
            except _Built as built:
                found[name] = built.args
    return found


def sets_prefix_tokens(cls: type) -> bool:
    codes = [getattr(vars(c).get("__init__"), "__code__", None) for c in cls.__mro__]
    return "num_prefix_tokens" in vars(cls) or any("num_prefix_tokens" in code.co_names for code in codes if code)


def family_variants() -> list[tuple[str, type, bool]]:
    """(smallest model name, class, whether it is the class's plain variant) for each family class and each block
    or attention type it is registered with."""
    groups: dict[tuple, list[tuple]] = {}
    for name, (cls, kwargs) in registered_classes().items():
        if sets_prefix_tokens(cls):
            key = (cls, *(getattr(kwargs.get(k), "__name__", kwargs.get(k)) for k in VARIES))
            size = [v if isinstance(v, int) else 10**9 for v in (kwargs.get("embed_dim"), kwargs.get("depth"))]
            groups.setdefault(key, []).append((*size, name))
    return sorted((min(names)[2], key[0], key[1:] == (None,) * len(VARIES)) for key, names in groups.items())


VARIANTS = family_variants()


def constructor_args(cls: type) -> set[str]:
    """Argument names the class's constructors take, following ``**kwargs`` up the class hierarchy."""
    names: set[str] = set()
    for c in cls.__mro__:
        if hasattr(vars(c).get("__init__"), "__code__"):
            params = inspect.signature(c.__init__).parameters.values()
            names |= {p.name for p in params if p.kind is not p.VAR_KEYWORD}
            if not any(p.kind is p.VAR_KEYWORD for p in params):
                break
    return names


def build(name: str, cls: type, device: str, **extra) -> torch.nn.Module:
    takes = constructor_args(cls)
    kwargs = {k: v for k, v in {**TINY, **extra}.items() if k in takes}
    torch.manual_seed(0)
    with torch.device(device):
        model = timm.create_model(name, pretrained=False, num_classes=5, **kwargs).eval()
    if device == "cpu":
        with torch.no_grad():  # larger weights: peaked attention, so rollout weights are far from uniform
            for p in model.blocks.parameters():
                if p.dim() > 1:
                    p.mul_(4.0)
    return model


def hand_attention(model: torch.nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each block's softmax(q k^T * scale + mask) in float64 from what the stock fused path hands to SDPA, and
    the final tokens of that pass."""
    found, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        assert not is_causal
        keys = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).double()  # grouped-query heads
        s = q.double() @ keys.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, -torch.inf) if attn_mask.dtype == torch.bool else s + attn_mask.double()
        found.append(s.softmax(-1))
        return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)

    with torch.no_grad(), fused_attention(model, True), mock.patch.object(F, "scaled_dot_product_attention", spy):
        tokens = model.forward_features(x)
    assert len(found) == len(model.blocks)
    return found, tokens


def plain_rollout_weights(attentions: list[torch.Tensor], prefix: int) -> torch.Tensor:
    """[CLS] row of (A_L + I)/rowsum ... (A_1 + I)/rowsum over the patches, renormalised: plain loops, float64."""
    out = []
    for i in range(attentions[0].shape[0]):
        n = attentions[0].shape[-1]
        r = torch.eye(n, dtype=torch.float64)
        for attn in attentions:
            a = attn[i].mean(0) + torch.eye(n, dtype=torch.float64)
            r = (a / a.sum(-1, keepdim=True)) @ r
        out.append(r[0, prefix:] / r[0, prefix:].sum())
    return torch.stack(out)


def refusal(model: torch.nn.Module, pool: str) -> str | None:
    """set_pooling's one-line ValueError, or None when it accepts (the model is then changed)."""
    cls = type(model)
    try:
        set_pooling(model, pool)
    except ValueError as e:
        assert "\n" not in str(e) and type(model) is cls
        return str(e)
    return None


def check_rollout(model: torch.nn.Module, x: torch.Tensor) -> None:
    """Rollout pooling of ``model`` (stock, not yet switched) equals the plain-loop rollout of hand attention."""
    attentions, tokens = hand_attention(model, x)
    prefix = model.num_prefix_tokens
    want = plain_rollout_weights(attentions, prefix)
    assert (want * want.shape[1] - 1).abs().max() > 0.05  # 5% or more from the plain mean: the test has teeth
    pooled = torch.einsum("bp,bpd->bd", want, tokens[:, prefix:].double()).float()
    with torch.no_grad():  # the class's own head is pool -> fc_norm -> head, which rollout pooling keeps
        own = TIMM_POOLS[model.global_pool](tokens, prefix) if model.global_pool in TIMM_POOLS else model.pool(tokens)
        torch.testing.assert_close(model.forward_head(tokens), model.head(model.fc_norm(own)))
        set_pooling(model, "rollout")
        assert isinstance(model, RolloutPooling)
        got_tokens = model.forward_features(x)
        torch.testing.assert_close(model.rollout_weights(got_tokens).double(), want, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(model.forward_head(got_tokens, pre_logits=True), model.fc_norm(pooled),
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model(x), model.head(model.fc_norm(pooled)), rtol=1e-4, atol=1e-5)


def check_timm_poolings(model: torch.nn.Module, x: torch.Tensor, pools: list[str]) -> None:
    """Each timm pooling set_pooling accepted pools as its plain definition (then timm's fc_norm)."""
    for pool in pools:
        with torch.no_grad():
            set_pooling(model, pool)
            tokens = model.forward_features(x)
            want = model.fc_norm(TIMM_POOLS[pool](tokens, model.num_prefix_tokens))
            torch.testing.assert_close(model.forward_head(tokens, pre_logits=True), want)


@pytest.mark.parametrize(("name", "cls", "plain"), VARIANTS, ids=[name for name, *_ in VARIANTS])
def test_every_family_class_pools_as_a_plain_loop_reference_or_is_refused(name, cls, plain):
    """Rollout, and every timm pooling other than the model's own, on the smallest variant of each class."""
    extra = {}
    why = refusal(build(name, cls, "meta"), "rollout")
    if why and "needs a class token" in why and "class_token" in constructor_args(cls):
        extra = {"class_token": True}
        why = refusal(build(name, cls, "meta", **extra), "rollout")
    if cls in POOLED_HEADS and plain:
        assert why is None, why  # the plain variants of the classes that pool through one head: not refused
    meta = build(name, cls, "meta", **extra)
    own = meta.global_pool
    pools = [pool for pool in TIMM_POOLS if pool != own and refusal(meta, pool) is None]
    if why is None or pools:
        model = build(name, cls, "cpu", **extra)
        x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        if why is None:
            check_rollout(model, x)
        check_timm_poolings(model, x, pools)


def test_family_covers_the_classes_the_issue_named():
    classes = {cls.__name__ for _, cls, _ in VARIANTS}
    assert {"VisionTransformer", "VisionTransformerDistilled", "Beit", "Eva", "VisionTransformerRelPos"} <= classes
    assert "ResNet" not in classes and len(VARIANTS) >= 15


def test_a_head_of_its_own_is_the_reason_given_and_its_own_pooling_is_a_no_op():
    """NaFlexVit with a class token (at ``embeds.cls_token``, not ``cls_token``): refused for its own forward_head,
    not for a class token it has; its own pooling is accepted and changes nothing."""
    torch.manual_seed(0)
    model = timm.create_model("naflexvit_base_patch16_gap", img_size=32, depth=2, embed_dim=64, num_heads=4,
                              class_token=True, global_pool="token", num_classes=5).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
    for pool in ("rollout", "avg"):
        why = refusal(model, pool)
        assert why and "own forward_head" in why and "class token" not in why, why
    assert set_pooling(model, "token") is model and model.global_pool == "token"
    with torch.no_grad():
        torch.testing.assert_close(model(x), want)
