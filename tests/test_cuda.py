"""The CUDA path end to end on the shipped ``cifar10-sample``: bf16 and fp16 training, kill-and-resume,
``torchrun``, ``--compile`` (``reduce-overhead``: CUDA graphs), ``harness.eval --faithfulness`` and
``harness.explain``. Skipped without a GPU.

Every run pins ``--device cuda`` and its precision. Where CUDA results are compared with the CPU, both sides
run in fp32 (``--amp none``) and the tolerance allows for TF32 convolutions and reordered sums only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from timm_rollout.data import load_image_set
from timm_rollout.records import RESUME_FILE, WEIGHTS_FILE
from timm_rollout.train import train
from timm_rollout.train.log import read_log

DEVICE = "cuda"
pytestmark = pytest.mark.cuda
SAMPLE = ["--dataset", "cifar10-sample", "--batch-size", "64", "--lr", "2e-3", "--seed", "0", "--no-progress",
          "--device", DEVICE, "--model-kwargs", "depth=2", "embed_dim=64"]  # more model kwargs may follow
BF16 = [*SAMPLE, "--amp", "bf16", "--epochs", "3"]
NO_DROPOUT = ["pos_drop_rate=0", "attn_drop_rate=0", "proj_drop_rate=0"]


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory) -> Path:
    """The uninterrupted bf16 run: 3 epochs of 31 steps on the 2,000 sample images, evaluated on its 1,000."""
    return train([*BF16, "--output", str(tmp_path_factory.mktemp("bf16") / "run")])


def _metrics(rows: list[dict]) -> list[dict]:
    return [{k: r[k] for k in ("epoch", "train_loss", "eval_loss", "eval_top1", "eval_top5", "lr")} for r in rows]


def _same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _cpu_top1(run: Path) -> float:
    """Top-1 (%) of the exported model on the sample's test split, recomputed on the CPU in fp32."""
    model = timm.create_model(f"local-dir:{run}", pretrained=True).eval()
    test = load_image_set("cifar10-sample", "test")
    mean = torch.tensor(model.pretrained_cfg["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(model.pretrained_cfg["std"]).view(1, 3, 1, 1)
    with torch.no_grad():
        pred = model((test.images.float() / 255 - mean) / std).argmax(1)
    return 100 * (pred == test.labels).float().mean().item()


def test_bf16_training_on_cuda_learns_and_its_export_agrees_with_the_cpu(bf16_run: Path) -> None:
    args = json.loads((bf16_run / "train_args.json").read_text())
    assert args["amp_dtype"] == "bfloat16" and args["device"] == DEVICE and args["steps_per_epoch"] == 31
    assert args["fp32_precision"] == "ieee"  # no TF32 for the float32 parts (cuDNN's default would use it for convs)
    rows = read_log(bf16_run / "log.csv")
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] < 2.31 and rows[-1]["eval_top1"] > 20.0
    # bf16 on the GPU and fp32 on the CPU may disagree on a few borderline images of the 1,000, no more.
    assert _cpu_top1(bf16_run) == pytest.approx(rows[-1]["eval_top1"], abs=1.0)


def test_fp16_with_grad_scaler_clipping_mixup_and_ema_on_cuda(tmp_path: Path) -> None:
    out = train([*SAMPLE, "--amp", "fp16", "--epochs", "2", "--clip-grad", "1.0", "--mixup", "0.8", "--cutmix",
                 "1.0", "--smoothing", "0.1", "--model-ema", "--model-ema-decay", "0.9", "--output",
                 str(tmp_path / "run")])
    assert json.loads((out / "train_args.json").read_text())["amp_dtype"] == "float16"
    rows = read_log(out / "log.csv")
    assert len(rows) == 2 and all(0 < r["train_loss"] < 10 and np.isfinite(r["eval_loss"]) for r in rows)
    with safe_open(str(out / RESUME_FILE), "pt") as f:
        scaler = json.loads(f.metadata()["resume"])["scaler"]
    assert scaler is not None and 0 < scaler["scale"] < float("inf")  # the GradScaler ran and was saved
    exported, state = load_file(out / WEIGHTS_FILE), load_file(out / RESUME_FILE)
    assert all(torch.isfinite(v).all() for v in exported.values())
    assert all(torch.equal(exported[k], state[f"ema.{k}"]) for k in exported)  # the EMA is what is published
    assert not torch.equal(exported["head.weight"], state["model.head.weight"])


def test_kill_and_resume_on_cuda_equals_the_uninterrupted_run(bf16_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "timm_rollout.train", *BF16, "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (out / "log.csv").exists() and proc.poll() is None:  # written after the checkpoint
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert not (out / "summary.json").exists(), "the run finished before it could be killed"
    assert 1 <= len(read_log(out / "log.csv")) < 3
    train([*BF16, "--output", str(out), "--resume"])
    assert _metrics(read_log(out / "log.csv")) == _metrics(read_log(bf16_run / "log.csv"))
    assert _same_weights(out, bf16_run)


def test_torchrun_one_process_on_cuda_equals_the_in_process_run(bf16_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           "-m", "timm_rollout.train", *BF16, "--output", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((out / "train_args.json").read_text())["world_size"] == 1
    assert _metrics(read_log(out / "log.csv")) == _metrics(read_log(bf16_run / "log.csv"))
    assert _same_weights(out, bf16_run)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compile_gives_the_eager_results_on_cuda(mode: str, tmp_path: Path) -> None:
    """--compile, and with --compile-mode reduce-overhead its passes replayed as CUDA graphs, trains as eager."""
    run = [*SAMPLE, *NO_DROPOUT, "--amp", "none", "--epochs", "1"]  # dropout masks: another RNG when compiled
    eager = read_log(train([*run, "--output", str(tmp_path / "eager")]) / "log.csv")
    compiled = read_log(train([*run, "--compile", "--compile-mode", mode, "--output", str(tmp_path / "compiled")])
                        / "log.csv")
    for key, tol in (("train_loss", 0.01), ("eval_loss", 0.02), ("eval_top1", 1.0)):
        assert compiled[0][key] == pytest.approx(eager[0][key], abs=tol), key


def _eval(run: Path, out: Path, device: str) -> dict:
    from harness import eval as harness_eval

    return harness_eval.main(["--model", "vit_tiny_cifar_rollout", "--checkpoint", str(run), "--dataset",
                              "cifar10-sample", "--heatmaps", "2", "--faithfulness", "--faithfulness-images", "8",
                              "--device", device, "--amp", "none", "--output", str(out)])


def test_eval_with_faithfulness_on_cuda_agrees_with_the_cpu(bf16_run: Path, tmp_path: Path) -> None:
    gpu, cpu = _eval(bf16_run, tmp_path / "gpu", DEVICE), _eval(bf16_run, tmp_path / "cpu", "cpu")
    assert gpu["environment"]["device"].startswith(DEVICE) and gpu["environment"]["dtype"] == "float32"
    assert (tmp_path / "gpu" / "faithfulness.png").exists() and (tmp_path / "gpu" / "heatmaps.png").exists()
    assert gpu["metrics"]["top1"] == pytest.approx(cpu["metrics"]["top1"], abs=0.005)  # 5 of 1,000 images
    assert gpu["faithfulness"]["num_images"] == 8
    assert set(gpu["faithfulness"]["fills"]) == {"mean", "drop"}
    for fill, block in gpu["faithfulness"]["fills"].items():
        for name in ("rollout", "last_layer_attention", "gradient_rollout"):  # "random" draws its own ranks
            for curve in ("deletion_curve", "insertion_curve"):
                np.testing.assert_allclose(block["maps"][name][curve],
                                           cpu["faithfulness"]["fills"][fill]["maps"][name][curve], atol=0.02,
                                           err_msg=f"{fill} {name}")


def test_explain_on_cuda_agrees_with_the_cpu(bf16_run: Path, tmp_path: Path) -> None:
    from harness.explain import main

    def explain(device: str) -> dict:
        return main(["--model", "vit_tiny_cifar_rollout", "--checkpoint", str(bf16_run), "--dataset",
                     "cifar10-sample", "--index", "5", "--device", device, "--output", str(tmp_path / device)])

    gpu, cpu = explain(DEVICE), explain("cpu")
    assert Path(gpu["figure"]).stat().st_size > 10_000
    assert gpu["maps"] == cpu["maps"] and (gpu["predicted"], gpu["target"]) == (cpu["predicted"], cpu["target"])
