#!/usr/bin/env bash
# One device call for Attn-QAT (issue #8): install into the image's python3, run the attn_qat tests on CUDA (the
# Triton kernels against the reference, small and full sizes), the accuracy harness on the Triton path
# (N=4096, D=128, --mode attn_qat), and a short timing of forward+backward beside SageBwd and SDPA.
# Files land in $OUT. Each part compiles and autotunes its own kernels on a fresh machine (a few minutes): name
# the parts to run them in separate calls.
# Usage (device tool): GIT_COMMIT=<sha> bash benchmarks/gpu_attn_qat.sh [tests] [accuracy] [timing]   (all three
# when none is named)
set -uo pipefail
PARTS=${*:-tests accuracy timing}
wants() { [[ " $PARTS " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
if wants tests; then
  python3 -m pytest tests/test_attn_qat.py tests/test_nvfp4.py -q -p no:cacheprovider -x -rs 2>&1 | tail -15
fi
if wants accuracy; then
  DAY=$(date +%Y%m%d)
  SLUG=$(cd benchmarks && python3 -c "from accuracy import device_name, device_slug; print(device_slug(device_name('cuda')))")
  python3 benchmarks/accuracy.py --device cuda --path triton --mode attn_qat --seq 4096 --head-dim 128 \
    --out "$OUT/accuracy-$SLUG-$DAY-triton-attn_qat.json" >"$OUT/accuracy.log" 2>&1 || tail -30 "$OUT/accuracy.log"
  grep -A45 "^## Summary" "$OUT/accuracy.log"
fi
if wants timing; then
python3 - <<'PY' 2>&1 | tee "$OUT/timing.txt"
# Forward+backward at B=4, H=16, N=4096, D=128, bf16 (median ms, triton.testing.do_bench): what the simulation costs.
import torch
import torch.nn.functional as F
from triton.testing import do_bench

from sage_lightning.kernels import AttentionPrecision, sage_attention

shape = (4, 16, 4096, 128)
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
runs = {
    "sdpa": lambda causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    "sagebwd": lambda causal: sage_attention(q, k, v, is_causal=causal),
    "attn_qat": lambda causal: sage_attention(q, k, v, is_causal=causal, precision=AttentionPrecision(mode="attn_qat")),
    "attn_qat:dropin": lambda causal: sage_attention(
        q, k, v, is_causal=causal, precision=AttentionPrecision(mode="attn_qat", qat_backward="dropin")
    ),
}
for causal in (False, True):
    for name, fn in runs.items():
        fwd = do_bench(lambda: fn(causal), return_mode="median")
        both = do_bench(lambda: torch.autograd.grad(fn(causal), (q, k, v), do), return_mode="median")
        print(f"timing causal={causal} {name:16s} fwd {fwd:7.2f} ms  fwd+bwd {both:7.2f} ms")
PY
fi
rm -f "$OUT/install.log"
