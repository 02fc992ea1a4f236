"""The original write-up's CIFAR-10 numbers (200 epochs, one seed, [CLS] vs rollout) beside a study's: its probe
table in three columns (its value, ours by its definitions on its kind of probe, ours by the harness's) and its
training-loss read-offs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from harness.compare import Group, format_mean, summarise
from harness.record import load_results
from timm_rollout.records import RESULTS_FILE

# Its probe table, [CLS] and rollout: (write-up's metric, harness metric on the full test split, what it is, the
# format that prints its values as it wrote them: 1.40, not 1.4).
WRITEUP_PROBE = {
    "ratio_original": ((1.40, 1.53), "ratio", "centroid ratio inter / intra", "#.3g"),
    "knn_original": ((0.845, 0.850), "knn_loo", "k-NN@5", "#.3g"),
    "silhouette": ((0.143, 0.134), "silhouette", "silhouette", "#.3g"),
    "intra_original": ((0.7167, 0.6937), "intra", "intra-class distance", ".4f"),
    "inter_original": ((1.0003, 1.0628), "inter", "inter-class distance", ".4f"),
}
HARNESS_ONLY = {"top1": "test top-1", "linear_probe": "linear probe", "knn_bank": "bank k-NN@20"}  # it never measured
WRITEUP_ARMS = ("cls", "rollout")
# Its training loss read off at epochs 10 (rollout ~9% below [CLS], no level given), 80 and 200; its length.
WRITEUP_LOSS = {10: None, 80: (0.230, 0.185), 200: (0.0335, 0.0145)}
WRITEUP_EPOCHS = 200
MILESTONES = (0.230, 0.185, 0.0335, 0.0145)
LOSS_FORMAT = "#.3g"  # its losses as it wrote them: 0.230, 0.0335
PROBE_DIR = "probe"  # probe/<arm>-s<seed>: harness.eval --per-class 100 of each run, the write-up's kind of probe
PROBE_NOTE = (
    "Column *its definitions* is `harness.eval --per-class 100` of each run (the seeded class-balanced draw of 100 "
    "test images per class, the same images for every model) in the write-up's units (`*_original`: Euclidean "
    "distance to the class mean, cosine distance between class means; `knn_original`: k-NN@5 counting the query as "
    "its own neighbour; scikit-learn's silhouette on the normalised features), written to `probe/<arm>-s<seed>`. "
    "Column *harness* is the study's own evaluation of the full test split: leave-one-out k-NN@5, geometry as "
    "angles (radians), top-1 and linear probe, which the write-up never measured. Mean ± std over seeds.")


def writeup_marks() -> dict[str, list[tuple[int, float | None]]]:
    """Its loss read-offs per arm for the training-curve figure: (epoch, loss), None where it gave no level."""
    return {arm: [(e, None if v is None else v[i]) for e, v in WRITEUP_LOSS.items()]
            for i, arm in enumerate(WRITEUP_ARMS)}


def probe_table(out: Path, groups: dict[str, Group], seeds: Sequence[int]) -> list[str]:
    """The write-up's table beside ours, one row per quantity and arm (the probe of arms evaluated at every seed)."""
    arms = [a for a in (*WRITEUP_ARMS, "gap") if a in groups]
    folders = {a: [out / PROBE_DIR / f"{a}-s{s}" for s in seeds] for a in arms}
    probe = {a: summarise(load_results(f), list(WRITEUP_PROBE), label=lambda _r, a=a: a)[0]
             for a, f in folders.items() if all((x / RESULTS_FILE).is_file() for x in f)}
    lines = ["| quantity | arm | write-up | ours, its definitions, its probe | ours, harness definitions, full test "
             "split |", "|---|---|---:|---:|---|"]
    for metric, (values, ours, what, spec) in WRITEUP_PROBE.items():
        for arm in arms:
            theirs = format(values[WRITEUP_ARMS.index(arm)], spec) if arm in WRITEUP_ARMS else "-"
            mine = (format_mean(probe[arm], metric) if arm in probe else  # else the study's own test split
                    f"{format_mean(groups[arm], metric)} (full test split)" if groups[arm].mean.get(metric) else "-")
            lines.append(f"| {what} | {arm} | {theirs} | {mine} | `{ours}` {format_mean(groups[arm], ours)} |")
    for metric, what in HARNESS_ONLY.items():
        lines += [f"| {what} | {arm} | - | - | `{metric}` {format_mean(groups[arm], metric)} |" for arm in arms]
    return lines


def loss_table(logs: dict[str, dict[int, list[dict[str, float]]]]) -> list[str]:
    """Training loss at the write-up's read-off epochs and the first epoch each run reaches its levels."""
    head = [*[f"loss @ {e}" for e in WRITEUP_LOSS], *[f"first epoch ≤ {m:{LOSS_FORMAT}}" for m in MILESTONES]]
    lines = ["| run | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    for i, arm in enumerate(WRITEUP_ARMS):
        read = [("rollout ~9% below cls" if arm == "rollout" else "-") if v is None else f"{v[i]:{LOSS_FORMAT}}"
                for v in WRITEUP_LOSS.values()]
        lines.append(f"| write-up {arm} | " + " | ".join(read + ["-"] * len(MILESTONES)) + " |")
    for arm, per_seed in logs.items():
        for seed, rows in sorted(per_seed.items()):
            loss = {int(r["epoch"]): r["train_loss"] for r in rows}
            at = [f"{loss[e]:.4f}" if e in loss else "-" for e in WRITEUP_LOSS]
            first = [next((str(e) for e, v in sorted(loss.items()) if v <= m), "not reached") for m in MILESTONES]
            lines.append(f"| {arm} seed {seed} | " + " | ".join(at + first) + " |")
    return lines


def writeup_section(out: Path, groups: dict[str, Group], seeds: Sequence[int],
                    logs: dict[str, dict[int, list[dict[str, float]]]] | None) -> list[str]:
    """The report's section beside the write-up; the loss part only for runs of its length (``logs``)."""
    lines = ["## Beside the original write-up", "",
             "The write-up trained [CLS] and rollout pooling once, 200 epochs, on CIFAR-10, and reported a probe of "
             "100 test images per class. " + PROBE_NOTE, "", *probe_table(out, groups, seeds), ""]
    if logs:
        lines += ["Training loss (cross-entropy over the epoch's batches, dropout on) at the write-up's read-off "
                  "epochs, and the first epoch each run reaches the levels it reported; the curves, on a log "
                  "scale with its read-offs marked, are in [`curves.png`](curves.png).", "", *loss_table(logs), ""]
    return lines
