"""``report.md`` of a study folder: which arms and seeds it covers, the metrics it adds to the evaluations' (learning
curves, faithfulness, ``--also-eval``), its sections and figures, and one exported seed per arm."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness import stats
from harness.compare import (
    METRICS,
    ORIGINAL_METRICS,
    PRIMARY,
    Group,
    evaluated_images,
    format_ci,
    format_number,
    format_p,
    same_images,
    summarise,
)
from harness.eval import posthoc_readout
from harness.explore import dataset_gallery, write_page
from harness.features import saliency_maps
from harness.figures import (
    plot_dose,
    plot_heatmaps,
    plot_object_weights,
    plot_pooling_diagnostics,
    plot_training_curves,
)
from harness.hub import write_upload_folder
from harness.metrics import LOCALISATION, POOLING_DIAGNOSTICS
from harness.record import load_results, read_predictions
from timm_rollout.atomic import write_text
from timm_rollout.curves import seeds_phrase
from timm_rollout.data import load_image_set, normalize
from timm_rollout.explain import MAP_LABELS
from timm_rollout.records import (
    CARD_FILE,
    CURVES_FILE,
    DATA_DIR,
    DOSE_FILE,
    EXPLORE_FILE,
    HEATMAPS_FILE,
    HUB_DIR,
    LOCALISATION_FILE,
    LOG_FILE,
    NOTES_FILE,
    POOLING_FILE,
    REPORT_FILE,
    RESULTS_FILE,
    SUMMARY_FILE,
    code_labels,
    data_card_title,
)
from timm_rollout.train.log import read_log

from .dose import INTEREST, contrast_metric, dose_section, dose_series
from .folder import also_folder, arm_of, layout
from .plan import ARMS, POSTHOC, arm_model, backbone
from .tables import (
    INTERACTION_NOTE,
    LAYERS_NOTE,
    LOCALISATION_NOTE,
    POOLING_NOTE,
    arm_change_table,
    means_table,
    null_excess_table,
    pooling_table,
    report_tables,
    tested_metrics,
)
from .writeup import WRITEUP_EPOCHS, writeup_marks, writeup_section


def report_scope(named: Sequence[str], arms: Sequence[str], seeds: Sequence[int],
                 evals: dict[tuple[str, int], Path]) -> tuple[list[str], list[int]]:
    """The report's seeds: those every ``named`` arm (the command's ``--arms``) has finished, post-hoc readouts
    of ``cls`` included; and its arms: the named ones plus every other arm of the folder finished for all those
    seeds. So ``--arms cls gap rollout`` reports on those three while a fourth arm of the folder is unfinished."""
    def with_posthoc(trained: Sequence[str]) -> list[str]:
        return [a for a in ARMS if a in trained] + [a for a in POSTHOC if "cls" in trained]

    done = [s for s in seeds if all((evals[a, s] / RESULTS_FILE).exists() for a in with_posthoc(named))]
    shown = [a for a in with_posthoc(arms) if all((evals[a, s] / RESULTS_FILE).exists() for s in done)]
    return shown, done


def plot_side_by_side(args: argparse.Namespace, panels: dict[str, tuple[str, Path, str | None]], seed: int,
                      path: Path) -> Path:
    """The same test images under every arm (``arm -> (model, run folder, pooling or None for its own)``): the
    attention rollout of the readout the arm classifies from, as weight x number of patches (1 = uniform), one
    column and colour range per arm (each evaluation's own heatmaps.png adds its other maps)."""
    from timm_rollout.loading import load_model  # here, so that --help loads no timm

    data = load_image_set(args.dataset, "test", boxes=True, box_format=args.bbox_format)
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(data.labels), generator=gen)[: args.heatmaps].sort().values
    images, labels = data.images[pick], data.labels[pick]
    found = {}
    for short, (name, run, pool) in panels.items():
        model, info = load_model(name, run)
        posthoc_readout(model, pool)
        found[short] = saliency_maps(model, normalize(images, info["mean"], info["std"]), device=torch.device("cpu"))
    names = data.class_names
    maps, preds = {}, {}
    for short, got in found.items():
        column = f"{short}\n(readout: {got.readout})"
        maps[column] = got.maps["rollout"]
        preds[column] = [names[int(j)] for j in got.logits.argmax(dim=1)]
    return plot_heatmaps(images, maps, [names[int(y)] for y in labels], preds, path,
                         f"Same test images under every arm: {MAP_LABELS['rollout']} of each arm's readout "
                         f"(seed {seed})",
                         data.boxes[pick] if data.boxes is not None else None, grid=next(iter(found.values())).grid)


