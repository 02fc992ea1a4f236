"""scripts/study.py end to end at toy scale on the shipped CIFAR-10 sample: arms, post-hoc readouts, report
statistics, commits, skipping, refusal."""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from safetensors.torch import load_file
from scipy import stats as sps

from harness import figures, study
from harness.compare import summarise
from harness.record import read_predictions
from harness.study import folder, jobs, plan
from harness.study import report as study_report
from harness.study import tables as study_tables
from timm_rollout import records
from timm_rollout.device import device_name
from timm_rollout.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


ARMS = ("cls", "gap", "rollout-grad")
POSTHOC = ("cls-posthoc-rollout", "cls-posthoc-avg")
SHOWN = (*ARMS, *POSTHOC)  # the report's columns, in study order
RUNS = 6  # trained: 3 arms x 2 seeds
EVALS = 10  # 5 arms (3 trained, 2 post-hoc) x 2 seeds


def _argv(out: Path, epochs: int = 1, arms: tuple[str, ...] = ARMS) -> list[str]:
    """Toy scale: depth-1 models (``--model-kwargs`` inside --train-args, merged with rollout-grad's own)."""
    return ["--dataset", "cifar10-sample", "--epochs", str(epochs), "--seeds", "0", "1", "--max-train-samples", "100",
            "--arms", *arms, "--train-args", "--batch-size 20 --model-kwargs depth=1 --warmup-epochs 0 "
            "--max-eval-samples 100 --no-progress --workers 1", "--eval-per-class", "5", "--bank-per-class", "10",
            "--faithfulness-images", "4", "--heatmaps", "2", "--jobs", "2", "--device", "cpu",
            "--commit", "--output", str(out)]


def _git(repo: Path, *argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=repo, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A fresh git repository with the project's .gitignore, the study committing into results/toy."""
    repo = tmp_path_factory.mktemp("repo")
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "study@test")
    _git(repo, "config", "user.name", "study test")
    shutil.copyfile(ROOT / ".gitignore", repo / ".gitignore")
    return repo


@pytest.fixture(scope="module")
def finished(repo) -> Path:
    out = repo / "results" / "toy"
    study.main(_argv(out))
    return out


def _table_row(report: str, metric: str, after: str = "") -> list[str]:
    """Cells of the first table row for ``metric`` after the line ``after`` (default: from the top)."""
    lines = report.splitlines()
    start = lines.index(after) if after else 0
    row = next(line for line in lines[start:] if line.startswith(f"| {metric} |"))
    return [cell.strip() for cell in row.strip("|").split("|")]


def _correct(folder: Path) -> dict[int, bool]:
    pred = read_predictions(folder)
    return {i: p == y for i, p, y in zip(pred["index"], pred["predicted"]["top1"], pred["label"], strict=True)}


def _columns(report: str) -> list[str]:
    """Arm names of the first means table's header (``cls (n=2)`` -> ``cls``)."""
    header = next(line for line in report.splitlines() if line.startswith("| metric |"))
    return [cell.strip().split(" (n=")[0] for cell in header.strip("|").split("|")[1:]]


