# Sourced by the gpu_*.sh drivers that install into the image's python3 and write into $OUT: strict mode, OUT and
# PYTHON with their defaults, the corpus' token cache in the run's scratch (not the home folder), the package
# installed (unless SKIP_INSTALL is set; the log in $OUT/install.log).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
PYTHON=${PYTHON:-python3}
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sage-cache}
mkdir -p "$OUT"
if [[ -z "${SKIP_INSTALL:-}" ]]; then
  "$PYTHON" -m pip install --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
fi