def write_explore(args: argparse.Namespace, runs: dict[str, tuple[str, Path]], seed: int, path: Path) -> Path:
    """The harness.explore page of the first 64 test images under each trained arm's run of ``seed``."""
    from timm_rollout.loading import load_model  # here, so that --help loads no timm

    models = [(arm, *load_model(name, run)) for arm, (name, run) in runs.items()]
    return write_page(models, dataset_gallery(args.dataset, "test", box_format=args.bbox_format), path,
                      f"{', '.join(runs)} on {Path(args.dataset).name} (seed {seed})")


def _figures(args: argparse.Namespace, out: Path, arms: list[str], seeds: list[int],
             runs: dict[tuple[str, int], Path], results: dict[tuple[str, int], dict[str, Any]]) -> bool:
    """Training curves of the trained arms, their pooling diagnostics (when every seed's evaluation has them;
    returns whether that figure was drawn) and the heatmap grid of every arm, on the first seed's test images."""
    trained = [a for a in arms if a in ARMS]
    logs = {a: {seed: read_log(runs[a, seed] / LOG_FILE) for seed in seeds} for a in trained}
    marks = writeup_marks() if args.epochs == WRITEUP_EPOCHS else None  # the write-up's loss read-offs
    plot_training_curves(logs, out / CURVES_FILE, f"Training on {args.dataset}, {args.epochs} epochs", marks)
    records = {a: [results[a, s].get("pooling_diagnostics") for s in seeds] for a in trained}
    records = {a: r for a, r in records.items() if all(r)}
    if records:
        plot_pooling_diagnostics(records, out / POOLING_FILE, f"Rollout pooling weights of each arm's backbone "
                                 f"({args.dataset} test split; for non-rollout arms, the weights rollout would pool "
                                 "with post hoc)")
    first = seeds[0]
    if args.heatmaps:
        panels = {a: (arm_model(args.model, backbone(a))[0], runs[backbone(a), first], POSTHOC.get(a)) for a in arms}
        plot_side_by_side(args, panels, first, out / HEATMAPS_FILE)
        write_explore(args, {a: panels[a][:2] for a in trained}, first, out / EXPLORE_FILE)
    else:  # --heatmaps 0: no grid nor page, and none left from an earlier render
        for name in (HEATMAPS_FILE, EXPLORE_FILE):
            (out / name).unlink(missing_ok=True)
    return bool(records)


def pick_seed(logs: dict[int, list[dict[str, float]]]) -> int:
    """The seed whose run ended with the lowest training loss (last ``log.csv`` row; ties: the lowest seed): a
    pick that never looks at the test set."""
    return min(sorted(logs), key=lambda seed: logs[seed][-1]["train_loss"])


PICK_RULE = "the lowest final training loss (last epoch of log.csv); the test set played no part in the pick"


def export_picked(args: argparse.Namespace, out: Path, arms: Sequence[str], seeds: Sequence[int],
                  runs: dict[tuple[str, int], Path], evals: dict[tuple[str, int], Path]) -> dict[str, int]:
    """One seed of each trained arm (:func:`pick_seed`) as a Hub upload folder ``hub/<arm>`` with its model card,
    which states the rule, as ``scripts/push_to_hub.py --dry-run`` writes it. Returns arm -> exported seed."""
    picked = {}
    for arm in (a for a in arms if a in ARMS):
        picked[arm] = seed = pick_seed({s: read_log(runs[arm, s] / LOG_FILE) for s in seeds})
        selection = f"seed {seed} of seeds {', '.join(map(str, seeds))} of this study arm, the one with {PICK_RULE}"
        write_upload_folder(runs[arm, seed], out / HUB_DIR / arm, hub_repo_id(args, arm), evals[arm, seed],
                            selection=selection)
    return picked


