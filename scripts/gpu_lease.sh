#!/usr/bin/env bash
# What a lent GPU machine runs, one prepared step per call (see scripts/README.md, "On a lent GPU").
#
#   bash scripts/gpu_lease.sh kit                       # here, once: wheels (Python 3.12) and CIFAR-10 into .gpu/
#   bash scripts/gpu_lease.sh away PID...               # here, before the calls: pause these processes and their
#                                                       # children, take results/ out of the tree that travels
#   bash scripts/gpu_lease.sh back PID...               # here, after them: results/ back, the processes continue
#   BUDGET_S=S bash scripts/gpu_lease.sh check          # there: versions, tests/test_cuda.py
#   BUDGET_S=S bash scripts/gpu_lease.sh bench          # there: the benchmark record, into $OUT
#   BUDGET_S=S bash scripts/gpu_lease.sh dose 1 2 3     # there: the clutter dose study's four cells of these seeds
#   BUDGET_S=S bash scripts/gpu_lease.sh eval 1 2 3     # there, next call while the machine is warm: evaluations
#
# There, nothing installs from the network: the wheels travel in .gpu/whl (and .gpu/faiss) and go to /tmp/site; the
# project runs from the checkout (PYTHONPATH). Each step there ends within BUDGET_S seconds, which the caller sets:
# min(540, the device time left - 60), since the device tool kills a call at its limit and then nothing comes back.
# A step returns at most 8 files and 60 MiB, its logs in one logs.tar. The dose step writes the 0- and 256-fragment
# canvases beside the checkout (the paths the study records) unless an earlier call on the machine did, checks their
# hashes against the committed study's, trains every run of the cells' seeds as its own process, all side by side (the
# exact train commands of scripts/study.py, which resume), stops them in time to pack the finished runs, without
# their resume states, into tars of at most three runs each. Unfinished runs, and finished runs beyond what one call
# returns, stay on the machine: `dose` again, while it is warm (30 s), continues them and returns the rest. faiss
# (which harness.eval needs) does not fit beside CIFAR-10 in one call's 64 MiB, so the evaluations are the next
# call's (`eval`, carrying .gpu/whl and .gpu/faiss), of the seeds whose four cells finished, on the canvases and
# runs the dose calls left on the machine; if it went cold meanwhile, the study command evaluates the runs here.
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:?usage: gpu_lease.sh kit|away|back|check|bench|dose SEED...|eval SEED...}
shift

WHEELS="timm==1.0.31 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19"
TA='--amp none --opt adamw --lr 1e-3 --weight-decay 0.05 --smoothing 0.1 --warmup-epochs 2 --model-kwargs img_size=64 patch_size=8 pos_drop_rate=0 attn_drop_rate=0 proj_drop_rate=0'
DOSE=results/cifar10-clutter-dose
PACKING_S=45  # of a dose call's BUDGET_S, kept for packing what it trained
MIB=1048576
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