def test_report_matches_the_evaluations(finished):
    """Every statistic in the report is recomputed from the results.json / predictions.json files of every arm
    (post-hoc readouts included) with numpy, scipy and a hand count."""
    report = (finished / "report.md").read_text(encoding="utf-8")
    assert "- `python scripts/study.py --dataset cifar10-sample --epochs 1 --seeds 0 1" in report
    assert "beyond" not in report  # the spread rule is gone
    assert _columns(report) == list(SHOWN)
    for name in ("curves.png", "heatmaps.png", "pooling.png", *(f"eval/{a}-s0/cosine_matrix.png" for a in SHOWN)):
        assert (finished / name).stat().st_size > 10_000, name
    folders = {(a, s): finished / "eval" / f"{a}-s{s}" for a in SHOWN for s in (0, 1)}
    results = {k: json.loads((f / "results.json").read_text()) for k, f in folders.items()}
    for metric in ("rollout_effective_patches", "rollout_cosine_to_mean"):  # shown per arm, not tested
        for arm, cell in zip(SHOWN, _table_row(report, metric)[1:], strict=True):
            values = [results[arm, s]["metrics"][metric] for s in (0, 1)]
            assert float(cell.split()[0]) == pytest.approx(np.mean(values), abs=6e-5)
        assert f"| {metric} |" not in report.split("## Paired differences")[1].split("## Training curves")[0]
    assert "![pooling diagnostics](pooling.png)" in report
    layers = next(line for line in report.splitlines() if line.startswith("| arm | rollout |"))
    head = [c.strip() for c in layers.strip("|").split("|")]
    assert head[2:6] == ["rollout max", "rollout min", "rollout mean-discard0.9", "rollout max-discard0.9"]
    for arm in (a for a in SHOWN if "posthoc" not in a):  # the trained arms: mean ± std over seeds of the records
        row = [c.strip() for c in next(line for line in report.splitlines() if line.startswith(f"| {arm} | ")
                                       and "±" in line and line.count("|") == len(head) + 1).strip("|").split("|")]
        records = [results[arm, s]["pooling_diagnostics"] for s in (0, 1)]
        want = [np.mean([r["rollout_variants"]["max"] for r in records]),
                np.mean([r["layer_effective_patches"][-1] for r in records])]
        assert [float(row[2].split()[0]), float(row[-1].split()[0])] == pytest.approx(want, abs=0.051)
    section = report.split("## Beside the original write-up")[1].split("\n## ")[0]
    for arm in ("cls", "gap"):  # no probe evaluations: the full test split in the write-up's units, said so
        values = np.array([results[arm, s]["metrics"]["ratio_original"] for s in (0, 1)])
        row = next(r for r in section.splitlines() if r.startswith(f"| centroid ratio inter / intra | {arm} |"))
        assert f"{values.mean():.4f} ± {values.std(ddof=1):.4f} (full test split)" in row
    assert "ratio_original" not in report.split("## Beside the original write-up")[0]  # shown, never tested
    for metric in ("top1", "linear_probe", "knn_loo", "knn_bank", "ratio", "silhouette"):
        values = {a: np.array([results[a, s]["metrics"][metric] for s in (0, 1)]) for a in SHOWN}
        for arm, cell in zip(SHOWN, _table_row(report, metric)[1:], strict=True):
            mean, std = map(float, re.findall(r"-?\d+\.\d+", cell))
            assert mean == pytest.approx(values[arm].mean(), abs=6e-5)
            assert std == pytest.approx(values[arm].std(ddof=1), abs=6e-5)
        for arm, ref in (("rollout-grad", "cls"), ("cls-posthoc-rollout", "cls"), ("cls-posthoc-avg", "gap")):
            row = _table_row(report, metric, after=f"### {arm} - {ref}")
            diff = values[arm] - values[ref]
            assert row[1] == "2" and float(row[2]) == pytest.approx(diff.mean(), abs=6e-5)
            if diff.std(ddof=1) > 0:
                low, high = sps.t.interval(0.95, 1, loc=diff.mean(), scale=diff.std(ddof=1) / np.sqrt(2))
                assert row[3] == f"[{low:+.4f}, {high:+.4f}]"
                assert float(row[4]) == pytest.approx(sps.ttest_rel(values[arm], values[ref]).pvalue, rel=1e-2)
    # Per-image McNemar for top-1 pooled over both seeds, counted by hand from predictions.json.
    only = [0, 0]
    for s in (0, 1):
        a, b = _correct(folders["cls", s]), _correct(folders["rollout-grad", s])
        only[0] += sum(a[i] and not b[i] for i in a)
        only[1] += sum(b[i] and not a[i] for i in a)
    assert _table_row(report, "top1", after="### rollout-grad - cls")[7] == f"{only[0]} / {only[1]}"
    deletion = {a: [results[a, s]["faithfulness"]["fills"]["drop"]["maps"]["rollout"]["deletion_auc"] for s in (0, 1)]
                for a in SHOWN}
    for arm, cell in zip(SHOWN, _table_row(report, "rollout deletion AUC (drop)")[1:], strict=True):
        assert float(cell.split()[0]) == pytest.approx(np.mean(deletion[arm]), abs=6e-5)


def test_report_lists_each_runs_wall_time_machine_and_code(finished):
    """The Runs section repeats what each run recorded: training minutes, the machine and code of every epoch, the
    evaluation's minutes, machine, precision and code (this test's runs trained two seeds per job, one after another,
    and evaluated on this CPU)."""
    report = (finished / "report.md").read_text(encoding="utf-8")
    cpu = device_name(torch.device("cpu")).removeprefix("CPU ").rsplit(", ", 1)[0]  # any CPU, "model name" or not
    for arm, seed in ((a, s) for a in SHOWN for s in (0, 1)):
        run = finished / "runs" / f"{plan.backbone(arm)}-s{seed}"
        summary = json.loads((run / "summary.json").read_text())
        [(machine, epochs)] = summary["machines"].items()
        precision = json.loads((run / "train_args.json").read_text())["amp_dtype"]  # --amp auto: bf16 where native
        assert re.fullmatch(rf"CPU {re.escape(cpu)}, \d+ threads, {precision}", machine) and epochs == 1
        result = json.loads((finished / "eval" / f"{arm}-s{seed}" / "results.json").read_text())
        [(code, epochs)] = summary["code"].items()
        assert code == _label(json.loads((run / "train_args.json").read_text())["code"]) and epochs == 1
        trained = (f"{summary['wall_seconds'] / 60:.1f} min, {machine}: 1 epoch; code {code}: 1 epoch" if arm in ARMS
                   else "the `cls` run")
        line = (f"- {arm}, seed {seed}: training `runs/{plan.backbone(arm)}-s{seed}` ({trained}); evaluation "
                f"`eval/{arm}-s{seed}` ({result['timing']['total'] / 60:.1f} min, CPU {cpu}, "
                f"{result['environment']['torch_threads']} threads, {result['environment']['dtype']}); "
                f"evaluation code {_label(result['code'])}")
        assert line in report.splitlines()


def _label(code: dict) -> str:
    """The code a record names, written out by hand: ``timm-rollout VERSION @ COMMIT[:12]`` (+ uncommitted changes)
    from a checkout, ``timm-rollout VERSION`` outside one."""
    if code["commit"] is None:
        return f"timm-rollout {code['version']}"
    dirty = " + uncommitted changes" if code["dirty"] else ""
    return f"timm-rollout {code['version']} @ {code['commit'][:12]}{dirty}"


def test_posthoc_readouts_evaluate_the_cls_weights_with_another_pooling(finished):
    cls = finished / "runs" / "cls-s1"
    for arm, pool in (("cls", "token"), ("cls-posthoc-rollout", "rollout"), ("cls-posthoc-avg", "avg")):
        model = json.loads((finished / "eval" / f"{arm}-s1" / "results.json").read_text())["model"]
        assert model["pool"] == pool and model["sha256"] == records.sha256_file(cls / "model.safetensors")
    assert not (finished / "runs" / "cls-posthoc-avg-s1").exists()  # no training of its own


