"""The study in one command: train both models per seed with one recipe, evaluate every run, write a report.

    python scripts/study.py --dataset cifar10 --epochs 30 --seeds 0 1 2 --output study/c10

The two models differ only in pooling. Each run trains with ``python -m timm_rollout.train`` and is
evaluated with ``python -m harness.eval`` (k-NN against the train split as bank). Finished runs and
evaluations are skipped and interrupted runs resume, so re-running the same command after a crash
completes the study. ``report.md`` in ``--output`` holds every metric per arm (mean +- std over seeds), the
paired-by-seed difference of each arm against ``cls`` and against ``gap`` when present (95% CI, p-value,
Holm-adjusted p for the secondary metrics, minimum detectable effect, McNemar's per-image test for
accuracies; see :mod:`harness.compare`), overlaid training curves, the cosine-similarity matrices and a
heatmap grid of the same test images under both models.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from harness.compare import (
    METRICS,
    ORIGINAL_METRICS,
    STATISTICS_NOTE,
    Group,
    compare_groups,
    load_results,
    render_comparison,
    summarise,
)
from harness.features import saliency_maps
from harness.figures import save_figure, upsample_patch_map
from timm_rollout.atomic import write_json, write_text
from timm_rollout.data import load_image_set, normalize
from timm_rollout.errors import UserError, run_cli
from timm_rollout.explain import MAP_LABELS
from timm_rollout.loading import load_model, sha256_file
from timm_rollout.train_log import read_log

MODELS = {"cls": "vit_tiny_cifar_cls", "rollout": "vit_tiny_cifar_rollout"}
REFERENCES = ("cls", "gap")  # every other arm is compared with each of these that the study has
# Study flags that change what is computed: a re-run must repeat them to reuse the folder.
IDENTITY = ("dataset", "epochs", "train_args", "max_train_samples", "eval_per_class", "bank_per_class",
            "faithfulness_images")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/study.py", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", required=True, help="alias (cifar10, cifar100, svhn, cifar10-sample), Hub id or folder")
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--output", required=True, help="study folder (runs/, eval/, report.md)")
    p.add_argument("--train-args", default="", help="extra flags for timm_rollout.train, quoted, same for both models")
    p.add_argument("--max-train-samples", type=int, help="class-balanced training subset (quick studies)")
    p.add_argument("--eval-per-class", type=int, help="evaluate N random test images per class (default: all)")
    p.add_argument("--bank-per-class", type=int, help="k-NN bank: N random train images per class (default: all)")
    p.add_argument("--faithfulness-images", type=int, default=0,
                   help="deletion/insertion faithfulness on N evaluated images (0: off)")
    p.add_argument("--heatmaps", type=int, default=6, help="test images in the side-by-side heatmap grid")
    p.add_argument("--jobs", type=int, default=1,
                   help="seeds run side by side, the CPU cores split between them")
    p.add_argument("--device", default="auto")
    return p


def _run(cmd: list[str], threads: int | None) -> None:
    """Run one step; ``threads`` caps its torch/OpenMP threads when seeds run side by side."""
    print("+ " + shlex.join(cmd), flush=True)
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(cmd, check=False, env=env)
    if done.returncode != 0:
        raise UserError(f"step failed (exit {done.returncode}): {shlex.join(cmd)}; fix it and re-run the study "
                        "command, finished runs are kept")


def _check_identity(args: argparse.Namespace, out: Path) -> None:
    """The folder remembers the flags that define the study; a re-run with other values is refused."""
    path = out / "study.json"
    wanted = {k: getattr(args, k) for k in IDENTITY}
    if path.exists():
        saved = json.loads(path.read_text(encoding="utf-8"))["identity"]
        diff = [f"--{k.replace('_', '-')} {saved.get(k)!r} (now {v!r})" for k, v in wanted.items() if saved.get(k) != v]
        if diff:
            raise UserError(f"{out} holds a study run with {', '.join(diff)}; repeat those flags or use a new --output")
    write_json(path, {"identity": wanted, "seeds": args.seeds, "command": args.command})


def train_run(args: argparse.Namespace, model: str, seed: int, folder: Path) -> None:
    """Train one run, or resume it; a finished run (summary.json) is left alone."""
    if (folder / "summary.json").exists():
        print(f"= {folder} finished, skipped")
        return
    cmd = [sys.executable, "-m", "timm_rollout.train", "--model", model, "--dataset", args.dataset,
           "--epochs", str(args.epochs), "--seed", str(seed), "--output", str(folder), "--resume",
           "--device", args.device, *shlex.split(args.train_args)]
    if args.max_train_samples:
        cmd += ["--max-train-samples", str(args.max_train_samples)]
    _run(cmd, args.threads)


def eval_run(args: argparse.Namespace, model: str, seed: int, run: Path, folder: Path) -> None:
    """Evaluate one finished run unless ``folder`` already holds results for these exact weights."""
    results = folder / "results.json"
    if results.exists():
        saved = json.loads(results.read_text(encoding="utf-8"))["model"].get("sha256")
        if saved == sha256_file(run / "model.safetensors"):
            print(f"= {folder} evaluated, skipped")
            return
    cmd = [sys.executable, "-m", "harness.eval", "--model", model, "--checkpoint", str(run), "--dataset",
           args.dataset, "--output", str(folder), "--seed", str(seed), "--bank-split", "train",
           "--device", args.device]
    if args.eval_per_class:
        cmd += ["--per-class", str(args.eval_per_class)]
    if args.bank_per_class:
        cmd += ["--bank-per-class", str(args.bank_per_class)]
    if args.faithfulness_images:
        cmd += ["--faithfulness", "--faithfulness-images", str(args.faithfulness_images)]
    _run(cmd, args.threads)


def means_table(groups: dict[str, Group], metrics: Sequence[str]) -> str:
    """Markdown table: each metric's mean ± sample std over seeds, one column per arm."""
    lines = ["| metric | " + " | ".join(f"{arm} (n={g.n})" for arm, g in groups.items()) + " |",
             "|---|" + "---:|" * len(groups)]
    for m in metrics:
        if all(g.mean.get(m) is None for g in groups.values()):
            continue
        cells = ["-" if g.mean.get(m) is None else f"{g.mean[m]:.4f}" if g.std.get(m) is None
                 else f"{g.mean[m]:.4f} ± {g.std[m]:.4f}" for g in groups.values()]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def delta_tables(groups: dict[str, Group], metrics: Sequence[str]) -> str:
    """Paired statistics of every arm against ``cls`` and against ``gap`` (when the study has them), one
    table per comparison; a pair already shown against ``cls`` is not repeated against ``gap``."""
    parts = []
    for ref in (r for r in REFERENCES if r in groups):
        for arm, group in groups.items():
            if arm in REFERENCES[: REFERENCES.index(ref) + 1]:
                continue
            parts += [f"### {arm} - {ref}", "", render_comparison(compare_groups(groups[ref], group, metrics)), ""]
    return "\n".join(parts)


