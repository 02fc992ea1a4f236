#!/usr/bin/env bash
# What a lent GPU machine runs, one prepared step per call (see scripts/README.md, "On a lent GPU").
#
#   bash scripts/gpu_lease.sh kit            # here, once: wheels (Python 3.12) and CIFAR-10 into .gpu/ (git-ignored)
#   bash scripts/gpu_lease.sh away PID...    # here, before the calls: pause these processes (a study command, say)
#                                            # and their children, take results/ out of the tree that travels
#   bash scripts/gpu_lease.sh back PID...    # here, after them: results/ back, the processes continue
#   bash scripts/gpu_lease.sh check          # there: versions, then tests/test_graphed.py and tests/test_cuda.py
#   bash scripts/gpu_lease.sh bench          # there: the benchmark record, into $OUT
#   bash scripts/gpu_lease.sh dose 1 2 3     # there: the clutter dose study's four cells of these seeds, into $OUT
#   bash scripts/gpu_lease.sh eval 1 2 3     # there, next call while the machine is warm: their evaluations
#
# There, nothing installs from the network: the wheels travel in .gpu/whl and go to /tmp/site; the project runs from
# the checkout (PYTHONPATH). The dose step writes the 0- and 256-fragment canvases beside the checkout (the paths the
# study records), checks their hashes against the committed study's, trains each cell's seeds stacked with the step
# captured as a CUDA graph (the exact train commands of scripts/study.py), and packs the finished runs, without
# their resume states, into tars of at most three runs each. faiss (which harness.eval needs) does not fit beside
# CIFAR-10 in one call's 64 MiB, so the evaluations are the next call's (`eval`, carrying .gpu/whl and .gpu/faiss),
# on the canvases and runs the first left on the machine; if it went cold meanwhile, the study command evaluates
# the runs here.
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:?usage: gpu_lease.sh kit|away|back|check|bench|dose SEED...|eval SEED...}
shift

WHEELS="timm==1.0.31 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19"
TA='--amp none --opt adamw --lr 1e-3 --weight-decay 0.05 --smoothing 0.1 --warmup-epochs 2 --model-kwargs img_size=64 patch_size=8 pos_drop_rate=0 attn_drop_rate=0 proj_drop_rate=0'
DOSE=results/cifar10-clutter-dose
# test-split canvas sha256 (pixels, labels, boxes) in the data cards of the committed dose study's canvases
HASH0=7918179caa76797ae981473298517a1b24fe3bc033a5a8daea5410e3cb7bf141
HASH256=58cd71a0c383c95d0d9a62b2ac3fbe86968e43fb34f2dbbac372e23fa7149a35

tree() {  # the processes and all their descendants
  for pid in "$@"; do
    echo "$pid"
    # shellcheck disable=SC2046
    tree $(pgrep -P "$pid" || true)
  done
}

