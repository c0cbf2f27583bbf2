#!/usr/bin/env bash
# Issue #41's evidence on the GPUs of one machine (one queue of training runs per GPU), examples/configs/small.yaml
# on the image's site corpus (benchmarks/gpu_evidence.sh's CORPUS=site), every run of a group on the same tokens:
#   large-qknorm     64 x 2048 = 131K tokens per step, QK-norm, 390 steps
#   small-qknorm     8 x 2048 = 16K tokens per step, QK-norm, 3,120 steps (the same tokens)
#   large-no-qknorm  131K tokens per step, no QK-norm, 390 steps
# Validation ten times per run (the last at its end) on 64 sequences, warm-up a tenth of the steps, as the evidence
# matrix sets them (benchmarks/training/matrix.py). In each group: full precision (seeds 1234, 1235), SageBwd fixed
# (1234: no controller; 1235: the controller measuring the noise ratio without acting, noise_ratio_high 1e6), then
# SageBwd + controller (both seeds) at the threshold that sage_lightning.noise.calibrate_threshold puts between the
# observing runs' readings (it waits for them), and in large-qknorm SageBwd ds="bf16" (seed 1234, last).
#   bash benchmarks/noise_evidence.sh start   # copy and install the tree, start the queues, follow FOLLOW_SECONDS
#   bash benchmarks/noise_evidence.sh wait    # follow again; repeat until it prints "finished"
# Each call leaves in $OUT noise.tar.gz (results/training-*.json, .md, .png; calibration.md; the logs) and
# summary.md. The runs use a copy of the tree installed under $WORK, so later calls (which replace the working
# tree) do not change the code they run. Env: WORK (/tmp/sage-noise), PYTHON (python3), GPUS (all), FOLLOW_SECONDS
# (570), STEPS (390: the large groups' steps; the small group takes 8x), HOLD_GPU0 (set: GPU 0's queue waits for
# $WORK/gpu0-free, so the calling command can verify the kernels there first), EXTRA_ARGS (more pretrain_compare
# arguments for every run, word-split), GIT_COMMIT (the commit the results name).
set -uo pipefail
MODE=${1:-start}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/sage-noise}
PYTHON=${PYTHON:-python3}
FOLLOW_SECONDS=${FOLLOW_SECONDS:-570}
STEPS=${STEPS:-390}
EXTRA_ARGS=${EXTRA_ARGS:-}
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sage-cache}
POLICY=adaptive_precision.init_args.config

group_sets() {  # the config changes of a group
  local batch=64 qk=true steps=$STEPS
  case "$1" in
    small-qknorm) batch=8 steps=$((STEPS * 8)) ;;
    large-no-qknorm) qk=false ;;
  esac
  echo "--max-steps $steps --set data.batch_size=$batch --set model.config.qk_norm=$qk" \
    "--set trainer.num_sanity_val_steps=0 --set trainer.limit_val_batches=$((64 / batch))" \
    "--set trainer.val_check_interval=$((steps / 10)) --set trainer.log_every_n_steps=$((steps >= 100 ? steps / 50 : 1))" \
    "--set model.warmup_steps=$((steps / 10))"
}

train() {  # GPU GROUP RUNSPEC NAME [more pretrain_compare arguments]
  local gpu=$1 group=$2 spec=$3 name=$4 tag="noise-$2-$4"
  shift 4
  echo "--- gpu $gpu: $group/$name started $(date +%T)" >>"$WORK/evidence.log"
  # shellcheck disable=SC2046,SC2086  # group_sets and EXTRA_ARGS are word-split on purpose
  # From a folder of its own: the copy's sage_lightning/ must not shadow the installed one (kernels/ mapped in).
  (cd "$WORK/run" && CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH="$WORK/site:$WORK/src" "$PYTHON" -m \
    benchmarks.training.pretrain_compare --config "$WORK/src/examples/configs/small.yaml" --runs "$spec,name=$name" \
    $(group_sets "$group") --set "data.paths=[\"$WORK/corpus.txt\"]" --corpus-note "$(cat "$WORK/corpus-note")" \
    --warmup-steps 3 --tag "$tag" --out-dir "$WORK/results" "$@" $EXTRA_ARGS >"$WORK/log-$tag.txt" 2>&1)
  local status=$?
  echo "--- gpu $gpu: $group/$name finished $(date +%T), exit status $status" >>"$WORK/evidence.log"
}