def plot_training_curves(logs: dict[str, dict[int, list[dict[str, float]]]], path: Path, title: str) -> Path:
    """Train loss and eval top-1 per epoch, every arm overlaid (one colour each), one line per seed."""
    fig = Figure(figsize=(11, 4.2))
    ax_loss, ax_acc = fig.subplots(1, 2)
    for arm, (short, per_seed) in enumerate(logs.items()):
        colour = f"C{arm}"  # one colour per arm, any number of arms
        for i, (seed, rows) in enumerate(sorted(per_seed.items())):
            epochs = [r["epoch"] for r in rows]
            label = f"{short} (seed {seed})"
            style = ("-", "--", ":", "-.")[i % 4]
            ax_loss.plot(epochs, [r["train_loss"] for r in rows], style, color=colour, label=label)
            ax_acc.plot(epochs, [r["eval_top1"] for r in rows], style, color=colour, label=label)
    ax_loss.set(xlabel="epoch", ylabel="train cross-entropy loss", title="Training loss")
    ax_acc.set(xlabel="epoch", ylabel="eval top-1 accuracy (%)", title="Eval top-1 accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_side_by_side(args: argparse.Namespace, runs: dict[str, Path], seed: int, path: Path) -> Path:
    """The same test images under each model: its attention rollout and gradient-weighted rollout of its own readout."""
    data = load_image_set(args.dataset, "test")
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(data.labels), generator=gen)[: args.heatmaps].sort().values
    images, labels = data.images[pick], data.labels[pick]
    found = {}
    for short, run in runs.items():
        model, info = load_model(MODELS[short], run)
        found[short] = saliency_maps(model, normalize(images, info["mean"], info["std"]), device=torch.device("cpu"))
    names = data.class_names
    columns = [(short, key) for short in runs for key in ("rollout", "gradient_rollout")]
    b, _, h, w = images.shape
    fig = Figure(figsize=(3.3 * (len(columns) + 1), 3.0 * b))
    axes = fig.subplots(b, len(columns) + 1, squeeze=False)
    for i in range(b):
        rgb = images[i].permute(1, 2, 0).numpy()
        axes[i, 0].imshow(rgb, interpolation="nearest")
        axes[i, 0].set_title(f"test image, true: {names[int(labels[i])]}", fontsize=9)
        for ax, (short, key) in zip(axes[i, 1:], columns, strict=True):
            ax.imshow(rgb, interpolation="nearest")
            im = ax.imshow(upsample_patch_map(found[short].maps[key][i], (h, w)), cmap="inferno", alpha=0.6)
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04).set_label("patch weight", fontsize=7)
            pred = names[int(found[short].logits[i].argmax())]
            ax.set_title(f"{short} model: {MAP_LABELS[key]}\n(readout {found[short].readout}), pred: {pred}",
                         fontsize=8)
        for ax in axes[i]:
            ax.set(xlabel="x (pixels)", ylabel="y (pixels)")
    fig.suptitle(f"Same test images under every model, maps of each model's own readout (seed {seed})")
    fig.tight_layout()
    return save_figure(fig, path)


