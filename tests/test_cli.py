"""Strict CLIs: every bad value is one line ``error: ...`` naming the fix, exit code 2, no traceback.

Each case is its own process running the real command exactly as ``python -m`` or ``python scripts/x.py`` does
(``runpy`` as ``__main__``, with ``sys.argv`` set); the processes are forked from one interpreter that has
already imported torch, timm and friends, so the cases cost one library import (5-10 s on a busy 2-core machine)
instead of one each. Every case fails before any data or model is loaded (two load the 3,000-image sample, for
its splits and its class names).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from timm_rollout.cli import as_flags
from timm_rollout.errors import UserError
from timm_rollout.train import build_parser
from timm_rollout.train.resume import merge_saved_args as _merge_saved_args

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["timm_rollout.train", "--dataset", "cifar10-sample", "--output", "{out}", "--device", "cpu", "--amp",
         "none", "--workers", "1", "--epochs", "1"]
EVAL = ["harness.eval", "--model", "vit_tiny_cifar_cls", "--dataset", "cifar10-sample", "--output", "{out}",
        "--device", "cpu", "--amp", "none"]
EXPLAIN = ["harness.explain", "--model", "vit_tiny_cifar_cls", "--output", "{out}", "--device", "cpu"]
COMPARE = ["harness.compare", "{run}", "--output", "{out}"]
STUDY = ["scripts/study.py", "--dataset", "cifar10-sample", "--epochs", "1", "--output", "{out}"]
SUMMARY = ["scripts/summary_figure.py", "--curves", "{run}", "--studies", "{run}", "--output", "{out}/s.png"]

# (command, extra flags, text the one-line message must contain); later flags override the base command's.
CASES = [
    (TRAIN, ["--epochs", "0"], "argument --epochs: must be an integer >= 1, got 0"),
    (TRAIN, ["--batch-size", "0"], "argument --batch-size: must be an integer >= 1, got 0"),
    (TRAIN, ["--lr", "-1"], "argument --lr: must be a number > 0, got -1"),
    (TRAIN, ["--lr", "fast"], "argument --lr: expected a number > 0, got 'fast'"),
    # A negative number in exponent form is a value for the validator, not a flag (argparse's own reading).
    (TRAIN, ["--lr", "-1e-3"], "argument --lr: must be a number > 0, got -1e-3"),
    (TRAIN, ["--std", "0.2", "0.2", "-.5e-1"], "argument --std: must be a number > 0, got -.5e-1"),
    (TRAIN, ["--mean", "0.5", "-1E2", "0.1"], "argument --mean: must be a number in [0, 1], got -1E2"),
    (TRAIN, ["--seed", "-3"], "argument --seed: must be an integer in [0, 4294967295], got -3"),
    (TRAIN, ["--dataset", "{notdata}"], "is not a data set folder: it must hold a datasets save_to_disk folder"),
    (TRAIN, ["--workers", "0"], "argument --workers: must be an integer >= 1, got 0"),
    (TRAIN, ["--save-every", "0"], "argument --save-every: must be an integer >= 1, got 0"),
    (TRAIN, ["--warmup-epochs", "-1"], "argument --warmup-epochs: must be a number >= 0, got -1"),
    (TRAIN, ["--smoothing", "1"], "argument --smoothing: must be a number in [0, 1), got 1"),
    (TRAIN, ["--mixup", "-0.2"], "argument --mixup: must be a number >= 0, got -0.2"),
    (TRAIN, ["--model-ema-decay", "1"], "argument --model-ema-decay: must be a number in (0, 1), got 1"),
    (TRAIN, ["--device", "cuda:99"], "argument --device: cuda"),  # no CUDA, or no 100th GPU: both refused
    (TRAIN, ["--device", "gpu0"], "argument --device: unknown device 'gpu0'; use auto, cpu, cuda or cuda:N"),
    (TRAIN, ["--amp", "fp8"], "argument --amp: invalid choice: 'fp8'"),
    (TRAIN, ["--compile-mode", "reduce-overhead"], "--compile-mode only applies with --compile; add --compile or drop"),
    (TRAIN, ["--compile", "--compile-mode", "fast"], "argument --compile-mode: invalid choice: 'fast'"),
    (TRAIN, ["--model", "vit_tiny_cifar_roll"], "unknown model 'vit_tiny_cifar_roll'; did you mean"),
    (TRAIN, ["--model-kwargs", "dpeth=2"], "cannot be built with {'dpeth': 2}"),
    (TRAIN, ["--model-kwargs", "depth"], "argument --model-kwargs: expected KEY=VALUE"),
    (TRAIN, ["--opt", "adamx"], "unknown optimizer 'adamx'; did you mean"),
    # Removed flags: one line naming what to use instead.
    (TRAIN, ["--seed", "0", "1", "--stack"], "--stack was removed; train many runs as separate processes with "
                                             "scripts/study.py --jobs N"),
    (TRAIN, ["--capture"], "--capture was removed; for CUDA graphs use --compile --compile-mode reduce-overhead"),
    (TRAIN, ["--dropout-draws", "keyed"], "--dropout-draws was removed; drop it: dropout and drop-path masks come "
                                          "from torch's generators"),
    (STUDY, ["--stack"], "--stack was removed; run seeds side by side as separate processes with --jobs N"),
    (STUDY, ["--pack", "2"], "--pack was removed; run seeds side by side as separate processes with --jobs N"),
    (STUDY, ["--capture"], "--capture was removed; for CUDA graphs pass --train-args '--compile --compile-mode "
                           "reduce-overhead'"),
    (TRAIN, ["--pool", "attention"], "argument --pool: invalid choice: 'attention'"),
    (TRAIN, ["--pool-kwargs", "head_fusion=max"], "--pool-kwargs are rollout options; add --pool rollout"),
    (TRAIN, ["--pool", "rollout", "--pool-kwargs", "head_fusion=median"], "unknown head_fusion 'median'"),
    (TRAIN, ["--model", "vit_small_patch16_224", "--model-kwargs", "class_token=False", "global_pool=avg", "--pool",
             "rollout"], "rollout pooling needs a class token"),
    (TRAIN, ["--model", "resnet10t", "--pool", "avg"],
     "drop --pool, or train a timm ViT (e.g. vit_tiny_cifar_rollout): resnet10t (ResNet) is not a timm VisionTransf"),
    # timm train.py's flags: refused naming ours, an abbreviation of ours (--drop of --drop-path) included
    (TRAIN, ["--data-dir", "/data/cifar10"], "name the data set (a local folder, a Hub id or an alias) with --dataset "
                                             "(--data-dir is a flag of timm's train.py)"),
    (TRAIN, ["--drop", "0.1"], "set dropout with --model-kwargs drop_rate=0.1 (--drop is a flag of timm's train.py)"),
    (TRAIN, ["--pretrained"], "start from local weights with --pretrained-file (nothing is downloaded) (--pretrained"),
    (TRAIN, ["--aa", "rand-m9-mstd0.5"], "drop --aa: augmentation here is a padded random crop (--crop-padding)"),
    (TRAIN, ["--reprob=0.25"], "drop --reprob: augmentation here is"),
    (TRAIN, ["--model-ema-force-cpu"], "drop --model-ema-force-cpu: the EMA (--model-ema) stays on the training"),
    # an unknown flag is named before a missing required one
    (["harness.eval", "--model", "vit_tiny_cifar_cls"], ["--bogus"], "unrecognized arguments: --bogus (see python -m"),
    (["harness.explain", "--model", "vit_tiny_cifar_cls"], ["--bogus"], "unrecognized arguments: --bogus (see python"),
    (EVAL, ["--model", "resnet10t", "--pool", "rollout", "--faithfulness"],
     "--pool and --faithfulness need attention, and resnet10t (ResNet) is not a timm VisionTransformer"),
    (EVAL, ["--model", "convnext_atto", "--heatmaps", "4"], "--heatmaps needs attention, and convnext_atto (ConvNeXt)"),
    (EXPLAIN, ["--model", "efficientnet_b0", "--dataset", "cifar10-sample"],
     "cannot explain efficientnet_b0: every map of harness.explain is drawn from attention"),
    (TRAIN, ["--pretrained-file", "{missing}"], "argument --pretrained-file: "),
    (TRAIN, ["--pretrained-file", "{file}"], "file.txt is not a weights file; pass a .safetensors file, a training"),
    (TRAIN, ["--sched", "cosin"], "argument --sched: invalid choice: 'cosin'"),
    (TRAIN, ["--output", "{file}"], "is a file; pass a folder"),
    (TRAIN, ["--epoch-count", "3"], "unrecognized arguments: --epoch-count 3; did you mean --epochs"),
    (EVAL, ["--capture"], "unrecognized arguments: --capture (see python -m harness.eval --help)"),  # no far guess
    (TRAIN, ["--output", "{run}", "--resume", "--lr", "5e-4"], "--lr 0.0005 differs from the saved run's 0.001"),
    (EVAL, ["--temperature", "0"], "argument --temperature: must be a number > 0, got 0"),
    (EVAL, ["--checkpoint", "{missing}"], "missing.png does not exist; check the path"),
    (EVAL, ["--checkpoint", "{run}s"], "runs does not exist (did you mean "),  # a near miss beside it: named
    (EVAL, ["--split", "nope"], "has no split 'nope'; its splits are train, test: name one with --split"),
    (EVAL, ["--label-column", "img"], "column 'img' would be both the images and the labels; name the label column"),
    (TRAIN, ["--label-column", "img"], "column 'img' would be both the images and the labels; name the label column"),
    (EVAL, ["--model"], "argument --model: expected one argument"),
    (EVAL, ["--classes", "unicorn"], "unknown class name(s) for --classes: unicorn; valid: airplane, automobile"),
    (EVAL, ["--bank-k", "7"], "--bank-k only applies with --bank-split; add --bank-split train or drop --bank-k"),
    (EVAL, ["--faithfulness-images", "9"], "--faithfulness-images only applies with --faithfulness; add --faithf"),
    (COMPARE, ["--output", "{file}"], "file.txt is a file; pass a folder"),
    (COMPARE, ["--metrics", "top2"], "argument --metrics: invalid choice: 'top2'"),
    (EVAL, ["--per-class", "1"], "argument --per-class: must be an integer >= 2, got 1"),
    (STUDY, ["--train-args", "--epochs=2"],
     "argument --train-args: expected one argument; give it after the flag, or as --train-args='...' when it starts "
     "with '-'"),
    (TRAIN, ["--model-kwargs"], "argument --model-kwargs: expected at least one argument; give it after the flag"),
    (STUDY, ["--train-args", "--epochs 2"], "--train-args sets --epochs, which the study sets itself; use the study's"),
    (STUDY, ["--train-args", "--lr '1e-3"], "does not split as shell words (No closing quotation); balance its quotes"),
    (["harness.compare", "{ev}", "--output", "{out}"], ["--metrics", "top1", "knn_bank", "silhouette"],
     "--metrics knn_bank silhouette: none of the evaluations has a value for them; they have top1, linear_probe"),
    (["harness.compare", "{ev}", "{ev}/results.json", "--output", "{out}"], [],
     "ev is passed twice; pass each evaluation folder once"),
    (["harness.compare", "{ev}", "{ev_copy}", "--output", "{out}"], [],
     "ev_copy are both seed 0 of vit_tiny_cifar_cls on cifar10-sample/test, so one seed would count twice"),
    (EXPLAIN, ["--image", "{missing}"], "does not exist; check the path"),
    (EXPLAIN, ["--dataset", "cifar10-sample", "--target-class", "-1"], "argument --target-class: must be an integer"),
    (EXPLAIN, ["--dataset", "cifar10-sample", "--image", "{file}"], "not allowed with argument"),
    (SUMMARY, ["--pairs", "cls:gap", "gap"], "argument --pairs: 'gap': give a pair as BASE:OTHER"),
    (["scripts/make_sample.py", "--output", "{out}"], ["--train-per-class", "0"], "must be an integer >= 1, got 0"),
    (["scripts/bench_train.py"], ["--repeats", "2"], "--repeats counts the alternated runs of --ranks; add --ranks"),
    (["scripts/bench_train.py"], ["--ranks", "1"], "--ranks compares N >= 2 processes with one; pass 2 or more"),
    (["scripts/bench_train.py"], ["--pack", "2"], "--pack was removed; time N separate processes (study.py --jobs N) "
                                                  "with --concurrent N ..."),
    (["scripts/bench_train.py"], ["--compile", "fast"], "argument --compile: invalid choice: 'fast'"),
    (["scripts/bench_models.py"], ["--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
]


def _paths(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "notdata").mkdir()
    (tmp_path / "notdata" / "notes.txt").write_text("not images")
    (tmp_path / "file.txt").write_text("a file")
    run = tmp_path / "run"  # an unfinished run saved with --lr 1e-3
    run.mkdir()
    (run / "train_args.json").write_text(json.dumps({"lr": 1e-3, "epochs": 1, "dataset": "cifar10-sample"}))
    (run / "resume.safetensors").write_bytes(b"")
    evaluation = {"metrics": {"top1": 0.5, "linear_probe": 0.25, "knn_bank": None}, "config": {"seed": 0},
                  "model": {"name": "vit_tiny_cifar_cls"}, "data": {"argument": "cifar10-sample", "split": "test"},
                  "args": {"model": "hf-hub:org/vit", "checkpoint": None}}  # no pooling diagnostics yet
    for name in ("ev", "ev_copy"):  # one evaluation and a copy of it
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(evaluation))
    return {"out": str(tmp_path / "out"), "notdata": str(tmp_path / "notdata"), "file": str(tmp_path / "file.txt"),
            "run": str(run), "missing": str(tmp_path / "missing.png"), "ev": str(tmp_path / "ev"),
            "ev_copy": str(tmp_path / "ev_copy")}


# Reads [[argv, stderr_file], ...] on stdin; runs each argv as `python -m` would, in a forked child whose stderr
# goes to its file (a few at a time); prints the exit codes as JSON.
DRIVER = """
import json, os, runpy, sys, traceback
import datasets, faiss, matplotlib.figure, scipy.optimize, sklearn.metrics, timm, torch  # what the CLIs import
import timm_rollout