threshold() {  # waits for the observing runs, calibrates once, prints the threshold (or the one given by hand)
  [[ -f "$WORK/threshold" ]] && { cat "$WORK/threshold"; return; }
  while (($(grep -c "observe finished" "$WORK/evidence.log") < 3)); do sleep 10; done
  if mkdir "$WORK/calibrating" 2>/dev/null; then
    # The fewest tokens per step are the quiet side (no loss gap expected), the rest the loud side.
    (cd "$WORK/run" && PYTHONPATH="$WORK/site" "$PYTHON" - "$WORK"/results/training-*-noise-*-observe.json <<'PY'
import json, statistics, sys
from sage_lightning.noise import calibrate_threshold
found = {}
for path in sys.argv[1:]:
    for run in json.load(open(path))["summary"]:
        values = [r[2] for r in run["noise_readings"] if r[0] >= 25 and r[2] is not None]  # from step 25
        found[(run["tokens_per_step"], path.rsplit("/", 1)[-1])] = values
for (tokens, name), values in sorted(found.items()):
    print(f"| {tokens:,} | {name} | {len(values)} | {statistics.median(values):.3f} | {max(values):.3f} |")
fewest = min(tokens for tokens, _ in found)
quiet = [v for (tokens, _), values in found.items() if tokens == fewest for v in values]
threshold, why = calibrate_threshold(quiet, [v for (tokens, _), v in found.items() if tokens > fewest])
print(f"\n{why}\nthreshold={'none' if threshold is None else f'{threshold:.4f}'}")
PY
    ) >"$WORK/calibration.txt" 2>&1
    { echo "| tokens per step | run | readings | median | max |"; echo "|---:|---|---:|---:|---:|"
      cat "$WORK/calibration.txt"; } >"$WORK/results/calibration.md"
    sed -n 's/^threshold=//p' "$WORK/calibration.txt" >"$WORK/threshold.tmp"
    echo "--- calibration: threshold $(cat "$WORK/threshold.tmp")" >>"$WORK/evidence.log"
    mv "$WORK/threshold.tmp" "$WORK/threshold"
  fi
  while [[ ! -f "$WORK/threshold" ]]; do sleep 5; done
  cat "$WORK/threshold"
}

controller() {  # GPU GROUP SEED NAME
  local t
  t=$(threshold)
  if [[ -z "$t" || "$t" == none ]]; then
    echo "--- gpu $1: $2/$4 not run: the calibration found no threshold" >>"$WORK/evidence.log"
    return
  fi
  train "$1" "$2" "sage:controller=on,seed=$3" "$4" --set "$POLICY.noise_ratio_high=$t" \
    --set "$POLICY.noise_ratio_low=$(awk "BEGIN { print $t / 2 }")"
}

queue() {  # the runs of GPU $1: the observing runs first (the calibration waits for them), the controller's last
  local gpu=$1 observe=(--set "$POLICY.noise_ratio_high=1000000")
  case $1 in
    0) # GPU 0 starts once $WORK/gpu0-free exists where HOLD_GPU0 is set (a verification runs there first).
       while [[ -n "${HOLD_GPU0:-}" && ! -f "$WORK/gpu0-free" ]]; do sleep 5; done
       train 0 large-qknorm full:controller=off,seed=1234 full
       controller 0 large-qknorm 1234 sage-controller
       controller 0 small-qknorm 1235 sage-controller-seed1235
       train 0 large-qknorm sage_bf16_ds:controller=off,seed=1234 sage-ds-bf16 ;;
    1) train 1 large-qknorm sage:controller=on,seed=1235 sage-fixed-seed1235-observe "${observe[@]}"
       train 1 small-qknorm sage:controller=on,seed=1235 sage-fixed-seed1235-observe "${observe[@]}"
       train 1 large-qknorm full:controller=off,seed=1235 full-seed1235
       controller 1 large-qknorm 1235 sage-controller-seed1235
       train 1 small-qknorm full:controller=off,seed=1235 full-seed1235 ;;
    2) train 2 large-no-qknorm sage:controller=on,seed=1235 sage-fixed-seed1235-observe "${observe[@]}"
       train 2 large-qknorm sage:controller=off,seed=1234 sage-fixed
       train 2 large-no-qknorm full:controller=off,seed=1234 full
       controller 2 large-no-qknorm 1234 sage-controller
       controller 2 small-qknorm 1234 sage-controller ;;
    3) train 3 large-no-qknorm sage:controller=off,seed=1234 sage-fixed
       train 3 small-qknorm sage:controller=off,seed=1234 sage-fixed
       train 3 small-qknorm full:controller=off,seed=1234 full
       train 3 large-no-qknorm full:controller=off,seed=1235 full-seed1235
       controller 3 large-no-qknorm 1235 sage-controller-seed1235 ;;
  esac
}

