"""The study in one command: train both models per seed with one recipe, evaluate every run, write a report.

    python scripts/study.py --dataset cifar10 --epochs 30 --seeds 0 1 2 --output study/c10

The two models differ only in pooling. Each run trains with ``python -m timm_rollout.train`` and is
evaluated with ``python -m harness.eval`` (k-NN against the train split as bank). Finished runs and
evaluations are skipped and interrupted runs resume, so re-running the same command after a crash
completes the study. ``report.md`` in ``--output`` holds the comparison (mean +- std over seeds, deltas,
and whether each delta exceeds the seed-to-seed spread), overlaid training curves, the cosine-similarity
matrices and a heatmap grid of the same test images under both models.
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

from harness.compare import METRICS, Group, load_results, summarise
from harness.features import saliency_maps
from harness.figures import save_figure, upsample_patch_map
from timm_rollout.atomic import write_json, write_text
from timm_rollout.data import load_image_set, normalize
from timm_rollout.errors import UserError, run_cli
from timm_rollout.explain import MAP_LABELS
from timm_rollout.loading import load_model, sha256_file
from timm_rollout.train_log import read_log

MODELS = {"cls": "vit_tiny_cifar_cls", "rollout": "vit_tiny_cifar_rollout"}
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


def spread_table(cls: Group, rollout: Group, metrics: Sequence[str]) -> str:
    """Markdown table: mean +- std per model, the delta, and whether it exceeds the seed-to-seed spread.

    A delta counts as beyond the spread when ``|delta| > std(CLS) + std(rollout)``; with one seed there is
    no spread to compare against.
    """
    lines = ["| metric | CLS | rollout | Δ (rollout - CLS) | beyond seed spread? |", "|---|---:|---:|---:|---|"]
    for m in metrics:
        a, b = cls.mean.get(m), rollout.mean.get(m)
        if a is None or b is None:
            continue
        sa, sb = cls.std.get(m), rollout.std.get(m)
        cell = lambda mean, std: f"{mean:.4f}" if std is None else f"{mean:.4f} ± {std:.4f}"  # noqa: E731
        delta = b - a
        verdict = "n/a (one seed)" if sa is None or sb is None else ("yes" if abs(delta) > sa + sb else "no")
        lines.append(f"| {m} | {cell(a, sa)} | {cell(b, sb)} | {delta:+.4f} | {verdict} |")
    return "\n".join(lines)


def plot_training_curves(logs: dict[str, dict[int, list[dict[str, float]]]], path: Path, title: str) -> Path:
    """Train loss and eval top-1 per epoch, both models overlaid, one line per seed."""
    fig = Figure(figsize=(11, 4.2))
    ax_loss, ax_acc = fig.subplots(1, 2)
    for (short, per_seed), colour in zip(logs.items(), ("tab:blue", "tab:orange"), strict=False):
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


def write_report(args: argparse.Namespace, out: Path, runs: dict[tuple[str, int], Path],
                 evals: dict[tuple[str, int], Path]) -> Path:
    """report.md with the comparison table, curves, cosine matrices and side-by-side heatmaps."""
    results = load_results([evals[k] for k in sorted(evals)])
    groups = {run_short(g.runs[0]): g for g in summarise(results)}
    cls, rollout = groups["cls"], groups["rollout"]
    logs = {short: {seed: read_log(runs[short, seed] / "log.csv") for seed in args.seeds} for short in MODELS}
    plot_training_curves(logs, out / "curves.png", f"Training on {args.dataset}, {args.epochs} epochs")
    first = args.seeds[0]
    plot_side_by_side(args, {s: runs[s, first] for s in MODELS}, first, out / "heatmaps_both.png")
    faithfulness = faithfulness_table(results)
    summaries = {k: json.loads((p / "summary.json").read_text(encoding="utf-8")) for k, p in runs.items()}
    minutes = sum(float(s["wall_seconds"]) for s in summaries.values()) / 60
    lines = [
        f"# Attention-rollout pooling vs [CLS] pooling on {args.dataset}",
        "",
        f"Command: `{args.command}`",
        "",
        f"{len(args.seeds)} seed(s) ({', '.join(map(str, args.seeds))}), {args.epochs} epoch(s) per run, the same "
        f"recipe for both models (only the pooling differs); {minutes:.1f} training minutes in all. "
        "Metrics are from `python -m harness.eval` on the test split with the train split as k-NN bank "
        "(definitions in the project README). Values: mean ± sample std over seeds.",
        "",
        spread_table(cls, rollout, METRICS),
        "",
        "A delta is *beyond seed spread* when |Δ| > std(CLS) + std(rollout).",
        "",
    ]
    if faithfulness:
        lines += ["## Faithfulness (area under the deletion / insertion curves)", "",
                  "Deletion AUC: lower is better; insertion AUC: higher is better. `rollout_weights` is the CLS "
                  "model's post-hoc rollout and the rollout model's pooling weights; `random` is the baseline "
                  "(mean of 3 random orders).", "", faithfulness, ""]
    lines += [
        "## Training curves", "", "![training curves](curves.png)", "",
        "## Cosine similarity of class centroids (seed " + str(first) + ")", "",
        f"![CLS]({evals['cls', first].relative_to(out)}/cosine_matrix.png)",
        f"![rollout]({evals['rollout', first].relative_to(out)}/cosine_matrix.png)", "",
        "## The same test images under both models", "", "![heatmaps](heatmaps_both.png)", "",
        "## Runs", "",
    ]
    for (short, seed), folder in sorted(evals.items()):
        lines.append(f"- {short}, seed {seed}: training `{runs[short, seed].relative_to(out)}`, "
                     f"evaluation `{folder.relative_to(out)}`")
    return write_text(out / "report.md", "\n".join(lines) + "\n")


def run_short(path: str) -> str:
    return Path(path).name.split("-s")[0]


def faithfulness_table(results: list[dict[str, Any]]) -> str:
    """The deletion/insertion AUC of every saliency map, as a spread table like the metrics (empty when not measured).

    Each AUC becomes a metric of its run, so the maps are averaged over seeds and compared between the two
    models with the same rule as the other metrics.
    """
    as_metrics = [{**r, "metrics": {f"{name} {kind} AUC": curve[f"{kind}_auc"]
                                    for name, curve in (r.get("faithfulness") or {}).get("maps", {}).items()
                                    for kind in ("deletion", "insertion")}} for r in results]
    names = list(dict.fromkeys(m for r in as_metrics for m in r["metrics"]))
    if not names:
        return ""
    groups = {run_short(g.runs[0]): g for g in summarise(as_metrics, names)}
    return spread_table(groups["cls"], groups["rollout"], names)


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
