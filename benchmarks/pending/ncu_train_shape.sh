#!/usr/bin/env bash
# Nsight Compute on SageBwd's kernels at the training shape of issue 42's end-to-end bar (examples/configs/small.yaml
# at 131K tokens a step: B=64, 10 query and 5 key/value heads of 64, N=2048, causal, q/k/v/dO in a model's
# [B, N, H, D] memory), one forward and backward each of the INT8 default and of AttentionPrecision.hopper() (bf16
# dS), after three untimed ones (the `tl` forward's autotuning done). Kernels in launch order: INT8's forward, dK/dV,
# dQ, then the preset's. On the GPU from the repository root, with the package installed (clocks left alone):
#
#   OUT=/tmp/ncu bash benchmarks/pending/ncu_train_shape.sh
#   OUT=/tmp/ncu SOURCE=1 bash benchmarks/pending/ncu_train_shape.sh   # the backward kernels' stall samples per SASS line
#   OUT=/tmp/ncu SHAPE="4 16 16 4096 128 0" bash benchmarks/pending/ncu_train_shape.sh   # another shape: B Hq Hkv N D causal
#
# Writes ncu-train.ncu-rep, its details page as text and every metric as CSV (the pipes' and issue slots' use, warp
# stall reasons: smsp__average_warps_issue_stalled_*, smsp__inst_executed_pipe_*); with SOURCE=1 only the dK/dV and dQ
# kernels, with the source page (each SASS instruction's executions and stall samples) as ncu-train-source.csv.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp}"
kernels="_hopper_forward_kernel|_gluon_dkdv_kernel|_gluon_dq_kernel|_backward_preprocess_kernel" extra=()
if [[ "${SOURCE:-0}" == 1 ]]; then kernels="_gluon_dkdv_kernel|_gluon_dq_kernel" extra=(--section SourceCounters); fi
ncu --clock-control none --profile-from-start off --kernel-name "regex:${kernels}" "${extra[@]}" \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
  --section LaunchStats --section WarpStateStats --section SchedulerStats --section InstructionStats \
  --export "${out}/ncu-train" --force-overwrite python3 - <<'PY'
import os

import torch
from sage_lightning.kernels import AttentionPrecision, sage_attention
from tests.gluon_forward_check import profiled_once

torch.manual_seed(0)
b, hq, hkv, n, d, causal = (int(x) for x in os.environ.get("SHAPE", "64 10 5 2048 64 1").split())
def model_layout(h):
    return torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
q, k, v = model_layout(hq), model_layout(hkv), model_layout(hkv)
grad = torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
for precision in (AttentionPrecision(), AttentionPrecision.hopper()):
    profiled_once(lambda: sage_attention(q, k, v, is_causal=bool(causal), precision=precision).backward(grad))
PY
ncu --import "${out}/ncu-train.ncu-rep" --page details >"${out}/ncu-train.txt"
ncu --import "${out}/ncu-train.ncu-rep" --page raw --csv >"${out}/ncu-train-raw.csv"
if [[ "${SOURCE:-0}" == 1 ]]; then
  ncu --import "${out}/ncu-train.ncu-rep" --page source --print-source sass --csv >"${out}/ncu-train-source.csv"
fi
echo "wrote ${out}/ncu-train.ncu-rep, .txt and -raw.csv"
