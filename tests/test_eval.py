"""harness.eval end to end on the shipped CIFAR-10 sample, --pool, heatmap maps, harness.compare, and error paths."""

from __future__ import annotations

import gzip
import io
import json
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
import timm
import torch
from matplotlib.figure import Figure
from PIL import Image
from safetensors.torch import load_file
from timm.models import save_for_hf

import timm_rollout
from harness import compare, metrics
from harness import eval as harness_eval
from harness.features import saliency_maps
from harness.figures import upsample_patch_map
from harness.metrics import POOLING_DIAGNOSTICS
from harness.record import SCHEMA, read_predictions, read_results, upgrade, write_evaluation
from timm_rollout import attention_rollout, patch_weights, rollout_cls_row
from timm_rollout.atomic import FIGURE_DPI, save_figure
from timm_rollout.data import balanced_indices, load_image_set, normalize
from timm_rollout.errors import UserError
from timm_rollout.loading import load_model

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = "cifar10-sample"  # 200 train and 100 test images per class, shipped in the package
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.247, 0.2435, 0.2616)


def _save(tmp_path_factory, name: str, num_classes: int) -> Path:
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=num_classes, depth=2, pretrained_cfg_overlay=dict(mean=MEAN, std=STD))
    folder = tmp_path_factory.mktemp("runs") / name
    save_for_hf(model, folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """An untrained depth-2 [CLS] model saved as a training output folder."""
    return _save(tmp_path_factory, "vit_tiny_cifar_cls", 10)


def _args(checkpoint: Path, output: Path, *extra: str) -> list[str]:
    return ["--model", "vit_tiny_cifar_rollout", "--checkpoint", str(checkpoint), "--dataset", SAMPLE,
            "--output", str(output), *extra]


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory) -> list[Path]:
    """The same seeded evaluation twice (CLS weights read out by rollout pooling)."""
    outputs = []
    for i in range(2):
        out = tmp_path_factory.mktemp(f"eval{i}")
        harness_eval.main(_args(checkpoint, out, "--per-class", "10", "--seed", "3", "--bank-split", "train",
                                "--bank-per-class", "20", "--heatmaps", "2", "--save-features",
                                "--cosine-classes", "ship", "cat", "dog", "--device", "cpu", "--amp", "none"))
        outputs.append(out)
    return outputs


