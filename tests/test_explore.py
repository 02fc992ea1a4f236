"""``python -m harness.explore``'s page in a real browser: headless Chromium (Debian's ``/usr/bin/chromium``) driven by
Playwright. The page loads from ``file://`` with every network request failing the test and no console error;
choosing an image and moving each control changes the map drawn, and every map drawn (read back from the canvas
pixels through the page's colour table) and stored (the JSON) equals the library's array for that setting, computed
here by another route (per-head products, full-depth rollout rows). On our models (and a second one beside it) and
on a stock timm ViT with register tokens, a non-square 32x48 input and object masks.

Without chromium or playwright these tests skip, unless ``CI`` is set: in CI they fail."""

from __future__ import annotations

import base64
import io
import json
import os
import re
from pathlib import Path

import datasets
import numpy as np
import pytest
import timm
import torch
from PIL import Image
from timm.models import save_for_hf

import timm_rollout.explain as E
from harness import explore
from harness.figures import relative_to_uniform
from timm_rollout.cli import run_cli
from timm_rollout.data import load_image_set, normalize
from timm_rollout.rollout import HEAD_FUSIONS, patch_weights, pooling_weights, rollout_options, rollout_row

CHROMIUM = Path("/usr/bin/chromium")
CIFAR = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
READ = """m => { const c = document.querySelectorAll('canvas.map')[m], g = c.getContext('2d');
  return {key: c.dataset.key, top: Number(c.dataset.top), opacity: c.style.opacity, size: [c.height, c.width],
          px: Array.from(g.getImageData(0, 0, c.width, c.height).data)}; }"""


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if sync_playwright is None or not CHROMIUM.exists():
        why = "needs Debian's chromium (apt-get install chromium) and playwright (pip install -e '.[dev]')"
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the browser tests: {why}")
        pytest.skip(why)
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM),
                                      args=["--no-sandbox", "--disable-background-networking"])
        yield chromium
        chromium.close()


