"""``--dropout-draws keyed``: masks from SplitMix64 keyed by (seed, site, update), the same in a stacked pass as in
the separate run's, and in a captured stack. fp32 on CPU, one thread."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from timm_rollout import train as train_module
from timm_rollout.keyed import KeyedDropout, splitmix64, use_keyed_draws
from timm_rollout.train import train
from timm_rollout.train_log import read_log

# Dropout at every ViT site and stochastic depth, keyed; EMA, clipping and weight decay as in test_packed.
KEYED = ["--dataset", "cifar10-sample", "--max-train-samples", "96", "--max-eval-samples", "100", "--batch-size",
         "16", "--workers", "1", "--no-progress", "--device", "cpu", "--amp", "none", "--epochs", "2",
         "--weight-decay", "0.5", "--clip-grad", "0.1", "--model-ema", "--model-ema-decay", "0.9",
         "--dropout-draws", "keyed", "--drop-path", "0.2", "--model", "vit_tiny_cifar_rollout",
         "--model-kwargs", "depth=2", "embed_dim=32", "drop_rate=0.1"]


def _splitmix64_by_hand(seed: int, n: int) -> list[int]:
    """Steele, Lea and Flood's SplitMix64, as published, in Python's unbounded ints reduced mod 2**64."""
    out, state, mask = [], seed % 2**64, 2**64 - 1
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return out


@pytest.mark.parametrize("seed", [0, 1, 12345, -7, 2**62 + 3])
def test_splitmix64_equals_the_published_algorithm(seed: int) -> None:
    ours = splitmix64(torch.tensor(seed, dtype=torch.int64), 64)
    assert [v % 2**64 for v in ours.tolist()] == _splitmix64_by_hand(seed, 64)
    assert _splitmix64_by_hand(1234567, 3)[0] == 6457827717110365317  # the reference's first output for 1234567


def test_keyed_dropout_drops_at_its_rate_and_differs_per_site_and_update() -> None:
    """Over 200,000 elements the realised drop rate is p within 5 binomial sds; kept values are scaled by
    1 / (1 - p_eff); a second pass, or another site, draws another mask; eval mode is the identity."""
    net = nn.Sequential(nn.Dropout(0.3), nn.Dropout(0.3))
    assert use_keyed_draws(net, seed=5) == 2 and all(type(m) is KeyedDropout for m in net)
    x = torch.ones(200_000)
    a, b, again = net[0](x), net[1](x), net[0](x)
    p_eff = 1 - round(0.7 * 65536) / 65536
    dropped = (a == 0).float().mean().item()
    assert abs(dropped - p_eff) < 5 * math.sqrt(p_eff * (1 - p_eff) / x.numel())
    assert torch.allclose(a[a != 0], torch.tensor(1 / (1 - p_eff)))
    assert not torch.equal(a, b) and not torch.equal(a, again)
    net.eval()
    assert torch.equal(net(x), x)


def test_keyed_stacked_runs_equal_separate_runs(tmp_path: Path) -> None:
    """With dropout at every site and drop path, keyed: each stacked run equals its separate run (weights, EMA,
    resume state, log), and seeds draw differently."""
    train([*KEYED, "--seed", "3", "4", "--stack", "--output", str(tmp_path / "stacked-s{seed}")])
    for seed in (3, 4):
        alone = train([*KEYED, "--seed", str(seed), "--output", str(tmp_path / f"alone-s{seed}")])
        for name in ("model.safetensors", "resume.safetensors"):
            x, y = load_file(tmp_path / f"stacked-s{seed}" / name), load_file(alone / name)
            assert all(torch.allclose(x[k].double(), y[k].double(), atol=1e-5, rtol=0) for k in x), (seed, name)
        for a, b in zip(read_log(tmp_path / f"stacked-s{seed}" / "log.csv"), read_log(alone / "log.csv"), strict=True):
            assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-5)
    streams = train([*KEYED[:KEYED.index("--dropout-draws")], *KEYED[KEYED.index("--dropout-draws") + 2:],
                     "--seed", "3", "--output", str(tmp_path / "streams")])
    x, y = load_file(streams / "model.safetensors"), load_file(tmp_path / "alone-s3" / "model.safetensors")
    assert not all(torch.equal(x[k], y[k]) for k in x)  # the scheme matters: the comparison can fail


def test_a_captured_keyed_stack_equals_the_separate_runs(monkeypatch, tmp_path: Path) -> None:
    """--stack --capture with keyed dropout (refused with stream-drawn dropout): each run equals its separate run."""
    monkeypatch.setattr(train_module, "CAPTURE_DEVICES", ("cuda", "cpu"))
    train([*KEYED, "--seed", "3", "4", "--stack", "--capture", "--output", str(tmp_path / "captured-s{seed}")])
    for seed in (3, 4):
        alone = train([*KEYED, "--seed", str(seed), "--output", str(tmp_path / f"alone-s{seed}")])
        x, y = load_file(tmp_path / f"captured-s{seed}" / "model.safetensors"), load_file(alone / "model.safetensors")
        assert all(torch.allclose(x[k].double(), y[k].double(), atol=1e-5, rtol=0) for k in x), seed


def test_a_killed_keyed_run_resumes_to_the_uninterrupted_run(killed_at_evaluation, tmp_path: Path) -> None:
    """The counters are not saved: each epoch sets them from its number, so a resumed run draws the same masks."""
    whole = train([*KEYED, "--output", str(tmp_path / "whole")])
    with killed_at_evaluation(2):
        train([*KEYED, "--output", str(tmp_path / "run")])
    resumed = train([*KEYED, "--resume", "--output", str(tmp_path / "run")])
    x, y = load_file(whole / "resume.safetensors"), load_file(resumed / "resume.safetensors")
    assert all(torch.equal(x[k], y[k]) for k in x)


def test_a_run_from_before_the_flag_resumes_with_the_draws_it_had(tmp_path: Path) -> None:
    """A run whose record predates --dropout-draws trained with stream draws: it resumes with them, and a typed
    --dropout-draws keyed is refused rather than switching the scheme mid-run."""
    import json

    from timm_rollout.errors import UserError

    streams = [*KEYED[:KEYED.index("--dropout-draws")], *KEYED[KEYED.index("--dropout-draws") + 2:]]
    one = [*streams[:streams.index("--epochs") + 1], "1", *streams[streams.index("--epochs") + 2:]]
    run = train([*one, "--output", str(tmp_path / "old")])
    record = json.loads((run / "train_args.json").read_text())
    del record["dropout_draws"]
    (run / "train_args.json").write_text(json.dumps(record))
    with pytest.raises(UserError, match="was trained before --dropout-draws existed, as with --dropout-draws streams"):
        train([*streams, "--dropout-draws", "keyed", "--resume", "--output", str(run)])
    resumed = train([*streams, "--resume", "--output", str(run)])
    train([*one, "--output", str(tmp_path / "new")])  # the same, its record intact
    intact = train([*streams, "--resume", "--output", str(tmp_path / "new")])
    x, y = load_file(intact / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(x[k], y[k]) for k in x)


def test_keyed_masks_do_not_enter_the_weights_files(tmp_path: Path) -> None:
    """Key and counter buffers are non-persistent: the export loads into the stock model."""
    import timm

    run = train([*KEYED, "--epochs", "1", "--output", str(tmp_path / "run")])
    assert not any("draw_" in k for k in load_file(run / "model.safetensors"))
    model = timm.create_model(f"local-dir:{run}", pretrained=True)
    assert np.isfinite(model(torch.zeros(1, 3, 32, 32)).detach().numpy()).all()


def _draws_recorded(monkeypatch, log: list) -> None:
    """Record the (key, counter) of every keyed draw."""
    from timm_rollout import keyed

    keep = keyed._keep
    monkeypatch.setattr(keyed, "_keep", lambda key, counter, n, p: log.append((int(key), int(counter)))
                        or keep(key, counter, n, p))


def test_a_site_called_twice_per_pass_never_repeats_a_draw(monkeypatch, tmp_path: Path) -> None:
    """timm's CaiT calls each block's drop path twice per pass: over two epochs no (key, counter) comes twice."""
    draws: list[tuple[int, int]] = []
    _draws_recorded(monkeypatch, draws)
    run = [*KEYED[:KEYED.index("--model")], "--model", "cait_xxs24_224", "--model-kwargs", "img_size=32",
           "patch_size=8", "depth=2", "depth_token_only=1", "embed_dim=48", "num_heads=3"]
    train([*run, "--output", str(tmp_path / "cait")])
    assert len(draws) > 2 * 2 * 6 and len(set(draws)) == len(draws)  # 2 epochs of 6 steps, sites called twice


def test_keyed_draws_differ_between_torchrun_ranks(tmp_path: Path) -> None:
    """Under torchrun each rank draws from its own counters (DDP would otherwise copy rank 0's buffers to every
    rank each pass, and all ranks would drop the same elements)."""
    import json
    import os
    import subprocess
    import sys

    probe = tmp_path / "probe.py"
    probe.write_text(f"""
