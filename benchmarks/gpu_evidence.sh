#!/usr/bin/env bash
# Issue #7's evidence, and issue #4's end-to-end speed at sequence 4096, on one GPU: install into the image's
# python3, then `python -m benchmarks.training.pretrain_compare --matrix evidence` on examples/configs/small.yaml (37M parameters):
#   large-qknorm     64 x 2048 = 131K tokens per step, QK-norm: full (seed 1234), SageBwd fixed, SageBwd +
#                    controller, full (seed 1235), SageBwd fixed without K-smoothing
#   small-qknorm     8 x 2048 = 16K tokens per step, QK-norm: full, SageBwd fixed, SageBwd + controller, full seed 1235
#   large-no-qknorm  131K tokens per step, no QK-norm: full, SageBwd fixed, SageBwd + controller
#   e2e-seq4096    8 x 4096 tokens per step, 100 steps each: SageBwd fixed, full on SDPA cuDNN, full on SDPA flash
# Run only when --groups names it (EXTRA_ARGS="--groups large-qknorm-d128"; issue 42's baseline):
#   large-qknorm-d128  131K tokens per step, QK-norm, 5 query and 5 key/value heads of 128 (cuDNN's FP8 attention
#                    declines head dim 64 on Hopper): full, SageBwd fixed, cuDNN FP8 attention with delayed scaling
#                    (sdpa=cudnn_fp8, benchmarks/training/cudnn_fp8.py), each with seeds 1234 and 1235; needs the
#                    nvidia-cudnn-frontend package (a benchmark dependency: on PYTHONPATH, or pip install it)
# The matrix keeps the final model of large-qknorm's first full-precision run (--save-checkpoint large-qknorm/full:
# $WORK/checkpoints/evidence-large-qknorm-full.ckpt, and the config it trained with beside it as .yaml), the input of
# the per-tensor error on real activations (the retired attribution.py: benchmarks/results/retired.md).
# Why this size: the 12 training runs plus the speed group fit in BUDGET_MINUTES (20)
# of one H100 or H200 at a few tens of millions of tokens per run (small.yaml trains 2,000 steps of 32K tokens in
# 152 s with SageBwd on an H200); 64 and 8 sequences per step are the study's ratio of 8 (2.1M and 260K tokens per
# step). Every training run sees the same tokens: the matrix times each setting in its warm-up and plans the steps
# to fit the budget; each run is also capped at 1.5x its planned time. The corpus (CORPUS=site) is the image's
# standard library and site-packages, Python sources and text, up to CORPUS_MAX_MB (256), so no run repeats data;
# CORPUS=stdlib takes the example's built-in corpus (10.7M tokens on the image, repeated about three times).
#
# The device tool stops a command after 10 minutes, so the matrix runs detached (setsid) and later calls on the same
# warm machine follow it (the machine stays warm 30 s after a call: make the next call at once):
#   GIT_COMMIT=<sha> bash benchmarks/gpu_evidence.sh start   # install, start the matrix, follow it FOLLOW_SECONDS
#   bash benchmarks/gpu_evidence.sh wait                      # follow it again; repeat until it prints "finished"
# Where no such limit applies, `GIT_COMMIT=<sha> bash benchmarks/gpu_evidence.sh` runs it in the foreground.
# Every call leaves in $OUT what has finished so far (the device returns at most 8 files): evidence.tar.gz (each
# group's training-*.json, .md and .png, rewritten after every run; the logs; the saved run's config, not its
# .ckpt), tensorboard.tar.gz and summary.md. Unpack the results and commit them:
#   tar -xzf evidence.tar.gz -C benchmarks/results --wildcards 'training-*'
#   git add benchmarks/results/training-*-evidence-*
#   python -m benchmarks.training.results_doc    # then commit docs/results.md and docs/images/results
#
# Env: BUDGET_MINUTES (20, the wall time of the matrix from the start of the install), CONFIG,
# CORPUS (site | stdlib), CORPUS_MAX_MB (256), FOLLOW_SECONDS (570), WORK (/tmp/sage-evidence), PYTHON (python3),
# SKIP_INSTALL (set: no pip install), EXTRA_ARGS (more pretrain_compare arguments, given last so they win;
# word-split).
set -uo pipefail
MODE=${1:-run}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/sage-evidence}
PYTHON=${PYTHON:-python3}
CONFIG=${CONFIG:-examples/configs/small.yaml}
CORPUS=${CORPUS:-site}
CORPUS_MAX_MB=${CORPUS_MAX_MB:-256}
BUDGET_MINUTES=${BUDGET_MINUTES:-20}
FOLLOW_SECONDS=${FOLLOW_SECONDS:-570}
EXTRA_ARGS=${EXTRA_ARGS:-}
# The run whose final model the matrix keeps: the first full-precision run of the large group, with QK-norm.
SAVED_RUN=large-qknorm/full
# The token file of the corpus goes with the run's scratch, not the home folder.
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sage-cache}

