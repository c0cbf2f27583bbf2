#!/usr/bin/env bash
# One device call for the pretraining example (issue #6): install into the image's python3, then
# benchmarks/pretrain_compare.py on examples/configs/small.yaml: an untimed warm-up (the Triton kernels compile and
# autotune), then the same training with SageBwd and with full-precision attention, each stopped at MAX_STEPS
# optimizer steps or MAX_MINUTES of wall time. Result JSON, markdown, PNG (where matplotlib is installed) and the
# TensorBoard logs land in $OUT. No LightningCLI here, so the image needs no jsonargparse.
# Usage (device tool): GIT_COMMIT=<sha> bash benchmarks/gpu_pretrain.sh [more pretrain_compare.py arguments]
source "$(dirname "$0")/gpu_setup.sh"
"$PYTHON" -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu', 'torch', torch.__version__)"
"$PYTHON" benchmarks/pretrain_compare.py --config examples/configs/small.yaml --max-steps "${MAX_STEPS:-2000}" \
  --max-minutes "${MAX_MINUTES:-3.3}" --out-dir "$OUT" "$@" >"$OUT/pretrain_compare.log" 2>&1
status=$?
grep -E "^--- |Trainer.fit. stopped|AdaptivePrecision: step|Error" "$OUT/pretrain_compare.log" | tail -40
cat "$OUT"/training-*.md 2>/dev/null || tail -60 "$OUT/pretrain_compare.log"
exit $status