import json, os, sys
from timm_rollout import keyed
from timm_rollout.train import train
draws, keep = [], keyed._keep
keyed._keep = lambda key, counter, n, p: draws.append((int(key), int(counter))) or keep(key, counter, n, p)
train(sys.argv[1:])
open(os.path.join({str(tmp_path)!r}, "rank" + os.environ["RANK"] + ".json"), "w").write(json.dumps(draws))
""")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(probe), *KEYED, "--epochs", "1", "--output", str(tmp_path / "ddp")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = [{tuple(d) for d in json.loads((tmp_path / f"rank{r}.json").read_text())} for r in (0, 1)]
    assert ranks[0] and ranks[1] and not ranks[0] & ranks[1]


@pytest.mark.parametrize("p", [1e-6, 0.9999999])
def test_keyed_dropout_at_the_ends_of_its_range(p: float) -> None:
    """A rate too small to drop at 1/65536 steps keeps everything and draws nothing (so a stack can train it); a rate
    too close to 1 to keep anything drops everything, also as drop path."""
    from timm.layers import DropPath

    net = nn.Sequential(nn.Dropout(p), DropPath(p))
    use_keyed_draws(net, seed=0)
    x = torch.ones(4, 8)
    out = net[1](net[0](x))
    assert torch.equal(out, x) if p < 0.5 else torch.equal(out, torch.zeros_like(x))
