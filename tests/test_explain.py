"""Saliency maps of each model's own readout: Chefer's rule by hand, rollout maps vs full matrix products, batching,
flow, and the explain CLI."""

import numpy as np
import pytest
import timm
import torch
from PIL import Image

from harness.explain import denormalize, main, prepare_image
from timm_rollout import attention_rollout, capture_attention
from timm_rollout import explain as E
from timm_rollout.cli import run_cli


def tiny(name: str = "vit_tiny_cifar_rollout", **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, num_classes=10, **{"depth": 2, **kwargs}).eval()


@pytest.fixture(scope="module")
def cifar() -> torch.Tensor:
    """Four real CIFAR-10 test images from the shipped sample, normalised with the model's mean/std."""
    from timm_rollout.data import load_image_set, normalize

    data = load_image_set("cifar10-sample", "test")
    cfg = tiny().pretrained_cfg
    return normalize(data.images[:4], cfg["mean"], cfg["std"])


def test_gradient_rollout_matches_hand_computed_example():
    # two tokens ([CLS], one patch), two heads, two layers; (grad * A)+ averaged over heads, by hand:
    # layer 1: [[1, 0], [.2, .8]] and [[0, 0], [0, .5]] -> [[.5, 0], [.1, .65]]
    # layer 2: [[.6, .4], [.3, .7]] and [[0, 0], [1, 0]] -> [[.3, .2], [.65, .35]]
    a1 = torch.tensor([[[0.5, 0.5], [0.2, 0.8]], [[1.0, 0.0], [0.0, 1.0]]])
    g1 = torch.tensor([[[2.0, -1.0], [1.0, 1.0]], [[-1.0, 4.0], [0.5, 0.5]]])
    a2 = torch.tensor([[[0.6, 0.4], [0.3, 0.7]], [[0.1, 0.9], [0.5, 0.5]]])
    g2 = torch.tensor([[[1.0, 1.0], [1.0, 1.0]], [[0.0, -1.0], [2.0, 0.0]]])
    layers = E.gradient_layers([a1[None], a2[None]], [g1[None], g2[None]])
    torch.testing.assert_close(layers[0][0], torch.tensor([[0.5, 0.0], [0.1, 0.65]]))
    torch.testing.assert_close(layers[1][0], torch.tensor([[0.3, 0.2], [0.65, 0.35]]))
    # R = (I + Ā2)(I + Ā1): row 0 = [1.3, .2] @ [[1.5, 0], [.1, 1.65]] = [1.97, .33] (no row normalisation)
    row = E.chefer_row(layers, torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(row, torch.tensor([[1.97, 0.33]]))
    # Chefer's own loop: R = I; R += Ā R, block by block
    r = np.eye(2)
    for a in layers:
        r = r + a[0].double().numpy() @ r
    np.testing.assert_allclose(row[0].numpy(), r[0], rtol=1e-6)


def test_gradient_pass_differentiates_the_target_logit(cifar):
    model = tiny()
    p = E.gradient_pass(model, cifar[:1], target_class=3)
    assert p.target.tolist() == [3]
    # independent route: autograd of logit 3 w.r.t. the captured attention, outside gradient_pass
    model.rollout_grad = True
    with capture_attention(model) as cap:
        logit = model(cifar[:1])[0, 3]
    model.rollout_grad = False
    grads = torch.autograd.grad(logit, cap.attentions)
    want = [(g * a).clamp(min=0).mean(dim=1) for a, g in zip(cap.attentions, grads, strict=True)]
    for got, exp in zip(p.gradient_layers, want, strict=True):
        torch.testing.assert_close(got, exp.detach())
    assert model.rollout_grad is False  # restored
    with pytest.raises(ValueError, match="outside"):
        E.gradient_pass(model, cifar[:1], target_class=10)


READOUTS = [("vit_tiny_cifar_rollout", {}, "rollout"), ("vit_tiny_cifar_cls", {}, "token"),
            ("vit_tiny_cifar_rollout", {"rollout_head_fusion": "max", "rollout_discard_ratio": 0.9}, "rollout"),
            ("vit_tiny_cifar_cls", {"global_pool": "avg", "fc_norm": False}, "avg"),
            ("vit_tiny_cifar_cls", {"global_pool": "map"}, "map")]


def _latent_attention_by_hand(model, x: torch.Tensor) -> torch.Tensor:
    """(B, 64): softmax(q_h . k_h / sqrt(d)) of the pool's one latent query, head by head in float64, averaged."""
    pool = model.attn_pool
    with torch.no_grad():
        tokens = model.forward_features(x)[:, 1:].double()  # what timm's pool() hands the pool: the patches
        q = pool.q.weight.double() @ pool.latent[0, 0].double() + pool.q.bias.double()
        k = tokens @ pool.kv.weight[:128].double().T + pool.kv.bias[:128].double()  # (B, 64, 128)
    d = pool.head_dim
    out = torch.zeros(len(x), 64, dtype=torch.float64)
    for i in range(len(x)):
        for h in range(pool.num_heads):
            scores = torch.tensor([float(q[h * d:(h + 1) * d] @ k[i, j, h * d:(h + 1) * d]) for j in range(64)])
            out[i] += (scores / d**0.5).softmax(dim=0) / pool.num_heads
    return out.float()


def _readout_by_hand(model, x: torch.Tensor, kind: str) -> torch.Tensor:
    """r (B, N): one-hot [CLS], [0, w] with w the model's own pooling weights, or the patch mean."""
    r = torch.zeros(len(x), 65)
    if kind == "token":
        r[:, 0] = 1.0
    elif kind == "avg":
        r[:, 1:] = 1.0 / 64
    elif kind == "map":
        r[:, 1:] = _latent_attention_by_hand(model, x)
    else:
        with torch.no_grad():
            r[:, 1:] = model.rollout_weights(model.forward_features(x))  # what the classifier really pools with
    return r


@pytest.mark.parametrize(("name", "kwargs", "kind"), READOUTS)
def test_gradient_rollout_explains_the_models_own_readout(cifar, name, kwargs, kind):
    model = tiny(name, **kwargs)
    got = E.gradient_rollout(E.gradient_pass(model, cifar))
    # independent route: autograd of each image's predicted logit (through the pooling weights for rollout
    # pooling), Chefer's loop R = I; R += mean_h((dy/dA * A)+) R in float64, then r R over the patches
    model.rollout_grad = True
    with capture_attention(model) as cap:
        logits = model(cifar)
    model.rollout_grad = False
    score = logits.gather(1, logits.argmax(dim=1, keepdim=True)).sum()
    grads = torch.autograd.grad(score, cap.attentions)
    r = _readout_by_hand(model, cifar, kind).double().numpy()
    for i in range(len(cifar)):
        rel = np.eye(65)
        for a, g in zip(cap.attentions, grads, strict=True):
            rel = rel + (g[i] * a[i]).clamp(min=0).mean(dim=0).detach().double().numpy() @ rel
        np.testing.assert_allclose(got[i].numpy(), (r[i] @ rel)[1:], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(("name", "kwargs", "kind"), READOUTS)
def test_rollout_and_attention_maps_are_the_readout_times_R(cifar, name, kwargs, kind):
    model = tiny(name, depth=3, **kwargs)
    p = E.gradient_pass(model, cifar)
    r = _readout_by_hand(model, cifar, kind)
    torch.testing.assert_close(p.readout, r)
    full = attention_rollout(p.attentions)  # (B, N, N), the full matrix product
    want = (r.unsqueeze(1) @ full).squeeze(1)[:, 1:]
    torch.testing.assert_close(E.rollout_map(p), want / want.sum(dim=1, keepdim=True))
    maxed = (r.unsqueeze(1) @ attention_rollout(p.attentions, "max", 0.5)).squeeze(1)[:, 1:]
    torch.testing.assert_close(E.rollout_map(p, "max", 0.5), maxed / maxed.sum(dim=1, keepdim=True))
    buildup = E.rollout_buildup(p)
    assert buildup.shape == (4, 3, 64)
    for layer in range(3):
        row = (r.unsqueeze(1) @ attention_rollout(p.attentions[: layer + 1])).squeeze(1)[:, 1:]
        torch.testing.assert_close(buildup[:, layer], row / row.sum(dim=1, keepdim=True))
    for layer in (1, -1):
        want = (r.unsqueeze(1) @ p.attentions[layer].mean(dim=1)).squeeze(1)[:, 1:]
        torch.testing.assert_close(E.readout_attention(p, layer), want)


def test_rollout_map_of_a_cls_model_is_its_post_hoc_rollout_pooling(cifar):
    model = tiny("vit_tiny_cifar_cls", depth=3)
    rollout = E.rollout_map(E.gradient_pass(model, cifar))
    model.global_pool = "rollout"  # the same weights read out by rollout pooling
    with torch.no_grad():
        torch.testing.assert_close(rollout, model.rollout_weights(model.forward_features(cifar)))


def test_map_readout_is_the_attention_the_pool_mixes_its_tokens_with(cifar):
    model = tiny("vit_tiny_cifar_cls", global_pool="map")
    with torch.no_grad():  # a peaked query: a wrong row cannot pass for the near-uniform one of the init
        model.attn_pool.q.weight.normal_(std=0.3, generator=torch.Generator().manual_seed(1))
        model.attn_pool.kv.weight.normal_(std=0.3, generator=torch.Generator().manual_seed(2))
    p = E.gradient_pass(model, cifar)
    assert p.readout_name == "attention-pool query" and float(p.readout[:, 0].abs().max()) == 0.0
    torch.testing.assert_close(p.readout[:, 1:], _latent_attention_by_hand(model, cifar), rtol=1e-4, atol=1e-6)
    assert float(p.readout.max()) > 2.5 / 64  # far from uniform, so the comparison above has teeth
    # the pool's own output, rebuilt from per-head attention @ values: the attention is the one it uses
    pool = model.attn_pool
    with torch.no_grad():
        tokens = model.forward_features(cifar)[:, 1:]
        attn = E.latent_attention(pool, tokens)  # mean over heads; rebuild per head below
        q = pool.q(pool.latent).reshape(1, 1, 4, 32).transpose(1, 2)
        k, v = pool.kv(tokens).reshape(4, 64, 2, 4, 32).permute(2, 0, 3, 1, 4)
        per_head = ((q * pool.scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # (B, heads, 1, 64)
        mixed = pool.proj((per_head @ v).transpose(1, 2).reshape(4, 1, 128))
        rebuilt = (mixed + pool.mlp(pool.norm(mixed)))[:, 0]
        torch.testing.assert_close(rebuilt, pool(tokens), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(attn, per_head.mean(dim=(1, 2)))
    ex = E.explain(model, cifar[:2])
    assert ex.readout == "attention-pool query" and all(v.shape == (2, 64) for v in ex.maps.values())


def test_unsupported_pooling_is_refused(cifar):
    with pytest.raises(ValueError, match="'max'"):
        E.explain(tiny("vit_tiny_cifar_cls", global_pool="max"), cifar[:1])


def test_batched_maps_equal_one_image_at_a_time(cifar):
    model = tiny()
    batched = E.explain(model, cifar[:3])
    for i in (0, 2):
        single = E.explain(model, cifar[i:i + 1])
        assert list(single.maps) == list(batched.maps)
        for name, values in single.maps.items():
            torch.testing.assert_close(batched.maps[name][i:i + 1], values, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(batched.buildup[i:i + 1], single.buildup, rtol=1e-4, atol=1e-6)
        assert int(batched.target[i]) == int(single.target[0])


def test_attention_flow_of_one_layer_is_the_attention_row(cifar):
    # with one layer the only path from [CLS] to input patch j has capacity Â[0, j]: flow = rollout row
    model = tiny("vit_tiny_cifar_cls", depth=1)
    p = E.gradient_pass(model, cifar[:2])
    flow = E.attention_flow(p, 1)
    torch.testing.assert_close(flow, E.rollout_map(p)[1], atol=1e-5, rtol=1e-4)


def test_register_model_without_class_token_reads_the_patch_mean():
    model = timm.create_model("vit_base_patch16_reg4_gap_256", img_size=64, depth=2, embed_dim=48,
                              num_heads=3).eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    ex = E.explain(model, x, flow=True)
    assert ex.readout == "patch-mean" and ex.grid == (4, 4)
    assert all(v.shape == (2, 16) for v in ex.maps.values())
    p = E.gradient_pass(model, x)
    full = attention_rollout(p.attentions, num_prefix_tokens=4)[:, 4:, 4:].mean(dim=1)  # mean of patch rows
    torch.testing.assert_close(ex.maps["rollout, mean of heads"], full / full.sum(dim=1, keepdim=True))


def test_prepare_image_handles_odd_modes_and_sizes():
    model = tiny()
    gen = np.random.default_rng(0)
    gray = Image.fromarray(gen.integers(0, 255, (30, 50), dtype=np.uint8), "L")
    rgba = Image.fromarray(gen.integers(0, 255, (40, 24, 4), dtype=np.uint8), "RGBA")
    x, note, as_is = prepare_image(gray, model)
    assert x.shape == (3, 32, 32) and "L to RGB" in note and "30x50" in note and "32x32" in note and not as_is
    rgb = denormalize(x, model.pretrained_cfg["mean"], model.pretrained_cfg["std"])
    np.testing.assert_allclose(rgb[..., 0], rgb[..., 1], atol=1e-6)  # grey stays grey once de-normalised
    x, note, _ = prepare_image(rgba, model)
    assert x.shape == (3, 32, 32) and "alpha dropped" in note
    image = Image.fromarray(gen.integers(0, 255, (32, 32, 3), dtype=np.uint8))
    x, note, as_is = prepare_image(image, model)
    assert "used as is" in note and as_is
    cfg = model.pretrained_cfg
    np.testing.assert_allclose(denormalize(x, cfg["mean"], cfg["std"]), np.asarray(image) / 255, atol=1e-6)


def test_a_stock_vits_crop_pct_moves_an_image_of_its_own_size():
    """timm's eval transform resizes to size / crop_pct and crops back: a 64x64 image for a 64x64 stock ViT
    (crop_pct 0.9) is zoomed, not used as is (a box drawn on it would be off)."""
    from timm_rollout.loading import load_model

    model, _ = load_model("vit_small_patch16_224", img_size=64, patch_size=8, depth=1)
    image = Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    x, note, as_is = prepare_image(image, model)
    assert not as_is and "shorter side to 71, crop_pct 0.9" in note
    cfg = model.pretrained_cfg
    assert np.abs(denormalize(x, cfg["mean"], cfg["std"]) - np.asarray(image) / 255).max() > 0.1


def test_explain_cli_on_ours_with_the_sample(tmp_path, capsys):
    out = main(["--model", "vit_tiny_cifar_rollout", "--model-kwargs", "depth=2", "--dataset", "cifar10-sample",
                "--index", "5", "--output", str(tmp_path)])
    assert (tmp_path / "explain_cifar10-sample_test_5.png").stat().st_size > 10_000
    assert "attention flow (max-flow)" in out["maps"] and len(out["maps"]) == 9  # 2 layers: 2 attention panels
    assert "used as is" in capsys.readouterr().out


def test_explain_cli_on_stock_vit_at_224_with_a_grayscale_photo(tmp_path, capsys):
    path = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (90, 160), dtype=np.uint8), "L").save(path)
    out = main(["--model", "vit_small_patch16_224", "--model-kwargs", "depth=2", "--image", str(path),
                "--target-class", "7", "--no-flow", "--output", str(tmp_path)])
    assert out["target"] == 7 and (tmp_path / "explain_photo.png").exists()
    assert "centre-cropped to 224x224" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--image", "missing.jpg"], "does not exist"),
        (["--dataset", "cifar10-sample", "--index", "5000"], "--index 5000 is outside"),
        (["--dataset", "cifar10-sample", "--target-class", "10"], "--target-class 10 is outside"),
    ],
)
def test_explain_cli_errors_are_one_line(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        run_cli(main, ["--model", "vit_tiny_cifar_rollout", "--model-kwargs", "depth=1", *args,
                       "--output", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_explaining_a_boxed_data_set_image_outlines_its_box_on_every_panel(tmp_path, monkeypatch):
    """--dataset with a bbox column: the box of --index (read here with datasets itself) is outlined on the input
    and on every map; an image file has no box."""
    import datasets
    from timm.models import save_for_hf

    from harness import figures
    from timm_rollout.clutter import ClutterRecipe, make_cluttered

    make_cluttered("cifar10-sample", tmp_path / "c4", ClutterRecipe(fragments=4, seed=0), per_class=1)
    save_for_hf(tiny("vit_tiny_cifar_cls", depth=1, img_size=64, patch_size=8), tmp_path / "run",
                safe_serialization=True, model_args=dict(depth=1, img_size=64, patch_size=8))
    outlined = []
    monkeypatch.setattr(figures, "draw_box", lambda ax, box: outlined.append(box.tolist()))
    result = main(["--model", f"local-dir:{tmp_path / 'run'}", "--dataset", str(tmp_path / "c4"), "--index", "3",
                   "--no-flow", "--device", "cpu", "--output", str(tmp_path / "out")])
    want = datasets.load_dataset(str(tmp_path / "c4"), split="test")[3]["bbox"]
    panels = 1 + len(result["maps"]) + 1  # the input, every map, the rollout build-up of the one layer
    assert outlined == [want] * panels
    clutter = datasets.load_dataset(str(tmp_path / "c4"), split="test")
    boxes = [[box] * (1 + (i == 1)) for i, box in enumerate(clutter["bbox"])]
    several = clutter.remove_columns("bbox").add_column("bbox", boxes)
    (tmp_path / "several").mkdir()
    several.to_parquet(str(tmp_path / "several" / "test.parquet"))  # row 1 has two boxes: explained, not outlined
    outlined.clear()
    main(["--model", f"local-dir:{tmp_path / 'run'}", "--dataset", str(tmp_path / "several"), "--index", "3",
          "--no-flow", "--device", "cpu", "--output", str(tmp_path / "out")])
    assert outlined == []
    Image.new("RGB", (64, 64)).save(tmp_path / "plain.png")
    main(["--model", f"local-dir:{tmp_path / 'run'}", "--image", str(tmp_path / "plain.png"), "--no-flow",
          "--device", "cpu", "--output", str(tmp_path / "out")])
    assert outlined == []


def test_map_panels_show_the_map_alone_in_the_colour_bars_colours(tmp_path, monkeypatch):
    """heatmaps.png and harness.explain's figure: every map panel holds one opaque image, the map, on the colour
    bar's colour map and range, so a panel's colours read off the bar (a map blended over the photo would not);
    the photo has its own panel. The rendered pixel at a patch is the bar's colour for its value."""
    from harness import figures

    drawn = []
    monkeypatch.setattr(figures, "save_figure", lambda fig, path: drawn.append(fig))
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=gen)
    maps = {"rollout": torch.rand(2, 64, generator=gen), "attention": torch.rand(2, 64, generator=gen)}
    figures.plot_heatmaps(images, maps, ["a", "b"], ["a", "a"], tmp_path / "h.png", "heatmaps", grid=(8, 8))
    ex = E.Explanation(maps={k: v[:1] for k, v in maps.items()}, buildup=torch.rand(1, 2, 64, generator=gen),
                       logits=torch.zeros(1, 3), target=torch.zeros(1, dtype=torch.int64), grid=(8, 8), readout="cls")
    figures.plot_explanation(ex, images[0].permute(1, 2, 0).numpy(), "explain", "input", tmp_path / "e.png")
    for fig, photos in zip(drawn, (2, 1), strict=True):
        shown = [ax.get_images() for ax in fig.axes if ax.get_images()]
        assert all(len(images) == 1 for images in shown)
        maps_shown = [im for (im,) in shown if im.get_array().ndim == 2]
        assert len(shown) - len(maps_shown) == photos  # the photos are the only RGB panels
        bars = [im.colorbar for im in maps_shown if im.colorbar is not None]
        ranges = {bar.mappable.get_clim() for bar in bars}  # each map (column) has its own range and bar
        assert bars and all(im.get_clim() in ranges for im in maps_shown)
        for im in maps_shown:
            assert im.get_alpha() in (None, 1.0) and im.get_cmap().name == figures.MAP_CMAP
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = drawn[1]  # nearest-neighbour patches: a patch's centre pixel is the bar's colour for its value
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    im = next(im for ax in fig.axes for im in ax.get_images() if im.get_array().ndim == 2)
    value = float(np.asarray(im.get_array())[3 * 4, 5 * 4])  # the map on the image's pixels: patch (3, 5)
    want = np.asarray(im.cmap(im.norm(value))[:3]) * 255
    x, y = im.axes.transData.transform((5 * 4 + 1.5, 3 * 4 + 1.5))  # patch (3, 5) in the 32x32 image's pixels
    rgba = np.asarray(canvas.buffer_rgba())
    assert np.abs(rgba[int(rgba.shape[0] - y), int(x), :3].astype(float) - want).max() <= 2


def test_a_model_built_with_map_and_pooled_by_rollout_is_explained_by_its_rollout_weights(cifar):
    """Rollout pooling replaces a learned attention pool (``global_pool='map'``, then ``--pool rollout``): the readout
    is the rollout weights the head pools with, whose weighted sum of the patch tokens is its pooled feature (it
    used to be refused as "'rollout' or 'map', not 'rollout'")."""
    from timm_rollout import set_pooling

    model = set_pooling(tiny("vit_tiny_cifar_cls", global_pool="map"), "rollout")
    with torch.no_grad():  # sharpened attention: rollout weights far from uniform, so the check has teeth
        for block in model.blocks:
            block.attn.qkv.weight[:256].mul_(10.0)
    p = E.gradient_pass(model, cifar)
    assert p.readout_name == "rollout-weights" and float(p.readout[:, 0].abs().max()) == 0.0
    assert float(p.readout.max()) > 2.5 / 64
    with torch.no_grad():
        tokens = model.forward_features(cifar)
        pooled = model.forward_head(tokens, pre_logits=True)
    summed = sum(p.readout[:, i, None] * tokens[:, i] for i in range(1, tokens.shape[1]))  # a plain loop
    torch.testing.assert_close(summed, pooled, rtol=1e-4, atol=1e-5)
    assert all(v.shape == (4, 64) for v in E.explain(model, cifar).maps.values())
