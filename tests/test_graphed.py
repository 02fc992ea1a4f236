"""``train --capture``: the step that a CUDA graph records, run eagerly on the CPU, equals the eager loop bit for bit.

Nothing is recorded on a CPU (:class:`~timm_rollout.graphed.Graphed` runs the body every step), so these tests let
``--capture`` run there (``CAPTURE_DEVICES`` patched) and check everything but the recording: the epoch's order and
crop/flip draws read on the device, learning rates, EMA, losses summed on the device, stacking and resume. The
recording itself is checked against this eager body on CUDA (``tests/test_cuda.py``). fp32 on CPU, one thread.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from timm_rollout import graphed
from timm_rollout import train as train_module
from timm_rollout.errors import UserError
from timm_rollout.graphed import Graphed, Plan
from timm_rollout.train import train
from timm_rollout.train_log import read_log

# Dropout at every site, EMA, clipping and weight decay: each one a place where a replayed step could go wrong.
TINY = ["--dataset", "cifar10-sample", "--max-train-samples", "128", "--max-eval-samples", "100", "--batch-size",
        "32", "--workers", "1", "--no-progress", "--device", "cpu", "--amp", "none", "--epochs", "2",
        "--weight-decay", "0.5", "--clip-grad", "0.1", "--model-ema", "--model-ema-decay", "0.9", "--smoothing",
        "0.1", "--model-kwargs", "depth=1", "embed_dim=64"]
NO_DROPOUT = ["pos_drop_rate=0", "attn_drop_rate=0", "proj_drop_rate=0"]


@pytest.fixture
def on_cpu(monkeypatch) -> None:
    """Let ``--capture`` run on the CPU: its step eagerly, every time."""
    monkeypatch.setattr(train_module, "CAPTURE_DEVICES", ("cuda", "cpu"))


def _equal(a: Path, b: Path, name: str) -> bool:
    x, y = load_file(a / name), load_file(b / name)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _close(a: Path, b: Path, name: str, tol: float = 1e-5) -> bool:
    x, y = load_file(a / name), load_file(b / name)
    return x.keys() == y.keys() and all(torch.allclose(x[k].double(), y[k].double(), atol=tol, rtol=0) for k in x)


def test_the_captured_step_equals_the_eager_loop_bit_for_bit(on_cpu, tmp_path: Path) -> None:
    """Weights, EMA export, optimizer moments and every logged number of a --capture run equal the eager run's."""
    eager = train([*TINY, "--output", str(tmp_path / "eager")])
    captured = train([*TINY, "--capture", "--output", str(tmp_path / "captured")])
    assert _equal(eager, captured, "model.safetensors") and _equal(eager, captured, "resume.safetensors")
    timed = ("img_per_s", "seconds")
    assert [{k: v for k, v in r.items() if k not in timed} for r in read_log(captured / "log.csv")] == \
        [{k: v for k, v in r.items() if k not in timed} for r in read_log(eager / "log.csv")]
    other = train([*TINY, "--capture", "--seed", "1", "--output", str(tmp_path / "other")])
    assert not _close(captured, other, "model.safetensors")  # the comparison can fail


@pytest.mark.parametrize("shared", [True, False], ids=["one-image-set", "a-subset-per-seed"])
def test_a_captured_stack_equals_the_separate_eager_runs(on_cpu, shared: bool, tmp_path: Path) -> None:
    """Stacked and captured, each run reads its own order, draws and images (a seeded subset of its own, or the one
    set all share, held once) and ends as its separate eager run."""
    run = [*TINY, *NO_DROPOUT]
    if shared:
        i = run.index("--max-train-samples")
        run = [*run[:i], *run[i + 2:], "--epochs", "1"]
    train([*run, "--capture", "--stack", "--seed", "3", "4", "--output", str(tmp_path / "stacked-s{seed}")])
    for seed in (3, 4):
        alone = train([*run, "--seed", str(seed), "--output", str(tmp_path / f"alone-s{seed}")])
        stacked = tmp_path / f"stacked-s{seed}"
        assert _close(stacked, alone, "model.safetensors") and _close(stacked, alone, "resume.safetensors"), seed
        for a, b in zip(read_log(stacked / "log.csv"), read_log(alone / "log.csv"), strict=True):
            assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-5)