setup() {
  t0=$(date +%s)
  BUDGET_S=${BUDGET_S:?set BUDGET_S: min(540, the device time left - 60) seconds}
  OUT=${OUT:?set by the device tool}
  LOGS=$(mktemp -d)  # the logs come back as one tar (at most 8 files come back from a call)
  trap 'tar -C "$LOGS" -cf "$OUT/logs.tar" . 2>/dev/null || true' EXIT
  # shellcheck disable=SC2046
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/whl/*.whl $(ls .gpu/faiss/*.whl 2>/dev/null)
  export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
}

left() {  # seconds of the budget left, less $1 kept back; at least 1 (timeout 0 would mean no limit)
  local s=$(( BUDGET_S - $1 - ($(date +%s) - t0) ))
  echo $(( s > 0 ? s : 1 ))
}

canvases() {  # the 0- and 256-fragment canvases beside the checkout, unless a call before this one made them
  local f pids=()
  for f in 256 0; do
    [[ -f ../cifar10-clutter$f/README.md ]] && continue  # the card is written last: without it, a killed attempt
    rm -rf ../cifar10-clutter$f
    timeout -k 10 "$(left $(( PACKING_S + 60 )))" python3 scripts/make_cluttered.py --dataset .gpu/cifar10 \
      --fragments $f --seed 0 --output ../cifar10-clutter$f > "$LOGS/canvases-$f.log" 2>&1 &
    pids+=($!)
  done
  for f in "${pids[@]}"; do
    wait "$f" || { echo "error: make_cluttered.py failed or ran out of time (logs.tar: canvases-*.log)" >&2; exit 1; }
  done
  grep -q "$HASH256" ../cifar10-clutter256/README.md && grep -q "$HASH0" ../cifar10-clutter0/README.md \
    || { echo "error: the canvases differ from the committed study's (hashes in the data cards)" >&2; exit 1; }
}

send() {  # tar the finished runs given, three a tar, while the files and bytes that come back allow; mark them sent
  local i n=0 total=0 size t
  for ((i = 0; i < $# && n < 7; i += 3)); do
    t="$OUT/runs-$n.tar"
    tar -cf "$t" --exclude=resume.safetensors --exclude='.*' "${@:i+1:3}"
    size=$(stat -c %s "$t")
    if (( size > 16 * MIB || total + size > 60 * MIB )); then
      rm "$t"
      echo "not returned yet (size): ${*:i+1} (run dose again)" >> "$LOGS/failed.txt"
      echo "returned $i runs in $n tars, $(( total / MIB )) MiB; the rest: dose again"
      return 0
    fi
    total=$(( total + size ))
    n=$(( n + 1 ))
    for t in "${@:i+1:3}"; do touch "$t/.returned"; done
  done
  (( i >= $# )) || echo "not returned yet (files): ${*:i+1} (run dose again)" >> "$LOGS/failed.txt"
  echo "returned $(( i < $# ? i : $# )) runs in $n tars, $(( total / MIB )) MiB"
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
  echo "carry .gpu/whl with .gpu/cifar10 (bench, dose) or with .gpu/faiss (check, eval); keep results/ out of the"
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
  timeout -k 10 "$(left 20)" python3 -m pytest -p no:cacheprovider -n 4 --dist load -q -rfE tests/test_cuda.py \
    2>&1 | tee "$LOGS/check.log" | tail -40 | tee "$OUT/check.txt"
  ;;
bench)
  setup
  # bench.json is rewritten after each section: a run stopped at the budget keeps what it measured
  timeout -k 10 "$(left 20)" python3 scripts/bench_train.py --device cuda --dataset .gpu/cifar10 --steps 20 \
    --compile default reduce-overhead --concurrent 1 8 32 --profile --json "$OUT/bench.json" 2>&1 | tail -40 \
    | tee "$OUT/bench.txt"
  ;;
dose)
  setup
  seeds=("$@")
  (( ${#seeds[@]} )) || { echo "error: name the seeds, e.g. dose 1 2 3" >&2; exit 2; }
  canvases
  echo "data in $(( $(date +%s) - t0 )) s"
  mapfile -t cmds < <(python3 - "${seeds[@]}" <<EOF | grep '^python3 -m timm_rollout.train ' || true
import shlex, sys, types
try:  # the study imports the harness, which imports faiss: not needed to build train commands, nor carried here
    import faiss  # noqa: F401
except ImportError:
    sys.modules["faiss"] = types.ModuleType("faiss")
from harness import study
from harness.study.plan import train_command
seeds = sys.argv[1:]
for dataset, out, extra in (("../cifar10-clutter256", "$DOSE", ["--also-eval", "../cifar10-clutter0"]),
                            ("../cifar10-clutter0", "$DOSE/fragments0", [])):
    args = study.build_parser().parse_args(
        ["--dataset", dataset, *extra, "--primary", "gap:rollout", "--epochs", "20", "--seeds", *seeds,
         "--arms", "gap", "rollout", "--faithfulness-images", "1000", "--output", out, "--train-args", """$TA""",
         "--device", "cuda"])
    for arm in args.arms:
        for seed in seeds:
            flags = train_command(args, arm, int(seed), f"{out}/runs/{arm}-s{seed}")
            print(shlex.join(["python3", "-m", "timm_rollout.train", "--no-progress", *flags]))
EOF
)
  (( ${#cmds[@]} == 4 * ${#seeds[@]} )) || { echo "error: the train commands could not be built (the error above)" >&2; exit 1; }
  limit=$(left "$PACKING_S")
  (( limit > 30 )) || { echo "error: no time left to train in BUDGET_S=$BUDGET_S s" >&2; exit 2; }
  echo "training for at most $limit s"
  for i in "${!cmds[@]}"; do
    echo "+ ${cmds[i]}"
    (timeout -k 10 -s TERM "$limit" bash -c "exec ${cmds[i]}" > "$LOGS/train-$i.log" 2>&1 \
      || echo "stopped or failed ($?): ${cmds[i]}" >> "$LOGS/failed.txt") &
  done
  wait
  echo "trained in $(( $(date +%s) - t0 )) s"
  runs=()
  for s in "${seeds[@]}"; do
    for dir in $DOSE/runs/{gap,rollout}-s$s $DOSE/fragments0/runs/{gap,rollout}-s$s; do
      if [[ -f $dir/summary.json && ! -f $dir/.returned ]]; then
        runs+=("$dir")
      elif [[ ! -f $dir/summary.json ]]; then
        echo "unfinished: $dir (its state stays on this machine: run dose again while it is warm)" >> "$LOGS/failed.txt"
      fi
    done
  done
  send "${runs[@]}"
  tail -n 3 "$LOGS"/train-*.log || true
  ;;
eval)
  setup
  (( $# )) || { echo "error: name the seeds, e.g. eval 1 2 3" >&2; exit 2; }
  [[ -f ../cifar10-clutter256/README.md && -f ../cifar10-clutter0/README.md ]] \
    || { echo "error: the canvases of the dose step are gone (the machine went cold); evaluate the runs here" >&2; exit 2; }
  done_seeds=()  # only seeds whose four cells finished: the study commands would train the others
  for s in "$@"; do
    if ls $DOSE/runs/{gap,rollout}-s$s/summary.json $DOSE/fragments0/runs/{gap,rollout}-s$s/summary.json >/dev/null 2>&1; then
      done_seeds+=("$s")
    else
      echo "seed $s: not all four cells finished; not evaluated" | tee -a "$LOGS/failed.txt"
    fi
  done
  (( ${#done_seeds[@]} )) || { echo "error: no seed of $* has its four cells finished; run dose first" >&2; exit 2; }
  # every run is finished: each study command only evaluates, four evaluations side by side
  common=(--primary gap:rollout --epochs 20 --seeds "${done_seeds[@]}" --arms gap rollout --faithfulness-images 1000
          --train-args "$TA" --device cuda --jobs 4)
  stop=$(left 20)  # both studies side by side, stopped in time to pack
  (( stop > 30 )) || { echo "error: no time left to evaluate in BUDGET_S=$BUDGET_S s" >&2; exit 2; }
  (timeout -k 10 -s TERM "$stop" python3 scripts/study.py --dataset ../cifar10-clutter256 --also-eval ../cifar10-clutter0 \
    --output $DOSE "${common[@]}" > "$LOGS/eval-256.log" 2>&1 \
    || echo "failed or stopped: the 256-fragment evaluations" >> "$LOGS/failed.txt") &
  (timeout -k 10 -s TERM "$stop" python3 scripts/study.py --dataset ../cifar10-clutter0 --output $DOSE/fragments0 \
    "${common[@]}" > "$LOGS/eval-0.log" 2>&1 || echo "failed or stopped: the 0-fragment evaluations" >> "$LOGS/failed.txt") &
  wait
  folders=()
  for s in "${done_seeds[@]}"; do
    for arm in gap rollout; do
      for f in $DOSE/eval/$arm-s$s $DOSE/eval-cifar10-clutter0/$arm-s$s $DOSE/fragments0/eval/$arm-s$s; do
        [[ -f $f/results.json ]] && folders+=("$f") || echo "not evaluated: $f" | tee -a "$LOGS/failed.txt"
      done
    done
  done
  (( ${#folders[@]} )) && tar -cf "$OUT/evals.tar" "${folders[@]}"
  tail -n 5 "$LOGS"/eval-*.log
  ;;
*)
  echo "error: unknown step $step; use kit, away, back, check, bench, dose or eval" >&2
  exit 2
  ;;
esac