def test_predictions_file_reproduces_the_accuracies(finished):
    folder = finished / "eval" / "rollout-grad-s1"
    results = json.loads((folder / "results.json").read_text())
    pred = read_predictions(folder)
    labels = np.array(pred["label"])
    assert len(labels) == results["data"]["num_images"] == 50 and len(set(pred["index"])) == 50
    for metric in ("top1", "linear_probe", "knn_loo", "knn_bank"):
        assert (np.array(pred["predicted"][metric]) == labels).mean() == pytest.approx(results["metrics"][metric])
    assert np.mean(pred["top5_hit"]) == pytest.approx(results["metrics"]["top5"])
    assert results["config"]["linear_probe"] == {"C": 1.0, "solver": "lbfgs", "max_iter": 1000, "tol": 1e-4}


def test_arms_share_one_recipe(finished):
    """The runs of a seed differ only in the model, rollout-grad's kwarg (merged with --train-args' own) and where
    they are written."""
    args = {a: json.loads((finished / "runs" / f"{a}-s0" / "train_args.json").read_text()) for a in ARMS}
    for arm in ("gap", "rollout-grad"):
        assert {k for k in args["cls"].keys() | args[arm].keys() if args["cls"].get(k) != args[arm].get(k)} == (
            {"model", "output", "model_kwargs"} if arm == "rollout-grad" else {"model", "output"})
    assert args["cls"]["model_kwargs"] == {"depth": 1}
    assert args["rollout-grad"]["model_kwargs"] == {"depth": 1, "rollout_grad": True}
    assert args["cls"]["seed"] == 0 and args["cls"]["epochs"] == 1 and args["cls"]["batch_size"] == 20
    config = json.loads((finished / "runs" / "rollout-grad-s0" / "config.json").read_text())
    assert config["model_args"]["rollout_grad"] is True and config["model_args"]["depth"] == 1


def test_pick_seed_ignores_the_test_set_and_breaks_ties_by_seed():
    logs = {2: [{"train_loss": 0.1}, {"train_loss": 0.5}], 0: [{"train_loss": 0.4}], 1: [{"train_loss": 0.4}]}
    assert study_report.pick_seed(logs) == 0  # the last epoch counts; 0 and 1 tie at 0.4
    assert study_report.pick_seed({**logs, 1: [{"train_loss": 0.39}]}) == 1


def test_arms_table_holds_learned_and_sharpened_pooling_outside_the_defaults():
    parser = study.build_parser()
    assert parser.parse_args(["--dataset", "x", "--epochs", "1", "--output", "o"]).arms == list(plan.DEFAULT_ARMS)
    assert set(plan.DEFAULT_ARMS) < set(plan.ARMS)
    # on the tiny CIFAR ViT: the committed studies' models and --model-kwargs
    assert plan.arm_model(None, "map") == ("vit_tiny_cifar_cls", ["global_pool=map"], [])
    assert plan.arm_model(None, "rollout-grad") == ("vit_tiny_cifar_rollout", ["rollout_grad=True"], [])
    model, kwargs, flags = plan.arm_model(None, "rollout-max-discard0.9")
    assert flags == []
    assert model == "vit_tiny_cifar_rollout" and kwargs == ["rollout_head_fusion=max", "rollout_discard_ratio=0.9"]
    assert plan.merge_model_kwargs(["--model-kwargs", "depth=1"], kwargs)[-3:] == ["depth=1", *kwargs]
    assert [plan.arm_model(None, a)[0] for a in ("cls", "gap", "rollout")] == [
        "vit_tiny_cifar_cls", "vit_tiny_cifar_gap", "vit_tiny_cifar_rollout"]
    # on any timm ViT: the trainer's --pool / --pool-kwargs, and map built in
    base = "vit_small_patch16_224"
    assert plan.arm_model(base, "gap") == (base, [], ["--pool", "avg"])
    assert plan.arm_model(base, "rollout-max-discard0.9") == (
        base, [], ["--pool", "rollout", "--pool-kwargs", "head_fusion=max", "discard_ratio=0.9"])
    assert plan.arm_model(base, "map") == (base, ["global_pool=map"], [])


def test_merge_model_kwargs_keeps_one_list():
    merge = plan.merge_model_kwargs
    assert merge(["--lr", "1e-3"], ()) == ["--lr", "1e-3"]
    assert merge(["--model-kwargs", "depth=1", "--lr", "1e-3"], ("rollout_grad=True",)) == [
        "--lr", "1e-3", "--model-kwargs", "depth=1", "rollout_grad=True"]
    assert merge(["--model-kwargs", "depth=1", "a=2", "--smoothing", "0.1", "--model-kwargs=depth=2"],
                 ("a=3",)) == ["--smoothing", "0.1", "--model-kwargs", "depth=2", "a=3"]