def _save(model: torch.nn.Module, folder: Path, size: tuple[int, int], mean, std, **model_args) -> str:
    """Random weights with sharpened attention (queries scaled, so that maps differ visibly), as a timm folder whose
    eval transform leaves ``size`` images in place."""
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[: block.attn.qkv.weight.shape[0] // 3].mul_(6)
    save_for_hf(model, folder, model_args=model_args, safe_serialization=True,
                data_config={"input_size": (3, *size), "crop_pct": 1.0, "mean": mean, "std": std})
    return str(folder)


def _page_data(html: Path) -> dict:
    text = re.search(r'<script type="application/json" id="explore-data">(.*?)</script>', html.read_text(), re.S)
    return json.loads(text.group(1))


def _reference(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every map of the page from the library, by another route than harness.explore's, as weight x P (N, P)."""
    p = E.gradient_pass(model, x)
    pre, ref = p.num_prefix_tokens, {}
    for layer, attn in enumerate(p.attentions, start=1):
        read = lambda a: (p.readout.unsqueeze(1) @ a).squeeze(1)[:, pre:]  # noqa: E731
        ref.update({f"attention/{layer}/head{h + 1}": read(attn[:, h]) for h in range(attn.shape[1])})
        ref.update({f"attention/{layer}/{f}": read(a) for f, a in zip(HEAD_FUSIONS, (attn.mean(1), attn.amax(1),
                                                                                     attn.amin(1)), strict=True)})
        for f in HEAD_FUSIONS:
            for r in (0.0, 0.5, 0.9):
                ref[f"rollout/{layer}/{f}/{r:g}"] = patch_weights(rollout_row(p.attentions[:layer], p.readout, f, r,
                                                                              pre), pre)
    ref["gradient_rollout"] = E.gradient_rollout(p)
    if p.readout_name == E.READOUTS["rollout"]:
        ref["pooling"] = pooling_weights(p.attentions, pre, *rollout_options(model))
    return {k: relative_to_uniform(v.detach()) for k, v in ref.items()}


def _check_stored(data: dict, refs: list[dict[str, torch.Tensor]]) -> None:
    """Each model's stored maps are its reference maps to the stored precision (vmax / 510), every key of them."""
    for entry, ref in zip(data["models"], refs, strict=True):
        assert set(entry["maps"]) == set(ref)
        for i, (encoded, vmax) in enumerate(zip(entry["values"], entry["vmax"], strict=True)):
            q = np.frombuffer(base64.b64decode(encoded), np.uint8).reshape(len(entry["maps"]), -1)
            for k, key in enumerate(entry["maps"]):
                want = ref[key][i].numpy()
                assert np.abs(q[k] / 255 * vmax[k] - want).max() <= vmax[k] / 510 + 1e-4, (key, i)


def _open(browser, html: Path):
    page = browser.new_page(viewport={"width": 1366, "height": 768})
    url, blocked, errors = html.resolve().as_uri(), [], []

    def route(r) -> None:
        if r.request.url == url:
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    return page, blocked, errors


def _drawn(page, m: int, lut: np.ndarray) -> tuple[str, np.ndarray, dict]:
    """The key and values of model ``m``'s map as drawn: each patch's pixel colour looked up in the colour table."""
    got = page.evaluate(READ, m)
    rgb = np.array(got["px"]).reshape(-1, 4)[:, :3]
    j = np.abs(rgb[:, None, :].astype(int) - lut[None].astype(int)).sum(-1).argmin(1)
    assert (lut[j] == rgb).all(), "a patch drawn in a colour outside the colour table"
    return got["key"], j / 255 * got["top"], got


def _assert_drawn(page, m: int, lut: np.ndarray, ref: dict[str, torch.Tensor], image: int, key: str) -> np.ndarray:
    found, values, got = _drawn(page, m, lut)
    assert found == key
    assert np.abs(values - ref[key][image].numpy()).max() <= got["top"] / 255 + 1e-4, key
    return values


def _slide(page, selector: str, value: str) -> None:
    page.eval_on_selector(selector, "(e, v) => { e.value = v; e.dispatchEvent(new Event('input')); }", value)


def test_our_models_side_by_side_every_control_draws_the_librarys_map(browser, tmp_path):
    torch.manual_seed(0)
    runs = {name: _save(timm.create_model(name, num_classes=10, depth=2), tmp_path / name, (32, 32), *CIFAR,
                        depth=2) for name in ("vit_tiny_cifar_rollout", "vit_tiny_cifar_cls")}
    html = explore.main(["--model", "vit_tiny_cifar_rollout", "--checkpoint", runs["vit_tiny_cifar_rollout"],
                         "--compare-model", "vit_tiny_cifar_cls", "--compare-checkpoint", runs["vit_tiny_cifar_cls"],
                         "--dataset", "cifar10-sample", "--images", "6", "--output", str(tmp_path / "page")])
    data = _page_data(html)
    images = load_image_set("cifar10-sample", "test").images[:6]
    models = [timm.create_model(f"local-dir:{runs[n]}", pretrained=True).eval() for n in runs]
    refs = [_reference(m, normalize(images, *CIFAR)) for m in models]
    _check_stored(data, refs)
    lut = np.frombuffer(bytes.fromhex(data["colormap"]), np.uint8).reshape(256, 3)
    page, blocked, errors = _open(browser, html)
    assert page.locator(".thumb").count() == 6 and data["models"][1]["grid"] == [8, 8]
    page.click(".thumb[data-i='2']")
    assert "test #2" in page.inner_text("#caption")
    before = _assert_drawn(page, 0, lut, refs[0], 2, "rollout/2/mean/0")  # the default: rollout through all layers
    _assert_drawn(page, 1, lut, refs[1], 2, "rollout/2/mean/0")
    steps = [("#method", "attention", "attention/2/mean"), ("#layer", "1", "attention/1/mean"),
             ("#head", "3", "attention/1/head3"), ("#head", "fused", "attention/1/mean"),
             ("#fusion", "max", "attention/1/max"), ("#method", "rollout", "rollout/1/max/0"),
             ("#ratio", "0.9", "rollout/1/max/0.9"), ("#layer", "2", "rollout/2/max/0.9"),
             ("#fusion", "min", "rollout/2/min/0.9"), ("#method", "gradient_rollout", "gradient_rollout"),
             ("#method", "pooling", "pooling")]
    for selector, value, key in steps:
        if selector == "#layer":
            _slide(page, selector, value)
        else:
            page.select_option(selector, value)
        now = _assert_drawn(page, 0, lut, refs[0], 2, key)
        assert not np.array_equal(now, before), f"{selector} {value} left the map as it was"
        before = now
        if key != "pooling":
            _assert_drawn(page, 1, lut, refs[1], 2, key)
    assert page.evaluate(READ, 1)["key"] == "" and "pools without attention weights" in page.inner_text("#panels")
    _slide(page, "#opacity", "0.3")
    assert page.evaluate(READ, 0)["opacity"] == "0.3"
    page.select_option("#method", "rollout")
    page.click("#caption")  # keys go to the page, not to a control
    page.keyboard.press("ArrowRight")
    assert "test #3" in page.inner_text("#caption")
    _assert_drawn(page, 0, lut, refs[0], 3, "rollout/2/min/0.9")
    page.keyboard.press("ArrowDown")
    _assert_drawn(page, 0, lut, refs[0], 3, "rollout/1/min/0.9")
    labels = [im["label"] for im in data["images"]]
    page.select_option("#f-class", str(labels[4]))
    assert [int(i) for i in page.eval_on_selector_all(".thumb", "b => b.map(e => e.dataset.i)")] == \
        [i for i, y in enumerate(labels) if y == labels[4]]
    page.select_option("#f-class", "all")
    right = [data["models"][0]["top5"][i][0][0] == labels[i] for i in range(6)]
    page.select_option("#f-ok", "false")
    assert page.locator(".thumb").count() == right.count(False)
    page.select_option("#f-ok", "all")
    page.select_option("#sort", "confidence, high first")
    order = [int(i) for i in page.eval_on_selector_all(".thumb", "b => b.map(e => e.dataset.i)")]
    assert order == sorted(range(6), key=lambda i: (-data["models"][0]["top5"][i][0][1], i))
    assert blocked == [] and errors == []


def _masked_set(folder: Path) -> tuple[str, np.ndarray]:
    """Four random 32x48 images in three classes, each with an object mask (a rectangle less a corner) and its box."""
    rng = np.random.default_rng(0)
    rects = [(4, 2, 20, 14), (24, 10, 16, 20), (0, 0, 12, 30), (10, 16, 30, 12)]
    masks = np.zeros((4, 32, 48), np.uint8)
    for m, (x, y, w, h) in zip(masks, rects, strict=True):
        m[y:y + h, x:x + w] = 1
        m[y:y + 3, x:x + 3] = 0
    png = lambda a: {"bytes": (buf := io.BytesIO(), Image.fromarray(a).save(buf, "PNG"))[0].getvalue(),  # noqa: E731
                     "path": None}
    columns = {"image": [png(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)) for _ in rects],
               "label": [0, 1, 2, 1], "bbox": [list(map(float, r)) for r in rects], "mask": [png(m) for m in masks]}
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"]),
                                  "bbox": datasets.Sequence(datasets.Value("float64")), "mask": datasets.Image()})
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(columns, features=features)}).save_to_disk(str(folder))
    return str(folder), masks


