"""The study report's section beside the original write-up: its three-column table and its training-loss
read-offs, checked against hand-written records and plain loops."""

from __future__ import annotations

import json

import pytest

from harness.compare import summarise
from harness.study import writeup


def _result(metrics: dict[str, float]) -> dict:
    return {"schema": 1, "metrics": metrics, "model": {"architecture": "vit_tiny_cifar_cls"}}


def _full_groups(values: dict[str, list[dict[str, float]]]):
    """Study groups per arm from hand-made full-split metrics, one dict per seed."""
    shown = [*writeup.HARNESS_ONLY, *(v[1] for v in writeup.WRITEUP_PROBE.values()), *writeup.WRITEUP_PROBE]
    return {arm: summarise([_result(m) for m in per_seed], shown, label=lambda _r, a=arm: a)[0]
            for arm, per_seed in values.items()}


def test_probe_table_sets_three_columns_side_by_side(tmp_path):
    full = {"cls": [{"ratio": 2.0, "knn_loo": 0.70, "ratio_original": 1.9, "top1": 0.75}],
            "rollout": [{"ratio": 2.5, "knn_loo": 0.72, "ratio_original": 2.2, "top1": 0.78}]}
    probe = tmp_path / writeup.PROBE_DIR / "cls-s0"
    probe.mkdir(parents=True)
    (probe / "results.json").write_text(json.dumps(_result({"ratio_original": 1.234, "knn_original": 0.9})))
    lines = writeup.probe_table(tmp_path, _full_groups(full), [0])
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[3:-1]]
            for line in lines[2:]}
    assert rows["centroid ratio inter / intra", "cls"] == ["1.40", "1.2340", "`ratio` 2.0000"]  # as it wrote it
    assert rows["k-NN@5", "cls"] == ["0.845", "0.9000", "`knn_loo` 0.7000"]
    assert rows["k-NN@5", "rollout"][0] == "0.850" and rows["intra-class distance", "cls"][0] == "0.7167"
    # no probe evaluation of rollout: its own test split's value in the write-up's units, said so
    assert rows["centroid ratio inter / intra", "rollout"] == ["1.53", "2.2000 (full test split)", "`ratio` 2.5000"]
    assert rows["test top-1", "rollout"] == ["-", "-", "`top1` 0.7800"]


def test_loss_table_first_epochs_match_a_plain_loop():
    losses = [2.0 * 0.98 ** e for e in range(1, 201)]  # 0.230 first at 108 by hand, never 0.0145 within 200
    logs = {"cls": {0: [{"epoch": e, "train_loss": v} for e, v in enumerate(losses, start=1)]}}
    row = writeup.loss_table(logs)[-1].split("|")[1:-1]
    expected = []
    for level in writeup.MILESTONES:
        hits = [e for e, v in enumerate(losses, start=1) if v <= level]
        expected.append(str(hits[0]) if hits else "not reached")
    assert [c.strip() for c in row[4:]] == expected
    assert expected[0] == "108" and expected[-1] == "not reached"
    table = writeup.loss_table(logs)
    assert "first epoch ≤ 0.230 " in table[0] and "| write-up cls | - | 0.230 | 0.0335 |" in table[2]
    assert [c.strip() for c in row[1:4]] == [f"{losses[9]:.4f}", f"{losses[79]:.4f}", f"{losses[199]:.4f}"]


def test_loss_marks_draw_the_read_offs_on_a_log_axis():
    from matplotlib.figure import Figure

    from harness.figures import _loss_marks

    ax = Figure().subplots()
    _loss_marks(ax, ["cls", "rollout"], writeup.writeup_marks())
    assert ax.get_yscale() == "log"
    crosses = {line.get_label(): list(zip(*line.get_data(), strict=True)) for line in ax.get_lines()
               if line.get_marker() == "x"}
    assert crosses == {"cls: write-up's read-off": [(80, 0.230), (200, 0.0335)],
                       "rollout: write-up's read-off": [(80, 0.185), (200, 0.0145)]}
    assert sorted(line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == ":") == [10, 80, 200]


@pytest.mark.parametrize("arm", ["cls", "rollout"])
def test_the_writeup_numbers_are_its_table(arm):
    i = writeup.WRITEUP_ARMS.index(arm)
    table = {m: v[0][i] for m, v in writeup.WRITEUP_PROBE.items()}
    assert table == ({"ratio_original": 1.40, "knn_original": 0.845, "silhouette": 0.143, "intra_original": 0.7167,
                      "inter_original": 1.0003} if arm == "cls" else
                     {"ratio_original": 1.53, "knn_original": 0.850, "silhouette": 0.134, "intra_original": 0.6937,
                      "inter_original": 1.0628})
