"""``harness.sweep``: arms across a swept training argument, checked against numpy/scipy by hand."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from harness import sweep
from timm_rollout.errors import UserError

ARMS = {"vit_tiny_cifar_cls": "cls", "vit_tiny_cifar_gap": "gap"}
LRS = (5e-4, 1e-3, 2e-3)
SEEDS = (0, 1, 2)
# top-1 per arm, lr and seed: cls is best at 1e-3, gap at 2e-3; 1e-3 is best over both arms
TOP1 = {("cls", 5e-4): [0.70, 0.71, 0.69], ("cls", 1e-3): [0.78, 0.80, 0.77], ("cls", 2e-3): [0.75, 0.76, 0.74],
        ("gap", 5e-4): [0.72, 0.73, 0.71], ("gap", 1e-3): [0.79, 0.80, 0.80], ("gap", 2e-3): [0.81, 0.79, 0.82]}


def _write_runs(root: Path) -> list[Path]:
    """One run folder (train_args.json) and one evaluation folder (results.json) per arm, lr and seed."""
    evals = []
    for name, arm in ARMS.items():
        for lr in LRS:
            for seed, top1 in zip(SEEDS, TOP1[arm, lr], strict=True):
                run = root / f"lr{lr}" / "runs" / f"{arm}-s{seed}"
                run.mkdir(parents=True)
                (run / "train_args.json").write_text(json.dumps({"lr": lr, "seed": seed, "model": name}))
                ev = root / f"lr{lr}" / "eval" / f"{arm}-s{seed}"
                ev.mkdir(parents=True)
                (ev / "results.json").write_text(json.dumps({
                    "model": {"name": name, "checkpoint": str(run)}, "metrics": {"top1": top1, "knn_loo": 1 - top1},
                    "data": {"argument": "cifar10", "split": "test"}, "config": {"seed": seed}}))
                evals.append(ev)
    return evals


def _section(report: str, title: str) -> dict[str, str]:
    """The top-1 row of the paired-statistics table under ``### title``."""
    block = report.split(f"### {title}\n", 1)[1].split("###", 1)[0]
    row = next(line for line in block.splitlines() if line.startswith("| top1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    return {"mean": cells[2], "ci": cells[3], "p": cells[4]}


def _paired(base: list[float], other: list[float]) -> tuple[float, float, float, float]:
    d = np.subtract(other, base)
    low, high = sps.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=sps.sem(d))
    return d.mean(), low, high, sps.ttest_1samp(d, 0).pvalue


def test_sweep_picks_each_arms_best_value_and_pairs_the_arms_there_and_at_the_shared_value(tmp_path: Path) -> None:
    evals = _write_runs(tmp_path)
    arms = sweep.main([*map(str, evals), "--param", "lr", "--metrics", "top1", "--output", str(tmp_path / "out")])
    cls, gap = (next(a for a in arms if a.startswith(name)) for name in ARMS)
    assert list(arms[cls]) == list(LRS) and arms[gap][2e-3].mean["top1"] == pytest.approx(np.mean(TOP1["gap", 2e-3]))
    assert sweep.best_values(arms) == {cls: 1e-3, gap: 2e-3}
    assert sweep.shared_value(arms) == 1e-3  # mean over arms: 0.7833 + 0.7967 beats 0.75 + 0.8067 at 2e-3
    report = (tmp_path / "out" / "report.md").read_text()
    assert re.search(r"\| vit_tiny_cifar_gap[^|]*\|[^|]*\|[^|]*\| \*\*0\.8067 ± 0\.0153 \(n=3\)\*\* \|", report)
    for title, (a, b) in ((f"{gap} - {cls}, each at its best lr (0.001 vs 0.002)", (1e-3, 2e-3)),
                          (f"{gap} - {cls}, both at lr=0.001", (1e-3, 1e-3))):
        mean, low, high, p = _paired(TOP1["cls", a], TOP1["gap", b])
        row = _section(report, title)
        assert row["mean"] == f"{mean:+.4f}" and row["ci"] == f"[{low:+.4f}, {high:+.4f}]" and row["p"] == f"{p:.3g}"
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 10_000


def test_sweep_finds_moved_runs_and_refuses_what_it_cannot_pair(tmp_path: Path) -> None:
    evals = _write_runs(tmp_path)
    moved = tmp_path / "moved"
    moved.mkdir()
    for run in (tmp_path / "lr0.001" / "runs").iterdir():
        shutil.move(run, moved / run.name)
    picked = [e for e in evals if "lr0.001" in str(e) or "lr0.002" in str(e)]
    with pytest.raises(UserError, match=r"no readable train_args\.json in its run folder"):
        sweep.main([*map(str, picked), "--param", "lr", "--output", str(tmp_path / "out")])
    arms = sweep.main([*map(str, picked), "--param", "lr", "--runs", str(moved), "--output", str(tmp_path / "out")])
    assert all(list(cells) == [1e-3, 2e-3] for cells in arms.values())
    for ev in picked:  # evaluated with harness.eval's default --seed: the seeds come from the moved runs
        record = json.loads((ev / "results.json").read_text())
        record["config"]["seed"] = 0
        (ev / "results.json").write_text(json.dumps(record))
    arms = sweep.main([*map(str, picked), "--param", "lr", "--runs", str(moved), "--output", str(tmp_path / "out")])
    assert all(g.seeds == list(SEEDS) for cells in arms.values() for g in cells.values())
    with pytest.raises(UserError, match="no training argument 'learning_rate'"):
        sweep.main([*map(str, picked), "--param", "learning_rate", "--runs", str(moved), "--output", str(tmp_path)])
    with pytest.raises(UserError, match=r"--shared 0\.0005: not every arm was run at lr=0\.0005"):
        sweep.main([*map(str, picked), "--param", "lr", "--runs", str(moved), "--shared", "5e-4", "--output",
                    str(tmp_path / "out")])


def test_sweep_finds_runs_of_the_study_layout_after_the_tree_moved(tmp_path: Path) -> None:
    """lr*/eval/cls-s0 next to lr*/runs/cls-s0, the whole tree moved: each evaluation reads its own lr's run
    (beside it, <evaluation>/../../runs), with or without --runs naming every lr's runs folder."""
    _write_runs(tmp_path / "before")
    shutil.move(tmp_path / "before", tmp_path / "after")
    evals = sorted(map(str, (tmp_path / "after").glob("lr*/eval/*-s*")))
    every = sorted(map(str, (tmp_path / "after").glob("lr*/runs")))
    for extra in ([], ["--runs", *every]):
        arms = sweep.main([*evals, "--param", "lr", "--metrics", "top1", *extra, "--output", str(tmp_path / "out")])
        for name, arm in ARMS.items():
            cells = next(cells for label, cells in arms.items() if label.startswith(name))
            assert list(cells) == list(LRS)
            for lr, group in cells.items():
                assert group.seeds == list(SEEDS)  # from each run's own train_args.json
                assert group.mean["top1"] == pytest.approx(np.mean(TOP1[arm, lr]))


def test_select_outside_metrics_is_computed_and_shown(tmp_path: Path) -> None:
    """--select knn_loo with --metrics top1: knn_loo = 1 - top1 here, so both arms are best at the lowest lr."""
    evals = _write_runs(tmp_path)
    arms = sweep.main([*map(str, evals), "--param", "lr", "--metrics", "top1", "--select", "knn_loo", "--output",
                       str(tmp_path / "out")])
    assert set(sweep.best_values(arms, "knn_loo").values()) == {5e-4}
    report = (tmp_path / "out" / "report.md").read_text()
    assert "best lr by mean knn_loo in bold" in report
    table = report.split("**knn_loo**", 1)[1].split("\n\n", 2)[1]
    assert re.search(r"\| vit_tiny_cifar_cls[^|]*\| \*\*0\.3000 ± 0\.0100 \(n=3\)\*\* \|", table)
    assert "**top1**" in report and "### " in report  # top1 still shown, the pairs still compared


def test_output_must_be_a_folder(tmp_path: Path) -> None:
    evals = _write_runs(tmp_path)
    (tmp_path / "report.md").write_text("a file")
    with pytest.raises(UserError, match=r"argument --output: .*report\.md is a file; pass a folder"):
        sweep.main([*map(str, evals), "--param", "lr", "--output", str(tmp_path / "report.md")])


def test_sweep_refuses_an_evaluation_counted_twice(tmp_path: Path) -> None:
    """The same folder twice, or a copy of one seed's evaluation, would count one seed twice in its cell; the same
    seed at two learning rates is two cells and is accepted."""
    evals = _write_runs(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(evals[0], copy)
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"is passed twice; pass each evaluation folder once"):
        sweep.main([*map(str, evals), str(evals[0]), "--param", "lr", "--output", str(out)])
    with pytest.raises(UserError, match=r"are both seed 0 of .* at lr=0.0005, so one seed would count twice"):
        sweep.main([*map(str, evals), str(copy), "--param", "lr", "--output", str(out)])
    assert not out.exists()
