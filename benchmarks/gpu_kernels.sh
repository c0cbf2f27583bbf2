#!/usr/bin/env bash
# One device call for the Triton kernels (issue #3): install into the image's python3, run the kernel tests on
# CUDA, the accuracy harness on the Triton path (N=4096, D=128), then benchmarks/speed.py (correctness at full
# sizes against the reference, then timings against SDPA flash and cuDNN). Files land in $OUT.
# Usage (device tool): GIT_COMMIT=<sha> bash benchmarks/gpu_kernels.sh [speed.py arguments]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest tests/test_triton_kernels.py -q -p no:cacheprovider -x 2>&1 | tail -15
DAY=$(date +%Y%m%d)
SLUG=$(cd benchmarks && python3 -c "from accuracy import device_name, device_slug; print(device_slug(device_name('cuda')))")
python3 benchmarks/accuracy.py --device cuda --path triton --seq 4096 --head-dim 128 \
  --out "$OUT/accuracy-$SLUG-$DAY-triton.json" >"$OUT/accuracy.log" 2>&1 || tail -30 "$OUT/accuracy.log"
grep -A8 "^## Summary" "$OUT/accuracy.log"
python3 benchmarks/speed.py --out "$OUT/speed-$SLUG-$DAY.json" "$@" 2>&1 | tee "$OUT/speed.log" | grep -v "^check" | tail -60
grep "^check" "$OUT/speed.log" | sort -t' ' -k10 -g | tail -3
rm -f "$OUT/install.log"
