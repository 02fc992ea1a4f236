"""Training on the shipped CIFAR-10 sample: accuracy, output folder contract, kill-and-resume, safety rails, DDP.

Every run pins ``--device cpu`` and its precision (fp32 unless precision is the point), so the numbers do not
depend on whether this CPU has native bf16 or the machine has a GPU; the CUDA path is in ``test_cuda.py``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import timm
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import timm_rollout
from timm_rollout.cli import run_cli
from timm_rollout.data import SAMPLE_DIR, balanced_indices, load_image_set, normalization_stats, normalize
from timm_rollout.errors import UserError
from timm_rollout.records import RESUME_FILE
from timm_rollout.train import build_parser, main, train
from timm_rollout.train.log import LOG_COLUMNS, OPTIONAL_COLUMNS, read_log

SAMPLE = "cifar10-sample"  # 2,000 train and 1,000 test images, shipped in the package
QUICK = ["--dataset", SAMPLE, "--max-train-samples", "2000", "--max-eval-samples", "1000", "--epochs", "2",
         "--batch-size", "64", "--lr", "2e-3", "--model-kwargs", "depth=2", "embed_dim=64", "--seed", "0",
         "--workers", "1", "--no-progress", "--device", "cpu", "--amp", "none"]
TINY = ["--dataset", SAMPLE, "--max-train-samples", "256", "--max-eval-samples", "100", "--batch-size", "32",
        "--model-kwargs", "depth=1", "embed_dim=64", "--workers", "1", "--no-progress", "--device", "cpu"]
FP32 = ["--amp", "none"]


TINY_RUN = [*TINY, *FP32, "--epochs", "3", "--lr", "2e-3"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """The uninterrupted fp32 reference for the resume and precision tests (3 epochs, 8 steps each)."""
    return train([*TINY_RUN, "--save-every", "3", "--output", str(tmp_path_factory.mktemp("tiny") / "run")])


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> Path:
    return train([*QUICK, "--save-every", "2", "--output", str(tmp_path_factory.mktemp("quick") / "run")])


def _metrics(rows: list[dict]) -> list[dict]:
    return [{k: r[k] for k in ("epoch", "train_loss", "eval_loss", "eval_top1", "eval_top5", "lr")} for r in rows]


def test_quick_run_learns_and_writes_the_output_contract(quick_run: Path) -> None:
    rows = read_log(quick_run / "log.csv")
    assert (quick_run / "log.csv").read_text().splitlines()[0] == ",".join([*LOG_COLUMNS, *OPTIONAL_COLUMNS])
    assert 1.0 <= rows[-1]["rollout_effective_patches"] <= 64.0 and rows[-1]["rollout_cosine_to_mean"] > 0.5
    assert [r["epoch"] for r in rows] == [1, 2]
    assert rows[-1]["eval_top1"] > 20.0  # chance is 10 %; 1,000 eval images give a standard error of ~1.4 %
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] < 2.31
    assert rows[0]["lr"] < rows[1]["lr"]  # warmup (5 epochs) is clipped to the 2-epoch run: still rising
    args = json.loads((quick_run / "train_args.json").read_text())
    assert args["warmup_epochs_used"] == 2 and args["num_classes"] == 10 and args["train_images"] == 2000
    assert args["class_names"][0] == "airplane" and args["versions"]["timm"] == timm.__version__
    assert args["amp_dtype"] == "float32" and args["steps_per_epoch"] == 31
    summary = json.loads((quick_run / "summary.json").read_text())
    assert summary["eval_top1"] == rows[-1]["eval_top1"] and summary["epochs"] == 2
    assert (quick_run / "curves.png").read_bytes()[:4] == b"\x89PNG"

    # The exported model rebuilds from config.json with the training mean/std and class names ...
    model = timm.create_model(f"local-dir:{quick_run}", pretrained=True).eval()
    assert model.num_classes == 10 and len(model.blocks) == 2 and model.global_pool == "rollout"
    assert list(model.pretrained_cfg["mean"]) == pytest.approx(args["mean"])
    assert list(model.pretrained_cfg["std"]) == pytest.approx(args["std"])
    assert model.pretrained_cfg.get("label_names", args["class_names"]) == args["class_names"]
    # ... and reproduces the logged accuracy through timm's own eval transform on the same 1,000 images.
    from timm_rollout.data import balanced_indices, load_image_set

    test = load_image_set(SAMPLE, "test")
    idx = balanced_indices(test.labels, total=1000, seed=0)
    mean = torch.tensor(model.pretrained_cfg["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(model.pretrained_cfg["std"]).view(1, 3, 1, 1)
    with torch.no_grad():
        pred = model((test.images[idx].float() / 255 - mean) / std).argmax(1)
    assert 100 * (pred == test.labels[idx]).float().mean().item() == pytest.approx(rows[-1]["eval_top1"], abs=0.11)
    # harness.eval of the same weights in the same precision (fp32) scores the same test images alike
    from harness import eval as harness_eval

    results = harness_eval.main(["--model", f"local-dir:{quick_run}", "--dataset", SAMPLE, "--heatmaps", "0",
                                 "--device", "cpu", "--amp", "none", "--output", str(quick_run.parent / "eval")])
    assert results["data"]["num_images"] == 1000
    assert 100 * results["metrics"]["top1"] == pytest.approx(rows[-1]["eval_top1"], abs=0.11)


def test_no_weight_decay_on_norms_biases_pos_embed_and_cls_token(quick_run: Path) -> None:
    model = timm.create_model("vit_tiny_cifar_rollout", num_classes=10, depth=2, embed_dim=64)
    names = [n for n, _ in model.named_parameters()]
    expect = {n for n, p in model.named_parameters() if p.ndim <= 1 or n in ("pos_embed", "cls_token")}
    assert {"pos_embed", "cls_token", "norm.weight", "head.bias", "blocks.0.attn.qkv.bias"} <= expect
    # The run's saved optimizer: the group without weight decay holds exactly that many parameters ...
    with safe_open(str(quick_run / RESUME_FILE), "pt") as f:
        groups = json.loads(f.metadata()["resume"])["optimizer"]["param_groups"]
    sizes = {g["weight_decay"]: len(g["params"]) for g in groups}
    assert sizes == {0.0: len(expect), 1e-4: len(names) - len(expect)}
    # ... and timm's factory, called as training calls it, puts exactly those names there.
    opt = timm.optim.create_optimizer_v2(model, opt="adamw", lr=5e-4, weight_decay=1e-4)
    by_id = {id(p): n for n, p in model.named_parameters()}
    no_decay = {by_id[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert no_decay == expect


def _same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_eval_pass_logs_the_pooling_diagnostics_of_the_rollout_weights_it_pooled_with(monkeypatch) -> None:
    import math

    import numpy as np

    from timm_rollout import attention_rollout, capture_attention
    from timm_rollout.train import validation as train_module

    monkeypatch.setattr(train_module, "EVAL_BATCH", 7)  # several batches, the last one short
    data = load_image_set("cifar10-sample", "test")
    images, labels = data.images[:20], data.labels[:20]
    mean, std = (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)
    d = train_module.Dist(0, 1, torch.device("cpu"))
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_cifar_rollout", num_classes=10, depth=2).eval()
    got = train_module.validate(model, images, labels, mean, std, d, None)
    # independent route: the full rollout matrix product of the captured attention, per image in float64
    cls = timm.create_model("vit_tiny_cifar_cls", num_classes=10, depth=2).eval()
    cls.load_state_dict(model.state_dict())
    with torch.no_grad(), capture_attention(cls) as cap:
        tokens = cls.forward_features(normalize(images, mean, std))[:, 1:].double().numpy()
    rows = attention_rollout(cap.attentions)[:, 0, 1:].double().numpy()
    patches, cosines = [], []
    for row, t in zip(rows, tokens, strict=True):
        w = row / row.sum()
        patches.append(math.exp(-sum(p * math.log(p) for p in w)))
        pooled, avg = w @ t, t.mean(axis=0)
        cosines.append(pooled @ avg / (np.linalg.norm(pooled) * np.linalg.norm(avg)))
    assert got["rollout_effective_patches"] == pytest.approx(np.mean(patches), rel=1e-5)
    assert got["rollout_cosine_to_mean"] == pytest.approx(np.mean(cosines), rel=1e-5)
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(normalize(images, mean, std)), labels).item()
    assert got["eval_loss"] == pytest.approx(loss, rel=1e-5)  # the same pass classifies
    assert set(train_module.validate(cls, images, labels, mean, std, d, None)) == {"eval_loss", "eval_top1",
                                                                                   "eval_top5"}


def test_log_keeps_optional_columns_of_some_rows_only(tmp_path: Path) -> None:
    from timm_rollout.train.log import write_log

    base = dict.fromkeys(LOG_COLUMNS, 1.0)
    rows = [{**base, "epoch": 1}, {**base, "epoch": 2, "rollout_effective_patches": 60.5}]  # epoch 1 from before
    write_log(tmp_path / "log.csv", rows)
    assert (tmp_path / "log.csv").read_text().splitlines()[0] == ",".join([*LOG_COLUMNS, "rollout_effective_patches"])
    back = read_log(tmp_path / "log.csv")
    assert "rollout_effective_patches" not in back[0] and back[1]["rollout_effective_patches"] == 60.5
    write_log(tmp_path / "plain.csv", rows[:1])
    assert (tmp_path / "plain.csv").read_text().splitlines()[0] == ",".join(LOG_COLUMNS)


def test_kill_and_resume_equals_uninterrupted_run(tiny_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "timm_rollout.train", *TINY_RUN, "--output", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (out / "log.csv").exists() and proc.poll() is None:  # written last, after the checkpoint
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert not (out / "summary.json").exists(), "the run finished before it could be killed"
    first = read_log(out / "log.csv")
    # Same seed, another process: the epochs written so far are identical to the uninterrupted run's.
    assert 1 <= len(first) < 3 and _metrics(first) == _metrics(read_log(tiny_run / "log.csv"))[:len(first)]
    with pytest.raises(UserError, match="unfinished run; add --resume"):
        train([*TINY_RUN, "--output", str(out)])
    with pytest.raises(UserError, match=r"--lr 0.1 differs from the saved run's 0.002"):
        train([*TINY_RUN, "--output", str(out), "--resume", "--lr", "0.1"])
    train([*TINY_RUN, "--output", str(out), "--resume"])
    assert _metrics(read_log(out / "log.csv")) == _metrics(read_log(tiny_run / "log.csv"))
    assert _same_weights(out, tiny_run)
    # Each process counted the epochs it trained, on whatever machine (here both on this CPU, in fp32).
    machines = json.loads((out / "summary.json").read_text())["machines"]
    assert sum(machines.values()) == 3 and all(m.startswith("CPU ") and m.endswith(", float32") for m in machines)


def test_a_second_process_training_into_a_run_is_refused(tmp_path: Path) -> None:
    """Another process holds the run folder's lock (as a process training into it does): a resume into it is
    refused in one line, writing nothing; once that process is gone (killed: the lock goes with it) the resume
    trains on. A refused fresh run leaves no folder."""
    from timm_rollout.train import resume

    out = tmp_path / "run"
    train([*TINY_RUN, "--epochs", "1", "--output", str(out)])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR)"
                               "; fcntl.lockf(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
                               str(out / resume.LOCK_FILE)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(UserError, match=f"another process is training into {out} .*train into another --output"):
            train([*TINY_RUN, "--output", str(out), "--resume"])
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    finally:
        holder.kill()
        holder.wait()
    train([*TINY_RUN, "--output", str(out), "--resume"])
    assert json.loads((out / "summary.json").read_text())["epochs"] == 3
    with pytest.raises(UserError, match="asked for 5 images but there are 10 classes"):
        train([*TINY_RUN, "--max-train-samples", "5", "--output", str(tmp_path / "new" / "a" / "b")])
    assert not (tmp_path / "new").exists()


def test_save_every_writes_less_and_resumes_exactly(tiny_run: Path, tmp_path: Path, monkeypatch) -> None:
    import timm_rollout.train.loop as train_module
    from timm_rollout.train import output

    plots, evals, evaluate = [], [], train_module.validate

    class Died(Exception):
        pass

    def crash_in_epoch_3(*args, **kwargs):
        """The real evaluation, until the third epoch's: then the run dies (epoch 3 trained, not saved)."""
        evals.append(1)
        if len(evals) == 3:
            raise Died
        return evaluate(*args, **kwargs)

    def plot(path, rows, title) -> None:
        plots.append(len(rows))

    monkeypatch.setattr(output, "plot_curves", plot)
    monkeypatch.setattr(train_module, "validate", crash_in_epoch_3)
    out = tmp_path / "run"
    with pytest.raises(Died):
        train([*TINY_RUN, "--save-every", "2", "--output", str(out)])
    # Epoch 1 wrote nothing, epoch 2 wrote everything, epoch 3 died before saving.
    assert plots == [2] and [r["epoch"] for r in read_log(out / "log.csv")] == [1, 2]
    with safe_open(str(out / RESUME_FILE), "pt") as f:
        assert json.loads(f.metadata()["resume"])["meta"]["epoch"] == 2
    monkeypatch.setattr(train_module, "validate", evaluate)
    train([*TINY_RUN, "--save-every", "2", "--output", str(out), "--resume"])
    assert plots == [2, 3]  # the last epoch is always saved
    assert _metrics(read_log(out / "log.csv")) == _metrics(read_log(tiny_run / "log.csv"))
    assert _same_weights(out, tiny_run)


