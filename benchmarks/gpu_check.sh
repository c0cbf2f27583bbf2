#!/usr/bin/env bash
# One device call for the foundation: install into the image's python3, record versions, run the CPU test
# suite under the image's torch/triton/lightning (the dependency lower bounds), then the quickstart and the
# accuracy harness on CUDA (the reference path). Files land in $OUT.
# Usage (device tool): GIT_COMMIT=<sha> bash benchmarks/gpu_check.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
python3 - <<'PY' | tee "$OUT/versions.txt"
import importlib.metadata as md
import torch
print("device", torch.cuda.get_device_name(), "| capability", torch.cuda.get_device_capability())
for name in ("torch", "triton", "lightning", "torchmetrics", "tensorboard", "numpy", "setuptools", "pytest"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
import sage_lightning, sage_lightning.kernels
print("sage_lightning from", sage_lightning.__file__, "| kernels from", sage_lightning.kernels.__file__)
PY
python3 -m pytest tests -q -p no:cacheprovider 2>&1 | tail -4
python3 examples/quickstart.py --seq 256 2>&1 | head -5
python3 benchmarks/accuracy.py --device cuda >"$OUT/accuracy.log" 2>&1 || { tail -30 "$OUT/accuracy.log"; exit 1; }
cp benchmarks/results/accuracy-h*-*.json benchmarks/results/accuracy-h*-*.md "$OUT"/ 2>/dev/null
tail -12 "$OUT/accuracy.log"