def test_a_killed_captured_run_resumes_eagerly_to_the_uninterrupted_run(on_cpu, killed_at_evaluation,
                                                                          tmp_path: Path) -> None:
    """Killed in epoch 2's evaluation, a --capture run resumes without --capture (its optimizer state moved back
    where the eager AdamW keeps it) to the weights of the uninterrupted run."""
    whole = train([*TINY, "--output", str(tmp_path / "whole")])
    with killed_at_evaluation(2):
        train([*TINY, "--capture", "--output", str(tmp_path / "run")])
    resumed = train([*TINY, "--resume", "--output", str(tmp_path / "run")])
    assert _equal(whole, resumed, "model.safetensors") and _equal(whole, resumed, "resume.safetensors")


@pytest.mark.parametrize(("flags", "says"), [
    (["--mixup", "0.8"], "Mixup draws on the host"),
    (["--compile"], "pass one of them"),
    (["--opt", "sgd"], "--opt sgd"),
    (["--amp", "fp16"], "GradScaler"),
    (["--stack", "--seed", "0", "1", "--output", "{}/s{{seed}}"], "drawn from each run's generator"),
])
def test_capture_refuses_what_a_replay_would_compute_otherwise(on_cpu, flags: list[str], says: str,
                                                               tmp_path: Path) -> None:
    flags = [f.format(tmp_path) for f in flags]
    with pytest.raises(UserError, match=says):
        train([*TINY, "--output", str(tmp_path / "run"), "--capture", *flags])
    assert not any(tmp_path.rglob("*.json"))  # refused before anything was written


def test_capture_on_a_cpu_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--capture records the training step as a CUDA graph; on cpu"):
        train([*TINY, "--capture", "--output", str(tmp_path / "run")])


def test_the_plan_reads_each_runs_batch_as_a_plain_loop_crops_it() -> None:
    """Two runs, one with its own images: each step's batch equals zero-padding, slicing and flipping by hand."""
    rng = np.random.default_rng(0)
    sets = [torch.from_numpy(rng.integers(0, 256, (n, 3, 6, 5), dtype=np.uint8)) for n in (7, 9)]
    labels = [torch.arange(7), torch.arange(100, 109)]
    steps, batch, pad = 3, 4, 2
    plan = Plan(sets, labels, mean=(0.0, 0.0, 0.0), std=(1 / 255,) * 3, padding=pad, steps=steps, batch=batch)
    orders = [torch.from_numpy(rng.integers(0, len(s), steps * batch)) for s in sets]
    draws = [torch.from_numpy(np.stack([rng.integers(0, 2 * pad + 1, (steps, batch)),  # row offset
                                        rng.integers(0, 2 * pad + 1, (steps, batch)),  # column offset
                                        rng.integers(0, 2, (steps, batch))], axis=1)) for _ in sets]  # flip
    plan.start(orders, draws)
    for step in range(steps):
        x, y = plan.batch()
        for run in range(2):
            for j in range(batch):
                i = int(orders[run][step * batch + j])
                img = np.pad(sets[run][i].numpy(), ((0, 0), (pad, pad), (pad, pad)))
                r, c, f = (int(v) for v in draws[run][step, :, j])
                crop = img[:, r:r + 6, c:c + 5]
                crop = crop[:, :, ::-1] if f else crop
                assert np.allclose(x[run, j].numpy(), crop, atol=1e-4), (step, run, j)
                assert int(y[run, j]) == int(labels[run][i])
        plan.record(torch.tensor([float(step), -float(step)]))
    assert plan.losses.tolist() == [[0.0, -0.0], [1.0, -1.0], [2.0, -2.0]] and int(plan.step) == steps


def test_graphed_runs_its_body_every_call_off_cuda() -> None:
    keys = []
    step = Graphed(keys.append, torch.device("cpu"))
    for k in range(graphed.WARMUP + 3):
        step(k % 2)
    assert keys == [k % 2 for k in range(graphed.WARMUP + 3)] and step.graph is None