def test_killed_between_the_last_epochs_writes_resume_publishes_them(tiny_run: Path, tmp_path: Path,
                                                                      monkeypatch) -> None:
    """Killed after the last epoch's resume state was written but before its export and log: --resume has nothing
    left to train and writes the export, log and curves of that state, equal to the uninterrupted run's."""
    import timm_rollout.train.output as train_module

    class Died(Exception):
        pass

    def die(*args, **kwargs):
        raise Died

    monkeypatch.setattr(train_module, "save_model", die)
    out = tmp_path / "run"
    with pytest.raises(Died):
        train([*TINY_RUN, "--save-every", "3", "--output", str(out)])
    assert (out / RESUME_FILE).exists() and not (out / "model.safetensors").exists()
    monkeypatch.undo()
    train([*TINY_RUN, "--save-every", "3", "--output", str(out), "--resume"])
    assert _metrics(read_log(out / "log.csv")) == _metrics(read_log(tiny_run / "log.csv"))
    assert _same_weights(out, tiny_run) and (out / "curves.png").exists() and (out / "summary.json").exists()


def test_bf16_autocast_on_cpu_is_recorded_and_learns_like_fp32(tiny_run: Path, tmp_path: Path) -> None:
    out = train([*TINY, "--epochs", "3", "--lr", "2e-3", "--amp", "bf16", "--save-every", "3",
                 "--output", str(tmp_path / "run")])
    assert json.loads((out / "train_args.json").read_text())["amp_dtype"] == "bfloat16"
    bf16, fp32 = read_log(out / "log.csv"), read_log(tiny_run / "log.csv")
    assert json.loads((tiny_run / "train_args.json").read_text())["amp_dtype"] == "float32"
    assert bf16[-1]["train_loss"] < bf16[0]["train_loss"]
    for a, b in zip(bf16, fp32, strict=True):  # bf16 rounding (3 significant digits) moves the losses only slightly
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=0.01)
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], abs=0.01)
    assert bf16[0]["train_loss"] != fp32[0]["train_loss"]  # ... but it did run in another precision


