"""Models that are no ViT (CNNs): they train, save, resume, reload through ``local-dir:`` as trained, are evaluated on
everything that needs no attention, and are refused the attention parts in one line.

The CNN is timm's own ``test_resnet`` (a 0.4M-parameter ResNet with batch norm), trained on the shipped sample in
fp32 on the CPU. The references are independent of the code under test: the trained model's own tensors in
``resume.safetensors`` (written from the training model's ``state_dict``, not through the export) and a plain loop
over the test images for top-1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file

from harness import compare, hub
from harness import eval as harness_eval
from harness import explain as harness_explain
from harness.localisation import LOCALISATION
from harness.metrics import POOLING_DIAGNOSTICS
from harness.record import read_predictions
from timm_rollout.checkpoint import save_model
from timm_rollout.cli import run_cli
from timm_rollout.clutter import ClutterRecipe, make_cluttered
from timm_rollout.data import load_image_set
from timm_rollout.pooling import attention_free, set_pooling
from timm_rollout.records import RESUME_FILE
from timm_rollout.train import train

CNN = "test_resnet"
SAMPLE = "cifar10-sample"
RUN = ["--model", CNN, "--dataset", SAMPLE, "--max-train-samples", "256", "--max-eval-samples", "100",
       "--batch-size", "32", "--device", "cpu", "--amp", "none", "--workers", "1", "--no-progress"]
EVAL = ["--dataset", SAMPLE, "--device", "cpu", "--amp", "none"]
NOT_A_VIT = f"{CNN} (ResNet) is not a timm VisionTransformer-family model: it has no attention over patch tokens"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """The CNN trained one epoch, then resumed for a second."""
    out = tmp_path_factory.mktemp("cnn") / "run"
    train([*RUN, "--epochs", "1", "--output", str(out)])
    train([*RUN, "--epochs", "2", "--resume", "--output", str(out)])
    return out


@pytest.fixture(scope="module")
def evaluation(run: Path, tmp_path_factory) -> tuple[Path, str]:
    """harness.eval of the run through ``local-dir:`` on the whole test split, with a small bank; and its stderr."""
    out = tmp_path_factory.mktemp("cnn-eval")
    with pytest.MonkeyPatch.context() as mp:
        err = out / "stderr.txt"
        with err.open("w") as f:
            mp.setattr("sys.stderr", f)
            harness_eval.main(["--model", f"local-dir:{run}", *EVAL, "--bank-split", "train", "--bank-per-class",
                               "10", "--output", str(out)])
    return out, err.read_text()


def _trained_tensors(run: Path) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in load_file(run / RESUME_FILE).items() if k.startswith("model.")}


def test_run_resumes_and_reloads_through_local_dir_as_trained(run: Path) -> None:
    rows = (run / "log.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2"]  # epoch 2 continued from the saved epoch 1
    config = json.loads((run / "config.json").read_text())
    assert config["architecture"] == CNN and "tag" not in config["pretrained_cfg"]
    assert config["pretrained_cfg"]["input_size"] == [3, 32, 32]  # the images it trained on, not timm's 160x160

    model = timm.create_model(f"local-dir:{run}", pretrained=True).eval()
    trained = _trained_tensors(run)
    state = model.state_dict()
    assert state.keys() == trained.keys()
    assert all(torch.equal(state[k], trained[k]) for k in state)  # batch-norm statistics included
    reference = timm.create_model(CNN, num_classes=10).eval()
    reference.load_state_dict(trained)
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=1e-6)


def _plain_top1(run: Path) -> tuple[float, list[int]]:
    """Top-1 of the run's weights on the sample's test split by a plain loop: 0-255 pixels / 255, minus the model's
    mean, over its std, one image at a time (nothing of the harness)."""
    model = timm.create_model(CNN, num_classes=10).eval()
    model.load_state_dict(_trained_tensors(run))
    cfg = json.loads((run / "config.json").read_text())["pretrained_cfg"]
    mean, std = torch.tensor(cfg["mean"]).view(3, 1, 1), torch.tensor(cfg["std"]).view(3, 1, 1)
    data = load_image_set(SAMPLE, "test")
    predicted = []
    with torch.no_grad():
        for image in data.images:
            x = (image.float() / 255 - mean) / std
            predicted.append(int(model(x[None]).argmax()))
    hits = sum(int(p == int(y)) for p, y in zip(predicted, data.labels, strict=True))
    return hits / len(predicted), predicted


def test_eval_scores_what_needs_no_attention_and_says_what_it_left_out(run: Path, evaluation) -> None:
    out, stderr = evaluation
    results = json.loads((out / "results.json").read_text())
    metrics = results["metrics"]
    for key in ("top1", "top5", "linear_probe", "knn_loo", "knn_bank", "intra", "inter", "ratio", "silhouette"):
        assert isinstance(metrics[key], float), key
    assert all(metrics[k] is None for k in POOLING_DIAGNOSTICS) and results["pooling_diagnostics"] is None
    assert results["left_out"] == {"reason": NOT_A_VIT,
                                   "parts": ["rollout pooling diagnostics", "heatmaps of attention maps"]}
    assert results["outputs"]["figures"] == ["cosine_matrix.png"] and not (out / "heatmaps.png").exists()
    assert results["model"]["global_pool"] == results["model"]["pool"] == "avg"
    recorded = results["model"]["pretrained_cfg"]  # timm keeps the stock weights' hub id: not where these came from
    assert recorded["input_size"] == [3, 32, 32] and not {"url", "hf_hub_id", "tag"} & set(recorded)
    notes = [line for line in stderr.splitlines() if line.startswith("note:")]
    assert notes == [f"note: {NOT_A_VIT}; left out the parts that need attention (rollout pooling diagnostics, "
                     "heatmaps of attention maps), their metrics null"]
    assert "Traceback" not in stderr

    top1, predicted = _plain_top1(run)  # fp32 both: the same images, the same predictions
    assert metrics["top1"] == top1
    assert read_predictions(out)["predicted"]["top1"] == predicted


@pytest.mark.parametrize("flags, asked", [(["--pool", "rollout", "--faithfulness"], "--pool and --faithfulness need"),
                                          (["--heatmaps", "2"], "--heatmaps needs")])
def test_attention_parts_are_refused_in_one_line_before_any_work(run: Path, tmp_path: Path, capsys, flags,
                                                                 asked) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        run_cli(harness_eval.main, ["--model", f"local-dir:{run}", *EVAL, *flags, "--output", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1
    assert lines[0] == f"error: {asked} attention, and {NOT_A_VIT}; drop {asked.rsplit(' ', 1)[0]} (accuracy, " \
                       "k-NN, geometry, linear probe and silhouette need none)"
    assert not out.exists()
    with pytest.raises(SystemExit) as stop:  # harness.explain draws nothing but attention
        run_cli(harness_explain.main, ["--model", f"local-dir:{run}", "--dataset", SAMPLE, "--output", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith(f"error: cannot explain local-dir:{run}: ")
    assert not out.exists()


def test_boxes_and_masks_leave_the_localisation_null(run: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    make_cluttered(SAMPLE, tmp_path / "clutter", ClutterRecipe(canvas=48, fragments=2, seed=0), per_class=3,
                   splits=["test"])
    monkeypatch.chdir(tmp_path)
    results = harness_eval.main(["--model", f"local-dir:{run}", "--dataset", "clutter", "--device", "cpu",
                                 "--amp", "none", "--k", "3", "--heatmaps", "0", "--output", "eval"])
    assert all(results["metrics"][k] is None for k in LOCALISATION)  # context_top1 too: 3 images a class
    assert results["left_out"]["parts"] == ["rollout pooling diagnostics",
                                            "localisation of pooling weights and attention maps"]
    assert isinstance(results["metrics"]["top1"], float)
    assert "Traceback" not in capsys.readouterr().err


def test_hub_card_of_a_cnn_run(run: Path, evaluation, tmp_path: Path) -> None:
    files, architecture = hub.write_upload_folder(run, tmp_path / "upload", "org/cnn", evaluation[0])
    card = (tmp_path / "upload" / "README.md").read_text()
    assert architecture == CNN and [f.name for f in files] == ["README.md", "config.json", "model.safetensors"]
    assert f"timm's {CNN} ResNet" in card and "built for 32x32 images" in card
    assert "attention-rollout" not in card and "Abnar" not in card and "| top1 |" in card


@pytest.mark.parametrize("name", ["test_efficientnet", "test_convnext", "test_mambaout", "test_vit"])
def test_timm_test_models_save_and_reload_with_the_same_logits(name: str, tmp_path: Path) -> None:
    """Save as training does and reload through local-dir: (a CNN, a ConvNeXt head, a model without pooling, and a
    stock ViT as control); only the ViT has attention."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=3).eval()
    save_model(tmp_path, model, ["a", "b", "c"], (0.5,) * 3, (0.25,) * 3, (3, 32, 32) if name != "test_vit" else None)
    loaded = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    size = loaded.pretrained_cfg["input_size"]
    x = torch.randn(2, *size)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert (attention_free(loaded) is None) == (name == "test_vit")
    assert hub.describe_model(loaded)["architecture"] == name


def test_pooling_of_a_cnn_is_refused_and_named() -> None:
    with torch.device("meta"):
        model = timm.create_model("test_convnext")
    with pytest.raises(ValueError, match=r"^test_convnext \(ConvNeXt\) is not a timm VisionTransformer-family model: "
                                         r"it has no attention over patch tokens; set_pooling \(--pool\) takes timm "
                                         r"ViT-family models only$"):
        set_pooling(model, "avg")
    assert compare.default_pool("test_convnext") == "avg"  # its pooling is in its head