def test_each_finished_run_is_committed_with_its_weights(repo, finished):
    log = _git(repo, "log", "--format=%s").splitlines()
    for arm in ARMS:
        for seed in (0, 1):
            message = next(line for line in log if line.startswith(f"study: {arm} seed {seed} (top1 "))
            top1 = json.loads((finished / "eval" / f"{arm}-s{seed}" / "results.json").read_text())["metrics"]["top1"]
            assert f"(top1 {top1:.4f}, linear_probe " in message
            assert message.endswith("; post-hoc readouts rollout, avg)") == (arm == "cls")
    assert log[0].startswith("study: report (cls, gap, rollout-grad, cls-posthoc-rollout, cls-posthoc-avg;")
    # The study's identity is committed on its own before the first run, so a fresh clone refuses a re-run with
    # other flags, and no run's commit carries a change of settings.
    touched = _git(repo, "log", "--reverse", "--format=%s", "--", "results/toy/study.json").splitlines()
    assert touched[0] == log[-1] == "study: settings and commands of toy (study.json)"
    assert not any(" seed " in message for message in touched)
    tracked = set(_git(repo, "ls-files").splitlines())
    assert {"results/toy/runs/cls-s0/model.safetensors", "results/toy/eval/cls-posthoc-avg-s1/predictions.json.gz",
            "results/toy/runs/gap-s1/log.csv", "results/toy/report.md"} <= tracked
    assert not any(name.endswith(("resume.safetensors", "features.safetensors")) for name in tracked)
    assert _git(repo, "status", "--porcelain", "--", "results") == ""  # nothing of the study left uncommitted
    assert not list(finished.glob("runs/*/resume.safetensors"))  # dropped once its run finished
    # An unfinished run's resume state is visible to git (it travels with the work tree); features stay ignored.
    ignored = [subprocess.run(["git", "check-ignore", "-q", f"results/toy/runs/cls-s9/{name}"], cwd=repo).returncode
               for name in ("resume.safetensors", "features.safetensors")]
    assert ignored == [1, 0]


def test_rerun_skips_finished_work_and_redoes_only_what_is_missing(repo, finished, capfd):
    kept = finished / "eval" / "cls-s1" / "results.json"
    redo = finished / "eval" / "cls-posthoc-rollout-s1" / "results.json"
    stamp = kept.stat().st_mtime_ns
    redo.unlink()
    older = finished / "eval" / "gap-s0" / "results.json"  # written before the schema and the pooling diagnostics
    full = json.loads(older.read_text())
    stripped = {k: v for k, v in full.items() if k not in ("schema", "pooling_diagnostics")}
    stripped["metrics"] = {k: v for k, v in full["metrics"].items() if not k.startswith("rollout_")}
    older.write_text(json.dumps(stripped))
    capfd.readouterr()
    study.main(_argv(finished))
    printed = capfd.readouterr().out
    assert printed.count("finished, skipped") == RUNS
    assert printed.count("evaluated, skipped") == EVALS - 2
    assert f"= {older.parent} evaluated by an older harness (results.json schema 0), evaluating again" in printed
    assert kept.stat().st_mtime_ns == stamp
    back = json.loads(older.read_text())  # evaluated again: the full evaluation's numbers, in the current layout
    assert back["schema"] == 1 and back["metrics"] == full["metrics"]
    assert back["pooling_diagnostics"] == full["pooling_diagnostics"]
    assert json.loads(redo.read_text())["model"]["pool"] == "rollout"
    assert _git(repo, "log", "-1", "--format=%s", "--", str(redo)).startswith("study: cls seed 1 (top1 ")
    # Naming fewer arms reuses the folder: the report still covers every arm run before.
    study.main(_argv(finished, arms=("gap",)))
    assert "evaluated, skipped" in capfd.readouterr().out
    assert _columns((finished / "report.md").read_text(encoding="utf-8")) == list(SHOWN)
    assert json.loads((finished / "study.json").read_text())["arms"] == list(ARMS)


def test_rerun_with_other_study_flags_is_refused(finished, tmp_path, repo):
    with pytest.raises(UserError, match=r"--epochs 1 \(now 2\)"):
        study.main(_argv(finished, epochs=2))
    with pytest.raises(UserError, match="argument --jobs: must be an integer >= 1, got 0"):
        study.main([*_argv(finished), "--jobs", "0"])
    with pytest.raises(UserError, match="--commit needs --output inside a git work tree"):
        study.main(_argv(tmp_path / "outside"))
    with pytest.raises(UserError, match=r"git ignores the weights written under .*\(\.gitignore\)"):
        study.main(_argv(repo / "study" / "ignored"))