def test_finished_run_is_not_overwritten(quick_run: Path) -> None:
    before = (quick_run / "model.safetensors").read_bytes()
    with pytest.raises(UserError, match="finished run; pass --overwrite"):
        train([*QUICK, "--output", str(quick_run)])
    assert train([*QUICK, "--output", str(quick_run), "--resume"]) == quick_run  # finished: the same --epochs
    assert (quick_run / "model.safetensors").read_bytes() == before


def _cosine_lr(t: int, total: int, lr: float = 2e-3, min_lr: float = 5e-6) -> float:
    """timm's cosine schedule without warmup after ``t`` of ``total`` updates (by hand)."""
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * t / total))


def test_resume_with_more_epochs_trains_a_finished_run_further_on_the_new_schedule(tmp_path: Path, capsys) -> None:
    cosine = [*TINY_RUN, "--warmup-epochs", "0"]  # 8 updates per epoch; the logged lr is each epoch's last
    out = train([*cosine, "--epochs", "1", "--output", str(tmp_path / "run")])
    first = read_log(out / "log.csv")
    assert first[0]["lr"] == pytest.approx(_cosine_lr(7, 8), rel=1e-12)  # the 1-epoch schedule, near its end
    train([*cosine, "--epochs", "3", "--resume", "--output", str(out)])
    rows = read_log(out / "log.csv")
    assert [r["epoch"] for r in rows] == [1, 2, 3] and _metrics(rows[:1]) == _metrics(first)
    # Epochs 2 and 3 follow the 3-epoch cosine from update 8 on: the rate jumps back up at the resume point.
    assert [r["lr"] for r in rows[1:]] == pytest.approx([_cosine_lr(15, 24), _cosine_lr(23, 24)], rel=1e-12)
    assert rows[1]["lr"] > 3 * first[0]["lr"]
    record = json.loads((out / "train_args.json").read_text())
    assert record["epochs"] == 3 and record["extended"] == [{"at_epoch": 1, "epochs": 1, "warmup_epochs_used": 0}]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs"] == 3 and summary["eval_top1"] == rows[-1]["eval_top1"]
    assert sum(summary["machines"].values()) == 3

    before = (out / "model.safetensors").read_bytes()
    capsys.readouterr()
    train([*cosine, "--epochs", "3", "--resume", "--output", str(out)])  # the same count: nothing typed goes unused
    assert "holds a finished run of 3 epochs; pass a larger --epochs" in capsys.readouterr().out
    with pytest.raises(UserError, match=r"--lr 0.1 differs from the saved run's 0.002"):
        train([*cosine, "--epochs", "5", "--resume", "--lr", "0.1", "--output", str(out)])
    with pytest.raises(UserError, match=r"--epochs 2 differs from the saved run's 3"):
        train([*cosine, "--epochs", "2", "--resume", "--output", str(out)])
    (out / RESUME_FILE).unlink()  # as scripts/study.py leaves a finished run
    with pytest.raises(UserError, match=r"without its resume.safetensors .* cannot continue exactly"):
        train([*cosine, "--epochs", "5", "--resume", "--output", str(out)])
    assert (out / "model.safetensors").read_bytes() == before and len(read_log(out / "log.csv")) == 3


def test_training_further_restores_optimizer_and_ema_exactly(tmp_path: Path) -> None:
    """With a schedule that does not depend on the run length, 1 epoch then 2 more equals 3 epochs in one go."""
    run = [*TINY_RUN, "--sched", "constant", "--warmup-epochs", "0", "--model-ema", "--model-ema-decay", "0.9"]
    whole = train([*run, "--output", str(tmp_path / "whole")])
    out = train([*run, "--epochs", "1", "--output", str(tmp_path / "extended")])
    train([*run, "--resume", "--output", str(out)])
    assert _metrics(read_log(out / "log.csv")) == _metrics(read_log(whole / "log.csv"))
    assert _same_weights(out, whole)  # the exported EMA
    a, b = load_file(out / RESUME_FILE), load_file(whole / RESUME_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # model, EMA, Adam moments


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path: Path, monkeypatch) -> None:
    create = timm.create_model
    calls = {"train": 0}

    def poisoned(*args, **kwargs):
        """The real model, whose training forward returns NaN from the second epoch (8 steps each) on."""
        model = create(*args, **kwargs)

        def hook(module, inputs, output):
            if module.training:
                calls["train"] += 1
                if calls["train"] > 8:
                    return output * float("nan")
            return output

        model.register_forward_hook(hook)
        return model

    monkeypatch.setattr(timm, "create_model", poisoned)
    out = tmp_path / "run"
    with pytest.raises(UserError, match=r"loss is nan at epoch 2 step 1; the last good checkpoint \(epoch 1\) is kept"):
        train([*TINY, *FP32, "--epochs", "3", "--output", str(out)])
    assert [r["epoch"] for r in read_log(out / "log.csv")] == [1]
    assert not (out / "summary.json").exists()
    with safe_open(str(out / RESUME_FILE), "pt") as f:
        assert json.loads(f.metadata()["resume"])["meta"]["epoch"] == 1
    weights = load_file(out / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in weights.values())


