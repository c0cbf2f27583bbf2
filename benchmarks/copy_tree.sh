#!/usr/bin/env bash
# Copy the repository's working tree into DEST without git's files, virtual environments, built wheels, scratch
# (.dev) or build output: the copy a detached GPU job runs from, so that later device calls (each sends a new tree)
# and kernel work in the tree itself do not change the code it runs. Used by gpu_lanes.sh, noise_evidence.sh and
# pending/check_patch.sh.
#   bash benchmarks/copy_tree.sh DEST
set -euo pipefail
dest="${1:?copy_tree.sh: give the folder to copy the tree into}"
mkdir -p "$dest"
cd "$(dirname "$0")/.."
tar --exclude=./.git --exclude='./.venv*' --exclude=./.whl --exclude=./.dev --exclude=./build -cf - . | tar -xf - -C "$dest"