@pytest.mark.parametrize(("flags", "message"), [
    (["--epochs", "-3"], "argument --epochs: must be an integer >= 1, got -3"),
    (["--eval-per-class", "1"], "argument --eval-per-class: must be an integer >= 2, got 1"),
    (["--bank-per-class", "0"], "argument --bank-per-class: must be an integer >= 1, got 0"),
    (["--max-train-samples", "0"], "argument --max-train-samples: must be an integer >= 1, got 0"),
    (["--heatmaps", "-1"], "argument --heatmaps: must be an integer >= 0, got -1"),
    (["--faithfulness-images", "-1"], "argument --faithfulness-images: must be an integer >= 0, got -1"),
    (["--seeds", "0", "-1"], "argument --seeds: must be an integer in [0, 4294967295], got -1"),
    (["--dataset", "./no/such/folder"], "no data set folder at ./no/such/folder"),
    (["--output", "{file}"], "study.json is a file; pass a folder"),
    (["--epocs", "2"], "unrecognized arguments: --epocs 2; did you mean --epochs"),
    # --train-args may not contradict a flag the study sets itself, in any spelling argparse accepts
    (["--train-args", "--epochs 2"], "--train-args sets --epochs, which the study sets itself; use the study's --epo"),
    (["--train-args", "--lr 1e-3 --epoch 2"], "sets --epochs, which the study sets itself; use the study's --epochs"),
    (["--train-args=--epochs=2"], "sets --epochs, which the study sets itself; use the study's --epochs"),
    (["--train-args", "--seed 7"], "sets --seed, which the study sets itself; use the study's --seeds"),
    (["--train-args", "--output runs/x"], "sets --output, which the study sets itself; use the study's --output"),
    (["--train-args", "--dataset cifar10"], "sets --dataset, which the study sets itself; use the study's --dataset"),
    (["--train-args", "--model vit_tiny_cifar_gap"], "sets --model, which the study sets itself; use the study's --mo"),
    (["--train-args", "--device cpu"], "sets --device, which the study sets itself; use the study's --device"),
    (["--train-args", "--max-train-samples 9"], "sets --max-train-samples, which the study sets itself; use the stu"),
    (["--train-args=--stack"], "--train-args: --stack was removed; train many runs as separate processes with scri"),
    (["--train-args=--resume"], "sets --resume, which the study sets itself; drop it: re-running the study command"),
    (["--train-args=--overwrite"], "sets --overwrite, which the study sets itself; drop it: the study never overwri"),
    (["--train-args", "--pool avg"], "sets --pool, which the study sets itself; choose the pooling with --arms"),
    (["--train-args", "--pool-kwargs grad=True"], "sets --pool-kwargs, which the study sets itself; choose the pooli"),
    (["--train-args", "--model-kwargs depth=1 global_pool=avg"],
     "--train-args sets --model-kwargs global_pool, which defines an arm's pooling; choose the pooling with --arms"),
    (["--train-args", "--model-kwargs rollout_head_fusion=max"], "sets --model-kwargs rollout_head_fusion, which def"),
    (["--train-args", "--model-kw depth=1"], "--train-args: write --model-kw out as --model-kwargs; the study merges"),
    # and must be shell words the trainer accepts, for every arm
    (["--train-args", "--lr '1e-3"], "does not split as shell words (No closing quotation); balance its quotes"),
    (["--train-args", "--lr -1"], "arm cls would not train: argument --lr: must be a number > 0, got -1 (check --tr"),
    (["--train-args=-h"], "--train-args asks for the trainer's help; read it with python -m timm_rollout.train --he"),
    (["--train-args", "--lr 1e-3 --hel"], "--train-args asks for the trainer's help; read it with python -m timm_ro"),
    (["--train-args", "--frobnicate 3"], "--train-args: unrecognized training flags --frobnicate 3; see python -m t"),
    (["--arms", "map", "--train-args", "--model-kwargs dpeth=2"], "arm map would not train: vit_tiny_cifar_cls cann"),
])
def test_bad_values_are_refused_before_anything_is_recorded(tmp_path, flags, message):
    (tmp_path / "study.json").write_text("{}")
    out = tmp_path / "study"
    argv = ["--dataset", "cifar10-sample", "--epochs", "2", "--output", str(out), "--report-only",  # never trains
            *[f.format(file=tmp_path / "study.json") for f in flags]]
    with pytest.raises(UserError) as e:
        study.main(argv)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not out.exists()


@pytest.mark.parametrize("base", [None, "vit_small_patch16_224"])
def test_every_trainer_flag_the_study_sets_is_guarded(base):
    """Every flag of the training command the study builds (each arm, on the tiny ViT and on a --model, with every
    study flag that adds one), read by the trainer's own parser, is one --train-args may not set."""
    args = study.build_parser().parse_args(["--dataset", "cifar10-sample", "--epochs", "2", "--output", "out",
                                            "--max-train-samples", "50", "--seeds", "0", "1",
                                            *(["--model", base] if base else []), "--train-args",
                                            "--model-kwargs img_size=32 patch_size=4 depth=1 --lr 1e-3"])
    for arm in plan.ARMS:
        command = plan.train_command(args, arm, 1, f"runs/{arm}-s1")
        given, kwargs = plan.train_flags(command)
        assert given - {"model_kwargs", "lr"} <= plan.STUDY_SETS.keys(), arm
        assert {"model", "dataset", "epochs", "seed", "output", "resume", "device", "max_train_samples"} <= given, arm
        own = {k for k in kwargs if k not in ("img_size", "patch_size", "depth")}
        assert all(k.startswith(plan.ARM_KWARGS) for k in own), arm
    trainer = {a.dest for a in plan.train_parser()._actions}
    assert plan.STUDY_SETS.keys() <= trainer


def test_recorded_settings_are_replaced_until_a_run_has_trained(tmp_path):
    """A first command with a typo (a Hub id that does not exist) records it; the corrected command replaces it
    while no run has saved an epoch, then other settings are refused."""
    out = tmp_path / "study"
    base = ["--epochs", "2", "--output", str(out), "--report-only"]
    for dataset in ("cifar10-sampel", "cifar10-sample"):
        with pytest.raises(UserError, match=r"no seed of .* is finished"):
            study.main(["--dataset", dataset, *base])
    saved = json.loads((out / "study.json").read_text())
    assert saved["identity"]["dataset"] == "cifar10-sample" and saved["identity"]["epochs"] == 2
    assert saved["commands"] == [f"python scripts/study.py --dataset cifar10-sample {' '.join(base)}"]
    (out / "runs" / "cls-s0").mkdir(parents=True)
    (out / "runs" / "cls-s0" / "resume.safetensors").write_bytes(b"")  # one epoch saved
    with pytest.raises(UserError, match=r"holds a study run with --epochs 2 \(now 3\); repeat those flags"):
        study.main(["--dataset", "cifar10-sample", "--epochs", "3", *base[2:]])
    assert json.loads((out / "study.json").read_text())["identity"]["epochs"] == 2