def hub_repo_id(args: argparse.Namespace, arm: str) -> str:
    """Repo id in the exported model card: ``<org>/vit-tiny-<data set folder name>-<arm>``."""
    return f"{args.hub_org}/vit-tiny-{Path(args.dataset).name}-{arm}"


def write_report(args: argparse.Namespace, out: Path, scope: tuple[list[str], list[int]], commands: list[str],
                 runs: dict[tuple[str, int], Path], evals: dict[tuple[str, int], Path]) -> Path:
    """report.md over the folder's arms and the seeds all of them finished (including runs of earlier commands):
    statistics, curves, cosine matrices, side-by-side heatmaps and the exported checkpoints."""
    arms, seeds = scope
    pairs = [(a, s) for a in arms for s in seeds]
    loaded = load_results([evals[pair] for pair in pairs])
    added = [{**added_metrics(args, arm, runs[backbone(arm), seed], r), **also_metrics(args, arm, seed, r)}
             for (arm, seed), r in zip(pairs, loaded, strict=True)]
    results = [{**r, "metrics": {**r["metrics"], **more}} for r, more in zip(loaded, added, strict=True)]
    extra = list(dict.fromkeys(m for more in added for m in more))
    shown = [*METRICS, *POOLING_DIAGNOSTICS, *LOCALISATION, *extra, *ORIGINAL_METRICS]
    groups = {g.label: g for g in summarise(results, shown, label=lambda r: arm_of(r["path"]))}
    pooling = _figures(args, out, arms, seeds, runs, dict(zip(pairs, loaded, strict=True)))
    exported = export_picked(args, out, arms, seeds, runs, evals)
    trained = [(a, s) for a in arms if a in ARMS for s in seeds]
    minutes = sum(float(json.loads((runs[k] / SUMMARY_FILE).read_text(encoding="utf-8"))["wall_seconds"])
                  for k in trained) / 60
    lines = [
        f"# Pooling arms ({', '.join(arms)}) on {args.dataset}", "",
        "Commands run on this folder:", "", *[f"- `{c}`" for c in commands], "",
        f"{len(seeds)} seed(s) ({', '.join(map(str, seeds))}), {args.epochs} epoch(s) per run, the same "
        f"recipe for every arm (only the pooling differs); {minutes:.1f} training minutes in all. " + (
            "`cls-posthoc-*` are the `cls` runs read out with another pooling, untrained (`harness.eval --pool`). "
            if any(a.startswith("cls-posthoc") for a in arms) else "") +
        "Metrics are from `python -m harness.eval` on the test split with the train split as k-NN bank and "
        "linear-probe training set (definitions in harness/README.md).", "",
        *data_section(args, out),
        *notes_section(out),
        *report_tables(groups, extra, args.primary, primary_metric(args)),
        *(writeup_section(out, groups, seeds, {a: {s: read_log(runs[a, s] / LOG_FILE) for s in seeds}
                                               for a in arms if a in ARMS} if args.epochs == WRITEUP_EPOCHS else None)
          if any(g.mean.get(m) is not None for g in groups.values() for m in ORIGINAL_METRICS) else []),
        *localisation_section(out, groups, seeds, results),
        *dose_report(args, out, seeds),
        *interaction_section(args, out, dict(zip(pairs, results, strict=True)), tested_metrics(extra)),
        "## Training curves", "", "![training curves](curves.png)", "",
        *(["## Pooling diagnostics", "", POOLING_NOTE, "", f"![pooling diagnostics]({POOLING_FILE})", "",
           LAYERS_NOTE, "", pooling_table(dict(zip(pairs, loaded, strict=True)), [a for a in arms if a in ARMS],
                                          seeds), ""]
          if pooling else []),
        f"## Cosine similarity of class centroids (seed {seeds[0]})", "",
        *[f"![{a}]({evals[a, seeds[0]].relative_to(out)}/cosine_matrix.png)" for a in arms], "",
        *(["## The same test images under every arm", "", "![heatmaps](heatmaps.png)", "",
           f"[Every map of the first 64 test images under each trained arm]({EXPLORE_FILE}): one page for any "
           "browser, offline (`harness.explore`).", ""] if args.heatmaps else []),
        "## Shareable checkpoints", "",
        f"One seed of each trained arm, the one with {PICK_RULE}, as a Hub upload folder with its model card "
        "(`scripts/push_to_hub.py --dry-run`); `timm.create_model(\"local-dir:<folder>\", pretrained=True)` "
        "loads it, `scripts/push_to_hub.py <run> --repo-id <id> --eval <eval>` uploads it.", "",
        *[f"- {arm}: `{HUB_DIR}/{arm}` (seed {seed}, repo id `{hub_repo_id(args, arm)}`)"
          for arm, seed in exported.items()], "",
        "## Runs", "",
        "Each run's folders, wall time, the machine and precision it ran on and the code it ran, as its "
        "`summary.json` (epochs trained on each machine and with each code version: a resumed run may change "
        "both) and `results.json` recorded them.", "",
        *[run_line(args, out, arm, seed, runs[backbone(arm), seed], evals[arm, seed], r) for (arm, seed), r in
          zip(pairs, loaded, strict=True)],
    ]
    return write_text(out / REPORT_FILE, "\n".join(lines) + "\n")