case "$MODE" in
  run | start | wait | _detached | corpus) ;;
  *)
    echo "gpu_evidence.sh: the mode must be run, start, wait or corpus; received '$MODE'." >&2
    exit 2
    ;;
esac
if [[ "$CORPUS" != site && "$CORPUS" != stdlib ]]; then
  echo "gpu_evidence.sh: CORPUS must be site or stdlib; received '$CORPUS'." >&2
  exit 2
fi
build_corpus() {
  # The corpus file $WORK/corpus.txt (CORPUS=site); prints what it holds.
  "$PYTHON" - "$WORK/corpus.txt" "$CORPUS_MAX_MB" <<'PY'
import sys, sysconfig
from pathlib import Path

out, cap = Path(sys.argv[1]), int(sys.argv[2]) * 2**20
stdlib, site = (Path(sysconfig.get_paths()[key]).resolve() for key in ("stdlib", "purelib"))
roots = [stdlib] + ([] if site.is_relative_to(stdlib) else [site])  # a folder listed twice would repeat its text
written = files = 0
# Our own editable install (its finder, .pth and dist-info) is left out: device runs 17 and 30 read three more files
# when it preceded the corpus, so the corpus would depend on the order of a call's steps.
ours = lambda p: p.name.startswith("__editable__") or any(q.startswith("sage_lightning-") for q in p.parts)
with out.open("wb") as sink:
    for root in roots:
        for path in sorted(
            p for p in root.rglob("*") if p.suffix in (".py", ".txt", ".md", ".rst") and p.is_file() and not ours(p)
        ):
            try:
                data = path.read_bytes()[: cap - written].replace(b"\0", b"")
            except OSError:  # unreadable: left out
                continue
            if not data:
                continue
            sink.write(data + b"\0")
            written, files = written + len(data) + 1, files + 1
            if written >= cap:
                break
        if written >= cap:
            break
print(
    f"{files} files (.py, .txt, .md, .rst) of {', '.join(map(str, roots))}, sorted, {written / 2**20:.0f} MB "
    f"(cap {cap // 2**20} MB), documents joined by byte 0 (benchmarks/gpu_evidence.sh, CORPUS=site)"
)
PY
}
matrix() {
  # The whole matrix in this process; its exit status goes to $WORK/status.
  local begin=$SECONDS
  if [[ -z "${SKIP_INSTALL:-}" ]]; then
    "$PYTHON" -m pip install --no-deps --no-build-isolation -e . >"$WORK/install.log" 2>&1 || {
      tail -20 "$WORK/install.log"
      echo 1 >"$WORK/status"
      return 1
    }
  fi
  # Progress lines start with "--- ": the follow-up calls print them.
  echo "--- device: $("$PYTHON" -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() \
    else 'cpu', 'torch', torch.__version__)" 2>&1)" >>"$WORK/evidence.log"
  local corpus=()
  if [[ "$CORPUS" == site ]]; then
    local note
    note=$(build_corpus) || { echo 1 >"$WORK/status"; return 1; }
    echo "--- corpus: $note" >>"$WORK/evidence.log"
    corpus=(--set "data.paths=[\"$WORK/corpus.txt\"]" --corpus-note "$note")
  fi
  local budget
  budget=$(awk "BEGIN { print $BUDGET_MINUTES - ($SECONDS - $begin) / 60 }")
  # shellcheck disable=SC2086  # EXTRA_ARGS is word-split on purpose
  "$PYTHON" -m benchmarks.training.pretrain_compare --matrix evidence --config "$CONFIG" --budget-minutes "$budget" \
    --out-dir "$WORK" "${corpus[@]}" --save-checkpoint "$SAVED_RUN" $EXTRA_ARGS >>"$WORK/evidence.log" 2>&1
  local status=$?
  # Last: "status" tells the follow-up calls that everything has finished.
  echo "$status" >"$WORK/status"
  return "$status"
}

