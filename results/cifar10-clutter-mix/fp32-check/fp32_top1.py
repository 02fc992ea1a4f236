"""The mixture study's top-1 at fp32 against its committed bf16 evaluations: per model the top-1 of each, the
images whose prediction differs, and the primary per seed. Run from the repository root, the test folders beside
it: ``python results/cifar10-clutter-mix/fp32-check/fp32_top1.py 0 1 2``."""
import json
import sys
from pathlib import Path

import numpy as np
import torch

from harness.features import extract
from harness.record import read_predictions
from timm_rollout.data import load_image_set
from timm_rollout.loading import load_model

STUDY = "results/cifar10-clutter-mix"
seeds = [int(s) for s in sys.argv[1:]] or [0, 1, 2]
cpu = torch.device("cpu")
out = {}
for dose in (0, 256):
    name = f"cifar10-clutter{dose}-test"
    data = load_image_set(f"../{name}", "test")
    labels = data.labels.numpy()
    for seed in seeds:
        for arm in ("gap", "rollout"):
            model, info = load_model(f"vit_tiny_cifar_{arm}", f"{STUDY}/runs/{arm}-s{seed}", device=cpu)
            _, logits = extract(model, data.images, info["mean"], info["std"], device=cpu, amp_dtype=None)
            fp32 = logits.argmax(1).numpy()
            if not out:  # this route at the evaluation's own precision gives its recorded predictions
                _, same = extract(model, data.images, info["mean"], info["std"], device=cpu, amp_dtype=torch.bfloat16)
                print("route check, bf16 here vs recorded: differ on",
                      int((same.argmax(1).numpy() != np.asarray(read_predictions(
                          f"{STUDY}/eval-{name}/{arm}-s{seed}")["predicted"]["top1"])).sum()), "images")
            bf16 = read_predictions(f"{STUDY}/eval-{name}/{arm}-s{seed}")
            assert list(bf16["label"]) == labels.tolist() and list(bf16["index"]) == list(range(len(labels)))
            bf = np.asarray(bf16["predicted"]["top1"])
            rec = json.load(open(f"{STUDY}/eval-{name}/{arm}-s{seed}/results.json"))["metrics"]["top1"]
            out[arm, seed, dose] = {"fp32": float((fp32 == labels).mean()), "bf16": float((bf == labels).mean()),
                                    "recorded_bf16": rec, "differ": int((fp32 != bf).sum())}
            print(arm, seed, dose, out[arm, seed, dose], flush=True)
for seed in seeds:
    row = {}
    for p in ("fp32", "bf16"):
        g = {d: out["rollout", seed, d][p] - out["gap", seed, d][p] for d in (0, 256)}
        row[p] = g[256] - g[0]
    print(f"seed {seed}: primary fp32 {row['fp32']:+.4f}, bf16 {row['bf16']:+.4f}")
record = {f"{a}-s{s}@{d}": v for (a, s, d), v in out.items()}
Path(__file__).with_suffix(".json").write_text(json.dumps(record, indent=1))
