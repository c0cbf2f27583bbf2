#!/usr/bin/env bash
# Nsight Compute on the forward kernels with FP8 P.V (issue 42 item 2): the `tl` Hopper forward against the
# warp-specialised Gluon forward (a variant of tests/gluon_forward_check.py's VARIANTS, `free-smem` by default), one
# launch each per QK format (INT8, FP8) at D=128, N=4096, 16K tokens, non-causal (gluon_forward_check.profile). On
# the GPU from the repository root, with the package installed (clocks left alone, as the device notes ask):
#
#   OUT=/tmp/ncu bash benchmarks/pending/ncu_forward.sh [VARIANT]
#
# Writes ncu-forward.ncu-rep, its details page as text, every metric (the warp stall reasons among them,
# smsp__average_warps_issue_stalled_*) as CSV, the rows in launch order tl int8, gluon int8, tl fp8, gluon fp8, and the
# source page (each SASS instruction's executions and stall samples, the kernels in the same order) as CSV.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp}"
ncu --clock-control none --profile-from-start off --kernel-name "regex:_hopper_forward_kernel|_gluon_forward_kernel" \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
  --section LaunchStats --section WarpStateStats --section SchedulerStats --section InstructionStats \
  --section SourceCounters --export "${out}/ncu-forward" --force-overwrite \
  python3 -m tests.gluon_forward_check --profile "${1:-free-smem}"
ncu --import "${out}/ncu-forward.ncu-rep" --page details >"${out}/ncu-forward.txt"
ncu --import "${out}/ncu-forward.ncu-rep" --page raw --csv >"${out}/ncu-forward-raw.csv"
ncu --import "${out}/ncu-forward.ncu-rep" --page source --print-source sass --csv >"${out}/ncu-forward-source.csv"
echo "wrote ${out}/ncu-forward.ncu-rep, .txt, -raw.csv and -source.csv"