steps=()  # --pack N --stack for N seeds, when there are several
pack() { (( $# > 1 )) && steps=(--pack $# --stack) || steps=(); }

setup() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/whl/*.whl $(ls .gpu/faiss/*.whl 2>/dev/null)
  export PYTHONPATH="$PWD:/tmp/site"
  OUT=${OUT:?set by the device tool}
}

case $step in
kit)
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
  mkdir -p .gpu/whl
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl $WHEELS
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .gpu/faiss faiss-cpu==1.15.1
  rm -rf .gpu/cifar10 && cp -r ../shared/data/cifar10 .gpu/cifar10 && chmod -R u+w .gpu/cifar10
  du -sh .gpu/*
  git ls-files -z -- . ':!results' | du -ch --files0-from=- | tail -n 1 | sed 's/total/tracked files outside results\//'
  echo "carry .gpu/whl with .gpu/cifar10 (check, bench, dose) or with .gpu/faiss (eval); keep results/ out of the"
  echo "working tree that travels (scripts/README.md, On a lent GPU)"
  ;;
away)
  (( $# )) || { echo "error: name the processes to pause (e.g. the study command's PID: pgrep -f scripts/study.py)" >&2; exit 2; }
  # shellcheck disable=SC2046
  kill -STOP $(tree "$@")
  grep -qx '/results/' .git/info/exclude || echo '/results/' >> .git/info/exclude
  git sparse-checkout set --no-cone '/*' '!/results/'
  git status --short | head
  ;;
back)
  git sparse-checkout disable
  sed -i '\#^/results/$#d' .git/info/exclude
  # shellcheck disable=SC2046
  (( $# )) && kill -CONT $(tree "$@")
  git status --short | head
  ;;
check)
  setup
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, timm, datasets, pyarrow; print('torch', torch.__version__, 'timm', timm.__version__, \
'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)"
  timeout 480 python3 -m pytest -p no:cacheprovider -n 4 -q tests/test_graphed.py tests/test_keyed.py tests/test_cuda.py \
    2>&1 | tail -25 | tee "$OUT/check.txt"
  ;;
bench)
  setup
  timeout 560 python3 scripts/bench_train.py --device cuda --dataset .gpu/cifar10 --steps 20 --capture-runs 1 8 32 \
    --profile 8 --json "$OUT/bench.json" 2>&1 | tail -40 | tee "$OUT/bench.txt"
  ;;
dose)
  setup
  seeds=("$@")
  (( ${#seeds[@]} )) || { echo "error: name the seeds, e.g. dose 1 2 3" >&2; exit 2; }
  t0=$(date +%s)
  python3 scripts/make_cluttered.py --dataset .gpu/cifar10 --fragments 256 --seed 0 --output ../cifar10-clutter256 &
  p256=$!
  python3 scripts/make_cluttered.py --dataset .gpu/cifar10 --fragments 0 --seed 0 --output ../cifar10-clutter0 &
  p0=$!
  wait $p256 && wait $p0 || { echo "error: make_cluttered.py failed (its output above)" >&2; exit 1; }
  grep -q "$HASH256" ../cifar10-clutter256/README.md && grep -q "$HASH0" ../cifar10-clutter0/README.md \
    || { echo "error: the canvases differ from the committed study's (hashes in the data cards)" >&2; exit 1; }
  echo "data in $(( $(date +%s) - t0 )) s"
  pack "${seeds[@]}"
  mapfile -t cmds < <(python3 - "${seeds[@]}" -- "${steps[@]}" <<EOF
import importlib.util, shlex, sys
spec = importlib.util.spec_from_file_location("study", "scripts/study.py")
study = importlib.util.module_from_spec(spec)
spec.loader.exec_module(study)
split = sys.argv.index("--")
seeds, packing = sys.argv[1:split], sys.argv[split + 1:]
for dataset, out, extra in (("../cifar10-clutter256", "$DOSE", ["--also-eval", "../cifar10-clutter0"]),
                            ("../cifar10-clutter0", "$DOSE/fragments0", [])):
    args = study.build_parser().parse_args(
        ["--dataset", dataset, *extra, "--primary", "gap:rollout", "--epochs", "20", "--seeds", *seeds,
         "--arms", "gap", "rollout", "--faithfulness-images", "1000", "--output", out, "--train-args", """$TA""",
         "--device", "cuda", *packing, "--capture"])
    for arm in args.arms:
        flags = study.train_command(args, arm, [int(s) for s in seeds], f"{out}/runs/{arm}-s{{seed}}")
        print(shlex.join(["python3", "-m", "timm_rollout.train", "--no-progress", *flags]))
EOF
)
  for i in "${!cmds[@]}"; do
    echo "+ ${cmds[i]}"
    (eval "${cmds[i]}" > "$OUT/train-$i.log" 2>&1 || echo "failed: ${cmds[i]}" >> "$OUT/failed.txt") &
  done
  wait
  echo "trained in $(( $(date +%s) - t0 )) s"
  runs=()
  for s in "${seeds[@]}"; do
    for dir in $DOSE/runs/{gap,rollout}-s$s $DOSE/fragments0/runs/{gap,rollout}-s$s; do
      if [[ -f $dir/summary.json ]]; then
        runs+=("$dir")
      elif [[ -f $dir/resume.safetensors ]]; then  # its resume state comes back, to continue it here or there
        echo "unfinished: $dir" | tee -a "$OUT/failed.txt"
        tar -cf "$OUT/unfinished-$(basename "$(dirname "$(dirname "$dir")")")-$(basename "$dir").tar" "$dir"
      fi
    done
  done
  for ((i = 0; i < ${#runs[@]}; i += 3)); do
    tar -cf "$OUT/runs-$((i / 3)).tar" --exclude=resume.safetensors "${runs[@]:i:3}"
  done
  tail -n 3 "$OUT"/train-*.log || true
  ;;
eval)
  setup
  (( $# )) || { echo "error: name the seeds, e.g. eval 1 2 3" >&2; exit 2; }
  [[ -f ../cifar10-clutter256/README.md && -f ../cifar10-clutter0/README.md ]] \
    || { echo "error: the canvases of the dose step are gone (the machine went cold); evaluate the runs here" >&2; exit 2; }
  pack "$@"
  common=(--primary gap:rollout --epochs 20 --seeds "$@" --arms gap rollout --faithfulness-images 1000
          --train-args "$TA" --device cuda "${steps[@]}" --capture --jobs 4)
  python3 scripts/study.py --dataset ../cifar10-clutter256 --also-eval ../cifar10-clutter0 --output $DOSE "${common[@]}" \
    > "$OUT/eval-256.log" 2>&1 || echo "failed: the 256-fragment evaluations" >> "$OUT/failed.txt"
  python3 scripts/study.py --dataset ../cifar10-clutter0 --output $DOSE/fragments0 "${common[@]}" \
    > "$OUT/eval-0.log" 2>&1 || echo "failed: the 0-fragment evaluations" >> "$OUT/failed.txt"
  folders=()
  for s in "$@"; do
    for arm in gap rollout; do
      for f in $DOSE/eval/$arm-s$s $DOSE/eval-cifar10-clutter0/$arm-s$s $DOSE/fragments0/eval/$arm-s$s; do
        [[ -f $f/results.json ]] && folders+=("$f") || echo "not evaluated: $f" | tee -a "$OUT/failed.txt"
      done
    done
  done
  (( ${#folders[@]} )) && tar -cf "$OUT/evals.tar" "${folders[@]}"
  tail -n 5 "$OUT"/eval-*.log
  ;;
*)
  echo "error: unknown step $step; use kit, away, back, check, bench, dose or eval" >&2
  exit 2
  ;;
esac
