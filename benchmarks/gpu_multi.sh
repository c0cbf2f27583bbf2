#!/usr/bin/env bash
# One device call for issue 16, case 8 (nvidia-h200-x2): install into the image's python3, then
# benchmarks/multi_gpu.py on examples/configs/small.yaml: one GPU, then two with DDP and with FSDP over NCCL, a NaN loss
# on rank 1 at step NAN_STEP; per-rank records, the comparison (multi-gpu-<device>-<date>.{json,md}) and each run's log
# land in $OUT.
# Usage (device tool): GIT_COMMIT=<sha> bash benchmarks/gpu_multi.sh [more multi_gpu.py arguments]
source "$(dirname "$0")/gpu_setup.sh"
"$PYTHON" -c "import torch; print(torch.cuda.device_count(), 'x', torch.cuda.get_device_name(), 'torch', torch.__version__)"
"$PYTHON" benchmarks/multi_gpu.py --config examples/configs/small.yaml --max-steps "${MAX_STEPS:-300}" \
  --nan-step "${NAN_STEP:-150}" --out-dir "$OUT" "$@"
status=$?
for log in "$OUT"/*.log; do grep -E "Error|Traceback" -A5 "$log" | head -20; done
exit $status
