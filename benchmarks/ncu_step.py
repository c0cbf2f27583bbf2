"""One SageBwd training call (forward and backward) repeated, for Nsight Compute to profile on the device.

``speed.py``'s shape (bf16, 16K tokens, ``heads = 2048 / head_dim``), warmed first, then ``--steps`` calls::

    ncu --clock-control none --profile-from-start off --kernel-name regex:'_hopper_forward|_gluon_dkdv|_gluon_dq' \\
        --launch-count 3 --section SpeedOfLight --section WarpStateStats python3 benchmarks/ncu_step.py --steps 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from speed import training_call  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    step = training_call(args.seq, args.head_dim, args.causal, 16384)  # compiled and autotuned here
    torch.cuda.profiler.start()  # with ``ncu --profile-from-start off``: only the calls below are profiled
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