def test_the_folder_remembers_also_eval_and_the_primary_comparison(tmp_path):
    """--also-eval and --primary, once given, are inherited by a command that leaves them out (a report would
    otherwise drop their rows silently) and refused when given otherwise."""
    out = tmp_path / "study"
    base = ["--dataset", "cifar10-sample", "--epochs", "2", "--output", str(out), "--report-only"]
    with pytest.raises(UserError, match=r"no seed of .* is finished"):
        study.main([*base, "--also-eval", "cifar10-sample", "--primary", "gap:rollout"])
    saved = json.loads((out / "study.json").read_text())
    assert saved["also_eval"] == ["cifar10-sample"] and saved["primary"] == ["gap", "rollout"]
    args = study.build_parser().parse_args(base)
    args.command = "python scripts/study.py ..."
    folder.check_identity(args, out)
    assert args.also_eval == ["cifar10-sample"] and args.primary == ("gap", "rollout")
    (out / "study.json").write_text(json.dumps({**saved, "also_eval": "cifar10-sample"}))  # recorded before lists
    args = study.build_parser().parse_args(base)
    args.command = "python scripts/study.py ..."
    folder.check_identity(args, out)
    assert args.also_eval == ["cifar10-sample"]
    with pytest.raises(UserError, match=r"was run with --also-eval cifar10-sample; repeat it, or leave --also-eval"):
        study.main([*base, "--also-eval", "cifar10-sample", "cifar10-sample-2"])
    with pytest.raises(UserError, match=r"was run with --primary gap:rollout; repeat it, or leave --primary out"):
        study.main([*base, "--primary", "cls:rollout"])
    for wrong in ("gap", "gap:gap", "gap:nope"):
        with pytest.raises(UserError, match=r"--primary: expected BASE:ARM of two arms \(cls, gap, .*gap:rollout$"):
            study.build_parser().parse_args([*base, "--primary", wrong])


def test_each_arm_is_compared_with_cls_gap_and_rollout():
    """Four arms, three seeds: every arm against cls, the others against gap and rollout too, each pair once."""
    def result(arm, seed, top1):
        return {"path": f"eval/{arm}-s{seed}", "model": {"name": arm}, "config": {"seed": seed},
                "metrics": {"top1": top1}}

    arms = {"cls": 0.50, "gap": 0.52, "rollout": 0.53, "rollout-grad": 0.51}
    results = [result(a, s, v + 0.01 * s * (a == "rollout")) for a, v in arms.items() for s in (0, 1, 2)]
    groups = {g.label: g for g in summarise(results, ["top1"], label=lambda r: folder.arm_of(r["path"]))}
    text = study_tables.delta_tables(groups, ["top1"])
    headings = [line for line in text.splitlines() if line.startswith("###")]
    assert headings == ["### gap - cls", "### rollout - cls", "### rollout-grad - cls", "### rollout - gap",
                        "### rollout-grad - gap", "### rollout-grad - rollout"]
    # rollout - cls per seed: 0.03, 0.04, 0.05 -> mean 0.04, sd 0.01, the 2-df closed form t = sqrt(1.805/0.0975).
    half = np.sqrt(1.805 / 0.0975) * 0.01 / np.sqrt(3)
    assert _table_row(text, "top1", after="### rollout - cls")[2:4] == ["+0.0400", f"[{0.04 - half:+.4f}, "
                                                                                  f"{0.04 + half:+.4f}]"]
    # rollout-grad - rollout per seed: -0.02, -0.03, -0.04 -> the same interval around -0.03.
    assert _table_row(text, "top1", after="### rollout-grad - rollout")[2:4] == [
        "-0.0300", f"[{-0.03 - half:+.4f}, {-0.03 + half:+.4f}]"]
    two = {k: groups[k] for k in ("cls", "gap")}
    assert "| top1 | 0.5000 ± 0.0000 | 0.5200 ± 0.0000 |" in study_tables.means_table(two, ["top1"])


def test_commit_waits_for_a_busy_repository(tmp_path):
    """Another process holding git's index lock delays the study's commit; it never loses it."""
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "study@test")
    _git(tmp_path, "config", "user.name", "study test")
    (tmp_path / "run.txt").write_text("finished run\n")
    lock = tmp_path / ".git" / "index.lock"
    lock.write_text("")
    threading.Timer(0.5, lock.unlink).start()
    assert jobs.commit_paths([tmp_path / "run.txt"], "study: toy", wait=0.2)
    assert _git(tmp_path, "log", "--format=%s") == "study: toy\n"
    lock.write_text("")  # a lock that stays: the study stops with git's own reason
    (tmp_path / "run.txt").write_text("changed\n")
    with pytest.raises(UserError, match=r"index\.lock"):
        jobs.commit_paths([tmp_path / "run.txt"], "study: toy 2", attempts=2, wait=0.01)


