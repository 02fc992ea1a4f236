"""Stacked training (``--stack``): N runs in one vmapped pass per step equal N separate runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from timm_rollout.dropout import FastDropout, effective_p, use_fast_dropout
from timm_rollout.errors import UserError
from timm_rollout.packed import Stack
from timm_rollout.train import train
from timm_rollout.train_log import read_log

# fp32 on CPU, one thread, no dropout: a stacked run must equal its separate run up to float rounding.
TINY = ["--dataset", "cifar10-sample", "--max-train-samples", "128", "--max-eval-samples", "100", "--batch-size",
        "32", "--workers", "1", "--no-progress", "--device", "cpu", "--amp", "none", "--epochs", "2",
        "--weight-decay", "0.5", "--clip-grad", "0.1", "--model-ema", "--model-ema-decay", "0.9",
        "--model-kwargs", "depth=1", "embed_dim=64", "pos_drop_rate=0", "attn_drop_rate=0", "proj_drop_rate=0"]
KEYS = ("train_loss", "eval_loss", "eval_top1", "eval_top5", "lr")


def _close(a: Path, b: Path, name: str, tol: float = 1e-5) -> bool:
    x, y = load_file(a / name), load_file(b / name)
    return x.keys() == y.keys() and all(torch.allclose(x[k].double(), y[k].double(), atol=tol, rtol=0) for k in x)


def _same_logs(a: Path, b: Path) -> None:
    rows, ref = read_log(a / "log.csv"), read_log(b / "log.csv")
    assert [r["epoch"] for r in rows] == [r["epoch"] for r in ref]
    for r, s in zip(rows, ref, strict=True):
        for k in KEYS:
            assert r[k] == pytest.approx(s[k], abs=1e-4), k


@pytest.mark.parametrize("model", ["vit_tiny_cifar_cls", "vit_tiny_cifar_gap", "vit_tiny_cifar_cls global_pool=map",
                                   "vit_tiny_cifar_rollout",
                                   "vit_tiny_cifar_rollout rollout_grad=True rollout_head_fusion=max "
                                   "rollout_discard_ratio=0.5"])
def test_stacked_runs_equal_separate_runs(model: str, tmp_path: Path) -> None:
    """Weights, EMA export, resume state (optimizer moments included) and log of each stacked run equal its
    separate run's; weight decay 0.5 and clipping at 0.1 make timm's no-decay groups and per-run clipping
    show if they were lost. The rollout models record attention with forward hooks inside the stacked pass."""
    name, *kwargs = model.split()
    run = [*TINY, *kwargs, "--model", name]
    train([*run, "--seed", "3", "4", "--stack", "--output", str(tmp_path / "stacked-s{seed}")])
    for seed in (3, 4):
        alone = train([*run, "--seed", str(seed), "--output", str(tmp_path / f"alone-s{seed}")])
        stacked = tmp_path / f"stacked-s{seed}"
        assert _close(stacked, alone, "model.safetensors") and _close(stacked, alone, "resume.safetensors")
        _same_logs(stacked, alone)
        machines = json.loads((stacked / "summary.json").read_text())["machines"]
        assert list(machines.values()) == [2] and next(iter(machines)).endswith("2 runs stacked")
    assert not _close(tmp_path / "stacked-s3", tmp_path / "stacked-s4", "model.safetensors")
    # the recipe's other knobs matter, so a stacked run that lost them would not match its separate run
    for i, other in enumerate((["--weight-decay", "0"], ["--clip-grad", "100"])):
        changed = train([*run, "--seed", "3", *other, "--output", str(tmp_path / f"other{i}")])
        assert not _close(tmp_path / "alone-s3", changed, "model.safetensors"), other


def test_a_killed_stacked_command_resumes_every_run_from_its_last_epoch(tmp_path: Path, monkeypatch) -> None:
    """Killed between the two runs' saves of epoch 2: --resume trains the run behind alone for one epoch, then
    both together; both equal an uninterrupted stacked command's runs."""
    import timm_rollout.train as train_module

    flags = [*TINY, "--model", "vit_tiny_cifar_gap", "--epochs", "3", "--seed", "0", "1", "--stack"]
    train([*flags, "--output", str(tmp_path / "whole-s{seed}")])
    evaluate, calls = train_module.evaluate, []

    class Died(Exception):
        pass

    def die_before_the_second_run_saves_epoch_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise Died
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(train_module, "evaluate", die_before_the_second_run_saves_epoch_2)
    with pytest.raises(Died):
        train([*flags, "--output", str(tmp_path / "run-s{seed}")])
    assert [len(read_log(tmp_path / f"run-s{s}" / "log.csv")) for s in (0, 1)] == [2, 1]
    monkeypatch.setattr(train_module, "evaluate", evaluate)
    train([*flags, "--resume", "--output", str(tmp_path / "run-s{seed}")])
    for seed in (0, 1):
        run, ref = tmp_path / f"run-s{seed}", tmp_path / f"whole-s{seed}"
        assert _close(run, ref, "model.safetensors") and _close(run, ref, "resume.safetensors")
        _same_logs(run, ref)
        machines = json.loads((run / "summary.json").read_text())["machines"]
        assert sum(machines.values()) == 3
    assert any(m.endswith(", 1 run stacked") for m in json.loads((tmp_path / "run-s1" / "summary.json")
                                                                   .read_text())["machines"])