def test_mixup_smoothing_and_ema_export_the_ema_weights(tmp_path: Path) -> None:
    out = train([*TINY, *FP32, "--epochs", "1", "--mixup", "0.8", "--cutmix", "1.0", "--smoothing", "0.1",
                 "--model-ema", "--model-ema-decay", "0.9", "--output", str(tmp_path / "run")])
    rows = read_log(out / "log.csv")
    assert len(rows) == 1 and 0 < rows[0]["train_loss"] < 10
    exported = load_file(out / "model.safetensors")
    state = load_file(out / RESUME_FILE)
    assert all(torch.equal(exported[k], state[f"ema.{k}"]) for k in exported)
    assert not torch.equal(exported["head.weight"], state["model.head.weight"])


def test_model_ema_decay_without_model_ema_is_refused_at_parse_time(tmp_path: Path, capsys) -> None:
    """A typed flag is used or refused, never ignored: the decay of an EMA that is not kept is a one-line error,
    exit 2, before anything is loaded or written."""
    with pytest.raises(SystemExit) as exit_:
        run_cli(main, [*TINY, "--model-ema-decay", "0.99", "--output", str(tmp_path / "run")])
    assert exit_.value.code == 2 and not (tmp_path / "run").exists()
    assert capsys.readouterr().err.splitlines() == ["error: --model-ema-decay only applies with --model-ema; "
                                                    "add --model-ema or drop --model-ema-decay"]
    assert build_parser().parse_args(["--model-ema", "--model-ema-decay", "0.99", "--output", "x"]).model_ema_decay \
        == 0.99


def test_ddp_two_cpu_processes(tmp_path: Path) -> None:
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "timm_rollout.train", *TINY, *FP32, "--epochs", "1", "--output", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    args = json.loads((out / "train_args.json").read_text())
    assert args["world_size"] == 2 and args["steps_per_epoch"] == 4  # 256 images / (32 per rank x 2 ranks)
    rows = read_log(out / "log.csv")
    assert len(rows) == 1 and rows[0]["train_loss"] > 0
    assert (out / "summary.json").exists()
    model = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    assert isinstance(model, timm_rollout.RolloutVisionTransformer)
    # The logged evaluation (each rank takes every other image, sums all-reduced) equals a plain one-process loop
    # over the same 100 balanced test images.
    test = load_image_set(SAMPLE, "test")
    test = test.subset(balanced_indices(test.labels, total=100, seed=0))
    mean, std = normalization_stats(SAMPLE, load_image_set(SAMPLE, "train"))
    with torch.no_grad():
        logits = torch.cat([model(normalize(test.images[i:i + 1], mean, std)) for i in range(len(test.labels))])
    top1 = 100 * sum(int(logits[i].argmax()) == int(test.labels[i]) for i in range(len(test.labels))) / 100
    loss = torch.nn.functional.cross_entropy(logits, test.labels).item()
    assert rows[0]["eval_top1"] == pytest.approx(top1, abs=1e-9)
    assert rows[0]["eval_loss"] == pytest.approx(loss, rel=1e-4)


def test_fp32_on_cuda_is_ieee_fp32_and_recorded() -> None:
    """exact_fp32 turns TF32 off for matrix products and cuDNN convolutions (PyTorch's flags exist on any build);
    fp32_precision reports what is in effect on CUDA and nothing on a CPU."""
    from timm_rollout import device

    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = matmul.fp32_precision, conv.fp32_precision
    try:
        matmul.fp32_precision, conv.fp32_precision = "ieee", "tf32"  # PyTorch's default for convolutions
        cuda = torch.device("cuda")
        assert device.fp32_precision(cuda) == "tf32" and device.fp32_precision(torch.device("cpu")) is None
        device.exact_fp32()
        assert matmul.fp32_precision == conv.fp32_precision == "ieee" and device.fp32_precision(cuda) == "ieee"
    finally:
        matmul.fp32_precision, conv.fp32_precision = before


def test_resolve_amp_on_cpus_with_and_without_native_bf16(monkeypatch) -> None:
    from timm_rollout import device

    cpu = torch.device("cpu")
    for native, auto in ((True, torch.bfloat16), (False, None)):  # emulated bf16 is far slower than fp32
        monkeypatch.setattr(device, "cpu_supports_bf16", lambda native=native: native)
        assert device.resolve_amp("auto", cpu) is auto
        assert device.resolve_amp("none", cpu) is None
        assert device.resolve_amp("bf16", cpu) is torch.bfloat16  # asked for: honoured either way
        assert device.resolve_amp("fp16", cpu) is torch.float16