def test_picked_run_of_each_arm_is_exported_for_the_hub(repo, finished):
    """hub/<arm> holds the seed with the lowest final training loss (never the test set) as the upload folder
    push_to_hub writes, committed, and its card says how it was picked."""
    report = (finished / "report.md").read_text(encoding="utf-8")
    tracked = set(_git(repo, "ls-files").splitlines())
    for arm in ARMS:
        loss = {}
        for s in (0, 1):
            with open(finished / "runs" / f"{arm}-s{s}" / "log.csv", newline="") as f:
                loss[s] = float(list(csv.DictReader(f))[-1]["train_loss"])
        best = 1 if loss[1] < loss[0] else 0
        folder = finished / "hub" / arm
        assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]
        weights = load_file(folder / "model.safetensors")
        run = load_file(finished / "runs" / f"{arm}-s{best}" / "model.safetensors")
        assert weights.keys() == run.keys() and all(torch.equal(weights[k], run[k]) for k in run)
        model = timm.create_model(f"local-dir:{folder}", pretrained=True)
        assert all(torch.equal(v, run[k]) for k, v in model.state_dict().items())
        card = (folder / "README.md").read_text()
        assert f"timm-rollout/vit-tiny-cifar10-sample-{arm}" in card
        assert f"**Selection:** seed {best} of seeds 0, 1 of this study arm, the one with the lowest final " \
               "training loss" in card and "the test set played no part" in card
        assert f"- {arm}: `hub/{arm}` (seed {best}," in report
        assert f"results/toy/hub/{arm}/model.safetensors" in tracked


def test_report_only_covers_the_seeds_every_arm_finished(finished, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy)
    (copy / "eval" / "gap-s1" / "results.json").unlink()  # seed 1 unfinished for one arm
    argv = [a for a in _argv(copy) if a != "--commit"] + ["--report-only"]
    study.main(argv)
    report = (copy / "report.md").read_text(encoding="utf-8")
    assert _columns(report) == list(SHOWN) and "cls (n=1)" in report and "1 seed(s) (0)" in report
    commands = json.loads((copy / "study.json").read_text())["commands"]
    assert commands[-1].endswith("--report-only") and len(set(commands)) == len(commands) >= 2
    # Naming the finished arms reports on both seeds, leaving out the arm that lacks one.
    study.main([a for a in _argv(copy, arms=("cls", "rollout-grad")) if a != "--commit"] + ["--report-only"])
    report = (copy / "report.md").read_text(encoding="utf-8")
    assert _columns(report) == ["cls", "rollout-grad", *POSTHOC] and "2 seed(s) (0, 1)" in report
    empty = tmp_path / "empty"
    with pytest.raises(UserError, match=r"no seed of .* is finished by every arm of --arms"):
        study.main([a for a in _argv(empty) if a != "--commit"] + ["--report-only"])


def test_report_includes_the_folders_notes(finished, tmp_path):
    """A hand-written notes.md is the report's Notes section, verbatim, on every render (--report-only rewrites
    report.md); without it there is no such section."""
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy)
    argv = [a for a in _argv(copy) if a != "--commit"] + ["--report-only"]
    notes = "What the numbers mean.\n\n### Limits\n\n- 2 seeds, 1 epoch"
    (copy / "notes.md").write_text(f"\n{notes}\n\n", encoding="utf-8")
    for _ in range(2):
        study.main(argv)
        report = (copy / "report.md").read_text(encoding="utf-8")
        assert report.split("\n## Notes\n\n")[1].split("\n## ")[0] == notes + "\n"
        assert report.index("## Notes") < report.index("## Metrics per arm")
    (copy / "notes.md").unlink()
    study.main(argv)
    assert "## Notes" not in (copy / "report.md").read_text(encoding="utf-8")


def test_the_report_links_a_page_of_every_trained_arm_of_seed_0_on_the_same_images(finished):
    """explore.html (harness.explore): the trained arms' seed-0 models on the first 64 test images, linked."""
    from timm_rollout.data import load_image_set, normalize
    from timm_rollout.loading import load_model

    assert "](explore.html)" in (finished / "report.md").read_text(encoding="utf-8")
    page = (finished / "explore.html").read_text(encoding="utf-8")
    data = json.loads(re.search(r'id="explore-data">(.*?)</script>', page, re.S).group(1))
    assert [m["name"] for m in data["models"]] == list(ARMS)
    assert [im["name"] for im in data["images"]] == [f"cifar10-sample/test #{i}" for i in range(64)]
    images = load_image_set("cifar10-sample", "test").images[:2]
    for arm, entry in zip(ARMS, data["models"], strict=True):
        model, info = load_model(plan.arm_model(None, arm)[0], finished / "runs" / f"{arm}-s0")
        probs = model(normalize(images, info["mean"], info["std"])).softmax(dim=1)
        assert [top[0][1] for top in entry["top5"][:2]] == pytest.approx(probs.max(dim=1).values.tolist(), abs=1e-4)


def test_heatmaps_0_renders_the_report_without_the_grid(finished, tmp_path):
    """--heatmaps 0 asks for no side-by-side grid: no figure (an earlier render's is removed), no section, and the
    rest of the report as with the grid."""
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy)
    assert (copy / "heatmaps.png").is_file()
    argv = [a for a in _argv(copy) if a != "--commit"] + ["--report-only"]
    argv[argv.index("--heatmaps") + 1] = "0"
    study.main(argv)
    report = (copy / "report.md").read_text(encoding="utf-8")
    assert not (copy / "heatmaps.png").exists() and not (copy / "explore.html").exists()
    assert "heatmaps.png" not in report and "## The same test images under every arm" not in report
    assert "explore.html" not in report
    with_grid = (finished / "report.md").read_text(encoding="utf-8")
    assert _table_row(report, "top1") == _table_row(with_grid, "top1")


