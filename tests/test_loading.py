"""timm_rollout.loading: round trips through save_for_hf folders and files, and every user-error path."""

from __future__ import annotations

import hashlib

import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.models import save_for_hf

import timm_rollout  # noqa: F401  (registers the models)
from timm_rollout.errors import UserError
from timm_rollout.loading import check_input_size, check_model, load_model

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.247, 0.2435, 0.2616)
LABELS = [f"class{i}" for i in range(10)]


@pytest.fixture(scope="module")
def cls_folder(tmp_path_factory):
    """A depth-2 [CLS] model saved the way training saves it: save_for_hf with safetensors."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_cifar_cls", num_classes=10, depth=2,
                              pretrained_cfg_overlay=dict(mean=MEAN, std=STD)).eval()
    folder = tmp_path_factory.mktemp("run") / "c10-cls"
    save_for_hf(model, folder, model_config=dict(label_names=LABELS), safe_serialization=True)
    return model, folder


def test_folder_round_trip_carries_weights_and_config(cls_folder):
    model, folder = cls_folder
    loaded, info = load_model("vit_tiny_cifar_cls", folder)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    x = torch.randn(3, 3, 32, 32)
    with torch.inference_mode():
        assert torch.equal(model(x), loaded(x))
    weights = folder / "model.safetensors"
    assert info["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert info["num_classes"] == 10 and info["label_names"] == LABELS
    assert info["mean"] == pytest.approx(MEAN) and info["std"] == pytest.approx(STD)
    assert tuple(loaded.pretrained_cfg["mean"]) == pytest.approx(MEAN)
    assert info["model_args"]["depth"] == 2 and not loaded.training


def test_file_and_local_dir_load_the_same_weights(cls_folder):
    model, folder = cls_folder
    from_file, info = load_model("vit_tiny_cifar_cls", folder / "model.safetensors", depth=2)
    from_dir, dir_info = load_model(f"local-dir:{folder}")
    assert info["num_classes"] == 10 and dir_info["architecture"] == "vit_tiny_cifar_cls"
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        assert torch.equal(from_file(x), model(x))
        assert torch.equal(from_dir(x), model(x))


def test_cls_checkpoint_loads_into_rollout_model(cls_folder):
    model, folder = cls_folder
    rollout, info = load_model("vit_tiny_cifar_rollout", folder)
    assert info["global_pool"] == "rollout" and info["checkpoint_architecture"] == "vit_tiny_cifar_cls"
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        tokens = model.forward_features(x)
        # same weights, only the pooling differs (the CLS model runs fused attention, the rollout model explicit)
        torch.testing.assert_close(rollout.forward_features(x), tokens, rtol=1e-5, atol=1e-5)
        pooled = rollout.forward_head(rollout.forward_features(x), pre_logits=True)
    assert not torch.allclose(pooled, tokens[:, 0])


def _saved(folder, name: str, seed: int, **kwargs):
    torch.manual_seed(seed)
    model = timm.create_model(name, num_classes=10, depth=2, **kwargs).eval()
    save_for_hf(model, folder, safe_serialization=True)
    return model


def test_local_dir_with_a_checkpoint_of_another_architecture_is_refused(cls_folder, tmp_path):
    """``local-dir:A`` with ``--checkpoint B``: B's weights in A's architecture when both were built alike (B's
    outputs exactly), refused by name when B's architecture, model arguments or pooling differ (it used to build
    A's class with B's weights and name the result after A)."""
    model, folder = cls_folder
    other = _saved(tmp_path / "cls-seed1", "vit_tiny_cifar_cls", 1)  # same build, other weights
    loaded, info = load_model(f"local-dir:{folder}", tmp_path / "cls-seed1")
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        assert torch.equal(loaded(x), other(x)) and not torch.equal(loaded(x), model(x))
    assert info["weights"] == str(tmp_path / "cls-seed1" / "model.safetensors")
    _saved(tmp_path / "rollout", "vit_tiny_cifar_rollout", 0)
    _saved(tmp_path / "map", "vit_tiny_cifar_cls", 0, global_pool="map")
    _saved(tmp_path / "sharp", "vit_tiny_cifar_rollout", 0, rollout_head_fusion="max")
    for a, b, trained_as in ((folder, tmp_path / "rollout", "vit_tiny_cifar_rollout"),
                             (tmp_path / "rollout", folder, "vit_tiny_cifar_cls"),
                             (folder, tmp_path / "map", "vit_tiny_cifar_cls"),
                             (tmp_path / "rollout", tmp_path / "sharp", "vit_tiny_cifar_rollout")):
        built = "vit_tiny_cifar_rollout" if "rollout" in a.name else "vit_tiny_cifar_cls"
        assert _error(f"local-dir:{a}", b) == (
            f"local-dir:{a} is {built} but --checkpoint {b} was trained as {trained_as} (architecture, model "
            f"arguments or pooling differ); evaluate it as local-dir:{b}, or as --model {built} --checkpoint {b} "
            f"for a readout with {built}'s own pooling")
    assert load_model("vit_tiny_cifar_rollout", folder)[1]["global_pool"] == "rollout"  # the readout it names


def test_local_dir_with_a_weights_file_builds_the_folder_model_and_checks_the_files_run(cls_folder, tmp_path):
    """``local-dir:A`` with a weights FILE builds A as its config.json says (it used to build A's class with default
    arguments): A's own file gives A's outputs, a file of A's build from elsewhere its own; a file whose run folder
    was built otherwise is refused as a folder is, and a file that does not fit A is refused by name."""
    model, folder = cls_folder
    x = torch.randn(2, 3, 32, 32)
    own, info = load_model(f"local-dir:{folder}", folder / "model.safetensors")
    other = _saved(tmp_path / "cls-seed1", "vit_tiny_cifar_cls", 1)
    moved = tmp_path / "loose" / "seed1.safetensors"  # no config.json beside it
    moved.parent.mkdir()
    moved.write_bytes((tmp_path / "cls-seed1" / "model.safetensors").read_bytes())
    with torch.inference_mode():
        assert torch.equal(own(x), model(x))
        for weights in (tmp_path / "cls-seed1" / "model.safetensors", moved):
            assert torch.equal(load_model(f"local-dir:{folder}", weights)[0](x), other(x))
    assert info["model_args"]["depth"] == 2 and info["label_names"] == LABELS
    _saved(tmp_path / "rollout", "vit_tiny_cifar_rollout", 0)
    b = tmp_path / "rollout" / "model.safetensors"
    assert _error(f"local-dir:{folder}", b) == (
        f"local-dir:{folder} is vit_tiny_cifar_cls but --checkpoint {b} was trained as vit_tiny_cifar_rollout "
        f"(architecture, model arguments or pooling differ); evaluate it as local-dir:{tmp_path / 'rollout'}, or "
        f"as --model vit_tiny_cifar_cls --checkpoint {tmp_path / 'rollout'} for a readout with vit_tiny_cifar_cls's "
        "own pooling")
    torch.manual_seed(0)
    save_file(timm.create_model("vit_tiny_cifar_cls", num_classes=10, depth=3).state_dict(),
              tmp_path / "deeper.safetensors")
    deeper = _error(f"local-dir:{folder}", tmp_path / "deeper.safetensors")
    assert "does not match vit_tiny_cifar_cls" in deeper and "blocks.2." in deeper


def test_untrained_registered_model():
    model, info = load_model("vit_tiny_cifar_rollout", num_classes=7, depth=1)
    assert model.num_classes == 7 and info["sha256"] is None and info["weights"] is None


def _error(*args, **kwargs) -> str:
    with pytest.raises(UserError) as e:
        load_model(*args, **kwargs)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_errors_name_the_mismatch_and_the_fix(cls_folder, tmp_path):
    _, folder = cls_folder
    assert "did you mean vit_tiny_cifar_rollout" in _error("vit_tiny_cifar_rolout")
    assert _error("vit_tiny_cifar_cls", folder, num_classes=100) == (
        "checkpoint has 10 classes, model built with 100; pass --num-classes 10 or drop it")
    data = (folder / "model.safetensors").read_bytes()
    bare = tmp_path / "bare.safetensors"  # no config.json beside it: the registered depth 6 is built
    bare.write_bytes(data)
    deeper = _error("vit_tiny_cifar_cls", bare)
    assert "does not match vit_tiny_cifar_cls" in deeper and "blocks.2." in deeper
    assert deeper.endswith("pass the training folder that holds it (its config.json builds the model), or the "
                           "--model (and --model-kwargs, where the command has them) it was trained with")
    wider = _error("vit_tiny_cifar_cls", folder / "model.safetensors", embed_dim=64)
    assert "shapes differ (checkpoint vs model)" in wider and "blocks.0.attn.qkv.bias (384,) vs (192,)" in wider
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    assert "not a readable safetensors file" in _error("vit_tiny_cifar_cls", truncated)
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\xff" * 64)
    assert "not a readable safetensors file" in _error("vit_tiny_cifar_cls", corrupt)
    pickled = tmp_path / "model.pth"
    pickled.write_bytes(b"not read")
    assert "scripts/convert_checkpoint.py" in _error("vit_tiny_cifar_cls", pickled)
    bin_folder = tmp_path / "bin_only"
    bin_folder.mkdir()
    (bin_folder / "config.json").write_text((folder / "config.json").read_text())
    (bin_folder / "pytorch_model.bin").write_bytes(b"not read")
    assert "pytorch_model.bin" in _error("vit_tiny_cifar_cls", bin_folder)
    assert "does not exist" in _error("vit_tiny_cifar_cls", tmp_path / "missing.safetensors")
    assert "local-dir:" in _error(str(tmp_path / "folder"))
    (bin_folder / "config.json").write_text("{}")
    assert "names no architecture" in _error(f"local-dir:{bin_folder}")


def test_model_arguments_timm_rejects_fail_fast(tmp_path):
    """check_model builds on the meta device (no weights allocated); load_model reports the same way."""
    for kwargs, reason in (({"dpeth": 2}, "unexpected keyword argument 'dpeth'"),
                           ({"global_pool": "nope"}, "pooling")):
        with pytest.raises(UserError, match=rf"vit_tiny_cifar_cls cannot be built with .*{reason}.*fix or drop"):
            check_model("vit_tiny_cifar_cls", kwargs)
        assert "cannot be built" in _error("vit_tiny_cifar_cls", **kwargs)
    check_model("vit_tiny_cifar_cls", {"depth": 2, "embed_dim": 64})
    check_model("hf-hub:org/anything")  # checked when loaded
    with pytest.raises(UserError, match="did you mean vit_tiny_cifar_cls"):
        check_model("vit_tiny_cifar_clss")
    with pytest.raises(UserError, match=r"is not a folder with config\.json"):
        check_model(f"local-dir:{tmp_path}")


def test_model_arguments_from_a_checkpoints_config_are_named_as_its_own(tmp_path, capsys):
    """A registered name with a run folder trained as another model: the arguments its config.json records (here the
    tiny rollout model's rollout options) are not the caller's to drop; the error names where they come from and
    how to load the run, in load_model and as harness.eval's one line."""
    from harness import eval as harness_eval
    from timm_rollout.checkpoint import save_model
    from timm_rollout.cli import run_cli

    run = tmp_path / "run"
    save_model(run, timm.create_model("vit_tiny_cifar_rollout", num_classes=10, depth=2), LABELS, MEAN, STD)
    message = _error("vit_small_patch16_224", run)
    assert message == (f"pass --model local-dir:{run} (or --model vit_tiny_cifar_rollout): --checkpoint {run} was "
                       "saved with vit_tiny_cifar_rollout, whose model arguments vit_small_patch16_224 does not take "
                       "(VisionTransformer.__init__() got an unexpected keyword argument 'rollout_head_fusion')")
    assert len(message) - 2 * len(str(run)) < 270  # the fix first, and short: no argument list (it was 560)
    assert _error("vit_tiny_cifar_cls", dpeth=2).endswith("; fix or drop the model arguments")  # typed by the caller
    with pytest.raises(SystemExit) as e:
        run_cli(harness_eval.main, ["--model", "vit_small_patch16_224", "--checkpoint", str(run), "--dataset",
                                    "cifar10-sample", "--output", str(tmp_path / "eval"), "--device", "cpu"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and lines == [f"error: {message}"]


def test_head_less_safetensors_file_uses_requested_classes(tmp_path):
    model = timm.create_model("vit_tiny_cifar_cls", num_classes=0, depth=1)
    path = tmp_path / "backbone.safetensors"
    save_file(model.state_dict(), str(path))
    assert "missing from the checkpoint (e.g. head.bias" in _error("vit_tiny_cifar_cls", path, num_classes=10, depth=1)
    loaded, info = load_model("vit_tiny_cifar_cls", path, num_classes=0, depth=1)
    assert info["num_classes"] == 0 and loaded.num_classes == 0


def test_hf_hub_name_offline_and_not_cached(monkeypatch):
    """Offline (no network is touched) and not in the cache: a one-line error naming both ways out."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    message = _error("hf-hub:nobody/not-a-cached-model")
    assert "not in the local Hugging Face cache" in message and "local-dir:PATH" in message


def test_a_weights_file_in_its_run_folder_loads_as_the_folder_does(cls_folder):
    """--checkpoint run/model.safetensors takes the run's config beside it (mean/std, label names, model arguments),
    exactly as --checkpoint run does; the registered defaults were silently used before."""
    _, folder = cls_folder
    by_folder, info_folder = load_model("vit_tiny_cifar_cls", folder)
    by_file, info_file = load_model("vit_tiny_cifar_cls", folder / "model.safetensors")
    assert tuple(info_file["mean"]) == pytest.approx(MEAN) and tuple(info_file["std"]) == pytest.approx(STD)
    assert info_file["label_names"] == LABELS
    for key in ("mean", "std", "label_names", "model_args", "input_size", "sha256"):
        assert info_file[key] == info_folder[key], key
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        assert torch.equal(by_file(x), by_folder(x))


def test_a_weights_file_takes_its_own_run_config_under_a_local_dir_model_too(cls_folder, tmp_path):
    """--model local-dir:A --checkpoint B/model.safetensors: B's mean/std and label names (A only builds alike)."""
    import json
    import shutil

    _, folder = cls_folder
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    config = json.loads((other / "config.json").read_text())
    config["pretrained_cfg"]["mean"], config["label_names"] = [0.1, 0.2, 0.3], [f"x{i}" for i in range(10)]
    (other / "config.json").write_text(json.dumps(config))
    for checkpoint in (other, other / "model.safetensors"):
        _, info = load_model(f"local-dir:{folder}", checkpoint)
        assert info["mean"] == pytest.approx([0.1, 0.2, 0.3]) and info["label_names"][0] == "x0", checkpoint
    bare = tmp_path / "bare.safetensors"
    shutil.copy(other / "model.safetensors", bare)
    assert load_model(f"local-dir:{folder}", bare)[1]["mean"] == pytest.approx(MEAN)  # no config of its own


def test_a_config_that_is_no_timm_config_and_weights_of_another_architecture_are_named(cls_folder, tmp_path):
    import shutil

    _, folder = cls_folder
    (tmp_path / "list").mkdir()
    shutil.copy(folder / "model.safetensors", tmp_path / "list")
    (tmp_path / "list" / "config.json").write_text("[1, 2]")
    listed = _error("vit_tiny_cifar_cls", tmp_path / "list" / "model.safetensors")
    assert "holds a JSON list, not a timm config" in listed
    small = tmp_path / "small"
    save_for_hf(timm.create_model("vit_small_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=10),
                small, safe_serialization=True, model_args=dict(img_size=32, patch_size=8, depth=1))
    message = _error("vit_tiny_cifar_cls", small / "model.safetensors", img_size=32, patch_size=8, depth=1)
    assert message == (f"pass --model vit_small_patch16_224 (or local-dir:{small}): --checkpoint {small} was saved as "
                       "vit_small_patch16_224, whose parameters vit_tiny_cifar_cls does not have (19 of other "
                       "shapes)")


def test_a_hybrid_vit_keeps_three_image_channels():
    """A hybrid ViT's patch projection takes its CNN's feature channels; the input is still RGB."""
    model, info = load_model("vit_tiny_r_s16_p8_224", img_size=64)
    assert model.patch_embed.proj.in_channels != 3 and info["input_size"] == [3, 64, 64]


def test_input_size_mismatch_is_a_one_line_error_naming_both_sizes():
    model = timm.create_model("vit_tiny_cifar_cls", num_classes=10, depth=1)
    check_input_size(model, torch.zeros(2, 3, 32, 32, dtype=torch.uint8), fix="unused")
    want = r"^the data set's images are 64x48 but vit_tiny_cifar_cls takes 32x32; fix it$"
    with pytest.raises(UserError, match=want):
        check_input_size(model, torch.zeros(2, 3, 64, 48, dtype=torch.uint8), fix="fix it")


@pytest.mark.parametrize("route", ["timm", "registered name", "checkpoint folder", "local-dir", "stock timm ViT"])
def test_a_model_built_for_another_size_tells_timms_data_config_that_size(route, tmp_path):
    """timm keeps the registered 32x32 in pretrained_cfg when img_size=64; the loaded model's data config must say
    64 (else timm's transform resizes to 32 and the model refuses the input), the registry keeps 32."""
    from PIL import Image
    from timm.data import create_transform, resolve_data_config

    kwargs = dict(num_classes=10, depth=1, img_size=64, patch_size=8)
    save_for_hf(timm.create_model("vit_tiny_cifar_cls", **kwargs), tmp_path, safe_serialization=True,
                model_args=dict(img_size=64, patch_size=8, depth=1))
    model, info = {"timm": lambda: (timm.create_model("vit_tiny_cifar_cls", **kwargs).eval(), None),
                   "registered name": lambda: load_model("vit_tiny_cifar_cls", **kwargs),
                   "checkpoint folder": lambda: load_model("vit_tiny_cifar_cls", tmp_path),
                   "local-dir": lambda: load_model(f"local-dir:{tmp_path}"),
                   "stock timm ViT": lambda: load_model("vit_small_patch16_224", **kwargs)}[route]()
    cfg = resolve_data_config(model=model)
    assert cfg["input_size"] == (3, 64, 64) and (info is None or info["input_size"] == [3, 64, 64])
    x = create_transform(**cfg, is_training=False)(Image.new("RGB", (100, 80)))
    assert x.shape == (3, 64, 64)
    with torch.inference_mode():
        assert model(x[None]).shape == (1, 10)
    assert model.default_cfg["input_size"] == (3, 64, 64)  # timm's alias of pretrained_cfg
    assert timm.create_model("vit_tiny_cifar_cls", depth=1).pretrained_cfg["input_size"] == (3, 32, 32)


def test_package_modules_import_each_other_without_a_cycle():
    """Every `from .x import` / `import timm_rollout.x` edge among the package's modules, at any depth in a file:
    the graph has no cycle (a cycle makes import order matter and hides behind function-level imports)."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "timm_rollout"
    names = {p.stem for p in package.glob("*.py")}
    edges = {}
    for path in package.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("timm_rollout."):
                found.add(node.module.split(".")[1])
        edges[path.stem] = found & names - {path.stem}

    def visit(name: str, stack: tuple[str, ...]) -> None:
        assert name not in stack, f"import cycle: {' -> '.join((*stack, name))}"
        for other in sorted(edges[name]):
            visit(other, (*stack, name))

    for name in sorted(edges):
        visit(name, ())


def test_a_folder_without_weights_says_what_it_holds_and_what_to_pass(cls_folder, tmp_path):
    """``--pretrained-file`` and ``--checkpoint`` given a folder that is no run folder: the message names the run
    folders or weights files inside it, or what it holds instead, never a model.safetensors it does not have."""
    from timm_rollout.loading import pretrained_config, pretrained_overlay

    _, run = cls_folder
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        (runs / name).mkdir(parents=True)
        (runs / name / "model.safetensors").write_bytes((run / "model.safetensors").read_bytes())
    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "vit_small.safetensors").write_bytes(b"")
    (loose / "resume.safetensors").write_bytes(b"")  # optimizer state, not weights to start from
    other = tmp_path / "other"
    (other / "eval").mkdir(parents=True)
    (other / "notes.txt").write_text("")
    (tmp_path / "empty").mkdir()
    expected = {
        runs: f"{runs} has no model.safetensors; it holds folders that do: pass one of them ({runs / 'a'}, "
              f"{runs / 'b'})",
        loose: f"{loose} has no model.safetensors; it holds {loose / 'vit_small.safetensors'}: pass that file itself",
        other: f"{other} has no model.safetensors; it holds eval/, notes.txt, no weights; pass a training output "
               "folder (model.safetensors + config.json) or a .safetensors file",
        tmp_path / "empty": f"{tmp_path / 'empty'} has no model.safetensors; it is empty; pass a training output "
                            "folder (model.safetensors + config.json) or a .safetensors file",
    }
    for folder, message in expected.items():
        for call, arg in ((pretrained_config, (folder, "vit_tiny_cifar_cls")), (pretrained_overlay, (folder,)),
                          (load_model, ("vit_tiny_cifar_cls", folder)), (load_model, (f"local-dir:{folder}",))):
            with pytest.raises(UserError) as e:
                call(*arg)
            assert str(e.value) == message


@pytest.mark.parametrize("name, kwargs", [("vit_tiny_cifar_cls", {}),
                                          ("vit_tiny_patch16_224", dict(img_size=32, patch_size=4))])
def test_a_model_built_with_map_and_trained_with_rollout_reloads_rollout_pooled(tmp_path, name, kwargs):
    """Training's export of a ViT built with ``global_pool='map'`` and pooled by rollout (``--pool rollout``) rebuilds
    its layout (the unused attention pool included) pooled by rollout: the saved model's own logits, by
    ``local-dir:`` and by ``--model NAME --checkpoint RUN``; the tiny model's config used to say only 'rollout',
    which rebuilt it without its attention pool."""
    from timm_rollout import set_pooling
    from timm_rollout.checkpoint import save_model

    torch.manual_seed(0)
    model = set_pooling(timm.create_model(name, num_classes=10, depth=2, global_pool="map", **kwargs).eval(),
                        "rollout", head_fusion="max", discard_ratio=0.5)
    save_model(tmp_path / "run", model, [str(i) for i in range(10)], (0.5,) * 3, (0.25,) * 3)
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        expected = model(x)
        for loaded, _ in (load_model(f"local-dir:{tmp_path / 'run'}"), load_model(name, tmp_path / "run")):
            assert loaded.global_pool == "rollout" and loaded.attn_pool is not None
            assert (loaded.rollout_head_fusion, loaded.rollout_discard_ratio) == ("max", 0.5)
            torch.testing.assert_close(loaded(x), expected, rtol=0, atol=0)