def test_resolve_amp_on_gpus_follows_compute_capability_not_is_bf16_supported(monkeypatch) -> None:
    from timm_rollout import device

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # true on T4/V100 (emulated)
    for capability, auto in (((7, 0), torch.float16), ((7, 5), torch.float16), ((8, 0), torch.bfloat16),
                             ((9, 0), torch.bfloat16)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert device.resolve_amp("auto", torch.device("cuda")) is auto, capability
        assert device.resolve_amp("bf16", torch.device("cuda")) is torch.bfloat16


def test_inference_batch_size_by_device() -> None:
    from timm_rollout.device import inference_batch_size

    assert inference_batch_size(torch.device("cpu")) == 128  # cache-sized batches are faster on a CPU
    assert inference_batch_size(torch.device("cuda", 1)) == 512


def test_a_missing_gpu_is_a_user_error(monkeypatch) -> None:
    from timm_rollout.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(UserError, match="--device cuda: cuda is not available on this machine"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(UserError, match=r"--device cuda:1: cuda:1 does not exist: this machine has 1 cuda device\(s\)"):
        resolve_device("cuda:1")
    with pytest.raises(UserError, match="unknown device 'gpu'"):
        resolve_device("gpu")


@pytest.mark.slow  # torch.compile: 3-4 minutes on a 2-core CPU (inductor builds C++ kernels for both graphs)
def test_compile_gives_the_eager_results_on_cpu(tmp_path: Path) -> None:
    no_dropout = ["pos_drop_rate=0", "attn_drop_rate=0", "proj_drop_rate=0"]  # compiled masks: another stream
    run = [*TINY, *FP32, "--epochs", "1", "--model-kwargs", "depth=1", "embed_dim=64", *no_dropout]
    eager = read_log(train([*run, "--output", str(tmp_path / "eager")]) / "log.csv")
    compiled = read_log(train([*run, "--compile", "--output", str(tmp_path / "compiled")]) / "log.csv")
    for key, tol in (("train_loss", 1e-3), ("eval_loss", 1e-3), ("eval_top1", 1.0)):
        assert compiled[0][key] == pytest.approx(eager[0][key], abs=tol), key


def test_several_seeds_in_one_command_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"--seed 0 1: one seed per run; train several as separate processes"):
        train([*TINY, "--seed", "0", "1", "--output", str(tmp_path / "run")])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_attention_dropout_trains_on_the_explicit_path_on_every_device(device: str) -> None:
    """Fused attention draws its dropout masks inside the kernel: with attention dropout every model trains on
    timm's explicit path, its masks drawn by its own dropout module; without it, GPUs keep fused attention. Only the
    model is built (no tensor is moved to the device)."""
    from types import SimpleNamespace

    from timm_rollout.train.setup import build_model as _create_model

    data = SimpleNamespace(num_classes=10, train=SimpleNamespace(images=torch.zeros(1, 3, 32, 32, dtype=torch.uint8)))
    for rate, fused_on_gpu in (("0.1", False), ("0", True)):
        args = build_parser().parse_args(["--model", "vit_tiny_cifar_gap", "--dataset", "cifar10-sample", "--output",
                                          "unused", "--model-kwargs", "depth=2", f"attn_drop_rate={rate}"])
        model = _create_model(args, data, torch.device(device))
        flags = {block.attn.fused_attn for block in model.blocks}
        assert flags == {fused_on_gpu and device == "cuda"}


def test_typed_mean_and_std_normalise_training_evaluation_and_export(tmp_path: Path) -> None:
    """--mean/--std replace the data set's statistics everywhere: the data set's own values typed give the default
    run bit for bit, other values train other weights, and the logged evaluation is the exported model's on images
    normalised by hand with the typed values (not with the data set's); a resume cannot change them."""
    base = [*TINY, *FP32, "--epochs", "1"]
    default = train([*base, "--output", str(tmp_path / "default")])
    own = normalization_stats(SAMPLE, load_image_set(SAMPLE, "train"))
    same = train([*base, "--mean", *map(str, own[0]), "--std", *map(str, own[1]), "--output", str(tmp_path / "same")])
    weights = load_file(default / "model.safetensors")
    assert weights.keys() == load_file(same / "model.safetensors").keys()
    assert all(torch.equal(weights[k], v) for k, v in load_file(same / "model.safetensors").items())
    mean, std = (0.2, 0.3, 0.4), (0.5, 0.25, 0.125)
    typed = ["--mean", "0.2", "0.3", "0.4", "--std", "0.5", "0.25", "0.125"]
    assert build_parser().parse_args(["--output", "x", "--std", "0.5"]).std == [0.5] * 3  # one for all, as timm
    run = train([*base, *typed, "--output", str(tmp_path / "typed")])
    assert not torch.equal(weights["patch_embed.proj.weight"],
                           load_file(run / "model.safetensors")["patch_embed.proj.weight"])
    args = json.loads((run / "train_args.json").read_text())
    assert tuple(args["mean"]) == mean and tuple(args["std"]) == std
    model = timm.create_model(f"local-dir:{run}", pretrained=True).eval()
    assert tuple(model.pretrained_cfg["mean"]) == mean and tuple(model.pretrained_cfg["std"]) == std
    test = load_image_set(SAMPLE, "test")
    idx = balanced_indices(test.labels, total=100, seed=0)  # the run's --max-eval-samples subset
    images, labels = test.images[idx], test.labels[idx]
    losses = {}
    for name, (m, s) in {"typed": (mean, std), "own": own}.items():
        x = (images.double() / 255 - torch.tensor(m).view(1, 3, 1, 1)) / torch.tensor(s).view(1, 3, 1, 1)
        with torch.no_grad():
            losses[name] = torch.nn.functional.cross_entropy(model(x.float()), labels).item()
    logged = read_log(run / "log.csv")[-1]["eval_loss"]
    assert logged == pytest.approx(losses["typed"], rel=1e-5) and abs(logged - losses["own"]) > 1e-3
    with pytest.raises(UserError, match=r"--mean 0\.1 0\.3 0\.4 differs from the saved run's 0\.2 0\.3 0\.4;"):
        train([*base, "--epochs", "2", "--resume", "--mean", "0.1", "0.3", "0.4", "--output", str(run)])


def test_a_non_finite_loss_stops_the_run_naming_the_fixes_that_apply(tmp_path: Path) -> None:
    """A loss that turns NaN/inf stops the run before anything is saved; the message offers only the fixes this
    run can still make: not --amp none to an fp32 run, nor --clip-grad to one that clips; --std where it is tiny."""
    from timm_rollout.train.loop import NonFiniteLossError

    base = [*TINY, *FP32, "--epochs", "1", "--clip-grad", "1.0"]
    fixes = r"step 1; no checkpoint was written in .*run; lower --lr or raise --std \(now 1e-30 1e-30 1e-30\) in "
    with pytest.raises(NonFiniteLossError, match=fixes + "a new --output$"):
        train([*base, "--std", "1e-30", "--output", str(tmp_path / "run")])
    assert not (tmp_path / "run" / "model.safetensors").exists()
    bf16_fixes = r"; lower --lr, add --clip-grad 1\.0 or use --amp none in a new --output$"
    with pytest.raises(NonFiniteLossError, match=bf16_fixes):
        train([*TINY, "--amp", "bf16", "--epochs", "1", "--lr", "1e30", "--output", str(tmp_path / "bf16")])


@pytest.mark.parametrize("source", ["run folder", "its weights file", "a bare weights file"])
def test_fine_tuning_normalises_as_the_pretrained_run_did(source: str, tmp_path: Path) -> None:
    """--pretrained-file of a run, as its folder or its weights file: the data are normalised with the run's own
    mean/std (its config.json), a bare file with the registered model's; a size mismatch names the run's patch."""
    import shutil

    from timm_rollout.checkpoint import save_model
    from timm_rollout.models import CIFAR100_MEAN

    mean, std = (0.1, 0.2, 0.3), (0.4, 0.5, 0.6)
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_cifar_cls", num_classes=10, depth=1, embed_dim=64, patch_size=8)
    save_model(tmp_path / "src", model, [f"c{i}" for i in range(10)], mean, std)
    shutil.copy(tmp_path / "src" / "model.safetensors", tmp_path / "bare.safetensors")
    path = {"run folder": tmp_path / "src", "its weights file": tmp_path / "src" / "model.safetensors",
            "a bare weights file": tmp_path / "bare.safetensors"}[source]
    args = [*TINY[:TINY.index("--model-kwargs")], "--workers", "1", "--no-progress", "--device", "cpu", *FP32,
            "--epochs", "1", "--pretrained-file", str(path), "--model-kwargs", "depth=1", "embed_dim=64"]
    if source != "a bare weights file":
        fix = r"takes 16x16; pass --model-kwargs img_size=32 patch_size=8 \(the pretrained weights' patch size\)$"
        with pytest.raises(UserError, match=fix):
            train([*args, "img_size=16", "--output", str(tmp_path / "refused")])
    run = train([*args, "patch_size=8", "--output", str(tmp_path / "run")])
    saved = json.loads((run / "config.json").read_text())["pretrained_cfg"]
    want = (mean, std) if source != "a bare weights file" else (CIFAR100_MEAN, timm_rollout.models.CIFAR100_STD)
    assert tuple(saved["mean"]) == pytest.approx(want[0]) and tuple(saved["std"]) == pytest.approx(want[1])


def test_a_local_dir_model_without_pretrained_file_says_it_starts_from_random_weights(tmp_path: Path, capsys) -> None:
    """timm builds local-dir:/hf-hub: names with fresh weights unless pretrained=True; training says so."""
    from timm_rollout.checkpoint import save_model

    save_model(tmp_path / "src", timm.create_model("vit_tiny_cifar_cls", num_classes=10, depth=1, embed_dim=64),
               [f"c{i}" for i in range(10)], (0.5,) * 3, (0.25,) * 3)
    args = [*TINY[:TINY.index("--model-kwargs")], "--workers", "1", "--no-progress", "--device", "cpu", *FP32,
            "--epochs", "1", "--model", f"local-dir:{tmp_path / 'src'}"]
    train([*args, "--output", str(tmp_path / "scratch")])
    assert "its architecture with fresh random weights" in capsys.readouterr().err
    train([*args, "--pretrained-file", str(tmp_path / "src"), "--output", str(tmp_path / "tuned")])
    assert "fresh random weights" not in capsys.readouterr().err


def test_the_machine_record_names_compilation_and_processes() -> None:
    """summary.json's machines tell epochs compiled (and in which mode) from eager ones on the same device."""
    from types import SimpleNamespace

    from timm_rollout.train import output as train_module

    d, data = SimpleNamespace(device=torch.device("cpu"), world=1), SimpleNamespace(amp_dtype=None)
    eager = train_module.machine_label(d, data, SimpleNamespace(compile=False, compile_mode="default"))
    compiled = train_module.machine_label(d, data,
                                     SimpleNamespace(compile=True, compile_mode="reduce-overhead"))
    assert eager.startswith("CPU ") and eager.endswith(", float32")
    assert compiled == f"{eager}, torch.compile mode reduce-overhead"
    two = train_module.machine_label(SimpleNamespace(device=d.device, world=2), data,
                                SimpleNamespace(compile=False, compile_mode="default"))
    assert two == f"{eager}, 2 processes"


def test_resume_state_keeps_tensors_in_param_groups(tmp_path: Path) -> None:
    """timm's LAMB keeps its step count as a tensor in the param group: the resume state stores it as a tensor (it
    used to fail the first save), and the restored optimizer takes the next step exactly as the uninterrupted one."""
    from timm.optim import create_optimizer_v2

    from timm_rollout.checkpoint import load_resume, save_resume

    def make():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        return model, create_optimizer_v2(model, "lamb", lr=1e-2, weight_decay=0.05)

    def step(model, opt, seed):
        opt.zero_grad()
        model(torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))).square().sum().backward()
        opt.step()

    model, opt = make()
    for seed in (1, 2):
        step(model, opt, seed)
    save_resume(tmp_path / "r.safetensors", model=model, optimizer=opt, meta={"epoch": 2})
    step(model, opt, 3)
    model2, opt2 = make()
    assert load_resume(tmp_path / "r.safetensors", model=model2, optimizer=opt2) == {"epoch": 2}
    assert torch.equal(opt2.param_groups[0]["step"], torch.tensor(2.0))
    step(model2, opt2, 3)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_native_bf16_is_read_from_the_cpu_flags_not_onednn(tmp_path: Path) -> None:
    """Hand-made /proc/cpuinfo files: plain AVX512 (oneDNN's check says bf16 there; it runs emulated, at half
    fp32's speed) is not native; AVX512-BF16, AMX-BF16 and Arm's BF16 are; an unreadable file means fp32."""
    from timm_rollout.device import cpu_supports_bf16

    cases = {"flags\t\t: fpu sse avx2 avx512f avx512bw avx512vl avx512_vnni\n": False,
             "flags\t\t: fpu avx2 avx512f avx512_bf16\n": True,
             "flags\t\t: fpu avx512f amx_tile amx_bf16 amx_int8\n": True,
             "Features\t: fp asimd sve bf16 i8mm\n": True,
             "model name\t: bf16 in a name is no flag\nflags\t\t: fpu avx2\n": False}
    for i, (text, native) in enumerate(cases.items()):
        (tmp_path / f"cpuinfo{i}").write_text(f"processor\t: 0\n{text}\n")
        assert cpu_supports_bf16(tmp_path / f"cpuinfo{i}") is native, text
    assert cpu_supports_bf16(tmp_path / "missing") is False


