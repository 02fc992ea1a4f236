"""Stacked training (``--stack``): N runs in one vmapped pass per step equal N separate runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from timm.layers import DropPath
from torch import nn

from timm_rollout.capture import set_fused_attention
from timm_rollout.dropout import FastDropout, effective_p, use_fast_dropout
from timm_rollout.errors import UserError
from timm_rollout.packed import Stack, check_stackable, seed_everything
from timm_rollout.train import train
from timm_rollout.train_log import read_log

# fp32 on CPU, one thread, no dropout: a stacked run must equal its separate run up to float rounding.
TINY = ["--dataset", "cifar10-sample", "--max-train-samples", "128", "--max-eval-samples", "100", "--batch-size",
        "32", "--workers", "1", "--no-progress", "--device", "cpu", "--amp", "none", "--epochs", "2",
        "--weight-decay", "0.5", "--clip-grad", "0.1", "--model-ema", "--model-ema-decay", "0.9",
        "--model-kwargs", "depth=1", "embed_dim=64", "pos_drop_rate=0", "attn_drop_rate=0", "proj_drop_rate=0"]
KEYS = ("train_loss", "eval_loss", "eval_top1", "eval_top5", "lr")
# Every augmentation the trainer offers, on at once, each drawing its own random numbers: random crop
# (--crop-padding) and flip (--hflip) from the run's augmentation generator; mixup and CutMix, switching between
# them (timm's Mixup, from numpy's global state), with label smoothing in their targets; dropout at every site of
# the ViT (position, attention, projection and MLP, head) and stochastic depth (--drop-path; depth 2, so block 2
# has rate 0.2), from torch's global state. EMA and clipping as in TINY.
AUGMENTED = [*TINY[:TINY.index("--model-kwargs")], "--model", "vit_tiny_cifar_rollout", "--crop-padding", "2",
             "--hflip", "0.3", "--mixup", "0.8", "--cutmix", "1.0", "--smoothing", "0.1", "--drop-path", "0.2",
             "--model-kwargs", "depth=2", "embed_dim=32", "pos_drop_rate=0.1", "attn_drop_rate=0.1",
             "proj_drop_rate=0.1", "drop_rate=0.1", "--max-train-samples", "64", "--batch-size", "16"]


def _close(a: Path, b: Path, name: str, tol: float = 1e-5) -> bool:
    x, y = load_file(a / name), load_file(b / name)
    return x.keys() == y.keys() and all(torch.allclose(x[k].double(), y[k].double(), atol=tol, rtol=0) for k in x)


def _same_logs(a: Path, b: Path) -> None:
    rows, ref = read_log(a / "log.csv"), read_log(b / "log.csv")
    assert [r["epoch"] for r in rows] == [r["epoch"] for r in ref]
    for r, s in zip(rows, ref, strict=True):
        for k in KEYS:
            assert r[k] == pytest.approx(s[k], abs=1e-4), k


@pytest.mark.parametrize("model", ["vit_tiny_cifar_cls", "vit_tiny_cifar_gap --smoothing 0.1",
                                   "vit_tiny_cifar_cls global_pool=map",
                                   "vit_tiny_cifar_rollout",
                                   "vit_tiny_cifar_rollout rollout_grad=True rollout_head_fusion=max "
                                   "rollout_discard_ratio=0.5"])
def test_stacked_runs_equal_separate_runs(model: str, tmp_path: Path) -> None:
    """Weights, EMA export, resume state (optimizer moments included) and log of each stacked run equal its
    separate run's; weight decay 0.5 and clipping at 0.1 make timm's no-decay groups and per-run clipping
    show if they were lost. The rollout models record attention with forward hooks inside the stacked pass; the gap
    model trains with label smoothing alone (timm's LabelSmoothingCrossEntropy, vmapped per run)."""
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


def test_a_killed_stacked_command_resumes_every_run_from_its_last_epoch(tmp_path: Path, killed_at_evaluation) -> None:
    """Killed between the two runs' saves of epoch 2: --resume trains the run behind alone for one epoch, then
    both together; both equal an uninterrupted stacked command's runs."""
    flags = [*TINY, "--model", "vit_tiny_cifar_gap", "--epochs", "3", "--seed", "0", "1", "--stack"]
    train([*flags, "--output", str(tmp_path / "whole-s{seed}")])
    with killed_at_evaluation(4):  # the second run's evaluation of epoch 2, before its save
        train([*flags, "--output", str(tmp_path / "run-s{seed}")])
    assert [len(read_log(tmp_path / f"run-s{s}" / "log.csv")) for s in (0, 1)] == [2, 1]
    train([*flags, "--resume", "--output", str(tmp_path / "run-s{seed}")])
    for seed in (0, 1):
        run, ref = tmp_path / f"run-s{seed}", tmp_path / f"whole-s{seed}"
        assert _close(run, ref, "model.safetensors") and _close(run, ref, "resume.safetensors")
        _same_logs(run, ref)
        machines = json.loads((run / "summary.json").read_text())["machines"]
        assert sum(machines.values()) == 3
    assert any(m.endswith(", 1 run stacked") for m in json.loads((tmp_path / "run-s1" / "summary.json")
                                                                   .read_text())["machines"])


NO_DROPOUT = dict(pos_drop_rate=0, attn_drop_rate=0, proj_drop_rate=0)


class _Noisy(nn.Module):
    """An activation adding noise: a random draw inside the pass that no per-run stream covers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.randn_like(x)


class Died(Exception):
    """A kill, raised just before a run would evaluate (and then save) an epoch."""


def _die_at_evaluation(monkeypatch, n: int) -> None:
    """Every later command dies at its ``n``-th evaluation: after the saves before it, before the saves after it."""
    import timm_rollout.train as train_module

    evaluate, calls = train_module.evaluate, []

    def evaluate_or_die(*args, **kwargs):
        calls.append(1)
        if len(calls) % n == 0:
            raise Died
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(train_module, "evaluate", evaluate_or_die)


def _equal_to_separate(runs: Path, separate: dict[int, Path]) -> None:
    """Weights, EMA export, resume state (optimizer moments included) and log of each run equal its separate run's,
    up to float rounding: batched products round otherwise than plain ones (the differences are ~1e-7, a single
    different random draw moves the weights by ~1e-3)."""
    for seed, alone in separate.items():
        run = runs.parent / runs.name.replace("{seed}", str(seed))
        assert _close(run, alone, "model.safetensors") and _close(run, alone, "resume.safetensors"), seed
        _same_logs(run, alone)


def _epochs_saved(run: Path) -> int:
    return len(read_log(run / "log.csv")) if (run / "log.csv").exists() else 0


@pytest.fixture(scope="module")
def separate(tmp_path_factory) -> dict[int, Path]:
    """Seeds 0 and 1 of the AUGMENTED recipe, each trained by its own command: the reference of stacked runs."""
    out = tmp_path_factory.mktemp("separate")
    return {seed: train([*AUGMENTED, "--seed", str(seed), "--output", str(out / f"s{seed}")]) for seed in (0, 1)}


def test_a_finished_stacked_command_resumed_says_so_and_an_unfinished_run_resumes_alone(tmp_path: Path, monkeypatch,
                                                                                          capsys) -> None:
    """--resume of a finished stacked command says each run is finished and trains nothing; with one run finished
    and the other killed after its first epoch (or among its last writes: no summary), the other trains on alone
    and ends as the uninterrupted command's run."""
    flags = [*TINY, "--model", "vit_tiny_cifar_gap"]
    whole = tmp_path / "whole-s{seed}"
    train([*flags, "--seed", "0", "1", "--stack", "--output", str(whole)])
    capsys.readouterr()
    outs = train([*flags, "--seed", "0", "1", "--stack", "--resume", "--output", str(whole)])
    assert outs == [tmp_path / "whole-s0", tmp_path / "whole-s1"]
    assert capsys.readouterr().out.count("holds a finished run of 2 epochs") == 2
    train([*flags, "--seed", "0", "--output", str(tmp_path / "run-s0")])
    _die_at_evaluation(monkeypatch, 2)
    with pytest.raises(Died):
        train([*flags, "--seed", "1", "--output", str(tmp_path / "run-s1")])
    monkeypatch.undo()
    train([*flags, "--seed", "0", "1", "--stack", "--resume", "--output", str(tmp_path / "run-s{seed}")])
    _equal_to_separate(tmp_path / "run-s{seed}", {0: tmp_path / "whole-s0", 1: tmp_path / "whole-s1"})
    machines = json.loads((tmp_path / "run-s1" / "summary.json").read_text())["machines"]
    assert sorted(machines.values()) == [1, 1] and any(m.endswith(", 1 run stacked") for m in machines)
    (tmp_path / "whole-s1" / "summary.json").unlink()
    train([*flags, "--seed", "0", "1", "--stack", "--resume", "--output", str(whole)])
    assert (tmp_path / "whole-s1" / "summary.json").exists()
    _equal_to_separate(whole, {0: tmp_path / "run-s0", 1: tmp_path / "run-s1"})


def test_stacked_runs_equal_separate_runs_under_every_augmentation(separate: dict[int, Path], tmp_path: Path) -> None:
    """Each run of a stacked command draws its crops, flips, mixup/CutMix, dropout and drop-path masks from its own
    streams, exactly as its separate command does; the two runs differ from each other."""
    train([*AUGMENTED, "--seed", "0", "1", "--stack", "--output", str(tmp_path / "s{seed}")])
    _equal_to_separate(tmp_path / "s{seed}", separate)
    assert not _close(separate[0], separate[1], "model.safetensors")


def test_a_stacked_command_killed_at_every_save_resumes_to_the_separate_runs(separate: dict[int, Path],
                                                                             tmp_path: Path, monkeypatch) -> None:
    """Every command dies at its second evaluation until the runs are done: between the two runs' saves of epoch 1,
    between epochs (after run 1 caught up alone), between the runs' saves of epoch 2; each --resume stacks
    whichever runs are behind. The last one (run 1's epoch 2 alone) dies between that epoch's resume state and
    its export, and one more --resume publishes them. Both runs end equal to their separate runs."""
    import timm_rollout.train as train_module

    flags = [*AUGMENTED, "--seed", "0", "1", "--stack", "--output", str(tmp_path / "s{seed}")]
    _die_at_evaluation(monkeypatch, 2)
    saved = []
    for resume in ([], ["--resume"], ["--resume"]):
        with pytest.raises(Died):
            train([*flags, *resume])
        saved.append([_epochs_saved(tmp_path / f"s{seed}") for seed in (0, 1)])
    assert saved == [[1, 0], [1, 1], [2, 1]]  # killed between runs, between epochs, between runs
    save_model = train_module.save_model

    def die_before_exporting_run_1(out: Path, *args, **kwargs) -> None:
        if out.name == "s1":
            raise Died
        save_model(out, *args, **kwargs)

    monkeypatch.setattr(train_module, "save_model", die_before_exporting_run_1)
    with pytest.raises(Died):
        train([*flags, "--resume"])
    with safe_open(str(tmp_path / "s1" / "resume.safetensors"), "pt") as f:  # epoch 2's state, epoch 1's log
        assert json.loads(f.metadata()["resume"])["meta"]["epoch"] == 2 and _epochs_saved(tmp_path / "s1") == 1
    monkeypatch.undo()
    train([*flags, "--resume"])
    _equal_to_separate(tmp_path / "s{seed}", separate)


def test_separate_runs_resumed_with_stack_equal_uninterrupted_separate_runs(separate: dict[int, Path],
                                                                             tmp_path: Path, monkeypatch) -> None:
    """--stack is free on resume (how the runs train, not what they compute): a several-seed command killed in
    run 0's epoch 2, before run 1 began, resumes stacked and ends with the separate runs' results."""
    flags = [*AUGMENTED, "--seed", "0", "1", "--output", str(tmp_path / "s{seed}")]
    _die_at_evaluation(monkeypatch, 2)
    with pytest.raises(Died):
        train(flags)
    assert (tmp_path / "s0" / "resume.safetensors").exists() and not (tmp_path / "s1").exists()
    monkeypatch.undo()
    train([*flags, "--stack", "--resume"])
    _equal_to_separate(tmp_path / "s{seed}", separate)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_stacked_dropout_and_drop_path_draw_each_runs_masks_from_its_own_stream(device: str) -> None:
    """Two runs with identical weights and inputs: each stacked pass drops exactly what the run's separate pass
    drops after seed_everything(its seed), pass after pass (FastDropout's masks on CPU, F.dropout's on CUDA, timm's
    drop-path draws)."""
    seeds, x = (5, 9), torch.ones(2, 50_000, 4, device=device)
    models = []
    for _ in seeds:
        m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.25), DropPath(0.5))
        with torch.no_grad():
            m[0].weight.copy_(torch.eye(4))
            m[0].bias.zero_()
        use_fast_dropout(m)
        models.append(m.to(device))
    assert type(models[0][1]) is FastDropout
    stack = Stack(models, [torch.optim.AdamW(m.parameters()) for m in models], None, nn.MSELoss(), torch.optim.AdamW)
    stack.seed(seeds)
    with torch.no_grad():
        stacked = [stack.forward(x) for _ in range(2)]
        for i, (seed, model) in enumerate(zip(seeds, models, strict=True)):
            seed_everything(seed)
            alone = [model(x[i]) for _ in range(2)]
            assert all(torch.allclose(s[i], a, rtol=1e-6, atol=0) for s, a in zip(stacked, alone, strict=True))
    assert not torch.equal(stacked[0][0], stacked[0][1]) and not torch.equal(stacked[0][0], stacked[1][0])
    dropped = (stacked[0] == 0).float().mean().item()  # dropout's rate plus whole samples dropped by drop path
    assert abs(dropped - (1 - (1 - (effective_p(0.25) if device == "cpu" else 0.25)) * 0.5)) < 0.01
    models[0].eval()
    with torch.no_grad():
        assert torch.equal(stack.forward(x), x)  # eval mode: no dropout


