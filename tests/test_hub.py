"""Sharing runs on the Hub, all offline: local-dir:/hf-hub: round trips, the push with a fake Hub client,
the dry run, the model card and the one-line errors."""

import hashlib
import http.server
import json
import os
import runpy
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import ClassVar

import pytest
import timm
import torch
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError
from safetensors.torch import load_file

import timm_rollout
from harness import hub
from harness.compare import ORIGINAL_METRICS
from timm_rollout import online, set_pooling, train
from timm_rollout.cli import run_cli
from timm_rollout.data import normalize
from timm_rollout.errors import UserError
from timm_rollout.loading import load_model
from timm_rollout.pooling import RolloutPooling

ROOT = Path(__file__).resolve().parents[1]
PUSH = ROOT / "scripts" / "push_to_hub.py"
REPO = "org/vit-tiny-cifar10-rollout"
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.247, 0.2435, 0.2616)
METRICS = {
    "top1": 0.8125, "top5": 0.9875, "linear_probe": 0.775, "knn_loo": 0.7625, "knn_bank": None, "intra": 0.6125,
    "inter": 0.5375, "ratio": 0.8775, "silhouette": 0.1125, "ratio_original": 3.5, "rollout_effective_patches": 61.5,
    "rollout_cosine_to_mean": 0.9975,
}
# results.json as python -m harness.eval writes it (metrics, provenance sections); model.sha256 set per run
RESULTS = {
    "metrics": METRICS,
    "data": {"dataset": "/work/shared/data/cifar10", "split": "test", "num_images": 200},
    "config": {"seed": 0, "k": 7, "bank_k": 20, "temperature": 0.07},
}
TRAIN_ARGS = {
    "model": "vit_tiny_cifar_rollout", "dataset": "/work/shared/data/cifar10", "epochs": 3, "batch_size": 128,
    "opt": "adamw", "lr": 0.001, "weight_decay": 0.05, "sched": "cosine", "warmup_epochs": 1, "min_lr": 1e-05,
    "smoothing": 0.1, "mixup": 0.0, "cutmix": 0.0, "model_ema": False, "amp": "none", "seed": 0,
    "max_train_samples": None, "class_names": CLASSES, "num_classes": 10, "mean": list(MEAN), "std": list(STD),
    "train_images": 2000, "eval_images": 1000, "versions": {"torch": torch.__version__, "timm": timm.__version__},
}


def push_main():
    return runpy.run_path(str(PUSH))["main"]


def save_run(folder: Path, name: str, **kwargs) -> torch.nn.Module:
    """A training output folder as the training contract describes it (depth 2 to keep it fast)."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, depth=2, **kwargs).eval()
    timm.models.save_for_hf(model, folder, model_config=dict(label_names=CLASSES), safe_serialization=True,
                            data_config=dict(mean=MEAN, std=STD))
    (folder / "train_args.json").write_text(json.dumps({**TRAIN_ARGS, "model": name}))
    (folder / "summary.json").write_text(json.dumps({"eval_top1": 81.25, "eval_top5": 98.5, "epochs": 3}))
    (folder / "log.csv").write_text("epoch,train_loss,eval_loss,eval_top1,eval_top5,lr,img_per_s,seconds\n")
    (folder / "curves.png").write_bytes(b"\x89PNG")
    (folder / "last.safetensors").write_bytes(b"resume state")
    return model


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("runs") / "c10-rollout"
    return folder, save_run(folder, "vit_tiny_cifar_rollout")


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory, run) -> Path:
    folder = tmp_path_factory.mktemp("eval")
    sha = hashlib.sha256((run[0] / "model.safetensors").read_bytes()).hexdigest()
    (folder / "results.json").write_text(json.dumps({**RESULTS, "model": {"name": "local-dir:x", "sha256": sha}}))
    return folder


@pytest.mark.parametrize("name", ["vit_tiny_cifar_cls", "vit_tiny_cifar_rollout"])
def test_local_dir_round_trip(tmp_path, images, name):
    model = save_run(tmp_path, name)
    loaded = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    assert isinstance(loaded, timm_rollout.RolloutVisionTransformer) and len(loaded.blocks) == 2
    with torch.no_grad():
        assert torch.equal(loaded(images), model(images))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architecture"] == name and cfg["num_classes"] == 10 and cfg["label_names"] == CLASSES
    assert cfg["model_args"]["depth"] == 2 and cfg["model_args"]["num_classes"] == 10
    assert cfg["global_pool"] == ("rollout" if name.endswith("rollout") else "token")
    assert cfg["pretrained_cfg"]["input_size"] == [3, 32, 32]
    assert cfg["pretrained_cfg"]["mean"] == list(MEAN) and cfg["pretrained_cfg"]["std"] == list(STD)
    assert loaded.pretrained_cfg["label_names"] == CLASSES and tuple(loaded.pretrained_cfg["mean"]) == MEAN
    assert loaded.global_pool == model.global_pool


def populate_hub_cache(cache: Path, repo_id: str, files: list[Path]) -> None:
    """The Hugging Face cache layout: blobs by hash, snapshots/<commit>/ symlinks, refs/main -> commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in files:
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))


