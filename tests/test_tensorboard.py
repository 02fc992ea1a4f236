"""``--report-to tensorboard``: the event files hold exactly the rows of ``log.csv`` (read back with TensorBoard's own
EventAccumulator), a resumed run continues the same curves without writing an epoch twice, and the weights are
those of a run without it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # the dev extra has it

from timm_rollout.cli import run_cli
from timm_rollout.train import main, train
from timm_rollout.train.log import read_log

RUN = ["--dataset", "cifar10-sample", "--max-train-samples", "128", "--max-eval-samples", "64", "--batch-size", "32",
       "--model-kwargs", "depth=1", "embed_dim=32", "--workers", "1", "--no-progress", "--device", "cpu",
       "--amp", "none", "--lr", "2e-3", "--epochs", "3"]
TAGS = {"loss/train": "train_loss", "loss/eval": "eval_loss", "accuracy/top1": "eval_top1",
        "accuracy/top5": "eval_top5", "lr": "lr",
        "throughput/img_per_s": "img_per_s", "time/epoch_seconds": "seconds",
        "rollout/effective_patches": "rollout_effective_patches", "rollout/cosine_to_mean": "rollout_cosine_to_mean"}


def _events(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the folder's event files, as each tag's (step, value) in the order written."""
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0}).Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _assert_events_are_the_log(folder: Path) -> None:
    rows = read_log(folder / "log.csv")
    events = _events(folder)
    assert set(events) == set(TAGS)  # top-5 of 10 classes; the rollout model's pooling diagnostics
    for tag, column in TAGS.items():
        assert events[tag] == [(r["epoch"], float(np.float32(r[column]))) for r in rows], tag  # one step per epoch


def _same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return train([*RUN, "--output", str(tmp_path_factory.mktemp("plain") / "run")])


def test_the_event_files_hold_the_log_and_the_weights_do_not_change(plain: Path, tmp_path: Path) -> None:
    out = train([*RUN, "--report-to", "tensorboard", "--output", str(tmp_path / "run")])
    _assert_events_are_the_log(out)
    assert len(read_log(out / "log.csv")) == 3 and _same_weights(out, plain)
    assert not list(plain.glob("events.out.tfevents.*"))  # none without the flag


def test_a_resumed_run_continues_the_curves_without_writing_an_epoch_twice(plain: Path, tmp_path: Path,
                                                                           monkeypatch) -> None:
    import timm_rollout.train.loop as loop

    evaluate, calls = loop.validate, []

    class Died(Exception):
        pass

    def die_in_epoch_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise Died
        return evaluate(*args, **kwargs)

    out = tmp_path / "run"
    monkeypatch.setattr(loop, "validate", die_in_epoch_3)
    with pytest.raises(Died):  # epochs 1 and 2 saved and logged, epoch 3 trained and lost
        train([*RUN, "--report-to", "tensorboard", "--output", str(out)])
    assert [s for s, _ in _events(out)["loss/train"]] == [1, 2]
    monkeypatch.setattr(loop, "validate", evaluate)
    train([*RUN, "--report-to", "tensorboard", "--output", str(out), "--resume"])
    assert len(list(out.glob("events.out.tfevents.*"))) == 2  # one per session
    _assert_events_are_the_log(out)
    assert _same_weights(out, plain)
    train([*RUN, "--report-to", "tensorboard", "--output", str(out), "--overwrite", "--epochs", "1"])
    assert [s for s, _ in _events(out)["loss/train"]] == [1]  # an overwritten run's events go with it


def test_a_run_resumed_with_the_flag_logs_its_earlier_epochs_too(tmp_path: Path) -> None:
    out = tmp_path / "run"
    train([*RUN, "--output", str(out), "--epochs", "2"])
    train([*RUN, "--output", str(out), "--resume", "--report-to", "tensorboard"])
    _assert_events_are_the_log(out)


def test_without_tensorboard_the_flag_is_one_line_naming_the_install(tmp_path: Path, monkeypatch, capsys) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        run_cli(main, [*RUN, "--report-to", "tensorboard", "--output", str(tmp_path / "run")])
    assert e.value.code == 2 and not (tmp_path / "run").exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --report-to tensorboard needs the tensorboard package: "
                                                   "pip install -e '.[tensorboard]'")
