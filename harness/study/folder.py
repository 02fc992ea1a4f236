"""A study folder's identity and layout: the settings it remembers (``study.json``), the recipe another study
must share for an interaction, and where its runs and evaluations live (``runs/``, ``eval/``, ``eval-<name>/``)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.compare import evaluated_images
from timm_rollout.atomic import write_json
from timm_rollout.data import load_image_set
from timm_rollout.errors import UserError
from timm_rollout.records import RESULTS_FILE, RESUME_FILE, STUDY_FILE, SUMMARY_FILE

from .plan import ARMS, POSTHOC

# Report settings a folder remembers once given: a later command inherits them, or must repeat them unchanged.
REMEMBERED = ("also_eval", "primary", "interaction")
# Study flags that change what is computed: a re-run must repeat them to reuse the folder (arms and seeds may grow).
IDENTITY = ("model", "dataset", "epochs", "train_args", "max_train_samples", "eval_per_class", "bank_per_class",
            "faithfulness_images", "bbox_format")
# Those that make two studies the same recipe (all but the data set), so that their primary comparisons can be set
# against each other.
SAME_RECIPE = tuple(k for k in IDENTITY if k != "dataset")


def check_identity(args: argparse.Namespace, out: Path) -> tuple[list[str], list[int], list[str]]:
    """The folder remembers the flags that define the study; once one of its runs has saved an epoch (a resumed
    run keeps its own settings) or finished, a re-run with other values is refused; before that, the new values
    replace the recorded ones, so a mistyped first command can be corrected. Arms and seeds are not part of it:
    they accumulate in ``study.json``, so a later command can add some. Returns the folder's arms, seeds and every
    distinct command run on it."""
    path = out / STUDY_FILE
    wanted = {k: getattr(args, k) for k in IDENTITY}
    arms, seeds, commands = set(args.arms), set(args.seeds), []
    typed = args.interaction is not None
    if path.exists():
        saved = json.loads(path.read_text(encoding="utf-8"))
        diff = [f"--{k.replace('_', '-')} {saved['identity'].get(k)!r} (now {v!r})" for k, v in wanted.items()
                if saved["identity"].get(k) != v]
        trained = any(any((out / "runs").glob(f"*/{name}")) for name in (SUMMARY_FILE, RESUME_FILE))
        if diff and trained:
            raise UserError(f"{out} holds a study run with {', '.join(diff)}; repeat those flags or use a new --output")
        if diff:
            print(f"= {out}: no run trained with {', '.join(diff)}; the new settings replace them", flush=True)
        else:
            arms |= set(saved.get("arms", ()))
            seeds |= set(saved.get("seeds", ()))
            commands = saved.get("commands", [saved["command"]] if "command" in saved else [])
        _remember(args, saved, out)
    check_interaction(args, out, typed)
    commands += [] if args.command in commands else [args.command]
    write_json(path, {"identity": wanted, "arms": [a for a in ARMS if a in arms], "seeds": sorted(seeds),
                      "commands": commands, **{k: getattr(args, k) for k in REMEMBERED}})
    return [a for a in ARMS if a in arms], sorted(seeds), commands


def _remember(args: argparse.Namespace, saved: dict[str, Any], out: Path) -> None:
    """``args`` takes the report settings the folder recorded (:data:`REMEMBERED`) where the command left them
    out; one given otherwise is refused."""
    for key in REMEMBERED:
        was, now = saved.get(key), getattr(args, key)
        was = (was,) if key == "also_eval" and isinstance(was, str) else was  # recorded as one name before lists
        was, now = (tuple(v) if isinstance(v, list) else v for v in (was, now))
        flag = f"--{key.replace('_', '-')}"
        if now is not None and was is not None and now != was:
            shown = (" " if key == "also_eval" else ":").join(was) if isinstance(was, tuple) else was
            raise UserError(f"{out} was run with {flag} {shown}; repeat it, or leave {flag} out to keep it")
        if now is None:
            setattr(args, key, list(was) if key == "also_eval" and was is not None else was)


def check_interaction(args: argparse.Namespace, out: Path, typed: bool) -> None:
    """``--interaction FOLDER`` names a study of the same recipe (:data:`SAME_RECIPE`) on another data set, and
    the comparison to set against it is ``--primary``'s; checked before anything is recorded. ``typed``: the flag
    is on this command (else the folder remembered it)."""
    if args.interaction is None:
        return
    other = Path(args.interaction)
    given = "" if typed else f" (--interaction as {out / STUDY_FILE} remembers it, read from the current directory)"
    if args.primary is None:
        raise UserError("--interaction sets the primary comparison of two studies against each other; add "
                        "--primary BASE:ARM")
    if other.resolve() == out.resolve():
        raise UserError("--interaction names this study's own --output; name the study of the same recipe on "
                        "another data set")
    try:
        saved = json.loads((other / STUDY_FILE).read_text(encoding="utf-8"))["identity"]
    except (FileNotFoundError, NotADirectoryError):
        raise UserError(f"{other} holds no {STUDY_FILE}{given}; name a folder written by scripts/study.py "
                        "--output") from None
    except (json.JSONDecodeError, KeyError, TypeError):
        raise UserError(f"{other / STUDY_FILE} is not a study record{given}; name a folder written by "
                        "scripts/study.py --output") from None
    diff = [f"--{k.replace('_', '-')} {saved.get(k)!r} (here {getattr(args, k)!r})" for k in SAME_RECIPE
            if saved.get(k) != getattr(args, k)]
    if diff:
        raise UserError(f"{other} was run with {', '.join(diff)}{given}; an interaction needs the same recipe on "
                        "another --dataset")
    there = data_fingerprints(other)
    here = (data_fingerprints(out) or {load_image_set(args.dataset, "test").fingerprint}) if there else set()
    if saved.get("dataset") == args.dataset or here & there:
        raise UserError(f"{other} is a study of the same data set as this one{given}; an interaction needs a study "
                        "on another --dataset")


def data_fingerprints(folder: Path) -> set[str]:
    """The fingerprints of the data a study folder's evaluations read (its own ``eval/``, not ``--also-eval``'s)."""
    records = (json.loads(path.read_text(encoding="utf-8")) for path in folder.glob(f"eval/*/{RESULTS_FILE}"))
    return {found[0] for found in map(evaluated_images, records) if found is not None and found[0] is not None}


def layout(out: Path, seeds: Sequence[int]) -> tuple[dict[tuple[str, int], Path], dict[tuple[str, int], Path]]:
    """Where a study folder keeps each (arm, seed)'s run, ``runs/<arm>-s<seed>``, and its evaluation,
    ``eval/<arm>-s<seed>`` (post-hoc readouts included)."""
    runs = {(arm, seed): out / "runs" / f"{arm}-s{seed}" for seed in seeds for arm in ARMS}
    evals = {(arm, seed): out / "eval" / f"{arm}-s{seed}" for seed in seeds for arm in (*ARMS, *POSTHOC)}
    return runs, evals


def also_folder(dataset: str, output: str | Path, arm: str, seed: int) -> Path:
    """Where ``--also-eval`` puts the evaluation of ``arm``'s seed on ``dataset``:
    ``<output>/eval-<data set folder name>/<arm>-s<seed>``."""
    return Path(output) / f"eval-{Path(dataset).name}" / f"{arm}-s{seed}"


def arm_of(path: str | Path) -> str:
    """``gap`` for ``.../gap-s2``: the arm of a run or evaluation folder, named ``<arm>-s<seed>``."""
    return Path(path).name.rsplit("-s", 1)[0]