def test_hf_hub_from_offline_cache(tmp_path, run, images, monkeypatch):
    """What HF_HUB_OFFLINE=1 HF_HUB_CACHE=... do, set on the constants huggingface_hub reads at call time."""
    folder, model = run
    cache = tmp_path / "hub"
    populate_hub_cache(cache, REPO, [folder / "config.json", folder / "model.safetensors"])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    loaded = timm.create_model(f"hf-hub:{REPO}", pretrained=True).eval()
    harness_model, info = load_model(f"hf-hub:{REPO}")
    with torch.no_grad():
        want = model(images)
        assert torch.equal(loaded(images), want) and torch.equal(harness_model(images), want)
    assert loaded.pretrained_cfg["label_names"] == CLASSES and tuple(loaded.pretrained_cfg["mean"]) == MEAN
    assert loaded.pretrained_cfg["hf_hub_id"] == REPO and info["weights"].startswith(str(cache))

    with pytest.raises(UserError) as e:
        load_model("hf-hub:org/not-in-cache")
    assert str(e.value) == (
        "hf-hub:org/not-in-cache is not in the local Hugging Face cache and the Hub is unreachable (offline); "
        "download it where there is network or use local-dir:PATH"
    )
    with pytest.raises(LocalEntryNotFoundError):  # what timm itself raises
        timm.create_model("hf-hub:org/not-in-cache", pretrained=True)


def test_hf_hub_without_network_loads_from_cache_without_retries(tmp_path, run, images, monkeypatch):
    """HF_HUB_OFFLINE unset and no network: the failed probe makes the download use the cache only, at once."""
    import timm.models._hub as timm_hub

    folder, model = run
    cache = tmp_path / "hub"
    populate_hub_cache(cache, REPO, [folder / "config.json", folder / "model.safetensors"])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(online, "hub_reachable", lambda: False)
    offline_at_call = []
    real = timm_hub.download_from_hf

    def spy(*args, **kwargs):
        offline_at_call.append(constants.HF_HUB_OFFLINE)
        return real(*args, **kwargs)

    monkeypatch.setattr(timm_hub, "download_from_hf", spy)
    loaded, _ = load_model(f"hf-hub:{REPO}")
    with torch.no_grad():
        assert torch.equal(loaded(images), model(images))
    with pytest.raises(UserError, match="not in the local Hugging Face cache and the Hub is unreachable"):
        load_model("hf-hub:org/not-in-cache")
    assert offline_at_call == [True, True, True] and constants.HF_HUB_OFFLINE is False


