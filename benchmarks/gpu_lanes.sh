#!/usr/bin/env bash
# Queues of benchmark commands, one queue per GPU of one machine, run detached from an installed copy of the tree,
# so that later device calls (which replace the working tree) and kernel work in the tree itself (a patch applied,
# an editable install, gpu_verify on GPU 0) do not change the code the queues run:
#   bash benchmarks/gpu_lanes.sh start benchmarks/lanes/<name>.lanes   # copy, install, start; follow FOLLOW_SECONDS
#   bash benchmarks/gpu_lanes.sh wait                                  # follow again; repeat until "finished"
# A lanes file holds one command a line, "GPU<space>NAME<space>command" ('#' starts a comment); each GPU's lines run
# in order, the GPUs side by side. GPU may be "G.K": a second queue K on GPU G, beside G's own (a small, host-bound
# run sharing a GPU with a large one; the large run's tokens/s then read low). A command runs in bash from an empty
# folder with CUDA_VISIBLE_DEVICES set to its GPU, PYTHONPATH the installed copy, the copy's sources and what PYTHONPATH held, and these variables:
#   SRC      the copy of the tree (its examples/configs, benchmarks/... scripts)
#   RESULTS  the folder whose files come back (results, JSON and tables)
#   CORPUS   the corpus file of benchmarks/gpu_evidence.sh's CORPUS=site, built once; CORPUS_NOTE says what it holds
# and a shell function, train ARGS: `python -m benchmarks.training.pretrain_compare` on CONFIG, the corpus and
# --out-dir $RESULTS, then ARGS.
# A GPU's queue can wait for kernel work on that GPU first: its first line `0 wait-gpu0 for _ in $(seq 180); do [[ -e
# /tmp/sage-gpu0-free ]] && break; sleep 5; done`, and the kernel work touches the file when done (device run 25).
# Each call leaves in $OUT lanes.tar.gz (results, logs) and lanes-summary.md (the training tables; no losses): the
# archive is the only copy of a run's result file until the next call's, so keep every call's, and call again at
# once (the machine goes back 30 s after a call, with the queues: run 25 lost two runs so). Env: WORK
# (/tmp/sage-lanes), PYTHON (python3), FOLLOW_SECONDS (570), CONFIG (examples/configs/small.yaml), GIT_COMMIT
# (the commit the results name).
set -uo pipefail
MODE=${1:-}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/sage-lanes}
PYTHON=${PYTHON:-python3}
FOLLOW_SECONDS=${FOLLOW_SECONDS:-570}
CONFIG=${CONFIG:-examples/configs/small.yaml}
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sage-cache}

train() {  # pretrain_compare on the copy, with the config, the corpus and --out-dir $RESULTS; then the arguments
  "$PYTHON" -m benchmarks.training.pretrain_compare --config "$SRC/$CONFIG" --out-dir "$RESULTS" \
    --set "data.paths=[\"$CORPUS\"]" --corpus-note "$CORPUS_NOTE" "$@"
}

lane() {  # GPU: that GPU's commands, in order
  local gpu=$1 name cmd status
  while read -r _ name cmd; do
    echo "--- gpu $gpu: $name started $(date -u +%T)" >>"$WORK/lanes.log"
    (cd "$WORK/run" && CUDA_VISIBLE_DEVICES=${gpu%%.*} bash -c "$cmd") >"$WORK/results/log-$name.txt" 2>&1
    status=$?
    echo "--- gpu $gpu: $name finished $(date -u +%T), exit status $status" >>"$WORK/lanes.log"
  done < <(grep -v '^\s*#' "$WORK/lanes" | awk -v g="$gpu" 'NF >= 3 && $1 "" == g')
}

detached() {
  echo $$ >"$WORK/pid"
  mkdir -p "$WORK/site" "$WORK/run" "$WORK/results"
  "$PYTHON" -m pip install --no-deps --no-build-isolation --target "$WORK/site" "$WORK/src" >"$WORK/install.log" 2>&1 ||
    { echo "--- install failed: $(tail -3 "$WORK/install.log")" >>"$WORK/lanes.log"; echo 1 >"$WORK/status"; return; }
  WORK=$WORK bash "$WORK/src/benchmarks/gpu_evidence.sh" corpus >"$WORK/corpus-note" ||
    { echo "--- corpus failed" >>"$WORK/lanes.log"; echo 1 >"$WORK/status"; return; }
  echo "--- device: $(nvidia-smi -L | head -1) x $(nvidia-smi -L | wc -l); corpus: $(cat "$WORK/corpus-note")" \
    >>"$WORK/lanes.log"
  export SRC=$WORK/src RESULTS=$WORK/results CORPUS=$WORK/corpus.txt CORPUS_NOTE
  CORPUS_NOTE=$(cat "$WORK/corpus-note")
  export PYTHONPATH="$WORK/site:$WORK/src${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHON CONFIG
  export -f train
  local pids=() gpu
  for gpu in $(grep -v '^\s*#' "$WORK/lanes" | awk 'NF >= 3 { print $1 }' | sort -u); do lane "$gpu" & pids+=($!); done
  wait "${pids[@]}"
  echo 0 >"$WORK/status"
}

follow() {
  local shown=0 lines
  while :; do
    lines=$(grep -c "^--- " "$WORK/lanes.log" 2>/dev/null || true)
    if ((lines > shown)); then grep "^--- " "$WORK/lanes.log" | tail -n +$((shown + 1)); shown=$lines; fi
    [[ -f "$WORK/status" ]] && { echo "finished"; return; }
    kill -0 "$(cat "$WORK/pid" 2>/dev/null)" 2>/dev/null || { echo "the lanes are not running"; return; }
    ((SECONDS >= FOLLOW_SECONDS)) && { echo "still running: call 'bash benchmarks/gpu_lanes.sh wait' now"; return; }
    sleep 5
  done
}

collect() {
  mkdir -p "$OUT"
  (cd "$WORK" && tar -czf "$OUT/lanes.tar.gz" --exclude='*.ckpt' --exclude=tensorboard results lanes lanes.log) \
    2>/dev/null
  cat "$WORK"/results/*.md >"$OUT/lanes-summary.md" 2>/dev/null
  grep -l "Traceback" "$WORK"/results/log-*.txt 2>/dev/null | while read -r f; do echo "== $f"; tail -5 "$f"; done
  return 0
}

case "$MODE" in
  start)
    [[ -f "${2:-}" ]] || { echo "gpu_lanes.sh start: give a lanes file; received '${2:-}'." >&2; exit 2; }
    rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
    cp "$2" "$WORK/lanes"
    # The copy before anything else: the calling command may change the tree as soon as this returns.
    bash "$(dirname "$0")/copy_tree.sh" "$WORK/src"
    setsid nohup bash "$0" _detached >"$WORK/driver.log" 2>&1 </dev/null &
    for _ in $(seq 50); do [[ -f "$WORK/pid" ]] && break; sleep 0.2; done
    follow
    collect
    ;;
  _detached) detached ;;
  wait)
    [[ -d "$WORK" ]] || { echo "no lanes here ($WORK is missing: the machine was given back?)"; exit 1; }
    follow
    collect
    ;;
  *)
    echo "gpu_lanes.sh: the mode must be start or wait; received '$MODE'." >&2
    exit 2
    ;;
esac