def _report_tables(groups: dict[str, Group], faithfulness: list[str]) -> list[str]:
    """The report's statistics: means per arm, paired differences, and the original study's geometry."""
    shown = [*METRICS, *faithfulness]
    tested = [m for m in shown if not m.startswith("random ")]  # the random-order baseline is no hypothesis
    lines = ["## Metrics per arm", "", "Mean ± sample std over seeds. Faithfulness rows are `<map> <quantity>` from "
             "`results.json[\"faithfulness\"]` (deletion AUC: lower is better; insertion AUC: higher is better; "
             "`random` is the random-order baseline, shown but not tested).", "", means_table(groups, shown), ""]
    if len(groups) > 1:
        lines += ["## Paired differences", "", STATISTICS_NOTE, "", delta_tables(groups, tested)]
    if any(g.mean.get(m) is not None for g in groups.values() for m in ORIGINAL_METRICS):
        lines += ["## The original study's geometry", "",
                  "Its mixed units (Euclidean intra, cosine-distance inter), only to set these runs beside its table; "
                  "the ratio shrinks when a layout shrinks, so it is not tested.", "",
                  means_table(groups, ORIGINAL_METRICS), ""]
    return lines


def write_report(args: argparse.Namespace, out: Path, runs: dict[tuple[str, int], Path],
                 evals: dict[tuple[str, int], Path]) -> Path:
    """report.md with the statistics of every arm, curves, cosine matrices and side-by-side heatmaps."""
    arms = [a for a in MODELS if (a, args.seeds[0]) in evals]
    results = [{**r, "metrics": {**r["metrics"], **faithfulness_metrics(r)}}
               for r in load_results([evals[a, s] for a in arms for s in args.seeds])]
    faithfulness = list(dict.fromkeys(m for r in results for m in faithfulness_metrics(r)))
    shown = [*METRICS, *faithfulness, *ORIGINAL_METRICS]
    groups = {g.label: g for g in summarise(results, shown, label=lambda r: run_short(r["path"]))}
    logs = {short: {seed: read_log(runs[short, seed] / "log.csv") for seed in args.seeds} for short in arms}
    plot_training_curves(logs, out / "curves.png", f"Training on {args.dataset}, {args.epochs} epochs")
    first = args.seeds[0]
    plot_side_by_side(args, {s: runs[s, first] for s in MODELS}, first, out / "heatmaps_both.png")
    summaries = {k: json.loads((p / "summary.json").read_text(encoding="utf-8")) for k, p in runs.items()}
    minutes = sum(float(s["wall_seconds"]) for s in summaries.values()) / 60
    lines = [
        f"# Pooling arms ({', '.join(arms)}) on {args.dataset}",
        "",
        f"Command: `{args.command}`",
        "",
        f"{len(args.seeds)} seed(s) ({', '.join(map(str, args.seeds))}), {args.epochs} epoch(s) per run, the same "
        f"recipe for every arm (only the pooling differs); {minutes:.1f} training minutes in all. "
        "Metrics are from `python -m harness.eval` on the test split with the train split as k-NN bank and "
        "linear-probe training set (definitions in the project README).",
        "",
        *_report_tables(groups, faithfulness),
        "## Training curves", "", "![training curves](curves.png)", "",
        f"## Cosine similarity of class centroids (seed {first})", "",
        *[f"![{a}]({evals[a, first].relative_to(out)}/cosine_matrix.png)" for a in arms], "",
        "## The same test images under both models", "", "![heatmaps](heatmaps_both.png)", "",
        "## Runs", "",
    ]
    for (short, seed), folder in sorted(evals.items()):
        lines.append(f"- {short}, seed {seed}: training `{runs[short, seed].relative_to(out)}`, "
                     f"evaluation `{folder.relative_to(out)}`")
    return write_text(out / "report.md", "\n".join(lines) + "\n")