class _Answer(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_hub_probe_answers_from_a_local_server_only(monkeypatch):
    """hub_reachable makes one request to the endpoint: True when something answers, False when nothing listens."""
    server = http.server.HTTPServer(("127.0.0.1", 0), _Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the probe itself, whatever the shell's HF_HUB_OFFLINE
    try:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        online.hub_reachable.cache_clear()
        assert online.hub_reachable()
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    online.hub_reachable.cache_clear()
    try:
        assert not online.hub_reachable()
    finally:
        online.hub_reachable.cache_clear()


class FakeHfApi:
    """Stands in for huggingface_hub.HfApi: records the repo creation and the uploaded folder's files."""

    calls: ClassVar[list] = []

    def __init__(self, token=None, **kwargs):
        self.token = token

    def create_repo(self, repo_id, private=False, exist_ok=False, **kwargs):
        self.calls.append(("create_repo", repo_id, private, exist_ok, self.token))
        return _RepoUrl(repo_id)

    def upload_folder(self, repo_id, folder_path, commit_message=None, delete_patterns=None, **kwargs):
        files = {p.name: p.read_bytes() for p in Path(folder_path).rglob("*") if p.is_file()}
        self.calls.append(("upload_folder", repo_id, files, commit_message, delete_patterns))


class _RepoUrl(str):
    def __new__(cls, repo_id):
        url = super().__new__(cls, f"https://huggingface.co/{repo_id}")
        url.repo_id = repo_id
        return url


@pytest.fixture
def fake_hub(monkeypatch):
    FakeHfApi.calls = []
    monkeypatch.setattr(hub, "HfApi", FakeHfApi)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(online, "hub_reachable", lambda: True)  # tests never touch the network
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    return FakeHfApi.calls


def test_push_uploads_exactly_the_model_and_card(tmp_path, run, eval_dir, fake_hub, monkeypatch, capsys):
    folder, _ = run
    push_main()([str(folder), "--repo-id", REPO, "--eval", str(eval_dir), "--private"])
    assert fake_hub[0] == ("create_repo", REPO, True, True, "hf_test_token")
    upload, repo_id, files, message, deleted = fake_hub[1]
    assert upload == "upload_folder" and repo_id == REPO and "vit_tiny_cifar_rollout" in message
    assert "*.bin" in deleted and "*.pth" in deleted  # stale pickles from earlier pushes go
    assert sorted(files) == ["README.md", "config.json", "model.safetensors"]
    assert files["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert files["config.json"] == (folder / "config.json").read_bytes()
    card = files["README.md"].decode()
    for key, definition in hub.METRIC_DEFINITIONS.items():
        if METRICS.get(key) is not None:  # the localisation metrics need object boxes: none here
            assert f"| {key} | {METRICS[key]} | {definition.format(k=7, bank_k=20, temperature=0.07)} |" in card
    assert "| knn_bank" not in card  # null in results.json: no row
    assert "| ratio_original" not in card  # the original study's mixed units stay off the card
    assert "| linear_probe | 0.775 | accuracy of a linear probe on the frozen features" in card
    assert "| intra | 0.6125 | mean over classes of the mean angle (radians)" in card
    assert "k-NN accuracy inside the evaluated set (cosine similarity, k = 7," in card
    assert "(data set cifar10, split test, images: 200)" in card
    assert "# Model card for vit-tiny-cifar10-rollout" in card
    assert card.index("import timm_rollout") < card.index(f'timm.create_model("hf-hub:{REPO}", pretrained=True)')
    assert "license: apache-2.0" in card and "datasets:\n- cifar10\n" in card
    assert "Quantifying Attention Flow in Transformers" in card and "2005.00928" in card and "Abnar" in card
    assert "  - opt: adamw\n  - lr: 0.001\n  - weight_decay: 0.05\n" in card and "  - seed: 0\n" in card
    assert "  - depth: 2\n  - num_heads: 4\n" in card and "Pooling:** rollout" in card
    n_params = sum(v.numel() for v in load_file(folder / "model.safetensors").values())
    assert f"Params (M):** {n_params / 1e6:.3f}" in card
    assert "uploaded README.md" in capsys.readouterr().out

    # the dry run writes the same folder and builds no Hub client at all
    monkeypatch.setattr(hub, "HfApi", None)
    dry = tmp_path / "dry"
    push_main()([str(folder), "--repo-id", REPO, "--eval", str(eval_dir), "--dry-run", "--output", str(dry)])
    assert {p.name: p.read_bytes() for p in dry.iterdir()} == files
    assert "nothing uploaded" in capsys.readouterr().out


def test_upload_folder_of_a_map_run_reloads_with_its_attention_pool(tmp_path, images):
    model = save_run(tmp_path / "run", "vit_tiny_cifar_cls", global_pool="map")
    files, arch = hub.write_upload_folder(tmp_path / "run", tmp_path / "up", "me/tiny-map")
    assert arch == "vit_tiny_cifar_cls" and [f.name for f in files] == ["README.md", "config.json", "model.safetensors"]
    loaded = timm.create_model(f"local-dir:{tmp_path / 'up'}", pretrained=True).eval()
    assert loaded.global_pool == "map" and type(loaded.attn_pool).__name__ == "AttentionPoolLatent"
    torch.testing.assert_close(loaded.attn_pool.latent, model.attn_pool.latent, rtol=0, atol=0)
    with torch.no_grad():
        assert torch.equal(loaded(images), model(images))
    assert "learned attention pooling" in (tmp_path / "up" / "README.md").read_text()


def test_card_tolerates_missing_optional_files():
    facts = hub.describe_model(timm.create_model("vit_tiny_cifar_cls", depth=1))
    text = hub.render_card(hub.model_card("me/tiny", facts), "me/tiny", {"metrics": {"top1": 0.5, "knn_loo": 0.25}})
    assert "| top1 | 0.5 |" in text and "| top5" not in text and "k = 5," in text  # flat results, default k
    assert "Training recipe" not in text and "datasets:" not in text and "Pooling:** token" in text
    assert hub.render_card(hub.model_card("me/tiny", facts), "me/tiny").count("## Evaluation") == 0


@pytest.mark.parametrize(("dataset", "resolved", "listed", "argument"), [
    ("cifar10", "uoft-cs/cifar10", "cifar10", "cifar10"),  # an alias of a Hub data set
    ("uoft-cs/cifar10", "uoft-cs/cifar10", "uoft-cs/cifar10", "uoft-cs/cifar10"),  # a Hub id
    ("{tmp}/cifar10", "{tmp}/cifar10", "cifar10", "cifar10"),  # a local copy named as the alias
    ("../cifar10-clutter16", "{tmp}/cifar10-clutter16", None, "PATH/cifar10-clutter16"),  # a data set of its own
    ("cifar10-clutter16", "{tmp}/cifar10-clutter16", None, "PATH/cifar10-clutter16"),  # named from where it trained
    ("cifar10-sample", None, None, "cifar10-sample"),  # the package's sample: no Hub data set, an alias anywhere
])
def test_card_lists_only_hub_data_sets_and_evaluates_on_the_training_data(dataset, resolved, listed, argument,
                                                                          tmp_path, monkeypatch):
    """The card's `datasets:` metadata names Hub data sets only, whatever directory training or the export ran in;
    its harness.eval line names the training data (a 64x64 clutter model cannot be evaluated on CIFAR-10)."""
    for name in ("cifar10", "cifar10-clutter16"):
        (tmp_path / name).mkdir()
    (tmp_path / "cifar10-clutter16" / "README.md").write_text("---\npretty_name: x\n---\n# cifar10 cluttered (16)\n")
    monkeypatch.chdir(tmp_path / "cifar10")  # the export runs elsewhere than training did
    facts = hub.describe_model(timm.create_model("vit_tiny_cifar_cls", depth=1))
    train_args = {"dataset": dataset.format(tmp=tmp_path),
                  **({"dataset_resolved": resolved.format(tmp=tmp_path)} if resolved else {})}
    text = hub.render_card(hub.model_card("me/tiny", facts, train_args), "me/tiny")
    assert (f"datasets:\n- {listed}\n" in text) if listed else ("datasets:" not in text)
    assert f"--model\nhf-hub:me/tiny --dataset {argument}`" in text
    if "clutter" in dataset:
        assert "a local data set folder, cifar10-clutter16 (cifar10 cluttered (16))" in text


@pytest.mark.parametrize(
    ("name", "kwargs", "pooling", "words"),
    [
        ("vit_tiny_cifar_cls", {}, "token", "the final [CLS] token"),
        ("vit_tiny_cifar_gap", {}, "avg", "the mean of the final patch tokens"),
        ("vit_tiny_cifar_rollout", {}, "rollout", "weighted by the [CLS] row of the attention rollout"),
        ("vit_tiny_cifar_rollout", {"rollout_grad": True}, "rollout", "rollout_grad=True"),
        ("vit_tiny_cifar_cls", {"global_pool": "map"}, "map", "one learned latent query attends"),
        ("vit_tiny_cifar_rollout", {"rollout_head_fusion": "max", "rollout_discard_ratio": 0.9}, "rollout",
         "rollout_head_fusion='max', rollout_discard_ratio=0.9"),
    ],
)
def test_card_names_each_study_arm(tmp_path, name, kwargs, pooling, words):
    """A saved run of every arm, reloaded as push_to_hub does: the card names its pooling, what it reads out (the
    final tokens normed before pooling, no fc_norm), and rollout's options."""
    save_run(tmp_path, name, **kwargs)
    facts = hub.describe_model(load_model(name, tmp_path)[0])
    grad = bool(kwargs.get("rollout_grad"))
    assert facts["pooling"] == pooling and facts["rollout_grad"] == grad
    assert facts["layout"]["norm_before_pool"] and not facts["layout"]["fc_norm"]
    card = hub.model_card("me/tiny", facts)
    line = card["details"]["Pooling"]
    assert line.startswith(f"{pooling}: ") and words in line and hub.POOLING_TEXT[pooling] in line
    assert ("rollout_grad=True" in line) == grad
    sharpened = "rollout_head_fusion" in kwargs
    options = ("max", 0.9) if sharpened else ("mean", 0.0)
    assert (facts["rollout_head_fusion"], facts["rollout_discard_ratio"]) == options
    assert ("rollout_head_fusion='max', rollout_discard_ratio=0.9" in line) == sharpened
    assert f"classifies from its {pooling} pooling" in card["description"]


def test_metric_definitions_cover_the_readme_metrics():
    """The card defines every metric of harness/README.md's table but the original study's (kept off the card)."""
    readme = (ROOT / "harness" / "README.md").read_text(encoding="utf-8").split("\n## Metrics\n")[1].split("\n## ")[0]
    keys = {k for line in readme.splitlines() if line.startswith("| `") for k in
            line.split("|")[1].replace("`", "").replace(" ", "").split(",")}
    assert set(hub.METRIC_DEFINITIONS) == keys - {*ORIGINAL_METRICS, "cosine_matrix"}
    assert "angle (radians)" in hub.METRIC_DEFINITIONS["intra"] and "angle (radians)" in hub.METRIC_DEFINITIONS["inter"]


def test_card_defines_the_localisation_metrics_of_each_map():
    metrics = {"top1": 0.5, "rollout_box_mass": 0.4, "gradient_rollout_pointing": 0.75, "pooling_object_mass": 0.3}
    rows = [line for line in hub._evaluation({"metrics": metrics}).splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[:2] for row in rows] == [["| top1", "0.5"], ["| pooling_object_mass", "0.3"],
                                                      ["| rollout_box_mass", "0.4"],
                                                      ["| gradient_rollout_pointing", "0.75"]]
    assert "share of the rollout map's mass on the object's box" in rows[2]
    assert "pointing game of the gradient_rollout map" in rows[3]
    masked = {"pooling_fill_mass": 0.4, "pooling_object_share": 0.7, "rollout_fill_mass": 0.3}
    rows = [line for line in hub._evaluation({"metrics": masked}).splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[0] for row in rows] == ["| pooling_fill_mass", "| pooling_object_share",
                                                     "| rollout_fill_mass"]  # each once: `pooling` is no map


def test_normalisation_mismatch_is_named():
    config = {"pretrained_cfg": {"mean": [0.5, 0.5, 0.5], "std": list(STD)}}
    assert hub.normalisation_mismatch(config, TRAIN_ARGS) == (
        f"config.json mean [0.5, 0.5, 0.5] differs from the training mean {list(MEAN)}"
    )
    assert hub.normalisation_mismatch({"pretrained_cfg": {"mean": list(MEAN), "std": list(STD)}}, TRAIN_ARGS) is None


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no_weights", "has no model.safetensors; pass a finished training output folder"),
        ("no_results", "has no results.json; run python -m harness.eval --output"),
        ("other_eval", "results.json evaluated other weights (sha256 0123456789ab...) than"),
        ("dry_no_output", "--dry-run needs --output DIR"),
        ("busy_output", "already holds other files (notes.txt); choose an empty --output"),
        ("offline", "HF_HUB_OFFLINE is set: unset it to upload, or use --dry-run --output DIR"),
        ("unreachable", "is unreachable; check the network, or use --dry-run --output DIR"),
        ("no_token", "no Hugging Face token: run `hf auth login` or set HF_TOKEN"),
        ("hub_fails", f"upload to {REPO} failed (ConnectionError: no route to host); check the network"),
    ],
)
def test_errors_are_one_line(tmp_path, run, eval_dir, fake_hub, monkeypatch, capsys, case, message):
    folder, _ = run
    argv = [str(folder), "--repo-id", REPO]
    if case == "no_weights":
        (tmp_path / "config.json").write_text("{}")
        argv[0] = str(tmp_path)
    elif case == "no_results":
        argv += ["--eval", str(tmp_path)]
    elif case == "other_eval":
        (tmp_path / "results.json").write_text(json.dumps({**RESULTS, "model": {"sha256": "0123456789abcdef"}}))
        argv += ["--eval", str(tmp_path)]
    elif case == "dry_no_output":
        argv += ["--dry-run"]
    elif case == "busy_output":
        (tmp_path / "notes.txt").write_text("mine")
        argv += ["--dry-run", "--output", str(tmp_path)]
    elif case == "offline":
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    elif case == "unreachable":
        monkeypatch.setattr(online, "hub_reachable", lambda: False)
    elif case == "no_token":
        monkeypatch.delenv("HF_TOKEN")
        monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    elif case == "hub_fails":
        def fail(self, *args, **kwargs):
            raise ConnectionError("no route to host")

        monkeypatch.setattr(FakeHfApi, "upload_folder", fail)
    with pytest.raises(SystemExit) as e:
        run_cli(push_main(), argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert err[-1].startswith("error: ") and message in err[-1]
    assert not [c for c in fake_hub if c[0] == "upload_folder"]


def test_card_labels_what_each_training_figure_measures(tmp_path):
    """summary.json's eval figures are on the split training evaluated (the test split here), and best_eval_top1
    is the best of them over the epochs: the card says so instead of a bare "eval"."""
    save_run(tmp_path / "run", "vit_tiny_cifar_cls")
    (tmp_path / "run" / "summary.json").write_text(json.dumps({"epochs": 3, "train_loss": 1.5, "eval_top1": 81.25,
                                                               "best_eval_top1": 82.5}))
    (tmp_path / "run" / "train_args.json").write_text(json.dumps({**TRAIN_ARGS, "eval_split": "test"}))
    hub.write_upload_folder(tmp_path / "run", tmp_path / "up", "me/tiny")
    card = (tmp_path / "up" / "README.md").read_text()
    head, section = card.split("- **Training summary (summary.json; ")[1].split(":**\n", 1)
    assert head == ("train_loss and eval_* of the last epoch, eval_* on the test split, top-1/top-5 in %; "
                    "best_eval_top1: the highest test-split top-1 of any epoch, picked on that split, so optimistic, "
                    "not a held-out figure)")
    assert section.split("\n- **")[0].splitlines() == ["  - epochs: 3", "  - train_loss: 1.5", "  - eval_top1: 81.25",
                                                        "  - best_eval_top1: 82.5"]


def test_card_states_how_the_run_was_picked(tmp_path):
    save_run(tmp_path / "run", "vit_tiny_cifar_cls")
    hub.write_upload_folder(tmp_path / "run", tmp_path / "up", "me/tiny", selection="seed 2 of seeds 0, 1, 2")
    assert "**Selection:** seed 2 of seeds 0, 1, 2" in (tmp_path / "up" / "README.md").read_text()
    hub.write_upload_folder(tmp_path / "run", tmp_path / "plain", "me/tiny")
    assert "Selection" not in (tmp_path / "plain" / "README.md").read_text()


# a stock timm ViT trained rollout-pooled, sharpened (max over heads, half the patch attention discarded); CPU, fp32
STOCK_ARGS = dict(img_size=32, patch_size=4, depth=2)
STOCK_TRAIN = ["--model", "vit_tiny_patch16_224", "--model-kwargs", *(f"{k}={v}" for k, v in STOCK_ARGS.items()),
               "--pool", "rollout", "--pool-kwargs", "head_fusion=max", "discard_ratio=0.5",
               "--dataset", "cifar10-sample", "--max-train-samples", "256", "--max-eval-samples", "64", "--epochs", "1",
               "--device", "cpu", "--amp", "none", "--workers", "1", "--no-progress"]


@pytest.fixture(scope="module")
def stock_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "stock-rollout"
    train.main([*STOCK_TRAIN, "--output", str(run)])
    return run


def trained_stock(run: Path) -> torch.nn.Module:
    """The trained model rebuilt by hand, without its config.json: the stock model the command built, the run's
    weights, and set_pooling with the options the command gave."""
    model = timm.create_model("vit_tiny_patch16_224", num_classes=10, **STOCK_ARGS).eval()
    model.load_state_dict(load_file(run / "model.safetensors"))
    return set_pooling(model, "rollout", head_fusion="max", discard_ratio=0.5)


def test_plain_timm_loading_of_a_stock_vit_trained_rollout_pooled_gives_the_trained_model(
        tmp_path, stock_run, images, monkeypatch):
    """timm.create_model on the run folder, its upload folder and the Hub copy of it (offline cache) gives the
    trained model's logits exactly, as load_model does: config.json names it as timm_rollout_pooled."""
    reference = trained_stock(stock_run)
    with torch.no_grad():
        want = reference(images)
        stock_pooled = set_pooling(trained_stock(stock_run), "token")(images)
    assert (want - stock_pooled).abs().max() > 0.05  # the pooling changes the logits: a stock reload would show
    hub.write_upload_folder(stock_run, tmp_path / "up", REPO)
    cache = tmp_path / "hub"
    populate_hub_cache(cache, REPO, [tmp_path / "up" / "config.json", tmp_path / "up" / "model.safetensors"])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    for name in (f"local-dir:{stock_run}", f"local-dir:{tmp_path / 'up'}", f"hf-hub:{REPO}"):
        model = timm.create_model(name, pretrained=True).eval()
        harness_model, info = load_model(name)
        with torch.no_grad():
            assert torch.equal(model(images), want) and torch.equal(harness_model(images), want)
        assert isinstance(model, RolloutPooling) and model.global_pool == info["global_pool"] == "rollout"
        assert (model.rollout_head_fusion, model.rollout_discard_ratio, model.rollout_grad) == ("max", 0.5, False)
        assert model.pretrained_cfg["input_size"] == (3, 32, 32) and model.pretrained_cfg["label_names"] == CLASSES
    config = json.loads((stock_run / "config.json").read_text())
    assert config["architecture"] == "timm_rollout_pooled" and config["global_pool"] == "rollout"
    assert {k: config["model_args"][k] for k in ("stock_architecture", "global_pool", "rollout_head_fusion",
                                                 "rollout_discard_ratio", "rollout_grad")} == {
        "stock_architecture": "vit_tiny_patch16_224", "global_pool": "token", "rollout_head_fusion": "max",
        "rollout_discard_ratio": 0.5, "rollout_grad": False}


def test_without_timm_rollout_timm_refuses_a_rollout_pooled_stock_vit(stock_run):
    """Plain timm (timm_rollout not imported) stops at the architecture it does not know instead of building the
    stock model with another pooling."""
    code = f"import sys, timm; timm.create_model({f'local-dir:{stock_run}'!r}, pretrained=True); " \
           "print('timm_rollout' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1] == "RuntimeError: Unknown model (timm_rollout_pooled)"


def _architecture(card: str) -> dict[str, str]:
    """The card's architecture facts, as timm's card generator lists them under **Architecture:**."""
    block = card.split("- **Architecture:**\n")[1].split("\n- **")[0]
    return dict(line.removeprefix("  - ").split(": ", 1) for line in block.splitlines())


def test_card_describes_the_stock_vit_that_was_trained(tmp_path, stock_run):
    """The card of a stock ViT states its own architecture, norm eps (1e-6 in timm's ViTs), parameter count and
    how timm loads it; nothing of the tiny study models."""
    model = trained_stock(stock_run)
    assert model.blocks[0].norm1.eps == 1e-6 and model.norm.eps == 1e-6
    hub.write_upload_folder(stock_run, tmp_path / "up", "me/stock")
    card = (tmp_path / "up" / "README.md").read_text()
    assert _architecture(card) == {"name": "vit_tiny_patch16_224", "timm class": "VisionTransformer",
                                   "patch_size": "(4, 4)", "embed_dim": "192", "depth": "2", "num_heads": "3",
                                   "mlp_hidden": "768", "block": "Block", "norm": "LayerNorm", "norm_eps": "1e-06",
                                   "activation": "GELU", "gelu_approximate": "none", "qkv_bias": "True",
                                   "num_prefix_tokens": "1", "num_reg_tokens": "0", "norm_before_pool": "True",
                                   "fc_norm": "False"}
    assert f"**Params (M):** {sum(p.numel() for p in model.parameters()) / 1e6:.3f}\n" in card
    assert card.count("vit_tiny_patch16_224 Vision Transformer") == 1 and "trained from random initialisation" in card
    assert "import timm_rollout  # registers timm_rollout_pooled: vit_tiny_patch16_224 pooled by rollout" in card
    assert "rollout_head_fusion='max', rollout_discard_ratio=0.5" in card
    for tiny in ("norm_eps: 1e-05", "one arm", "timm-rollout study", "vit_tiny_cifar"):
        assert tiny not in card


def test_card_of_a_stock_vit_with_a_timm_pooling_needs_no_timm_rollout(tmp_path, images):
    """A stock ViT pooled by timm's mean with the LayerNorm after pooling (fc_norm): plain timm rebuilds it."""
    model = save_run(tmp_path / "run", "vit_tiny_patch16_224", img_size=32, patch_size=4, global_pool="avg")
    assert model.fc_norm.eps == 1e-6 and isinstance(model.norm, torch.nn.Identity)
    hub.write_upload_folder(tmp_path / "run", tmp_path / "up", "me/stock-avg")
    card = (tmp_path / "up" / "README.md").read_text()
    layout = _architecture(card)
    assert (layout["norm"], layout["norm_eps"]) == ("LayerNorm", "1e-06")
    assert "import timm_rollout" not in card and "A plain timm" in card
    assert "**Pooling:** avg: the mean of the final patch tokens\n" in card
    assert (layout["norm_before_pool"], layout["fc_norm"]) == ("False", "True") and "one arm" not in card
    loaded = timm.create_model(f"local-dir:{tmp_path / 'up'}", pretrained=True).eval()
    with torch.no_grad():
        assert torch.equal(loaded(images), model(images))


def test_card_of_a_tiny_model_is_a_study_arm(tmp_path, run):
    hub.write_upload_folder(run[0], tmp_path / "up", "me/tiny")
    card = (tmp_path / "up" / "README.md").read_text()
    assert _architecture(card) == {"name": "vit_tiny_cifar_rollout", "timm class": "VisionTransformer",
                                   "patch_size": "(4, 4)", "embed_dim": "128", "depth": "2", "num_heads": "4",
                                   "mlp_hidden": "512", "block": "Block", "norm": "LayerNorm", "norm_eps": "1e-05",
                                   "activation": "GELU", "gelu_approximate": "none", "qkv_bias": "True",
                                   "num_prefix_tokens": "1", "num_reg_tokens": "0", "norm_before_pool": "True",
                                   "fc_norm": "False"}
    assert run[1].blocks[0].norm1.eps == 1e-5 and "It is one arm of the timm-rollout study" in card
    assert "timm knows `vit_tiny_cifar_cls` / `vit_tiny_cifar_gap` / `vit_tiny_cifar_rollout`" in card


# a stock ViT trained with a timm pooling unlike the one it was built with: timm's layout (fc_norm or the final norm)
# follows the build-time pooling, so the run must rebuild that layout, then pool as trained (CPU, fp32)
REPOOLED = {"avg-on-token": ("vit_tiny_patch16_224", {}, "avg"),
            "token-on-avg": ("deit_tiny_patch16_224", {"global_pool": "avg"}, "token")}


@pytest.mark.parametrize("case", REPOOLED)
def test_a_stock_vit_trained_with_another_timm_pooling_reloads_as_trained(tmp_path, images, case):
    """Plain timm (local-dir:), load_model (harness.eval) and the upload folder (push_to_hub.py) give the trained
    model's logits exactly: the trained model rebuilt by hand from the command's arguments and the run's weights."""
    arch, built_kwargs, pool = REPOOLED[case]
    run = tmp_path / "run"
    kwargs = [f"{k}={v}" for k, v in {**STOCK_ARGS, **built_kwargs}.items()]
    flags = [a for a in STOCK_TRAIN if a not in ("--pool-kwargs", "head_fusion=max", "discard_ratio=0.5")]
    flags[flags.index("vit_tiny_patch16_224")] = arch
    flags[flags.index("rollout")] = pool
    at = flags.index("--model-kwargs") + 1
    train.main([*flags[:at], *kwargs, *flags[at + len(STOCK_ARGS):], "--output", str(run)])
    reference = timm.create_model(arch, num_classes=10, **STOCK_ARGS, **built_kwargs).eval()
    reference.load_state_dict(load_file(run / "model.safetensors"))
    with torch.no_grad():
        as_built = reference(images)
        want = set_pooling(reference, pool)(images)
    assert (want - as_built).abs().max() > 0.01  # the pooling changes the logits: a reload as built would show
    hub.write_upload_folder(run, tmp_path / "up", "me/repooled")
    for name in (f"local-dir:{run}", f"local-dir:{tmp_path / 'up'}"):
        model = timm.create_model(name, pretrained=True).eval()
        with torch.no_grad():
            assert torch.equal(model(images), want) and torch.equal(load_model(name)[0](images), want)
        assert model.global_pool == pool and model.pretrained_cfg["input_size"] == (3, 32, 32)
    config = json.loads((run / "config.json").read_text())
    assert config["architecture"] == "timm_rollout_pooled" and {
        k: config["model_args"][k] for k in ("stock_architecture", "global_pool", "pool")} == {
        "stock_architecture": arch, "global_pool": built_kwargs.get("global_pool", "token"), "pool": pool}
    card = (tmp_path / "up" / "README.md").read_text()
    assert f"import timm_rollout  # registers timm_rollout_pooled: {arch} pooled by {pool}" in card


def test_a_stock_vit_run_describes_the_pixels_it_trained_on_and_its_card_snippet_scores_them(tmp_path, stock_run):
    """A stock ViT's config says crop_pct 1.0 and no ImageNet tag (training took the pixels as they are), so the
    card's snippet, run on a grayscale 32x32 PNG, feeds the model exactly what the harness scores: the image's
    pixels as RGB, normalised with the run's mean/std, with the trained model's probabilities (CPU, fp32)."""
    saved = json.loads((stock_run / "config.json").read_text())["pretrained_cfg"]
    assert saved["crop_pct"] == 1.0 and saved["crop_mode"] == "center" and "tag" not in saved
    assert saved["input_size"] == [3, 32, 32]
    hub.write_upload_folder(stock_run, tmp_path / "up", REPO)
    card = (tmp_path / "up" / "README.md").read_text()
    snippet = card.split("```python\n")[1].split("```")[0]
    assert 'img = Image.open("image.png").convert("RGB")' in snippet
    gray = torch.randint(0, 256, (32, 32), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    from PIL import Image
    Image.fromarray(gray.numpy(), mode="L").save(tmp_path / "image.png")
    scope: dict = {}
    code = snippet.replace(f"hf-hub:{REPO}", f"local-dir:{tmp_path / 'up'}").replace("image.png",
                                                                                    str(tmp_path / "image.png"))
    exec(code, scope)  # the card's own snippet, on local files
    pixels = normalize(gray.expand(1, 3, 32, 32), MEAN, STD)
    assert torch.equal(scope["transform"](scope["img"]).unsqueeze(0), pixels)
    with torch.no_grad():
        assert torch.equal(scope["probs"], trained_stock(stock_run)(pixels).softmax(-1))


@pytest.mark.parametrize(("fusion", "said", "not_said"), [("max", "rollout_head_fusion='max'", "'mean'"),
                                                          ("mean", "rollout_head_fusion='mean'", "'max'")])
def test_card_pooling_line_states_the_runs_head_fusion(tmp_path, fusion, said, not_said):
    save_run(tmp_path / "run", "vit_tiny_cifar_rollout", rollout_head_fusion=fusion)
    hub.write_upload_folder(tmp_path / "run", tmp_path / "up", "me/tiny")
    line = next(x for x in (tmp_path / "up" / "README.md").read_text().splitlines() if x.startswith("- **Pooling:**"))
    assert said in line and not_said not in line and "head-averaged" not in line


def test_card_recipe_gives_the_warmup_the_run_used(tmp_path):
    """--warmup-epochs 5 clipped to a 1-epoch run: train_args.json's warmup_epochs_used is the one stated."""
    save_run(tmp_path / "run", "vit_tiny_cifar_cls")
    args = json.loads((tmp_path / "run" / "train_args.json").read_text())
    (tmp_path / "run" / "train_args.json").write_text(json.dumps({**args, "warmup_epochs": 5,
                                                                  "warmup_epochs_used": 1}))
    hub.write_upload_folder(tmp_path / "run", tmp_path / "up", "me/tiny")
    card = (tmp_path / "up" / "README.md").read_text()
    assert "  - sched: cosine\n  - warmup_epochs: 1\n  - min_lr: 1e-05\n" in card and "warmup_epochs: 5" not in card
