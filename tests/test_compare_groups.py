"""harness.compare groups a run only with runs of the same model on the same data (model arguments, rollout options,
the data's content), labels groups by what differs, and refuses pairings confounded by a second difference; on
hand-made records whose groups and means are known by construction, and on the committed studies."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from harness import compare
from harness.record import load_results
from harness.study.folder import arm_of
from timm_rollout.cli import run_cli
from timm_rollout.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def _record(tmp_path: Path, name: str, seed: int, top1: float, args: dict | None = None, content: str = "c1",
            pool: str | None = None, boxes: str | None = None) -> dict:
    """A results.json of ``name`` (built with ``args``, pooled by ``pool``, default: as its name says) on
    cifar10/test whose split has content hash ``content``, written to its own folder."""
    pool = pool or ("rollout" if name.endswith("rollout") else "avg")
    folder = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    record = {"model": {"name": name, "architecture": name, "checkpoint_architecture": name, "global_pool": pool,
                        "pool": pool, "model_args": {"global_pool": pool, **(args or {})}},
              "data": {"argument": "data/cifar10", "split": "test", "fingerprint": "f", "subset_fingerprint": "f",
                       "split_content": content, "content": content, "box_content": boxes},
              "config": {"seed": seed}, "metrics": {"top1": top1}}
    (folder / "results.json").write_text(json.dumps(record))
    return {**record, "path": str(folder)}


def test_unlike_runs_form_groups_labelled_by_what_differs(tmp_path):
    """Two architectures, two rollout option sets (an older record without the default options groups with the
    newer one that states them), two data sets of one folder name: each its own group, with the plain mean."""
    r = "vit_tiny_cifar_rollout"
    runs = [_record(tmp_path, r, 0, 0.50, {"depth": 3, "embed_dim": 192}),
            _record(tmp_path, r, 1, 0.60, {"depth": 3, "embed_dim": 192}),
            _record(tmp_path, r, 0, 0.70, {"depth": 2, "embed_dim": 96, "reg_tokens": 4}),
            _record(tmp_path, r, 1, 0.90, {"depth": 2, "embed_dim": 96, "reg_tokens": 4})]
    groups = compare.summarise(runs, ["top1"])
    assert [(g.label, g.n) for g in groups] == [(f"{r} (depth=3 embed_dim=192) on cifar10/test", 2),
                                                (f"{r} (depth=2 embed_dim=96 reg_tokens=4) on cifar10/test", 2)]
    assert [g.mean["top1"] for g in groups] == [pytest.approx(0.55), pytest.approx(0.80)]

    options = [_record(tmp_path, r, 0, 0.4, {"rollout_head_fusion": "mean", "rollout_discard_ratio": 0.0}),
               _record(tmp_path, r, 1, 0.6),  # recorded before the options were
               _record(tmp_path, r, 0, 0.3, {"rollout_head_fusion": "max", "rollout_discard_ratio": 0.9})]
    groups = compare.summarise(options, ["top1"])
    assert [(g.label, g.n, g.seeds) for g in groups] == [
        (f"{r} on cifar10/test", 2, [0, 1]), (f"{r} (head_fusion=max discard_ratio=0.9) on cifar10/test", 1, [0])]
    assert groups[0].mean["top1"] == pytest.approx(0.5)

    gap = "vit_tiny_cifar_gap"
    data = [_record(tmp_path, gap, 0, 0.5, content="a" * 64), _record(tmp_path, gap, 0, 0.7, content="b" * 64)]
    assert [g.label for g in compare.summarise(data, ["top1"])] == [f"{gap} (content=aaaaaaaa) on cifar10/test",
                                                                    f"{gap} (content=bbbbbbbb) on cifar10/test"]
    compare.check_distinct(data)  # one seed in each of two groups: not counted twice


def test_a_pairing_that_differs_in_more_than_one_factor_is_refused(tmp_path, capsys):
    gap, rollout = "vit_tiny_cifar_gap", "vit_tiny_cifar_rollout"
    values = {(gap, 2): (0.50, 0.54), (rollout, 2): (0.53, 0.58), (rollout, 3): (0.61, 0.62)}
    runs = {key: [_record(tmp_path, key[0], s, v, {"depth": key[1]}) for s, v in enumerate(vals)]
            for key, vals in values.items()}
    base, by_pool, by_depth = (compare.summarise(runs[k], ["top1"])[0] for k in values)
    for a, b, x, y in ((base, by_pool, (gap, 2), (rollout, 2)), (by_pool, by_depth, (rollout, 2), (rollout, 3))):
        row = compare.compare_groups(a, b, ["top1"])[0]  # one factor: paired, as by hand
        by_hand = np.mean([v - u for u, v in zip(values[x], values[y], strict=True)])
        assert row.seeds == [0, 1] and row.delta.mean == pytest.approx(by_hand)
    with pytest.raises(UserError) as e:
        compare.compare_groups(base, by_depth, ["top1"])
    assert str(e.value) == (
        f"{rollout} on cifar10/test and {gap} on cifar10/test differ in the pooling (architecture "
        f"{gap} vs {rollout}, weights {gap} vs {rollout}, pooling avg vs rollout, readout avg vs rollout, global_pool "
        "avg vs rollout) and in the architecture (depth 2 vs 3); a paired difference compares one factor: compare runs "
        "that differ only in the pooling, or only in the architecture")
    # the command: one line, exit 2, no report
    folders = [r["path"] for r in runs[(gap, 2)] + runs[(rollout, 3)]]
    with pytest.raises(SystemExit) as stop:
        run_cli(compare.main, [*folders, "--output", str(tmp_path / "report")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith(f"error: {rollout} on cifar10/test and")
    assert not (tmp_path / "report" / "report.md").exists()


def test_another_architecture_of_other_parameters_is_the_architecture_factor(tmp_path):
    """The tiny models' _gap and _rollout build to the same parameters (a pooling difference); vit_small does not."""
    small = [_record(tmp_path, "vit_small_patch16_224", 0, 0.5, pool="rollout")]  # built with token pooling
    tiny = [_record(tmp_path, "vit_tiny_cifar_gap", 0, 0.5, {"depth": 2})]
    with pytest.raises(UserError, match=r"differ in the architecture \(architecture vit_tiny_cifar_gap vs "
                                        r"vit_small_patch16_224, .*depth 2 vs None\) and in the pooling "):
        compare.compare_groups(*compare.summarise(tiny + small, ["top1"]), ["top1"])