def primary_metric(args: argparse.Namespace) -> str:
    """The metric of the primary test: the dose contrast with several ``--also-eval`` data sets, else top-1."""
    names = [Path(d).name for d in args.also_eval or ()]
    return contrast_metric(names) if len(names) > 1 and args.primary else PRIMARY


def dose_report(args: argparse.Namespace, out: Path, seeds: Sequence[int]) -> list[str]:
    """The dose section (:mod:`harness.study.dose`) and its figure over the seeds whose primary arms were evaluated
    on every ``--also-eval`` data set; nothing with fewer than two data sets or without ``--primary``."""
    names = [Path(d).name for d in args.also_eval or ()]
    if len(names) < 2 or not args.primary:
        (out / DOSE_FILE).unlink(missing_ok=True)  # no figure left from an earlier render
        return []
    folders = {(a, s, n): also_folder(d, args.output, a, s) for a in args.primary for s in seeds
               for d, n in zip(args.also_eval, names, strict=True)}
    done = [s for s in seeds if all((folders[a, s, n] / RESULTS_FILE).is_file() for a in args.primary for n in names)]
    if not done:
        (out / DOSE_FILE).unlink(missing_ok=True)  # no figure left from an earlier render
        return []
    keys = [k for k in folders if k[1] in done]
    results = dict(zip(keys, load_results([folders[k] for k in keys]), strict=True))
    found = {k: read_predictions(folders[k]) for k in keys}
    same = all(f is not None and (f["index"], f["label"]) == (found[keys[0]]["index"], found[keys[0]]["label"])
               for f in found.values())  # image-level needs every model on the same images, in one order
    hits = {k: (np.asarray(f["predicted"]["top1"]) == np.asarray(f["label"])).astype(np.float64)
            for k, f in found.items()} if same else None
    base, arm = args.primary
    plot_dose(*dose_series(base, arm, names, done, results), out / DOSE_FILE,
              f"{arm} against {base}, the same models at every dose ({seeds_phrase(len(done))})",
              f"{arm} - {base}", INTEREST)
    lines = dose_section(base, arm, names, done, results, hits)
    return [*lines[:2], f"![{arm} - {base} and object masses at each dose]({DOSE_FILE})", "", *lines[2:]]


def data_section(args: argparse.Namespace, out: Path) -> list[str]:
    """The data sets' cards (a folder's README.md, as scripts/make_cluttered.py writes it): title, and a copy in
    ``out/data/`` (committed with the report: the data sets themselves are not, and are made again from it)."""
    lines = []
    for role, dataset in (("trained and evaluated on", args.dataset),
                          *(("also evaluated on", d) for d in args.also_eval or ())):
        title = data_card_title(dataset) if dataset else None
        if title is not None:
            copy = write_text(out / DATA_DIR / f"{Path(dataset).name}.md",
                              (Path(dataset) / CARD_FILE).read_text(encoding="utf-8"))
            lines.append(f"- {role} `{dataset}` ({title}): its data card, as made, in "
                         f"[`{DATA_DIR}/{copy.name}`]({DATA_DIR}/{copy.name})")
    return ["## Data", "", *lines, ""] if lines else []