def test_learning_curve_metrics_come_from_the_training_log(finished, tmp_path):
    """By hand on a constructed log (8 epochs, quarter = epoch 2), and the report's rows against the toy runs' logs."""
    run = tmp_path / "rollout-s3"
    run.mkdir()
    top1 = [10.0, 20.0, 35.0, 40.0, 50.0, 55.0, 60.0, 62.0]
    (run / "log.csv").write_text("epoch,train_loss,eval_loss,eval_top1,eval_top5,lr,img_per_s,seconds\n" + "".join(
        f"{e},1,1,{t},90,0.001,100,10\n" for e, t in enumerate(top1, start=1)))
    got = study_report.curve_metrics(run, epochs=8)
    assert got == {"learning curve mean top-1": pytest.approx(sum(top1) / 800), "eval top-1 at epoch 2": 0.20}
    report = (finished / "report.md").read_text(encoding="utf-8")
    cells = _table_row(report, "learning curve mean top-1")[1:]
    for arm, cell in zip(SHOWN, cells, strict=True):
        if arm in POSTHOC:
            assert cell == "-"
            continue
        logged = [_mean_logged_top1(finished / "runs" / f"{arm}-s{s}" / "log.csv") for s in (0, 1)]
        assert float(cell.split()[0]) == pytest.approx(np.mean(logged), abs=6e-5)
    assert _table_row(report, "eval top-1 at epoch 1", after="### rollout-grad - cls")[1] == "2"


def _mean_logged_top1(log: Path) -> float:
    """Mean eval top-1 (fraction) of a log.csv, read with the csv module."""
    with log.open() as f:
        return float(np.mean([float(row["eval_top1"]) / 100 for row in csv.DictReader(f)]))


def test_side_by_side_runs_spread_over_the_visible_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert jobs.job_devices("auto", 3) == ["cuda:0", "cuda:1", "cuda:0"]
    assert jobs.job_devices("cuda", 2) == ["cuda:0", "cuda:1"]
    assert jobs.job_devices("cuda:1", 2) == ["cuda:1", "cuda:1"]  # a device named by the user is kept
    assert jobs.job_devices("cpu", 2) == ["cpu", "cpu"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert jobs.job_devices("auto", 2) == ["auto", "auto"]  # one GPU: the runs share it


def test_training_curves_of_one_seed_say_so_and_tick_whole_epochs(tmp_path, monkeypatch):
    """One seed per arm: its legend says '1 seed', the title no 'thin lines', each arm draws one line and the epoch
    axis ticks whole epochs only; with two seeds the mean and the single seeds are named."""
    drawn = {}
    monkeypatch.setattr(figures, "save_figure", lambda fig, path: drawn.setdefault(len(drawn), fig))
    rows = [{"epoch": e, "train_loss": 2.0 / e, "eval_top1": 10.0 * e} for e in (1, 2)]
    figures.plot_training_curves({"cls": {0: rows}, "gap": {0: rows}}, tmp_path / "one.png", "Training")
    figures.plot_training_curves({"cls": {0: rows, 1: rows}}, tmp_path / "two.png", "Training")
    one, two = drawn[0], drawn[1]
    assert one.texts[0].get_text() == "Training" and two.texts[0].get_text() == "Training (thin lines: single seeds)"
    assert [t.get_text() for t in one.legends[0].get_texts()] == ["cls (1 seed)", "gap (1 seed)"]
    assert [t.get_text() for t in two.legends[0].get_texts()] == ["cls (mean of 2 seeds)"]
    for ax in one.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks == [1.0, 2.0] and ax.get_xlabel() == "epoch" and len(ax.get_lines()) == 2
    assert len(two.axes[0].get_lines()) == 3  # two single seeds and their mean
    figures.plot_training_curves({"cls": {0: rows[:1]}}, tmp_path / "short.png", "Training")
    assert all(line.get_marker() == "." for ax in drawn[2].axes for line in ax.get_lines())  # one epoch: visible


def test_eval_amp_evaluates_at_that_precision_and_redoes_an_evaluation_recorded_at_another(finished, tmp_path):
    """A copy of one finished run and its evaluation (in bf16 or fp32, as this CPU's auto chose): --eval-amp none,
    then bf16, then none again: each change of precision redoes the evaluation in it (bf16 autocast runs on any CPU,
    emulated where not native); an evaluation already in the asked precision, or any with auto, is kept byte for
    byte."""
    run, evaluation = tmp_path / "runs" / "gap-s0", tmp_path / "eval" / "gap-s0"
    shutil.copytree(finished / "runs" / "gap-s0", run)
    shutil.copytree(finished / "eval" / "gap-s0", evaluation)
    results = evaluation / "results.json"

    def evaluate(*amp: str) -> bytes:
        args = study.build_parser().parse_args([*_argv(tmp_path / "unused")[:-3], "--output", str(tmp_path), *amp])
        args.threads = None
        jobs.eval_run(args, "vit_tiny_cifar_gap", 0, run, evaluation)
        return results.read_bytes()

    assert json.loads(evaluate("--eval-amp", "none"))["environment"]["dtype"] == "float32"  # redone, or kept
    for amp, dtype in (("bf16", "bfloat16"), ("none", "float32")):  # each differs from the one before: redone
        first = evaluate("--eval-amp", amp)
        record = json.loads(first)
        assert record["environment"]["dtype"] == dtype and record["args"]["amp"] == amp
        assert evaluate("--eval-amp", amp) == first  # already in that precision: kept
    assert evaluate() == first and evaluate("--eval-amp", "auto") == first  # auto keeps what was recorded
    with pytest.raises(UserError, match="--report-only evaluates nothing, so --eval-amp would do nothing"):
        study.main([*_argv(tmp_path / "unused"), "--report-only", "--eval-amp", "none"])