running() { [[ -f "$WORK/pid" ]] && kill -0 "$(cat "$WORK/pid")" 2>/dev/null; }

follow() {
  # Until the matrix has finished or FOLLOW_SECONDS have passed, printing its progress as it comes.
  local shown=0 lines
  while :; do
    if [[ -f "$WORK/evidence.log" ]]; then
      lines=$(grep -cE "^--- " "$WORK/evidence.log" || true)
      if ((lines > shown)); then
        grep -E "^--- " "$WORK/evidence.log" | tail -n +$((shown + 1))
        shown=$lines
      fi
    fi
    [[ -f "$WORK/status" ]] && return 0
    running || { echo "the matrix is not running (its process is gone: a fresh machine?)"; return 1; }
    ((SECONDS >= FOLLOW_SECONDS)) && return 0
    sleep 5
  done
}

collect() {
  # What has finished, into $OUT: the results and log in one archive, the TensorBoard logs in another.
  mkdir -p "$OUT"
  (cd "$WORK" && tar -czf "$OUT/evidence.tar.gz" --exclude=tensorboard --exclude=pid --exclude=corpus.txt \
    --exclude='*.ckpt' -- *) 2>/dev/null
  [[ -d "$WORK/tensorboard" ]] && tar -czf "$OUT/tensorboard.tar.gz" -C "$WORK" tensorboard 2>/dev/null
  cat "$WORK"/training-*.md >"$OUT/summary.md" 2>/dev/null || true
}

report() {
  grep -E "Error|Traceback|not run|failed" "$WORK/evidence.log" 2>/dev/null | grep -v Warning | tail -8
  for md in "$WORK"/training-*.md; do
    [[ -f "$md" ]] || continue
    echo "== $(basename "$md")"
    grep -E "^\| |^Speed" "$md"
  done
  if [[ -f "$WORK/status" ]]; then
    echo "finished: exit status $(cat "$WORK/status"); results in $OUT/evidence.tar.gz"
  else
    echo "still running: call 'bash benchmarks/gpu_evidence.sh wait' now (the machine stays warm for 30 s)"
  fi
}

case "$MODE" in
  corpus)  # only the corpus file, for other drivers (benchmarks/noise_evidence.sh)
    mkdir -p "$WORK" && build_corpus
    ;;
  _detached)
    echo $$ >"$WORK/pid"
    matrix
    ;;
  run)
    rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
    matrix
    grep -E "^--- " "$WORK/evidence.log" 2>/dev/null | tail -30
    collect
    report
    exit "$(cat "$WORK/status" 2>/dev/null || echo 1)"
    ;;
  start)
    if running; then
      echo "a matrix is already running (pid $(cat "$WORK/pid")): call 'bash benchmarks/gpu_evidence.sh wait'"
      exit 1
    fi
    rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
    # A new session: the device tool ends a command's other processes when the command returns.
    setsid nohup bash "$0" _detached >"$WORK/driver.log" 2>&1 </dev/null &
    for _ in $(seq 50); do [[ -f "$WORK/pid" ]] && break; sleep 0.2; done
    follow
    collect
    report
    ;;
  wait)
    if [[ ! -d "$WORK" ]]; then
      echo "no matrix here ($WORK is missing: the machine was given back?); start one with 'start'"
      exit 1
    fi
    follow
    collect
    report
    ;;
esac