def also_metrics(args: argparse.Namespace, arm: str, seed: int, result: dict[str, Any]) -> dict[str, float]:
    """``--also-eval``: the run's top-1 on each other data set's test split and its paired change from the study's
    (e.g. the top-1 a model loses to clutter, when the other set holds the same objects without it); with several,
    also the last minus the first (:func:`harness.study.dose.contrast_metric`: its paired comparison is the dose
    interaction)."""
    top1 = {folder.parent.name.removeprefix("eval-"): r["metrics"]["top1"]
            for folder, r in zip(*also_results(args, arm, seed), strict=True)}
    found = {f"top1 on {name}": v for name, v in top1.items()}
    found |= {f"top1 on {name} - top1": v - result["metrics"]["top1"] for name, v in top1.items()}
    names = [Path(d).name for d in args.also_eval or ()]
    if len(names) > 1 and names[0] in top1 and names[-1] in top1:
        found[contrast_metric(names)] = top1[names[-1]] - top1[names[0]]
    return found


def localisation_section(out: Path, groups: dict[str, Group], seeds: Sequence[int],
                         results: Sequence[dict[str, Any]]) -> list[str]:
    """The localisation table and figure (pooling weight inside against outside the box), when the evaluations
    scored boxes."""
    if not any(r["metrics"].get("pooling_object_mass") is not None for r in results):
        return []
    values = {arm: [(i, o) for i, o in zip(g.values.get("pooling_weight_inside", []),
                                           g.values.get("pooling_weight_outside", []), strict=True)
                    if i is not None and o is not None] for arm, g in groups.items()}
    plot_object_weights(values, out / LOCALISATION_FILE, f"Pooling weight on the object's box against the rest "
                        f"(test split, seeds {' '.join(map(str, seeds))})")
    return ["## Localisation", "", LOCALISATION_NOTE, "", means_table(groups, LOCALISATION), "",
            *null_excess_table(groups), f"![pooling weight inside and outside the box]({LOCALISATION_FILE})", ""]