@pytest.mark.parametrize("study", ["cifar10-cpu", "cifar10-gpu-10ep", "cifar10-clutter"])
def test_the_committed_studies_pair_their_arms_and_group_their_rollout_variants_apart(study):
    """Every arm of a committed study differs from every other in its pooling only, so the report pairs them all
    as before; compared without the study's arm labels, rollout and its max/0.9 variant are two groups of 3 (they
    were one of 6), each the plain mean of its runs' recorded top-1."""
    folders = sorted(p.parent for p in (REPO / "results" / study / "eval").glob("*-s*/results.json"))
    results = load_results(folders)
    arms = compare.summarise(results, ["top1"], label=lambda r: arm_of(r["path"]))
    for a, b in itertools.permutations(arms, 2):
        assert compare.compare_groups(a, b, ["top1"])[0].delta is not None
    groups = {g.label: g for g in compare.summarise(results, ["top1"])}
    assert len(groups) == len(arms)
    for arm in arms:
        group = next(g for g in groups.values() if sorted(g.runs) == sorted(arm.runs))  # the same runs
        assert group.mean["top1"] == pytest.approx(np.mean([r["metrics"]["top1"] for r in results
                                                            if r["path"] in arm.runs]))


def test_runs_scored_on_other_boxes_are_apart_and_never_paired(tmp_path):
    """The same images with other object boxes (another --bbox-format, or edited boxes): other groups, labelled by
    the boxes' hash, and a pairing across them is refused in one line."""
    gap, rollout = "vit_tiny_cifar_gap", "vit_tiny_cifar_rollout"
    runs = [_record(tmp_path, gap, 0, 0.5, boxes="a" * 64), _record(tmp_path, gap, 1, 0.7, boxes="b" * 64)]
    groups = compare.summarise(runs, ["top1"])
    assert [(g.label, g.n) for g in groups] == [(f"{gap} (boxes=aaaaaaaa) on cifar10/test", 1),
                                                (f"{gap} (boxes=bbbbbbbb) on cifar10/test", 1)]
    base, other = compare.summarise([runs[0], _record(tmp_path, rollout, 0, 0.6, boxes="b" * 64)], ["top1"])
    with pytest.raises(UserError, match=r"scored on other object boxes .*same --bbox-format"):
        compare.compare_groups(base, other, ["top1"])
    like = compare.summarise([runs[0], _record(tmp_path, rollout, 0, 0.6, boxes="a" * 64)], ["top1"])
    assert compare.compare_groups(*like, ["top1"])[0].seeds == [0]
