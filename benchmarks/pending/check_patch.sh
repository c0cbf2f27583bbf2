#!/usr/bin/env bash
# One device call for a parked kernel patch: main's speed, then the patch applied, its speed (with the
# correctness check), then the kernel tests on CUDA. Everything also goes to $OUT/log.txt, so a call cut short
# still brings back what ran. Usage, from the repository root on the GPU (working tree of main, no .git needed):
#
#   bash benchmarks/pending/check_patch.sh issue-14-dq-tile-scales-and-peak-memory.patch <sha of main>
#
# HEAD_DIM (128) and IMPLS ("--impl sage") choose what the speed steps time, beside SDPA's backends; BEFORE_LIMIT
# (150) and AFTER_LIMIT (260) their limits in seconds (a fresh machine compiles every kernel in the first); SPEED=0
# skips both (a patch that needs only its record, e.g. a preset); AFTER_CHECK=0 times the patch without speed.py's
# correctness check (when gpu_verify follows, whose tests check more; run 29's checked "after" step ran past 300 s).
# About 8 minutes on an H100 (run it with the device tool's timeout_s at 590): speed before ~70 s, after ~200 s
# (speed.py prints only its final table), the tests ~250 s. Limits per step keep one slow step from eating the
# others; rc 124 on a step means its limit, not a failure of the code.
#
# Beside training lanes (benchmarks/gpu_lanes.sh; device run 25's way): DETACH=1 copies the tree to CHECK_DIR
# (/tmp/check-patch) and runs the steps there in the background on GPU CHECK_GPU (0), writing to CHECK_DIR-out, so
# later calls may replace the tree. With VERIFY_COMMIT=<the sha the patch will be committed as>, the last step is
# gpu_verify's record instead of the kernel tests (it runs every kernel test; VERIFY_LIMIT, 800 s, is its
# --time-limit, above its default 470 s: one record took 465 s alone on an H100, and a patch adds tests). At the end
# it touches GPU_FREE_FLAG (/tmp/sage-gpu0-free), which that GPU's first lanes line can wait for. `bash benchmarks/pending/check_patch.sh
# collect` copies what it wrote so far to $OUT/check: call it in every device call until log.txt ends with "done".
set -uo pipefail
dir=${CHECK_DIR:-/tmp/check-patch} flag=${GPU_FREE_FLAG:-/tmp/sage-gpu0-free}
if [[ "${1:-}" == collect ]]; then
  mkdir -p "${OUT:-/tmp}/check" && cp -r "$dir-out/." "${OUT:-/tmp}/check/" && tail -n 30 "$dir-out/log.txt"
  exit
fi
patch="${1:?the file name of the patch in benchmarks/pending (several: comma-separated, applied in order)}"
sha="${2:?the commit of main, for the result files}"
if [[ "${DETACH:-0}" == 1 ]]; then
  rm -rf "$dir" "$dir-out" "$flag" && mkdir -p "$dir" "$dir-out"
  bash "$(dirname "$0")/../copy_tree.sh" "$dir"
  OUT="$dir-out" DETACH=0 FLAG="$flag" CUDA_VISIBLE_DEVICES="${CHECK_GPU:-0}" setsid nohup \
    bash "$dir/benchmarks/pending/check_patch.sh" "$patch" "$sha" >/dev/null 2>&1 </dev/null &
  echo "check_patch.sh runs detached in $dir on GPU ${CHECK_GPU:-0}: 'bash $0 collect' for its files"
  exit
fi
out="${OUT:-/tmp}"
[[ -n "${FLAG:-}" ]] && trap 'touch "$FLAG"' EXIT  # the lanes waiting for this GPU go on, whatever happened
exec > >(tee -a "${out}/log.txt") 2>&1
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
step() { echo "== $(date -u +%T) $*"; }
install() { python3 -m pip install --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 || { tail -20 /tmp/install.log; exit 1; }; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
install
if [[ "${SPEED:-1}" != 0 ]]; then  # SPEED=0: a change that needs only its record (no kernel code), no timings
  step "speed of main (${sha})"
  # shellcheck disable=SC2086  # IMPLS is word-split on purpose
  GIT_COMMIT="${sha}" timeout "${BEFORE_LIMIT:-150}" python3 -m benchmarks.kernels.speed ${IMPLS:---impl sage} --impl sdpa_cudnn --head-dim "${HEAD_DIM:-128}" \
      --seq 4096 --seq 8192 --no-check --no-breakdown --out "${out}/before.json" 2>&1 | grep -v Warning | grep "^|"
fi
step "git apply ${patch}"
for one in ${patch//,/ }; do git apply "benchmarks/pending/${one}" || exit 3; done
install
check_flag=(); [[ "${AFTER_CHECK:-1}" == 0 ]] && check_flag=(--no-check)
if [[ "${SPEED:-1}" != 0 ]]; then
  step "speed with ${patch}"
  # shellcheck disable=SC2086
  GIT_COMMIT="${sha}+${patch//.patch/}" timeout "${AFTER_LIMIT:-260}" python3 -m benchmarks.kernels.speed ${IMPLS:---impl sage} --impl sdpa_cudnn \
      --impl sdpa_flash --head-dim "${HEAD_DIM:-128}" --seq 4096 --seq 8192 --no-breakdown "${check_flag[@]}" --out "${out}/after.json" 2>&1 \
      | grep -v Warning | grep -E "^\||^check|FAIL|Error"
fi
if [[ -n "${VERIFY_COMMIT:-}" ]]; then
  step "gpu_verify with ${patch} as ${VERIFY_COMMIT}"
  GIT_COMMIT="${VERIFY_COMMIT}" timeout 900 python3 -m benchmarks.kernels.gpu_verify --out "${out}/gpu-verified.json" \
    --work-dir "${dir}-verify" --time-limit "${VERIFY_LIMIT:-800}" 2>&1 | tail -12
else
  step "kernel tests on CUDA with ${patch}"
  timeout 280 python3 -m pytest tests/test_triton_kernels.py tests/test_hopper_kernels.py tests/test_gluon_backward.py \
    -q -p no:cacheprovider 2>&1 | tail -8
fi
step "done"