def interaction_section(args: argparse.Namespace, out: Path, here: dict[tuple[str, int], dict[str, Any]],
                        metrics: Sequence[str]) -> list[str]:
    """``--interaction``: the primary comparison here against the same comparison in the other study, per
    metric, paired by seed. ``here``: this study's results (with the metrics the report adds) by (arm, seed)."""
    if args.interaction is None:
        return []
    (base, arm), other = args.primary, Path(args.interaction)
    there = other_results(args, other, [(a, s) for a, s in here if a in (base, arm)])
    seeds = sorted({s for _, s in here if all((a, s) in here and (a, s) in there for a in (base, arm))})
    link = Path(os.path.relpath(other / REPORT_FILE, out)).as_posix()
    lines = [f"## Interaction with `{other}`", "",
             INTERACTION_NOTE.format(arm=arm, base=base, primary=PRIMARY) + f" Its report: [{link}]({link}).", ""]
    same = [f"{a} seed {s}" for a in (base, arm) for s in seeds
            if None not in (found := [evaluated_images(r[a, s]) for r in (here, there)]) and same_images(*found)[0]]
    if not seeds or same:
        return [*lines, f"Not computed: {', '.join(same)} read the same data in both studies; name a study on "
                        "another data set." if same else f"No seed has {base} and {arm} evaluated in both studies "
                        "yet.", ""]
    rows = []
    for metric in metrics:
        value = {(k, r): v[k]["metrics"].get(metric) for r, v in (("here", here), ("there", there)) for k in v}
        paired = [s for s in seeds if all(value.get(((a, s), r)) is not None for a in (base, arm)
                                          for r in ("here", "there"))]
        if paired:
            d_here, d_there = ([value[(arm, s), r] - value[(base, s), r] for s in paired] for r in ("here", "there"))
            rows.append((metric, np.mean(d_here), np.mean(d_there), stats.paired_delta(d_there, d_here)))
    adjusted = iter(stats.holm([d.p for metric, *_, d in rows if metric != PRIMARY]))
    lines += [f"| metric | seeds | {arm} - {base} here | there | interaction | 95% CI | p | p Holm | MDE |",
              "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for metric, d_here, d_there, d in rows:
        holm = "uncorrected" if metric == PRIMARY else format_p(next(adjusted))
        lines.append(f"| {metric} | {d.n} | {d_here:+.4f} | {d_there:+.4f} | {d.mean:+.4f} | {format_ci(d)} | "
                     f"{format_p(d.p)} | {holm} | {format_number(d.mde)} |")
    return [*lines, "", *arm_change_table((base, arm), seeds, here, there)]


def other_results(args: argparse.Namespace, other: Path, pairs: Sequence[tuple[str, int]]
                  ) -> dict[tuple[str, int], dict[str, Any]]:
    """The other study's evaluations of ``pairs`` (arm, seed) that exist, with the metrics this report adds to its
    own (learning curves, faithfulness)."""
    runs, evals = layout(other, sorted({seed for _, seed in pairs}))
    found = {}
    for arm, seed in pairs:
        if (evals[arm, seed] / RESULTS_FILE).is_file():
            result = load_results([evals[arm, seed]])[0]
            added = added_metrics(args, arm, runs[backbone(arm), seed], result)
            found[arm, seed] = {**result, "metrics": {**result["metrics"], **added}}
    return found


def added_metrics(args: argparse.Namespace, arm: str, run: Path, result: dict[str, Any]) -> dict[str, float]:
    """The metrics the report adds to an evaluation's: the learning curves of a trained arm's run (its
    ``log.csv``; ``run`` is the backbone's run) and the faithfulness scores."""
    curves = curve_metrics(run, args.epochs) if arm in ARMS and (run / LOG_FILE).is_file() else {}
    return {**curves, **faithfulness_metrics(result)}


def notes_section(out: Path) -> list[str]:
    """The study folder's hand-written ``notes.md`` (what the numbers mean, limits) as the report's "Notes"
    section, or nothing: report.md is rewritten on every render, so prose kept there would be lost."""
    path = out / NOTES_FILE
    return ["## Notes", "", path.read_text(encoding="utf-8").strip(), ""] if path.is_file() else []


def run_line(args: argparse.Namespace, out: Path, arm: str, seed: int, run: Path, evaluation: Path,
             result: dict[str, Any]) -> str:
    """The report's line for one run: its folders, wall times and machines (runs from before machines were
    recorded say so), of training and of each evaluation (the study's, then ``--also-eval``'s)."""
    summary = json.loads((run / SUMMARY_FILE).read_text(encoding="utf-8"))
    def per_epoch(key: str, missing: str) -> str:
        return "; ".join(f"{k}: {n} epoch{'s' if n != 1 else ''}" for k, n in summary.get(key, {}).items()) or missing

    trained = (f"{summary['wall_seconds'] / 60:.1f} min, {per_epoch('machines', 'machine not recorded')}; code "
               f"{per_epoch('code', 'not recorded')}" if arm in ARMS else f"the `{backbone(arm)}` run")
    folders, found = also_results(args, arm, seed)
    evaluated = []
    for folder, record in zip([evaluation, *folders], [result, *found], strict=True):
        env = record["environment"]
        evaluated.append(f"`{folder.relative_to(out)}` ({record['timing']['total'] / 60:.1f} min, "
                         f"{env.get('machine', env['device'])}, {env['dtype']})")
    return (f"- {arm}, seed {seed}: training `{run.relative_to(out)}` ({trained}); evaluation "
            + ", ".join(evaluated) + f"; evaluation code {code_labels([result, *found])}")


def also_results(args: argparse.Namespace, arm: str, seed: int) -> tuple[list[Path], list[dict[str, Any]]]:
    """The ``--also-eval`` evaluations of ``arm``'s seed that exist, in the order of the data sets: (folders,
    results)."""
    folders = [also_folder(d, args.output, arm, seed) for d in args.also_eval or ()]
    folders = [f for f in folders if (f / RESULTS_FILE).is_file()]
    return folders, load_results(folders) if folders else []


def curve_metrics(run: Path, epochs: int) -> dict[str, float]:
    """How fast a trained run learned, from its ``log.csv``: eval top-1 (fraction) averaged over all epochs, and
    after a quarter of them (a post-hoc readout has none: its backbone is a ``cls`` run)."""
    top1 = {int(r["epoch"]): r["eval_top1"] / 100 for r in read_log(run / LOG_FILE)}
    quarter = max(1, round(epochs / 4))
    return {"learning curve mean top-1": sum(top1.values()) / len(top1),
            f"eval top-1 at epoch {quarter}": top1[quarter]}


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
