"""scripts/summary_figure.py on the committed 50-epoch study: its paired differences against scipy by hand."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from timm_rollout.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "results" / "cifar10-cpu"
_spec = importlib.util.spec_from_file_location("summary_figure", ROOT / "scripts" / "summary_figure.py")
summary_figure = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summary_figure)

pytestmark = pytest.mark.skipif(not (STUDY / "eval" / "gap-s0").exists(), reason="needs results/cifar10-cpu")


def test_paired_differences_match_a_t_interval_by_hand():
    pairs = [("cls", "gap"), ("gap", "map"), ("gap", "no-such-arm")]
    found = summary_figure.paired_top1(summary_figure.study_groups(STUDY), pairs)
    assert set(found) == {("cls", "gap"), ("gap", "map")}  # a pair the study lacks is left out
    for base, other in found:
        top1 = {arm: [json.loads((STUDY / "eval" / f"{arm}-s{s}" / "results.json").read_text())["metrics"]["top1"]
                      for s in (0, 1, 2)] for arm in (base, other)}
        d = 100 * (np.array(top1[other]) - np.array(top1[base]))
        half = sps.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
        np.testing.assert_allclose(found[base, other][:3], (d.mean(), d.mean() - half, d.mean() + half), rtol=1e-9)
        assert found[base, other][3] == 3


def test_cli_writes_the_figure_and_refuses_a_bad_pair(tmp_path):
    out = tmp_path / "summary.png"
    common = ["--curves", str(STUDY), "--studies", str(STUDY), "--output", str(out)]
    summary_figure.main([*common, "--pairs", "cls:gap", "gap:map"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(UserError, match="'cls': give a pair as BASE:OTHER"):  # one line: tests/test_cli.py
        summary_figure.main([*common, "--pairs", "cls"])