def test_stack_refuses_randomness_it_cannot_draw_per_run(tmp_path: Path) -> None:
    """timm's PatchDropout draws inside the pass with no per-run stream: refused before any run folder is written,
    one line. The attention dropout inside the fused attention kernel (how GPUs run the CLS and gap models) is
    refused when the stack is built. Any other draw is refused at the first stacked step."""
    with pytest.raises(UserError, match="--stack cannot draw timm's patch dropout per run as its separate run does; "
                                        "drop --stack"):
        train([*TINY, "--model", "vit_tiny_cifar_gap", "--model-kwargs", "depth=1", "patch_drop_rate=0.5",
               "--epochs", "1", "--seed", "0", "1", "--stack", "--output", str(tmp_path / "s{seed}")])
    assert not list(tmp_path.rglob("*.json"))  # refused before any run's record
    eva = timm.create_model("eva02_tiny_patch14_224", img_size=32, patch_size=4, depth=1, embed_dim=32, num_heads=2,
                            patch_drop_rate=0.5)  # Eva's patch dropout returns the kept indices: another class
    with pytest.raises(UserError, match="--stack cannot draw timm's patch dropout per run"):
        check_stackable(eva)
    model = timm.create_model("vit_tiny_cifar_gap", depth=1, **NO_DROPOUT)
    model.blocks[0].mlp.act = _Noisy()  # a draw inside the pass that no per-run stream covers
    stack = Stack([model], [torch.optim.AdamW(model.parameters())], None, nn.MSELoss(), torch.optim.AdamW)
    with pytest.raises(UserError, match="--stack cannot draw per run as its separate run does"):
        stack.forward(torch.zeros(1, 2, 3, 32, 32))
    models = [timm.create_model("vit_tiny_cifar_gap", depth=1, attn_drop_rate=rate) for rate in (0.1, 0.1, 0.0)]
    set_fused_attention(models[0], True)
    set_fused_attention(models[1], False)
    with pytest.raises(UserError, match="cannot draw the attention dropout inside the fused attention kernel"):
        Stack(models[:1], [torch.optim.AdamW(models[0].parameters())], None, nn.MSELoss(), torch.optim.AdamW)
    for model in models[1:]:  # explicit attention with dropout, fused attention without
        Stack([model], [torch.optim.AdamW(model.parameters())], None, nn.MSELoss(), torch.optim.AdamW)


