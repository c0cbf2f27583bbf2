# The install into the device image's python3, before a tool runs there (the log in $OUT/install.log; SKIP_INSTALL
# set: none), with OUT and PYTHON's defaults and the corpus' token cache in the run's scratch. Run it, or source it:
#   bash benchmarks/gpu_setup.sh && GIT_COMMIT=<sha> python3 -m benchmarks.kernels.gpu_verify --out "$OUT/gpu-verified.json"
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
PYTHON=${PYTHON:-python3}
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sage-cache}
mkdir -p "$OUT"
if [[ -z "${SKIP_INSTALL:-}" ]]; then
  "$PYTHON" -m pip install --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
fi