def test_a_stock_vit_with_registers_on_a_non_square_input_with_masks(browser, tmp_path):
    torch.manual_seed(1)
    args = {"embed_dim": 48, "depth": 2, "num_heads": 3, "reg_tokens": 4, "img_size": (32, 48), "patch_size": 8}
    stats = ((0.5,) * 3, (0.25,) * 3)
    run = _save(timm.create_model("vit_small_patch16_224", num_classes=3, **args), tmp_path / "vit", (32, 48), *stats,
                **args)
    dataset, masks = _masked_set(tmp_path / "ds")
    html = explore.main(["--model", f"local-dir:{run}", "--dataset", dataset, "--indices", "1", "3",
                         "--output", str(tmp_path / "page")])
    data = _page_data(html)
    model = timm.create_model(f"local-dir:{run}", pretrained=True).eval()
    ref = _reference(model, normalize(load_image_set(dataset, "test").images[[1, 3]], *stats))
    _check_stored(data, [ref])
    entry = data["models"][0]
    assert entry["grid"] == [4, 6] and entry["heads"] == 3 and "pooling" not in entry["maps"]
    # object mass: each map's share on the object's pixels, by hand
    fraction = torch.tensor(masks[[1, 3]], dtype=torch.float64).view(2, 4, 8, 6, 8).mean(dim=(2, 4)).flatten(1)
    for k, key in enumerate(entry["maps"]):
        shares = ref[key].double() / ref[key].double().sum(dim=1, keepdim=True)
        assert np.allclose([m[k] for m in entry["mass"]], (shares * fraction).sum(dim=1), atol=2e-4), key
    lut = np.frombuffer(bytes.fromhex(data["colormap"]), np.uint8).reshape(256, 3)
    page, blocked, errors = _open(browser, html)
    page.click(".thumb[data-i='1']")
    _assert_drawn(page, 0, lut, ref, 1, "rollout/2/mean/0")
    assert page.evaluate(READ, 0)["size"] == [4, 6]
    mass = entry["mass"][1][entry["maps"].index("rollout/2/mean/0")]
    assert f"object mass {mass:.3f}" in page.inner_text(".mass")
    page.select_option("#method", "attention")
    page.select_option("#head", "2")
    _assert_drawn(page, 0, lut, ref, 1, "attention/2/head2")
    assert page.locator("#method option[value='pooling']").count() == 0
    outlined = page.evaluate("() => { const c = document.querySelector('.stack canvas:last-of-type'); return c"
                             ".getContext('2d').getImageData(0, 0, c.width, c.height).data.filter((v, i) => i % 4 == 3"
                             " && v > 0).length; }")
    assert outlined > 0
    assert blocked == [] and errors == []


def test_a_model_without_attention_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run_cli(explore.main, ["--model", "resnet18", "--dataset", "cifar10-sample", "--output", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: cannot explain resnet18: every map of harness.explore is drawn from attention")


def test_names_that_look_like_html_stay_data(tmp_path):
    """A class or image name holding ``<!--<script>`` or ``</script>`` cannot end or hide the data element: the JSON
    in the page holds no ``<`` at all, and reads back to the names given."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_cifar_cls", num_classes=2, depth=1).eval()
    names = ["<!--<script>", "</script><b>x</b>"]
    gallery = explore.Gallery([Image.new("RGB", (32, 32), c) for c in ("red", "blue")], names, [0, 1], names)
    html = explore.write_page([("m", model, {"mean": CIFAR[0], "std": CIFAR[1]})], gallery, tmp_path / "index.html",
                              "t")
    text = re.search(r'id="explore-data">(.*?)</script>', html.read_text(), re.S).group(1)
    assert "<" not in text
    data = json.loads(text)
    assert data["classes"] == names and [i["name"] for i in data["images"]] == names