def test_stacked_dropout_draws_an_independent_mask_per_run_at_the_separate_runs_rate() -> None:
    """Two runs with identical weights and inputs: each drops elements at the rate its separate run's
    FastDropout realises, and their masks are independent (both drop together at rate p**2)."""
    p, n = 0.25, 200_000
    torch.manual_seed(0)
    models = []
    for _ in range(2):
        m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(p))
        with torch.no_grad():
            m[0].weight.copy_(torch.eye(4))
            m[0].bias.zero_()
        use_fast_dropout(m)
        models.append(m)
    assert type(models[0][1]) is FastDropout
    stack = Stack(models, [torch.optim.AdamW(m.parameters()) for m in models], None, nn.MSELoss(), torch.optim.AdamW)
    x = torch.ones(2, n // 4, 4)
    with torch.no_grad():
        out = stack.forward(x).reshape(2, -1)
        separate = models[0](x[0]).reshape(-1)
    dropped = out == 0
    assert torch.allclose(out[~dropped], torch.full_like(out[~dropped], 1 / (1 - p)))
    sigma = (p * (1 - p) / n) ** 0.5
    for rate in (*dropped.float().mean(1).tolist(), (separate == 0).float().mean().item()):
        assert abs(rate - effective_p(p)) < 5 * sigma
    both = (dropped[0] & dropped[1]).float().mean().item()
    assert abs(both - p * p) < 5 * (p * p * (1 - p * p) / n) ** 0.5
    models[0].eval()
    with torch.no_grad():
        assert torch.equal(stack.forward(x), x)  # eval mode: no dropout


@pytest.mark.slow  # torch.compile: a minute or more on a 2-core CPU
def test_compiled_stacked_runs_equal_eager_stacked_runs(tmp_path: Path) -> None:
    """--stack --compile compiles the vmapped pass once (the stack lives across epochs) and trains as eager."""
    run = [*TINY, "--model", "vit_tiny_cifar_rollout", "--seed", "0", "1", "--stack"]
    train([*run, "--output", str(tmp_path / "eager-s{seed}")])
    train([*run, "--compile", "--output", str(tmp_path / "compiled-s{seed}")])
    for seed in (0, 1):
        assert _close(tmp_path / f"compiled-s{seed}", tmp_path / f"eager-s{seed}", "model.safetensors", tol=1e-4)
        _same_logs(tmp_path / f"compiled-s{seed}", tmp_path / f"eager-s{seed}")


def test_stack_refuses_what_it_cannot_train_exactly(tmp_path: Path) -> None:
    run = [*TINY, "--model", "vit_tiny_cifar_gap", "--seed", "0", "1", "--stack", "--output",
           str(tmp_path / "r-s{seed}")]
    with pytest.raises(UserError, match="--stack needs one loss scale per run"):
        train([*run, "--amp", "fp16"])
    with pytest.raises(UserError, match="--opt lamb may take norms over whole tensors"):  # LAMB's trust ratio
        train([*run, "--opt", "lamb"])