def start(argv, err_path):
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    os.dup2(os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    code = 0
    try:
        sys.argv = list(argv)
        if argv[0].endswith(".py"):  # a script of scripts/, as `python scripts/x.py` runs it (its folder first)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
        else:
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stderr.flush()
    os._exit(code)


jobs, width, running, codes = json.load(sys.stdin), max(2, os.cpu_count() or 2), {}, {}
for i, (argv, err_path) in enumerate(jobs):
    if len(running) >= width:
        pid, status = os.wait()
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    running[start(argv, err_path)] = i
while running:
    pid, status = os.wait()
    codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
print(json.dumps([codes[i] for i in range(len(jobs))]))
"""


def _run_all(cases: list[list[str]], tmp_path: Path) -> list[tuple[int, str]]:
    """(exit code, stderr) of each argv, each run as ``python -m argv[0] argv[1:]`` in its own process."""
    jobs = [[argv, str(tmp_path / f"stderr-{i}.txt")] for i, argv in enumerate(cases)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": "1"}  # fork-safe
    proc = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(jobs), capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600, check=True)
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    return [(code, Path(err).read_text()) for code, (_, err) in zip(codes, jobs, strict=True)]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="runs each case in a process forked from a warm interpreter")
def test_bad_values_are_one_line_errors_with_exit_code_2(tmp_path: Path) -> None:
    paths = _paths(tmp_path)
    results = _run_all([[a.format(**paths) for a in [*command, *extra]] for command, extra, _ in CASES], tmp_path)
    failures = []
    for (command, extra, message), (code, stderr) in zip(CASES, results, strict=True):
        lines = stderr.strip().splitlines()
        ok = code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
        if not ok or "Traceback" in stderr:
            failures.append(f"{command[0]} {' '.join(extra)}: exit {code}, stderr {stderr[-600:]!r}")
    assert not failures, "\n".join(failures)
    assert not (tmp_path / "out").exists()  # every case stopped before writing anything


def _resume(tmp_path: Path, *flags: str):
    """Parse ``flags`` as the train CLI does and merge them with a run saved with --lr 1e-3 and depth=2."""
    saved = {"lr": 1e-3, "epochs": 3, "model_kwargs": {"depth": 2}, "workers": 2, "dataset": "cifar10-sample"}
    (tmp_path / "train_args.json").write_text(json.dumps(saved))
    parser = build_parser()
    args = parser.parse_args(["--output", str(tmp_path), "--resume", *flags])
    return _merge_saved_args(args, tmp_path, parser)


def test_resume_refuses_a_typed_flag_that_differs_even_at_its_default(tmp_path: Path) -> None:
    assert build_parser().get_default("lr") == 5e-4  # the case that used to continue silently at 1e-3
    with pytest.raises(UserError, match=r"--lr 0.0005 differs from the saved run's 0.001; drop it"):
        _resume(tmp_path, "--lr", "5e-4")
    with pytest.raises(UserError, match=r"--model-kwargs depth=3 differs from the saved run's depth=2"):
        _resume(tmp_path, "--model-kwargs", "depth=3")
    merged = _resume(tmp_path)  # omitted flags take the saved values
    assert merged.lr == 1e-3 and merged.epochs == 3 and merged.model_kwargs == {"depth": 2}
    merged = _resume(tmp_path, "--lr", "1e-3", "--model-kwargs", "depth=2", "--workers", "1")
    assert merged.lr == 1e-3 and merged.workers == 1  # the same values typed again; where/how it runs may change


def test_resume_drops_the_keys_of_removed_flags_and_refuses_what_it_cannot_continue(tmp_path: Path) -> None:
    """Runs recorded with the removed ``stack``/``capture``/``dropout_draws`` keys at their plain values (as every
    committed run is) resume; one trained with keyed draws or a captured step is refused in one line."""
    saved = {"lr": 1e-3, "epochs": 3, "dataset": "cifar10-sample", "stack": False, "capture": False,
             "dropout_draws": "streams"}
    parser = build_parser()
    args = parser.parse_args(["--output", str(tmp_path), "--resume"])
    for extra in ({}, {"stack": True}):
        (tmp_path / "train_args.json").write_text(json.dumps({**saved, **extra}))
        merged = _merge_saved_args(args, tmp_path, parser)
        assert merged.lr == 1e-3 and not {"stack", "capture", "dropout_draws"} & set(vars(merged))
    for extra, flag in (({"dropout_draws": "keyed"}, "--dropout-draws keyed"), ({"capture": True}, "--capture")):
        (tmp_path / "train_args.json").write_text(json.dumps({**saved, **extra}))
        with pytest.raises(UserError, match=rf"was trained with {flag}, which was removed, so it cannot continue "
                                            r"exactly; start a new --output$"):
            _merge_saved_args(args, tmp_path, parser)


def test_parser_records_the_flags_typed() -> None:
    parser = build_parser()
    parser.parse_args(["--output", "o", "--lr", "5e-4", "--model-ema", "--model-kwargs", "depth=2"])
    assert parser.given == {"output", "lr", "model_ema", "model_kwargs"}


def test_timm_train_py_spellings_of_our_flags_are_taken_as_ours() -> None:
    parser = build_parser()
    args = parser.parse_args(["--output", "o", "--data", "x", "--val-split", "validation", "-b", "64", "-j", "3"])
    assert (args.dataset, args.eval_split, args.batch_size, args.workers) == ("x", "validation", 64, 3)
    assert parser.given == {"output", "dataset", "eval_split", "batch_size", "workers"}




def test_as_flags_parses_back_to_the_options() -> None:
    """A command passes typed options to another as flags: parsed by that command's parser they are the options
    again (None and False left out, True a bare flag)."""
    from harness.eval import build_parser as eval_parser

    options = {"model": "vit_tiny_cifar_cls", "dataset": "cifar10-sample", "output": "out", "seed": 3,
               "overwrite": True, "per_class": 5, "bank_split": "train", "faithfulness": True,
               "faithfulness_images": 8, "pool": None, "save_features": False}
    assert as_flags(options)[:2] == ["--model", "vit_tiny_cifar_cls"] and "--pool" not in as_flags(options)
    parsed = vars(eval_parser().parse_args(as_flags(options)))
    assert {k: parsed[k] for k in options if options[k] is not None} == {k: v for k, v in options.items()
                                                                          if v is not None}