def test_stacked_pass_runs_explicit_attention_and_equals_the_fused_runs() -> None:
    """Runs on fused attention (how GPUs run the CLS and gap models) are stacked on timm's explicit path (fused SDPA's
    backward fails under vmap on CUDA), the runs' own models stay fused, and the stacked pass equals each run's own
    fused forward and backward (fp32, CPU)."""
    torch.manual_seed(0)
    models = [timm.create_model("vit_tiny_cifar_gap", depth=2, **NO_DROPOUT) for _ in range(2)]
    for model in models:
        set_fused_attention(model, True)
    stack = Stack(models, [torch.optim.AdamW(m.parameters()) for m in models], None, nn.MSELoss(), torch.optim.AdamW)
    attn = [m for m in stack.base.modules() if hasattr(m, "fused_attn")]
    assert attn and not any(m.fused_attn for m in attn)
    assert all(m.fused_attn for model in models for m in model.modules() if hasattr(m, "fused_attn"))
    x = torch.randn(2, 3, 3, 32, 32)
    stacked = stack.forward(x)
    stacked.square().sum().backward()
    for i, model in enumerate(models):
        alone = model(x[i])
        alone.square().sum().backward()
        torch.testing.assert_close(stacked[i], alone, rtol=1e-5, atol=1e-5)
        grad = stack.params["head.weight"].grad[i]
        torch.testing.assert_close(grad, model.head.weight.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # torch.compile: a minute or more on a 2-core CPU
def test_compiled_stacked_runs_equal_eager_stacked_runs(tmp_path: Path) -> None:
    """--stack --compile compiles the vmapped pass once (the stack lives across epochs) and trains as eager."""
    run = [*TINY, "--model", "vit_tiny_cifar_rollout", "--seed", "0", "1", "--stack"]
    train([*run, "--output", str(tmp_path / "eager-s{seed}")])
    train([*run, "--compile", "--output", str(tmp_path / "compiled-s{seed}")])
    for seed in (0, 1):
        assert _close(tmp_path / f"compiled-s{seed}", tmp_path / f"eager-s{seed}", "model.safetensors", tol=1e-4)
        _same_logs(tmp_path / f"compiled-s{seed}", tmp_path / f"eager-s{seed}")


@pytest.mark.slow  # torch.compile: minutes on a 2-core CPU
def test_compiled_stacked_runs_draw_as_separate_eager_runs(separate: dict[int, Path], tmp_path: Path) -> None:
    """--stack --compile under every augmentation: dynamo leaves the per-run draws out of the compiled graph, so the
    runs draw what their separate eager runs draw (separate compiled runs take inductor's dropout instead)."""
    train([*AUGMENTED, "--seed", "0", "1", "--stack", "--compile", "--output", str(tmp_path / "s{seed}")])
    for seed, alone in separate.items():
        assert _close(tmp_path / f"s{seed}", alone, "model.safetensors", tol=1e-4)
        _same_logs(tmp_path / f"s{seed}", alone)


def test_stack_refuses_what_it_cannot_train_exactly(tmp_path: Path) -> None:
    """A typed fp16 or LAMB is refused at parse time, nothing written; a resumed run saved with LARS when opened."""
    run = [*TINY, "--model", "vit_tiny_cifar_gap", "--seed", "0", "1", "--stack", "--output",
           str(tmp_path / "r-s{seed}")]
    with pytest.raises(UserError, match="--stack needs one loss scale per run"):
        train([*run, "--amp", "fp16"])
    with pytest.raises(UserError, match="--opt lamb may take norms over whole tensors"):  # LAMB's trust ratio
        train([*run, "--opt", "lamb"])
    assert not list(tmp_path.iterdir())
    lars = [*TINY, "--model", "vit_tiny_cifar_gap", "--opt", "lars", "--epochs", "1"]
    train([*lars, "--seed", "0", "--output", str(tmp_path / "l-s0")])
    with pytest.raises(UserError, match="--opt lars may take norms over whole tensors"):
        train([*TINY, "--model", "vit_tiny_cifar_gap", "--epochs", "2", "--seed", "0", "--stack", "--resume",
               "--output", str(tmp_path / "l-s0")])
