#!/usr/bin/env bash
# Nsight Compute on SageBwd's kernels of one forward and backward (benchmarks/ncu_target.py): where each kernel's
# cycles go (warp stall reasons, issue slots, pipes, memory), for benchmarks/NOTES.md's method. On the GPU, from
# the repository root (Firecracker machines read the counters; clocks left alone, as the device notes ask):
#
#   bash benchmarks/ncu_kernels.sh                            # every kernel, N=4096, D=128, into $OUT (or /tmp)
#   KERNELS='_dkdv_kernel' bash benchmarks/ncu_kernels.sh --seq 8192 --causal
#
# Writes ncu-kernels.ncu-rep, and the same as text (ncu-kernels.txt) and CSV (ncu-kernels.csv; every metric, the
# stall reasons included, in ncu-kernels-raw.csv). Arguments go to ncu_target.py.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}"
kernels="${KERNELS:-_dkdv_kernel|_dq_kernel|_hopper_forward_kernel|_forward_kernel}"
ncu --clock-control none --profile-from-start off --kernel-name "regex:${kernels}" \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section InstructionStats \
    --export "${out}/ncu-kernels" --force-overwrite \
    python3 benchmarks/ncu_target.py "$@"
ncu --import "${out}/ncu-kernels.ncu-rep" --page details > "${out}/ncu-kernels.txt"
ncu --import "${out}/ncu-kernels.ncu-rep" --page details --csv > "${out}/ncu-kernels.csv"
# Every collected metric, the warp stall breakdown (smsp__average_warp_latency_issue_stalled_*) included.
ncu --import "${out}/ncu-kernels.ncu-rep" --page raw --csv > "${out}/ncu-kernels-raw.csv"
echo "wrote ${out}/ncu-kernels.ncu-rep, .txt, .csv and -raw.csv"
