"""The code version (records.code_label) in harness.compare's report and in the Hub card, and the card's mask wording
following the mask convention the evaluated data had; on hand-made records."""

from __future__ import annotations

import json
from pathlib import Path

import timm

from harness import compare, hub
from timm_rollout.records import code_label

CODE_A = {"version": "0.1.0", "commit": "a" * 40, "dirty": False}
CODE_B = {"version": "0.1.0", "commit": "b" * 40, "dirty": True}


def _evaluation(folder: Path, name: str, seed: int, top1: float, code: dict | None) -> str:
    folder.mkdir(parents=True)
    record = {"model": {"name": name, "architecture": name, "global_pool": "avg", "model_args": {}},
              "data": {"argument": "cifar10", "split": "test", "fingerprint": "f", "subset_fingerprint": "f",
                       "split_content": "c", "content": "c"},
              "config": {"seed": seed}, "metrics": {"top1": top1}, **({"code": code} if code else {})}
    (folder / "results.json").write_text(json.dumps(record))
    return str(folder)


def test_compare_report_names_the_code_that_compared_and_that_evaluated(tmp_path):
    runs = [_evaluation(tmp_path / f"e{i}", "vit_tiny_cifar_gap", i, 0.5 + i / 10, code)
            for i, code in enumerate((CODE_B, CODE_A, None, CODE_A))]
    compare.main([*runs, "--output", str(tmp_path / "report")])
    last = (tmp_path / "report" / "report.md").read_text().splitlines()[-1]
    assert last == (f"Code: compared with {code_label()}; evaluated with not recorded, timm-rollout 0.1.0 @ "
                    "aaaaaaaaaaaa, timm-rollout 0.1.0 @ bbbbbbbbbbbb + uncommitted changes.")


def _card(results: dict, summary: dict | None = None, train_args: dict | None = None) -> str:
    facts = hub.describe_model(timm.create_model("vit_tiny_cifar_gap", depth=1))
    return hub.render_card(hub.model_card("me/tiny", facts, train_args, summary), "me/tiny", results)


def test_card_names_the_code_of_training_evaluation_and_card():
    summary = {"epochs": 3, "code": {"timm-rollout 0.1.0 @ aaaaaaaaaaaa": 2, "timm-rollout 0.1.0 @ bbbbbbbbbbbb": 1}}
    text = _card({"metrics": {"top1": 0.5}, "code": CODE_B}, summary, {"code": CODE_A})
    assert "timm-rollout 0.1.0 @ aaaaaaaaaaaa: 2 epochs; timm-rollout 0.1.0 @ bbbbbbbbbbbb: 1 epochs" in text
    assert f"card: {code_label()}" in text
    assert "`python -m harness.eval` by timm-rollout 0.1.0 @ bbbbbbbbbbbb + uncommitted changes, computed" in text
    assert "training: timm-rollout 0.1.0 @ aaaaaaaaaaaa" in _card({"metrics": {}}, None, {"code": CODE_A})


def test_card_speaks_of_background_for_foreground_masks_and_of_clutter_for_clutter_masks():
    metrics = {"pooling_object_share": 0.4, "context_top1": 0.2, "rollout_object_share": 0.3}
    for convention, word, other in (("foreground", "background", "clutter"), ("clutter", "clutter", "background")):
        evaluation = _card({"metrics": metrics, "data": {"mask_convention": convention}}).split("## Evaluation")[1]
        rows = [line for line in evaluation.splitlines() if line.startswith("| ") and "Metric" not in line]
        assert len(rows) == 3 and all(word in row and other not in row for row in rows), rows