def run_short(path: str) -> str:
    """Arm of a run or evaluation folder named ``<arm>-s<seed>``."""
    return Path(path).name.rsplit("-s", 1)[0]


def faithfulness_metrics(result: dict[str, Any]) -> dict[str, float]:
    """Each saliency map's deletion/insertion AUC and paired score, per removal (``mean`` fill, token ``drop``), as
    metrics of its run (e.g. ``rollout deletion paired (drop)``), averaged and tested like the other metrics."""
    fills = (result.get("faithfulness") or {}).get("fills", {})
    out: dict[str, float] = {}
    for fill, block in fills.items():
        for name, quantities in block["maps"].items():
            for kind in ("deletion", "insertion"):
                out[f"{name} {kind} AUC ({fill})"] = float(quantities[f"{kind}_auc"])
        for name, kinds in block["paired"].items():
            for kind, score in kinds.items():
                if score["mean"] is not None:
                    out[f"{name} {kind} paired ({fill})"] = float(score["mean"])
    return out


def main(argv: list[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    args.command = shlex.join(["python", "scripts/study.py", *(sys.argv[1:] if argv is None else argv)])
    if args.jobs < 1:
        raise UserError(f"--jobs must be at least 1, got {args.jobs}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    args.threads = None if args.jobs == 1 else max(1, cores // args.jobs)
    out = Path(args.output)
    _check_identity(args, out)
    runs = {(short, seed): out / "runs" / f"{short}-s{seed}" for seed in args.seeds for short in MODELS}
    evals = {(short, seed): out / "eval" / f"{short}-s{seed}" for seed in args.seeds for short in MODELS}

    def one_seed(seed: int) -> None:
        for short, model in MODELS.items():
            train_run(args, model, seed, runs[short, seed])
            eval_run(args, model, seed, runs[short, seed], evals[short, seed])

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one_seed, args.seeds))
    report = write_report(args, out, runs, evals)
    print(f"study finished: {len(runs)} runs on {args.dataset}; report at {report}")
    return report


if __name__ == "__main__":
    run_cli(main)