setup() {
  mkdir -p "$WORK/src" "$WORK/results" "$WORK/run"
  bash "$(dirname "$0")/copy_tree.sh" "$WORK/src"
  "$PYTHON" -m pip install --no-deps --no-build-isolation --target "$WORK/site" "$WORK/src" >"$WORK/install.log" 2>&1 ||
    { tail -5 "$WORK/install.log"; return 1; }
  WORK=$WORK CORPUS_MAX_MB=${CORPUS_MAX_MB:-256} bash benchmarks/gpu_evidence.sh corpus >"$WORK/corpus-note" || return 1
  echo "--- device: $(nvidia-smi -L 2>&1 | head -1) x ${GPUS:-$(nvidia-smi -L | wc -l)}; corpus: $(cat "$WORK/corpus-note")" \
    >>"$WORK/evidence.log"
}

all_queues() {
  echo $$ >"$WORK/pid"
  local gpus=${GPUS:-$(nvidia-smi -L | wc -l)} pids=() gpu
  if ((gpus < 4)); then
    echo "--- noise_evidence.sh needs 4 GPUs (GPUS=$gpus)" >>"$WORK/evidence.log"
    echo 1 >"$WORK/status"
    return
  fi
  for gpu in 0 1 2 3; do queue "$gpu" & pids+=($!); done
  wait "${pids[@]}"
  echo 0 >"$WORK/status"
}

follow() {
  local shown=0 lines
  while :; do
    lines=$(grep -c "^--- " "$WORK/evidence.log" 2>/dev/null || true)
    if ((lines > shown)); then grep "^--- " "$WORK/evidence.log" | tail -n +$((shown + 1)); shown=$lines; fi
    [[ -f "$WORK/status" ]] && { echo "finished"; return; }
    kill -0 "$(cat "$WORK/pid" 2>/dev/null)" 2>/dev/null || { echo "the queues are not running"; return; }
    ((SECONDS >= FOLLOW_SECONDS)) && { echo "still running: call 'bash benchmarks/noise_evidence.sh wait' now"; return; }
    sleep 5
  done
}

collect() {
  mkdir -p "$OUT"
  (cd "$WORK" && tar -czf "$OUT/noise.tar.gz" results calibration.txt evidence.log log-*.txt 2>/dev/null)
  cat "$WORK"/results/training-*.md >"$OUT/summary.md" 2>/dev/null
  grep -h "^| \(full\|sage\)" "$WORK"/results/training-*.md 2>/dev/null | grep -v "tokens/s" | head -60
  cat "$WORK/results/calibration.md" 2>/dev/null
  grep -l "Traceback" "$WORK"/log-*.txt 2>/dev/null | while read -r f; do echo "== $f"; tail -5 "$f"; done
}

extra() {  # a second round, one run per GPU, at a threshold given by hand (where the calibration found none)
  case $1 in
    0) controller 0 large-no-qknorm 1234 sage-controller ;;
    1) controller 1 large-qknorm 1235 sage-controller-seed1235 ;;
    2) controller 2 large-qknorm 1234 sage-controller ;;
    3) controller 3 small-qknorm 1234 sage-controller ;;
  esac
}

case "$MODE" in
  extra)  # THRESHOLD: the runs of extra() (on the installed copy; a fresh machine installs one), detached
    [[ -d "$WORK/site" ]] || { mkdir -p "$WORK" "$OUT" && setup; } || exit 1
    echo "$2" >"$WORK/threshold" && rm -f "$WORK/status"
    echo "--- extra round at noise_ratio_high $2" >>"$WORK/evidence.log"
    setsid nohup bash "$0" _extra >>"$WORK/driver.log" 2>&1 </dev/null &
    sleep 2
    ;;
  _extra)
    echo $$ >"$WORK/pid"
    for gpu in 0 1 2 3; do extra "$gpu" & done
    wait
    echo 0 >"$WORK/status"
    ;;
  start)
    rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
    setup || { cat "$WORK/install.log" | tail -20; exit 1; }
    HOLD_GPU0=${HOLD_GPU0:-} setsid nohup bash "$0" _detached >"$WORK/driver.log" 2>&1 </dev/null &
    for _ in $(seq 50); do [[ -f "$WORK/pid" ]] && break; sleep 0.2; done
    follow
    collect
    ;;
  _detached) all_queues ;;
  wait)
    [[ -d "$WORK" ]] || { echo "no runs here ($WORK is missing: the machine was given back?)"; exit 1; }
    follow
    collect
    ;;
  *)
    echo "noise_evidence.sh: the mode must be start, wait or extra; received '$MODE'." >&2
    exit 2
    ;;
esac