def _sample_copy(folder: Path, column: str | None = None, changed: Callable[[int, Any], Any] | None = None) -> Path:
    """A copy of the shipped sample (data card included) at ``folder``; ``changed(i, value)`` rewrites ``column``
    of its train split with pyarrow, schema kept, so datasets' fingerprint of the copy stays the original's."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    shutil.copytree(SAMPLE_DIR, folder)
    if changed is not None:
        table = pq.read_table(folder / "train.parquet")
        at = table.schema.get_field_index(column)
        values = [changed(i, v) for i, v in enumerate(table.column(column).to_pylist())]
        table = table.set_column(at, table.schema.field(at), pa.array(values, type=table.schema.field(at).type))
        pq.write_table(table, folder / "train.parquet")
    return folder


def test_a_resumed_run_reads_the_images_it_trained_on(tmp_path: Path, monkeypatch) -> None:
    """A relative --dataset is read from the current folder when a run resumes: a copy of the same files there
    continues the run; a folder of the same name, data card and datasets fingerprint with one pixel changed is
    refused before anything is written; one whose images outside the run's subset changed (other statistics)
    continues it normalised as it trained, exactly as the copy does."""
    import hashlib
    import io
    import shutil

    import numpy as np
    from PIL import Image

    _sample_copy(tmp_path / "a" / "data")
    _sample_copy(tmp_path / "b" / "data")
    drawn = balanced_indices(load_image_set(SAMPLE, "train").labels, total=256, seed=0)
    subset = set(drawn.tolist())

    def png(image: Image.Image) -> dict:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return {"bytes": buf.getvalue(), "path": None}

    def one_pixel_off(i: int, img: dict) -> dict:  # one value of one image the run trains on, +1
        if i != drawn[0]:
            return img
        pixels = np.array(Image.open(io.BytesIO(img["bytes"])).convert("RGB"))
        pixels[0, 0, 0] ^= 1
        return png(Image.fromarray(pixels))

    _sample_copy(tmp_path / "c" / "data", "img", one_pixel_off)
    white = png(Image.new("RGB", (32, 32), (255, 255, 255)))
    _sample_copy(tmp_path / "d" / "data", "img", lambda i, img: img if i in subset else white)  # the run's kept
    out = tmp_path / "run"
    run = [arg if arg != SAMPLE else "data" for arg in TINY_RUN]
    monkeypatch.chdir(tmp_path / "a")
    train([*run, "--epochs", "1", "--output", str(out)])
    record = json.loads((out / "train_args.json").read_text())
    used = load_image_set(str(tmp_path / "a" / "data"), "train")
    used = used.subset(balanced_indices(used.labels, total=256, seed=0))
    by_hand = hashlib.sha256(used.images.numpy().tobytes() + used.labels.numpy().astype("int64").tobytes())
    assert record["content"]["train"] == by_hand.hexdigest()

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.chdir(tmp_path / "c")
    with pytest.raises(UserError, match=r"--dataset data \(.*/c/data\) gives other train images \(train\) than"):
        train([*run, "--epochs", "2", "--resume", "--output", str(out)])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    shutil.copytree(out, tmp_path / "twin")
    monkeypatch.chdir(tmp_path / "b")
    train([*run, "--epochs", "2", "--resume", "--output", str(out)])
    assert [r["epoch"] for r in read_log(out / "log.csv")] == [1, 2]
    # Its own images among others: other statistics, but the run goes on normalised as it trained, as from b.
    monkeypatch.chdir(tmp_path / "d")
    assert load_image_set("data", "train").subset(drawn).content == record["content"]["train"]  # the same subset
    assert normalization_stats("data", load_image_set("data", "train"))[0] != tuple(record["mean"])
    train([*run, "--epochs", "2", "--resume", "--output", str(tmp_path / "twin")])
    assert load_file(tmp_path / "twin" / "model.safetensors").keys() == load_file(out / "model.safetensors").keys()
    assert all(torch.equal(v, load_file(out / "model.safetensors")[k])
               for k, v in load_file(tmp_path / "twin" / "model.safetensors").items())


def test_two_local_folders_of_one_name_and_card_load_their_own_images(tmp_path: Path) -> None:
    """datasets caches a local folder under its name and data card: a second folder of that name, the first one
    written again (even with its old modification time put back), or a file in a linked folder its card names,
    must still load their own images (labels read back with pyarrow, datasets aside)."""
    import hashlib
    import shutil

    import pyarrow.parquet as pq

    def labels(parquet: Path) -> list[int]:
        return pq.read_table(parquet).column("label").to_pylist()

    first = labels(SAMPLE_DIR / "train.parquet")[:2]
    flipped = _sample_copy(tmp_path / "x" / "data", "label", lambda i, label: first[1 - i] if i < 2 else label)
    plain = _sample_copy(tmp_path / "y" / "data", "label", lambda i, label: label)  # the same writer
    assert labels(plain / "train.parquet") != labels(flipped / "train.parquet")
    assert (plain / "train.parquet").stat().st_size == (flipped / "train.parquet").stat().st_size
    for folder in (plain, flipped):
        assert load_image_set(str(folder), "train").labels.tolist() == labels(folder / "train.parquet")
    before = (plain / "train.parquet").stat()
    shutil.copyfile(flipped / "train.parquet", plain / "train.parquet")  # written again: same size and inode
    os.utime(plain / "train.parquet", ns=(before.st_atime_ns, before.st_mtime_ns))
    assert load_image_set(str(plain), "train").labels.tolist() == labels(flipped / "train.parquet")
    import datasets

    place = hashlib.sha256(str(plain.resolve()).encode()).hexdigest()[:16]  # the earlier files' caches are gone
    cache = Path(datasets.config.HF_DATASETS_CACHE)
    assert len([p for p in (cache / "timm_rollout_local" / place).iterdir() if p.name != "source"]) == 1
    assert len(list((cache / "timm_rollout_decoded").glob(f"*-{place}-*"))) == 1

    linked = tmp_path / "z" / "data"  # a user's card names split/train.parquet; split/ links to a folder elsewhere
    _sample_copy(linked)
    (tmp_path / "elsewhere").mkdir()
    (linked / "train.parquet").rename(tmp_path / "elsewhere" / "train.parquet")
    (linked / "split").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (linked / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                                      "    path: split/train.parquet\n  - split: test\n    path: test.parquet\n---\n")
    assert load_image_set(str(linked), "train").labels.tolist() == labels(SAMPLE_DIR / "train.parquet")
    shutil.copy(flipped / "train.parquet", tmp_path / "elsewhere" / "train.parquet.new")
    (tmp_path / "elsewhere" / "train.parquet.new").replace(tmp_path / "elsewhere" / "train.parquet")
    assert load_image_set(str(linked), "train").labels.tolist() == labels(flipped / "train.parquet")
    gone = hashlib.sha256(str(flipped.resolve()).encode()).hexdigest()[:16]
    assert (cache / "timm_rollout_local" / gone).is_dir()
    shutil.rmtree(flipped)  # a folder that no longer exists: its caches go at the next load of any folder
    load_image_set(str(plain), "train")
    assert not (cache / "timm_rollout_local" / gone).exists()
    assert not list((cache / "timm_rollout_decoded").glob(f"*-{gone}-*"))


def test_a_refused_overwrite_writes_nothing(tmp_path: Path) -> None:
    """A refused --overwrite leaves the old run as it was (its files go only when the new run begins)."""
    train([*TINY, *FP32, "--epochs", "1", "--lr", "2e-3", "--seed", "0", "--output", str(tmp_path / "r0")])
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    with pytest.raises(UserError, match=r"do not fill one batch of 512"):  # refused: the old run stays
        train([*TINY, *FP32, "--epochs", "1", "--batch-size", "512", "--overwrite", "--output", str(tmp_path / "r0")])
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before


def test_a_data_set_without_a_test_split_names_test_and_eval_split(tmp_path: Path) -> None:
    """Without --eval-split the trainer evaluates on ``test``, else ``validation``; a data set with neither is
    refused naming both and the flag that picks another split, before any training."""
    from PIL import Image

    for i, name in enumerate(("cat", "dog")):
        (tmp_path / "ds" / "train" / name).mkdir(parents=True)
        for j in range(2):
            Image.new("RGB", (32, 32), (60 * i, 10 * j, 0)).save(tmp_path / "ds" / "train" / name / f"{j}.png")
    args = ["--dataset", str(tmp_path / "ds"), "--epochs", "1", "--model-kwargs", "depth=1", "embed_dim=64",
            "--workers", "1", "--no-progress", "--device", "cpu", *FP32, "--output", str(tmp_path / "run")]
    with pytest.raises(UserError) as e:
        train(args)
    assert str(e.value) == (f"data set {str(tmp_path / 'ds')!r} has no split 'test' or 'validation' to evaluate on; "
                            "its splits are train: name the one to evaluate on with --eval-split")
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_pretrained_weights_of_another_model_name_the_mismatch_and_the_model_they_fit(tmp_path: Path) -> None:
    """A vit_tiny run's weights into vit_small: one line with the first mismatched parameter, both shapes, and the
    --model and --model-kwargs that build the model they were trained as."""
    from timm_rollout.checkpoint import save_model

    tiny = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, depth=2, num_classes=10)
    save_model(tmp_path / "vt", tiny, [str(i) for i in range(10)], (0.5,) * 3, (0.25,) * 3)
    args = [*TINY, *FP32, "--epochs", "1", "--model", "vit_small_patch16_224", "--model-kwargs", "img_size=32",
            "patch_size=4", "depth=2", "--pretrained-file", str(tmp_path / "vt"), "--output", str(tmp_path / "run")]
    with pytest.raises(UserError) as e:
        train(args)
    assert str(e.value) == (
        "the pretrained weights do not fit vit_small_patch16_224 built with {'num_classes': 10, 'img_size': 32, "
        "'patch_size': 4, 'depth': 2}: their shapes differ (e.g. cls_token: [1, 1, 192] in the weights, "
        "[1, 1, 384] in the model); they were trained as vit_tiny_patch16_224: pass --model vit_tiny_patch16_224 "
        "--model-kwargs img_size=32 patch_size=4 depth=2 in_chans=3")
    (tmp_path / "log.csv").write_text("epoch,train_loss\n1,2.3\n")
    with pytest.raises(UserError) as e:
        train([*args[:-4], "--pretrained-file", str(tmp_path / "log.csv"), "--output", str(tmp_path / "run")])
    assert str(e.value) == (f"{tmp_path / 'log.csv'} is not a weights file; pass a .safetensors file, a training "
                            "output folder or a timm checkpoint (.pth, .pt)")


def test_a_run_records_the_code_it_ran_and_no_folder_of_this_machine(quick_run: Path) -> None:
    """train_args.json and summary.json name the code (version, commit, uncommitted changes: checked against git
    itself) and epochs per code version; the data set folder is recorded relative to the run folder."""
    from timm_rollout.records import code_label, resolve_recorded

    args = json.loads((quick_run / "train_args.json").read_text())
    summary = json.loads((quick_run / "summary.json").read_text())
    root = Path(timm_rollout.__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "timm_rollout", "harness",
                                 "scripts", "pyproject.toml"], capture_output=True, text=True).stdout
        assert args["code"] == {"version": timm_rollout.__version__, "commit": head.stdout.strip(),
                                "dirty": bool(status.strip())}
    assert args["code"]["version"] == timm_rollout.__version__
    assert summary["code"] == {code_label(args["code"]): 2}
    assert args["dataset_resolved"] == args["dataset"] == SAMPLE  # the package's sample by its name, as typed
    assert resolve_recorded(args["dataset_resolved"], quick_run) == SAMPLE


def test_portable_paths_by_hand(tmp_path: Path, monkeypatch) -> None:
    """As typed when relative; relative to the record when absolute in the working directory's tree, through a
    symbolic link as typed (never its target); else the folder's name only."""
    from timm_rollout.records import portable_path, recorded_data, resolve_recorded

    tree, real = tmp_path / "tree", tmp_path / "machine" / "disk" / "set"
    real.mkdir(parents=True)
    out = tree / "study" / "runs" / "a"
    out.mkdir(parents=True)
    (tree / "data").symlink_to(real.parent)  # tree/data/set is real, through a link
    monkeypatch.chdir(tree)
    assert portable_path(str(tree / "data" / "set"), out) == "../../../data/set"  # not ../../../../machine/...
    assert resolve_recorded("../../../data/set", out) == str(tree / "data" / "set")  # the link kept
    assert portable_path("../machine/disk/set", out) == "../machine/disk/set"  # relative: as typed
    assert portable_path(str(real), out) == portable_path(str(tmp_path / "x" / ".." / "set"), out) == ".../set"
    assert portable_path(str(tree / "data"), tmp_path / "elsewhere") == ".../data"  # a record outside the tree
    assert portable_path("uoft-cs/cifar10", out) == "uoft-cs/cifar10" == resolve_recorded("uoft-cs/cifar10", out)
    assert recorded_data("cifar10", "uoft-cs/cifar10", out) == "uoft-cs/cifar10"  # an alias's Hub id
    assert recorded_data(str(tree / "data" / "set"), str(real), out) == "../../../data/set"  # not the resolved one
    assert recorded_data("data/set", str(real), out) == "../../../data/set"  # where the record finds it again
    assert recorded_data("cifar10-sample", "/site-packages/cifar10_sample", out) == "cifar10-sample"
    assert portable_path(None, out) is None and resolve_recorded(None, out) is None
    assert resolve_recorded("/elsewhere/set", out) == "/elsewhere/set"  # an older record's absolute path
    assert resolve_recorded(".../set", out) == ".../set"


