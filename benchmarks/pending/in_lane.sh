#!/usr/bin/env bash
# Parked kernel patches checked inside a benchmarks/gpu_lanes.sh queue (a lanes line), so that a record, a check
# and a fallback follow each other on their GPUs without a device call between them (device run 31's way):
#
#   bash $SRC/benchmarks/pending/in_lane.sh record NAME PATCHES SHA   # check_patch.sh's gpu_verify record of the
#                                   # comma-separated PATCHES applied on the lanes' tree, labelled SHA, to $RESULTS/NAME
#   bash $SRC/benchmarks/pending/in_lane.sh check NAME PATCHES COMMAND...   # COMMAND in the tree with PATCHES applied
#   bash $SRC/benchmarks/pending/in_lane.sh passed NAME   # waits for NAME (at most WAIT_SECONDS, 1200); exit 0 if it passed
#
# Each NAME works in its own copy of the lanes' tree (/tmp/lane-NAME) and leaves /tmp/lane-NAME.done holding
# "passed" or "failed". The lanes' PYTHONPATH (their installed copy of main) is dropped, or the patched code would
# not be what runs: `record` installs its copy in editable mode, as check_patch.sh does on its own (so two records
# must not overlap in time: let the second wait with `passed`), and `check` imports from its copy (the kernels
# linked into the package folder as an install maps them), so it installs nothing.
set -uo pipefail
what="${1:?record, check or passed}" name="${2:?a name for the step}"
done_file="/tmp/lane-${name}.done"
if [[ "$what" == passed ]]; then
  for _ in $(seq $((${WAIT_SECONDS:-1200} / 5))); do [[ -e "$done_file" ]] && break; sleep 5; done
  [[ "$(cat "$done_file" 2>/dev/null)" == passed ]]
  exit
fi
patches="${3:?the comma-separated patches in benchmarks/pending, applied in order}"
shift 3
: "${SRC:?in_lane.sh runs in a lanes line (SRC: the copy of the tree the lanes run)}" "${RESULTS:?}"
copy="/tmp/lane-${name}" result=failed
rm -rf "$copy" "$done_file" && cp -r "$SRC" "$copy" && cd "$copy" || exit 1
unset PYTHONPATH
if [[ "$what" == record ]]; then
  sha="${1:?the commit the record names (the branch with the patches)}"
  mkdir -p "$RESULTS/$name"
  OUT="$RESULTS/$name" CHECK_DIR="$copy" SPEED=0 VERIFY_COMMIT="$sha" \
    bash benchmarks/pending/check_patch.sh "$patches" "${GIT_COMMIT:-unknown}"
  python3 -c "import json, sys; sys.exit(not json.load(open(sys.argv[1]))['passed'])" \
    "$RESULTS/$name/gpu-verified.json" && result=passed
elif [[ "$what" == check ]]; then
  for one in ${patches//,/ }; do git apply "benchmarks/pending/${one}" || { echo failed >"$done_file"; exit 3; }; done
  ln -sfn ../kernels sage_lightning/kernels
  "$@" && result=passed
else
  echo "in_lane.sh: the first argument is record, check or passed; received '$what'" >&2
  exit 2
fi
echo "$result" >"$done_file"
echo "in_lane.sh $what $name: $result"
[[ "$result" == passed ]]