def test_a_re_evaluation_is_refused_without_overwrite_and_never_mixes_two(runs, checkpoint, monkeypatch, tmp_path):
    """Without --overwrite a folder holding an evaluation is refused before any work, its files as they were; with
    it, a re-evaluation (another seed, so other images) that fails while computing leaves the old evaluation as it
    was, and one that fails while writing leaves none of the old files beside a new one: they go just before the
    first new file is written."""
    folder = tmp_path / "again"
    shutil.copytree(runs[1], folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert {"results.json", "predictions.json.gz", "features.safetensors", "heatmaps.png"} <= set(before)
    with pytest.raises(UserError, match=r"again holds an evaluation \(results.json, predictions.json.gz, features"
                                        r".safetensors, cosine_matrix.png, heatmaps.png\); pass --overwrite to "):
        harness_eval.main(_args(checkpoint, folder, "--per-class", "10", "--seed", "4", "--device", "cpu"))
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before

    def fail(*args, **kwargs):
        raise RuntimeError("interrupted")

    again = _args(checkpoint, folder, "--per-class", "10", "--seed", "4", "--device", "cpu", "--overwrite")
    monkeypatch.setattr(harness_eval, "_drawings", fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        harness_eval.main(again)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    monkeypatch.undo()
    monkeypatch.setattr(harness_eval, "plot_cosine_matrix", fail)  # the first figure Evaluation.save draws
    with pytest.raises(RuntimeError, match="interrupted"):
        harness_eval.main(again)
    assert list(folder.iterdir()) == []


def test_results_json_has_metrics_and_provenance(runs, checkpoint):
    results = json.loads((runs[0] / "results.json").read_text())
    assert set(results["metrics"]) == {"top1", "top5", "linear_probe", "knn_loo", "knn_bank", "intra", "inter", "ratio",
                                       "silhouette", "intra_original", "inter_original", "ratio_original",
                                       "knn_original",
                                       "rollout_effective_patches", "rollout_cosine_to_mean"}
    assert all(isinstance(v, float) for v in results["metrics"].values())
    model, data, config = results["model"], results["data"], results["config"]
    assert model["architecture"] == "vit_tiny_cifar_rollout" and model["pool"] == "rollout"
    assert model["checkpoint_architecture"] == "vit_tiny_cifar_cls"
    assert model["sha256"] and model["checkpoint"] == str(checkpoint) and model["mean"] == pytest.approx(MEAN)
    assert data["split"] == "test" and data["fingerprint"] and data["num_images"] == 100
    assert data["per_class_counts"] == {name: 10 for name in data["class_names"]} and len(data["class_names"]) == 10
    assert data["bank"]["split"] == "train" and data["bank"]["num_images"] == 200
    assert config["k"] == 5 and config["bank_k"] == 20 and config["seed"] == 3
    assert config["silhouette_sample_size"] is None
    assert config["batch_size"] == 128  # the CPU default (inference_batch_size); 512 on a GPU
    assert results["cosine_matrix"]["classes"] == ["ship", "cat", "dog"]  # the order asked for
    assert np.allclose(np.diag(results["cosine_matrix"]["matrix"]), 1.0)
    env = results["environment"]
    assert env["device"] == "cpu" and env["packages"]["faiss-cpu"] and env["packages"]["timm"] == timm.__version__
    assert {"load_data", "load_model", "extract", "extract_bank", "metrics", "figures", "total"} <= set(
        results["timing"])
    from timm_rollout.records import code_version

    assert results["code"] == code_version() and results["code"]["version"] == timm_rollout.__version__
    assert data["dataset"] == data["argument"] == results["args"]["dataset"] == "cifar10-sample"  # by its name


@pytest.fixture(scope="module")
def peaked(tmp_path_factory) -> tuple[Path, Path]:
    """A [CLS] checkpoint whose attention is sharpened (q, k weights x10: rollout weights far from uniform, which
    an untrained model's are not) and its evaluation folder."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_cifar_cls", num_classes=10, depth=2)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[:256].mul_(10.0)
    run, out = tmp_path_factory.mktemp("runs") / "peaked", tmp_path_factory.mktemp("eval-peaked")
    save_for_hf(model, run, safe_serialization=True, data_config=dict(mean=MEAN, std=STD))
    harness_eval.main(["--model", "vit_tiny_cifar_cls", "--checkpoint", str(run), "--dataset", SAMPLE,
                       "--per-class", "3", "--heatmaps", "0", "--device", "cpu", "--amp", "none", "--output", str(out)])
    return run, out


def test_pooling_diagnostics_of_the_evaluated_images_against_a_plain_loop(peaked):
    checkpoint, out = peaked
    results = json.loads((out / "results.json").read_text())
    full = load_image_set(SAMPLE, "test")
    idx = torch.tensor(read_predictions(out)["index"])
    model, _ = load_model("vit_tiny_cifar_cls", checkpoint)  # [CLS]-pooled: the weights rollout would pool with
    def perplexity(row: np.ndarray) -> float:
        w = row / row.sum()
        return float(np.exp(-sum(p * np.log(p) for p in w)))

    patches, cosines, total, layers, variants = [], [], np.zeros(64), [], {}
    for i in idx.tolist():  # one image at a time: full rollout matrix product, entropy by a float64 loop
        with torch.inference_mode():
            attentions = _manual_attentions(model, normalize(full.images[i:i + 1], MEAN, STD))
            tokens = model.forward_features(normalize(full.images[i:i + 1], MEAN, STD))[0, 1:].double().numpy()
        row = attention_rollout(attentions)[0, 0, 1:].double().numpy()
        w = row / row.sum()
        total += w
        patches.append(perplexity(row))
        layers.append([perplexity(a[0, :, 0, 1:].double().mean(dim=0).numpy()) for a in attentions])
        for fusion, ratio, name in (("max", 0.0, "max"), ("mean", 0.9, "mean-discard0.9")):
            variants.setdefault(name, []).append(
                perplexity(attention_rollout(attentions, fusion, ratio)[0, 0, 1:].double().numpy()))
        pooled, avg = w @ tokens, tokens.mean(axis=0)
        cosines.append(pooled @ avg / np.linalg.norm(pooled) / np.linalg.norm(avg))
    assert results["metrics"]["rollout_effective_patches"] == pytest.approx(np.mean(patches), rel=1e-4)
    assert results["metrics"]["rollout_cosine_to_mean"] == pytest.approx(np.mean(cosines), rel=1e-5)
    record = results["pooling_diagnostics"]
    assert (record["head_fusion"], record["discard_ratio"], record["num_images"]) == ("mean", 0.0, len(idx))
    np.testing.assert_allclose(record["mean_weights"], total / len(idx), atol=2e-6)
    hist = record["effective_patches_histogram"]
    assert sum(hist["counts"]) == len(idx) and hist["edges"][0] == 1.0 and hist["edges"][-1] == 64.0
    np.testing.assert_allclose(record["layer_effective_patches"], np.mean(layers, axis=0), rtol=1e-4)
    for name, values in variants.items():
        assert record["rollout_variants"][name] == pytest.approx(np.mean(values), rel=1e-4)
    assert max(patches) < 60 and min(cosines) < 0.95  # far from uniform: the comparisons above have teeth


def test_heatmaps_0_writes_no_heatmap_figure(peaked):
    _, out = peaked
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["heatmaps"] == 0 and "heatmaps.png" not in results["outputs"]["figures"]
    assert not (out / "heatmaps.png").exists() and (out / "cosine_matrix.png").is_file()


def test_features_file_reproduces_the_metrics(runs):
    results = json.loads((runs[0] / "results.json").read_text())
    saved = load_file(str(runs[0] / "features.safetensors"))
    feats, labels = saved["features"], saved["labels"]
    assert feats.dtype == torch.float32 and feats.shape == (100, 128)
    assert labels.dtype == torch.int64 and torch.bincount(labels).tolist() == [10] * 10
    assert metrics.knn_loo(feats.numpy(), labels.numpy(), 5) == results["metrics"]["knn_loo"]
    assert metrics.centroid_metrics(feats, labels)["ratio"] == pytest.approx(results["metrics"]["ratio"])
    unit = feats.double() / feats.double().norm(dim=1, keepdim=True)
    cents = torch.stack([unit[labels == c].mean(dim=0) for c in (8, 3, 5)])  # ship, cat, dog
    cents = cents / cents.norm(dim=1, keepdim=True)
    assert np.allclose(results["cosine_matrix"]["matrix"], (cents @ cents.T).numpy(), atol=1e-5)


def test_features_file_holds_the_bank_and_recomputes_the_bank_metrics(runs, checkpoint):
    """With a bank, features.safetensors also holds the bank's features and labels: the model's own features of
    the bank images (recomputed here by a plain forward pass), from which knn_bank and linear_probe come out as
    results.json has them."""
    results = json.loads((runs[0] / "results.json").read_text())
    saved = load_file(str(runs[0] / "features.safetensors"))
    bank, bank_labels = saved["bank_features"], saved["bank_labels"]
    assert bank.dtype == torch.float32 and bank.shape == (200, 128) and bank_labels.dtype == torch.int64
    train = load_image_set(SAMPLE, "train")
    idx = balanced_indices(train.labels, per_class=20, classes=list(range(10)), seed=3)
    assert torch.equal(bank_labels, train.labels[idx])
    model, _ = load_model("vit_tiny_cifar_rollout", checkpoint)
    with torch.inference_mode():
        pooled = model.forward_head(model.forward_features(normalize(train.images[idx], MEAN, STD)), pre_logits=True)
    torch.testing.assert_close(bank, pooled, atol=1e-5, rtol=1e-4)
    config, got = results["config"], results["metrics"]
    assert metrics.knn_bank(bank, bank_labels, saved["features"], saved["labels"], config["bank_k"],
                            config["temperature"]) == got["knn_bank"]
    assert metrics.linear_probe(bank, bank_labels, saved["features"], saved["labels"]) == got["linear_probe"]


def test_a_class_with_one_evaluated_image_is_left_out_of_intra_and_named(checkpoint, tmp_path):
    """A split whose class c has one image: intra and ratio are computed over a and b only (by hand from the saved
    features), and results.json names c as left out."""
    rng = np.random.default_rng(0)
    labels = [0, 0, 0, 1, 1, 1, 2]
    columns = {"image": [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in labels],
               "label": labels}
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])})
    folder = tmp_path / "lone"
    datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(folder))
    out = tmp_path / "out"
    results = harness_eval.main(["--model", "vit_tiny_cifar_cls", "--dataset", str(folder), "--split", "train",
                                 "--k", "2", "--heatmaps", "0", "--save-features", "--device", "cpu", "--amp", "none",
                                 "--output", str(out)])
    assert results["data"]["intra_left_out"] == ["c"]
    saved = load_file(str(out / "features.safetensors"))
    x = saved["features"].double() / saved["features"].double().norm(dim=1, keepdim=True)
    y = saved["labels"]
    dirs = [x[y == c].mean(dim=0) / x[y == c].mean(dim=0).norm() for c in range(3)]
    intra = np.mean([float(torch.arccos((x[y == c] @ dirs[c]).clamp(-1, 1)).mean()) for c in (0, 1)])
    inter = np.mean([float(torch.arccos((dirs[a] @ dirs[b]).clamp(-1, 1))) for a, b in ((0, 1), (0, 2), (1, 2))])
    assert results["metrics"]["intra"] == pytest.approx(intra, rel=1e-5)
    assert results["metrics"]["ratio"] == pytest.approx(inter / intra, rel=1e-5)


def test_figures_are_written(runs):
    for name in ("cosine_matrix.png", "heatmaps.png"):
        with Image.open(runs[0] / name) as img:
            assert img.format == "PNG" and img.mode == "P" and img.size[0] > 200  # a 256-colour palette


def test_palette_figures_stay_close_to_the_full_colour_render(tmp_path):
    """save_figure's 256-colour PNG against matplotlib's own RGBA render of a heatmap panel grid, pixel by pixel."""
    images = load_image_set(SAMPLE, "test").images[:6]
    fig = Figure(figsize=(9, 6))
    for ax, image, seed in zip(fig.subplots(2, 3).flat, images, range(6), strict=True):
        ax.imshow(image.permute(1, 2, 0).numpy(), interpolation="nearest")
        weights = torch.rand(64, generator=torch.Generator().manual_seed(seed))
        fig.colorbar(ax.imshow(upsample_patch_map(weights, (8, 8), (32, 32)), cmap="inferno", alpha=0.6), ax=ax)
    save_figure(fig, tmp_path / "fig.png")
    raw = io.BytesIO()
    fig.savefig(raw, dpi=FIGURE_DPI, bbox_inches="tight", format="png")
    with Image.open(tmp_path / "fig.png") as small, Image.open(raw) as full:
        assert small.mode == "P" and small.size == full.size
        error = np.abs(np.asarray(small.convert("RGB"), dtype=int) - np.asarray(full.convert("RGB"), dtype=int))
    assert error.max() <= 32 and error.mean() < 6, (error.max(), error.mean())
    assert (tmp_path / "fig.png").stat().st_size < 0.5 * len(raw.getvalue())


def test_predictions_are_compressed_and_read_in_both_formats(runs, tmp_path):
    results = json.loads((runs[0] / "results.json").read_text())
    assert results["outputs"]["predictions"] == "predictions.json.gz"
    a, b = ((r / "predictions.json.gz").read_bytes() for r in runs)
    assert a == b  # the same seeded evaluation gives the same bytes (no timestamp in the gzip header)
    pred = json.loads(gzip.decompress(a))  # plain gzip + JSON, no project code needed
    labels = np.array(pred["label"])
    assert (np.array(pred["predicted"]["top1"]) == labels).mean() == pytest.approx(results["metrics"]["top1"])
    assert np.mean(pred["top5_hit"]) == pytest.approx(results["metrics"]["top5"])
    assert read_predictions(runs[0]) == pred
    (tmp_path / "predictions.json").write_text(json.dumps(pred))  # an evaluation written before compression
    assert read_predictions(tmp_path) == pred and read_predictions(tmp_path / "missing") is None
    correct = compare.correct_per_image(tmp_path, "knn_loo")
    assert correct == {i: p == y for i, p, y in zip(pred["index"], pred["predicted"]["knn_loo"], labels, strict=True)}
    write_evaluation(tmp_path, results, pred)  # re-evaluated: the stale legacy file goes
    assert not (tmp_path / "predictions.json").exists() and read_predictions(tmp_path) == pred
    assert json.loads((tmp_path / "results.json").read_text()) == results


def _only_nulls_added(up: dict, raw: dict) -> None:
    """Every value of ``raw`` is in ``up`` unchanged (nested dicts alike); what ``up`` adds is null."""
    assert set(raw) <= set(up)
    for key, value in up.items():
        if key not in raw:
            assert value is None, key
        elif isinstance(value, dict) and isinstance(raw[key], dict):
            _only_nulls_added(value, raw[key])
        else:
            assert value == raw[key], key


@pytest.mark.parametrize("path", sorted(ROOT.glob("results/**/results.json")), ids=lambda p: str(p.parent))
def test_every_committed_record_is_current_and_an_older_layout_upgrades_to_it(path):
    """Each committed results.json is of the current schema and reads with its numbers as written (one written before
    the schema, by a study pinned to older code, upgrades adding only nulls); the same record stripped to the layout
    before the schema (no ``schema``, none of the keys added since) upgrades to the same keys, the stripped ones null
    and every number unchanged."""
    raw = json.loads(path.read_text())
    if "schema" not in raw:  # written by code from before the schema (a study pinned to it): upgraded, only nulls added
        up = read_results(path)
        assert up.pop("schema") == SCHEMA
        _only_nulls_added(up, raw)
        return
    assert raw["schema"] == SCHEMA and read_results(path) == raw
    old = {k: v for k, v in raw.items() if k not in ("schema", "left_out", "code")}
    old["data"] = {k: v for k, v in raw["data"].items() if k not in ("content", "split_content", "box_content")}
    old["metrics"] = {k: v for k, v in raw["metrics"].items() if k not in POOLING_DIAGNOSTICS}
    up = upgrade(json.loads(json.dumps(old)))
    assert set(up) == set(raw) and set(up["data"]) == set(raw["data"]) and next(iter(up)) == "schema"
    assert up["metrics"] == {**raw["metrics"], **dict.fromkeys(POOLING_DIAGNOSTICS)}
    assert {k: up[k] for k in old} == {**old, "metrics": up["metrics"], "data": up["data"]}
    assert up["left_out"] is up["code"] is up["data"]["content"] is up["data"]["box_content"] is None


def test_a_record_of_a_newer_schema_is_refused(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"schema": SCHEMA + 1, "metrics": {}, "model": {}}))
    with pytest.raises(UserError, match=rf"schema {SCHEMA + 1}, newer than this harness reads \({SCHEMA}\); upgrade"):
        read_results(tmp_path)


def test_same_seed_gives_identical_results(runs):
    first, second = (json.loads((r / "results.json").read_text()) for r in runs)
    for key in ("metrics", "cosine_matrix", "data", "config"):
        assert first[key] == second[key], key
    a, b = (load_file(str(r / "features.safetensors")) for r in runs)
    assert torch.equal(a["features"], b["features"]) and torch.equal(a["labels"], b["labels"])


def _as_seed(folder: Path, out: Path, seed: int, knn_loo: float) -> Path:
    """A copy of an evaluation recorded as another seed with another knn_loo (a second run of its group, so other
    weights: another sha256)."""
    record = json.loads((folder / "results.json").read_text())
    record["config"]["seed"], record["metrics"]["knn_loo"] = seed, knn_loo
    record["model"]["sha256"] = f"{record['model']['sha256']}-seed{seed}"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(record))
    return out


def test_compare_groups_runs_and_writes_report(runs, tmp_path):
    first = json.loads((runs[0] / "results.json").read_text())["metrics"]["knn_loo"]
    other = _as_seed(runs[1], tmp_path / "seed4", 4, first + 0.1)
    groups = compare.main([str(runs[0]), str(other), "--output", str(tmp_path / "report")])
    assert len(groups) == 1 and groups[0].n == 2 and groups[0].seeds == [3, 4]
    assert groups[0].std["knn_loo"] == pytest.approx(np.std([first, first + 0.1], ddof=1))
    report = (tmp_path / "report" / "report.md").read_text()
    assert "vit_tiny_cifar_rollout (vit_tiny_cifar_cls weights) on cifar10-sample/test (n=2)" in report
    assert "| knn_loo |" in report and (tmp_path / "report" / "comparison.png").is_file()


def test_compare_refuses_an_evaluation_counted_twice(runs, tmp_path):
    """One folder twice, or two folders holding one seed's evaluation (``runs``: the same evaluation repeated), would
    count one seed as two; so would two records without a seed of the same weights on the same images."""
    out = tmp_path / "report"
    with pytest.raises(UserError, match=r"is passed twice; pass each evaluation folder once"):
        compare.main([str(runs[0]), str(runs[0] / "results.json"), "--output", str(out)])
    with pytest.raises(UserError, match=r"are both seed 3 of vit_tiny_cifar_rollout \(vit_tiny_cifar_cls weights\) "
                                        r"on cifar10-sample/test, so one seed would count twice"):
        compare.main([str(runs[0]), str(runs[1]), "--output", str(out)])
    unseeded = []
    for i, folder in enumerate(runs):
        record = json.loads((folder / "results.json").read_text())
        del record["config"]["seed"]
        (tmp_path / f"unseeded{i}").mkdir()
        (tmp_path / f"unseeded{i}" / "results.json").write_text(json.dumps(record))
        unseeded.append(str(tmp_path / f"unseeded{i}"))
    with pytest.raises(UserError, match=r"are both the same weights of vit_tiny_cifar_rollout"):
        compare.main([*unseeded, "--output", str(out)])
    for name, edit in (("reseeded", {}), ("other-images", {"subset_fingerprint": "another[20]"})):
        twin = _as_seed(runs[0], tmp_path / name, 4, 0.5)  # the same checkpoint evaluated with --seed 4
        record = json.loads((twin / "results.json").read_text())
        record["model"]["sha256"] = json.loads((runs[0] / "results.json").read_text())["model"]["sha256"]
        record["data"].update(edit)
        (twin / "results.json").write_text(json.dumps(record))
        with pytest.raises(UserError, match=r"are both the same weights of vit_tiny_cifar_rollout"):
            compare.main([str(runs[0]), str(twin), "--output", str(out)])
    assert not out.exists()


def test_compare_pairs_a_published_models_subset_draws_by_eval_seed(runs, tmp_path):
    """A model without a training checkpoint (Hub or local-dir) evaluated with two --seeds: two subset draws of one
    model, which pair by eval seed; a copy of one draw is still refused."""
    draws = []
    for i, seed in enumerate((3, 4)):
        record = json.loads((runs[0] / "results.json").read_text())
        record["model"]["checkpoint"], record["config"]["seed"] = None, seed
        record["data"]["subset_fingerprint"] = f"draw{i}[20]"
        (tmp_path / f"draw{seed}").mkdir()
        (tmp_path / f"draw{seed}" / "results.json").write_text(json.dumps(record))
        draws.append(str(tmp_path / f"draw{seed}"))
    groups = compare.main([*draws, "--output", str(tmp_path / "report")])
    assert len(groups) == 1 and groups[0].seeds == [3, 4]
    shutil.copytree(tmp_path / "draw3", tmp_path / "copy3")
    with pytest.raises(UserError, match=r"are both seed 3 of"):
        compare.main([*draws, str(tmp_path / "copy3"), "--output", str(tmp_path / "report2")])


def test_compare_refuses_metrics_no_evaluation_has(runs, tmp_path):
    """--metrics naming only metrics the evaluations lack used to print an empty table and exit 0."""
    record = json.loads((runs[0] / "results.json").read_text())
    held = [m for m in compare.SHOWABLE if record["metrics"].get(m) is not None]
    lacking = [m for m in compare.SHOWABLE if m not in held]
    assert "top1" in held and lacking  # the sample evaluation has no localisation metrics
    with pytest.raises(UserError) as e:
        compare.main([str(runs[0]), "--metrics", lacking[0], "--output", str(tmp_path / "report")])
    assert str(e.value) == (f"--metrics {lacking[0]}: none of the evaluations has a value for it; they have "
                            f"{', '.join(held)}")
    assert not (tmp_path / "report").exists()
    groups = compare.main([str(runs[0]), "--metrics", "top1", "knn_loo", "--output", str(tmp_path / "report")])
    assert groups[0].mean["top1"] == record["metrics"]["top1"]


def test_summarise_mean_std_and_deltas():
    def result(model, value):
        return {"model": {"name": model, "architecture": model}, "data": {"argument": "cifar10", "split": "test"},
                "metrics": {"knn_loo": value, "knn_bank": None}}

    pooled = {"model": {"name": "vit_tiny_cifar_cls", "global_pool": "map", "pool": "avg"}, "data": {}}
    assert compare.run_label(pooled) == "vit_tiny_cifar_cls (global_pool=map) (read out with avg) on ?/?"
    plain = {"model": {"name": "vit_tiny_cifar_cls", "global_pool": "token", "pool": "token"}, "data": {}}
    assert compare.run_label(plain) == "vit_tiny_cifar_cls on ?/?"
    groups = compare.summarise([result("a", 0.5), result("b", 0.7), result("a", 0.7)], ["knn_loo", "knn_bank"])
    assert [g.label for g in groups] == ["a on cifar10/test", "b on cifar10/test"]
    assert groups[0].mean["knn_loo"] == pytest.approx(0.6) and groups[0].std["knn_loo"] == pytest.approx(0.1414214)
    assert groups[1].std["knn_loo"] is None and groups[0].mean["knn_bank"] is None
    table = compare.render_markdown(groups, ["knn_loo", "knn_bank"])
    assert "| knn_loo | 0.6000 ± 0.1414 | 0.7000 | +0.1000 |" in table and "knn_bank" not in table


def test_run_label_of_names_timm_does_not_register(tmp_path):
    """A moved local-dir: folder or an uncached hf-hub: name has no default pooling: its built one is named,
    nothing is loaded (these used to raise FileNotFoundError in compare and sweep)."""
    for name in (f"local-dir:{tmp_path / 'moved'}", "hf-hub:timm-rollout/not-a-cached-model"):
        assert compare.default_pool(name) is None
        result = {"model": {"name": name, "global_pool": "token", "pool": "token"}, "data": {}}
        assert compare.run_label(result) == f"{name} (global_pool=token) on ?/?"
    assert compare.default_pool("vit_tiny_cifar_gap") == "avg"


def test_flags_without_the_flag_they_need_are_refused(tmp_path):
    """Bank and faithfulness options are refused without --bank-split / --faithfulness, even typed at their
    defaults; with it they parse."""
    base = ["--model", "vit_tiny_cifar_cls", "--dataset", SAMPLE, "--output", str(tmp_path / "out")]
    for flag, value, fix in (("--bank-per-class", "5", "--bank-split train"), ("--bank-k", "20", "--bank-split train"),
                             ("--temperature", "0.07", "--bank-split train"),
                             ("--faithfulness-images", "10", "--faithfulness")):
        message = _user_error([*base, flag, value])
        assert message == f"{flag} only applies with {fix.split()[0]}; add {fix} or drop {flag}"
        args = harness_eval.build_parser().parse_args([*base, flag, value, *fix.split()])
        assert vars(args)[flag[2:].replace("-", "_")] == float(value)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return load_image_set(SAMPLE, "test").images[:4]


def _manual_attentions(model, x: torch.Tensor) -> list[torch.Tensor]:
    """Each block's softmax(q k^T / sqrt(d)) recomputed from that block's own input, block by block."""
    out = []
    h = model.norm_pre(model._pos_embed(model.patch_embed(x)))
    for block in model.blocks:
        attn = block.attn
        b, n, _ = h.shape
        qkv = attn.qkv(block.norm1(h)).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        q, k = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])
        out.append(((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1))
        h = block(h)
    return out


@pytest.mark.parametrize("name", ["vit_tiny_cifar_rollout", "vit_tiny_cifar_cls"])
def test_heatmap_maps_explain_the_readout_from_every_layers_real_attention(name, images):
    torch.manual_seed(1)
    model = timm.create_model(name, num_classes=10, depth=3).eval()
    x = normalize(images, MEAN, STD)
    found = saliency_maps(model, x, device=torch.device("cpu"))
    with torch.inference_mode():
        attentions = _manual_attentions(model, x)
    r = torch.zeros(4, 65)
    if name == "vit_tiny_cifar_rollout":  # r = [0, w]: the weights its classifier pools the final patches with
        r[:, 1:] = patch_weights(rollout_cls_row(attentions))
    else:
        r[:, 0] = 1.0
    rollout = (r.unsqueeze(1) @ attention_rollout(attentions)).squeeze(1)[:, 1:]
    assert torch.allclose(found.maps["rollout"], rollout / rollout.sum(dim=1, keepdim=True), atol=1e-5)
    last = (r.unsqueeze(1) @ attentions[-1].mean(dim=1)).squeeze(1)[:, 1:]
    assert torch.allclose(found.maps["last_layer_attention"], last, atol=1e-5)
    assert found.maps["gradient_rollout"].shape == (4, 64) and found.logits.shape == (4, 10)


def test_pool_avg_reads_out_the_mean_of_the_final_patch_tokens(checkpoint, tmp_path):
    out = tmp_path / "avg"
    results = harness_eval.main(["--model", "vit_tiny_cifar_cls", "--checkpoint", str(checkpoint), "--dataset",
                                 SAMPLE, "--per-class", "3", "--pool", "avg", "--heatmaps", "1",
                                 "--save-features", "--device", "cpu", "--amp", "none", "--output", str(out)])
    assert results["model"]["pool"] == "avg"
    saved = load_file(str(out / "features.safetensors"))
    full = load_image_set(SAMPLE, "test")
    idx = balanced_indices(full.labels, per_class=3, classes=list(range(10)), seed=0)
    assert torch.equal(saved["labels"], full.labels[idx])
    model, _ = load_model("vit_tiny_cifar_cls", checkpoint)  # still [CLS]-pooled: its own readout
    with torch.inference_mode():
        tokens = model.forward_features(normalize(full.images[idx], MEAN, STD))
    torch.testing.assert_close(saved["features"], tokens[:, 1:].mean(dim=1), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(saved["features"], tokens[:, 0], atol=1e-3)


def test_map_pooled_model_evaluates_end_to_end(tmp_path_factory, tmp_path):
    run = tmp_path_factory.mktemp("runs") / "map"
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_cifar_cls", num_classes=10, depth=2, global_pool="map").eval()
    save_for_hf(model, run, safe_serialization=True, data_config=dict(mean=MEAN, std=STD))
    results = harness_eval.main(["--model", "vit_tiny_cifar_cls", "--checkpoint", str(run), "--dataset",
                                 SAMPLE, "--per-class", "2", "--heatmaps", "1", "--faithfulness",
                                 "--faithfulness-images", "3", "--save-features", "--device", "cpu", "--amp", "none",
                                 "--output", str(tmp_path)])
    assert results["model"]["pool"] == "map"
    assert {"heatmaps.png", "faithfulness.png"} <= set(results["outputs"]["figures"])
    assert set(results["faithfulness"]["fills"]["mean"]["maps"]) >= {"rollout", "gradient_rollout"}
    full = load_image_set(SAMPLE, "test")
    idx = balanced_indices(full.labels, per_class=2, classes=list(range(10)), seed=0)
    with torch.inference_mode():  # the features are the attention pool's output on the final patch tokens
        tokens = model.forward_features(normalize(full.images[idx], MEAN, STD))
        pooled = model.attn_pool(tokens[:, 1:])
    torch.testing.assert_close(load_file(str(tmp_path / "features.safetensors"))["features"], pooled,
                               atol=1e-5, rtol=1e-4)


def test_set_pool_refuses_what_it_cannot_switch():
    model = timm.create_model("vit_tiny_cifar_cls", num_classes=10, depth=1)
    assert harness_eval.posthoc_readout(model, None) == "token"
    assert harness_eval.posthoc_readout(model, "rollout") == "rollout"
    stock = timm.create_model("vit_tiny_patch16_224", depth=1)  # any timm ViT pools by rollout through set_pooling
    assert harness_eval.posthoc_readout(stock, "rollout") == "rollout" and stock.global_pool == "rollout"
    with pytest.raises(UserError, match="--pool token: token pooling needs a class token"):
        harness_eval.posthoc_readout(timm.create_model("vit_tiny_patch16_224", depth=1, class_token=False,
                                                       global_pool="max", fc_norm=False), "token")
    with pytest.raises(UserError, match="fc_norm"):
        harness_eval.posthoc_readout(timm.create_model("vit_tiny_cifar_cls", global_pool="avg", fc_norm=True,
                                                       depth=1), "token")
    with pytest.raises(UserError, match="learned attention pool"):  # timm would pool with attn_pool whatever it says
        harness_eval.posthoc_readout(timm.create_model("vit_tiny_cifar_cls", global_pool="map", depth=1), "avg")


def _synthetic_folder(root: Path, with_labels: bool) -> Path:
    """A tiny saved data set: 8 images of classes a and b, ClassLabel names a-d (c and d have no images)."""
    rng = np.random.default_rng(0)
    columns = {"image": [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in range(8)]}
    features = {"image": datasets.Image()}
    if with_labels:
        columns["label"] = [0, 1] * 4
        features["label"] = datasets.ClassLabel(names=["a", "b", "c", "d"])
    folder = root / ("labelled" if with_labels else "unlabelled")
    datasets.Dataset.from_dict(columns, features=datasets.Features(features)).save_to_disk(str(folder))
    return folder


def _user_error(argv: list[str]) -> str:
    with pytest.raises(UserError) as e:
        harness_eval.main(argv)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_user_errors(checkpoint, tmp_path, tmp_path_factory):
    out = str(tmp_path / "out")
    message = _user_error(_args(checkpoint, out, "--classes", "cat", "unicorn"))
    assert "unicorn" in message and "valid: airplane, automobile, bird" in message
    assert "only 100 images" in _user_error(_args(checkpoint, out, "--per-class", "101"))
    assert "is the evaluated split" in _user_error(_args(checkpoint, out, "--bank-split", "test"))
    c100 = _save(tmp_path_factory, "vit_tiny_cifar_cls", 100)
    assert "checkpoint has 100 classes" in _user_error(_args(c100, out))
    rollout = _save(tmp_path_factory, "vit_tiny_cifar_rollout", 10)  # local-dir:A with B of another architecture
    assert f"local-dir:{rollout} is vit_tiny_cifar_rollout but --checkpoint {checkpoint} was trained as " \
           "vit_tiny_cifar_cls" in _user_error(["--model", f"local-dir:{rollout}", *_args(checkpoint, out)[2:]])
    assert "must be an integer >= 2, got 1" in _user_error(_args(checkpoint, out, "--per-class", "1"))
    base = ["--model", "vit_tiny_cifar_rollout", "--split", "train", "--output", out]
    labelled = str(_synthetic_folder(tmp_path, True))
    assert "selection is empty" in _user_error([*base, "--dataset", labelled, "--classes", "c", "d"])
    unlabelled = str(_synthetic_folder(tmp_path, False))
    assert "label column" in _user_error([*base, "--dataset", unlabelled])
    assert not (tmp_path / "out" / "results.json").exists()


def test_more_heatmaps_than_images_draws_them_all_and_says_so(checkpoint, tmp_path, capsys):
    results = harness_eval.main(_args(checkpoint, tmp_path / "h", "--per-class", "2", "--heatmaps", "25", "--device",
                                      "cpu", "--amp", "none"))
    assert "note: --heatmaps 25 but 20 images are evaluated: all of them drawn" in capsys.readouterr().err
    assert "heatmaps.png" in results["outputs"]["figures"]


def test_a_post_hoc_readout_says_so_and_the_summary_names_precision_and_batch(checkpoint, tmp_path, capsys):
    """[CLS] weights read out by rollout pooling (another architecture) or with --pool: one note line each; the
    weights evaluated as trained: none. The summary line names the precision and batch size (bf16 results depend
    on the batch size)."""
    quick = ["--per-class", "2", "--heatmaps", "0", "--device", "cpu", "--amp", "none", "--batch-size", "16"]
    harness_eval.main(_args(checkpoint, tmp_path / "a", *quick))
    out, err = capsys.readouterr()
    assert err.count("note: ") == 1 and ("note: the weights were trained as vit_tiny_cifar_cls and are read out as "
                                         "vit_tiny_cifar_rollout (pool rollout): a post-hoc readout") in err
    assert "(float32, batches of 16, " in out  # the summary (stdout) and results.json say it too
    assert out.startswith("vit_tiny_cifar_rollout (a post-hoc readout, not the trained model) on 20 images: ")
    assert json.loads((tmp_path / "a" / "results.json").read_text())["model"]["readout_note"] in err
    harness_eval.main(["--model", "vit_tiny_cifar_cls", "--checkpoint", str(checkpoint), "--dataset", SAMPLE,
                       "--output", str(tmp_path / "b"), *quick])
    out, err = capsys.readouterr()
    assert "note: " not in err and out.startswith("vit_tiny_cifar_cls on 20 images: ")
    assert json.loads((tmp_path / "b" / "results.json").read_text())["model"]["readout_note"] is None
    harness_eval.main(["--model", "vit_tiny_cifar_cls", "--checkpoint", str(checkpoint), "--dataset", SAMPLE,
                       "--output", str(tmp_path / "c"), "--pool", "avg", *quick])
    out, err = capsys.readouterr()
    assert "is read out with --pool avg: a post-hoc readout" in err and "(a post-hoc readout, not the" in out