def test_a_run_on_a_linked_folder_outside_the_tree_records_its_name_only_and_resumes_with_it_typed(
        tmp_path: Path, monkeypatch) -> None:
    """train_args.json names a data set folder outside the working directory's tree by its name only (no folder of
    the machine, no link target); resuming without --dataset is refused naming it, and with it continues."""
    real = _sample_copy(tmp_path / "machine" / "disk" / "sample")
    (tmp_path / "mnt").mkdir()
    (tmp_path / "mnt" / "cifar").symlink_to(real)
    (tmp_path / "tree").mkdir()
    monkeypatch.chdir(tmp_path / "tree")
    out = tmp_path / "tree" / "runs" / "a"
    run = [*[arg if arg != SAMPLE else str(tmp_path / "mnt" / "cifar") for arg in TINY_RUN], "--output", str(out)]
    train([*run, "--epochs", "1"])
    record = json.loads((out / "train_args.json").read_text())
    assert (record["dataset"], record["dataset_resolved"], record["output"]) == (".../cifar", ".../cifar", ".")
    assert str(tmp_path) not in json.dumps(record) and "disk" not in json.dumps(record)
    with pytest.raises(UserError, match=r"by name only \(\.\.\./cifar.*resume it with --dataset"):
        main(["--resume", "--epochs", "2", "--output", str(out)])
    train([*run, "--resume", "--epochs", "2"])
    assert [r["epoch"] for r in read_log(out / "log.csv")] == [1, 2]