class _HostTraffic(TorchDispatchMode):
    """Records what a CUDA graph cannot: a host sync, or a copy between host and device memory."""

    SYNCS = frozenset({"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "item", "_assert_async"})

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        devices = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        if name == "_to_copy" and kwargs.get("device") is not None:
            devices.add(torch.device(kwargs["device"]).type)
        if name in self.SYNCS or (name in ("copy_", "_to_copy", "copy") and {"cpu", "cuda"} <= devices):
            self.found.append(str(func))
        return func(*args, **kwargs)


def _recorded_step_traffic(model: torch.nn.Module, monkeypatch) -> list[str]:
    """The host traffic of the recorded step (the second call; the first is the eager warm-up), traced on fake
    CUDA tensors: batch, forward, loss, clipping, capturable AdamW with device learning rates, EMA. The backward
    pass is not traced (autograd needs a real GPU): gradients of ones stand in."""
    from timm.loss import LabelSmoothingCrossEntropy
    from timm.optim import create_optimizer_v2
    from timm.utils import ModelEmaV3
    from torch._subclasses.fake_tensor import FakeTensorMode

    from timm_rollout.graphed import learning_rates, tensor_lrs
    from timm_rollout.train_step import optimizer_step

    ema = ModelEmaV3(model, decay=0.9)
    with FakeTensorMode(allow_non_fake_inputs=True):
        cuda = torch.device("cuda")
        model, ema.module = model.to(cuda).train(), ema.module.to(cuda)
        optimizer = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05, capturable=True)
        lrs = learning_rates(optimizer)
        plan = Plan([torch.zeros(64, 3, 32, 32, dtype=torch.uint8, device=cuda)],
                    [torch.zeros(64, dtype=torch.long, device=cuda)], (0.5,) * 3, (0.25,) * 3, 4, steps=2, batch=16)
        params = [p for p in model.parameters() if p.requires_grad]
        monkeypatch.setattr(torch.Tensor, "backward", lambda self, *a, **k: [setattr(p, "grad", torch.ones_like(p))
                                                                             for p in params] and None)
        watch = _HostTraffic()
        for recorded in (False, True):
            with watch if recorded else contextlib.nullcontext():
                x, y = plan.batch()
                with tensor_lrs(optimizer, lrs):
                    loss = optimizer_step(model, x[0], y[0], LabelSmoothingCrossEntropy(0.1), optimizer, device=cuda,
                                          amp_dtype=None, clip_grad=1.0)
                ema.apply_update_(model, 0.9)
                plan.record(loss)
    return watch.found


@pytest.mark.parametrize("build", [
    "vit_tiny_cifar_rollout depth=2",
    "vit_tiny_cifar_gap depth=2 drop_path_rate=0.1 keyed",
    "vit_tiny_patch16_224 img_size=32 patch_size=8 depth=2 pool=rollout",
    "vit_tiny_cifar_cls depth=2 global_pool=map",
])
def test_the_recorded_step_neither_syncs_nor_copies_from_the_host(build: str, monkeypatch) -> None:
    """What --capture records must run on the device alone: traced on fake CUDA tensors (no GPU needed), the step
    of each pooling (rollout among them: its one-hot row once came from a host copy) makes no host traffic."""
    import timm

    from timm_rollout.keyed import use_keyed_draws
    from timm_rollout.pooling import set_pooling

    name, *options = build.split()
    kwargs = {k: (int(v) if v.isdigit() else float(v) if "." in v else v)
              for k, v in (o.split("=") for o in options if "=" in o and not o.startswith("pool="))}
    model = timm.create_model(name, num_classes=10, **kwargs)
    if "pool=rollout" in options:
        set_pooling(model, "rollout")
    if "keyed" in options:
        use_keyed_draws(model, seed=0)
    assert _recorded_step_traffic(model, monkeypatch) == []


def test_the_host_traffic_trace_finds_a_host_copy() -> None:
    """The trace above can fail: indexing a device tensor with a Python value copies from the host."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), _HostTraffic() as watch:
        row = torch.zeros(5, device="cuda")
        row[0] = 1.0
        with pytest.raises(DataDependentOutputException):  # a fake tensor has no value to sync
            row.sum().item()
    assert any("copy_" in f for f in watch.found) and any("_local_scalar_dense" in f for f in watch.found)
