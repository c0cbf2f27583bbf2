"""``benchmarks/memory_peak.py`` (what is live at the peak of one call): the replay of an allocator history on a
made-up one, and, without CUDA, a refusal that says why. The snapshot itself needs a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "memory_peak.py"
sys.path.insert(0, str(REPO / "benchmarks"))
from memory_peak import live_at_peak  # noqa: E402


def test_the_replay_finds_the_highest_point_and_who_allocated_it() -> None:
    ours = [{"filename": "/x/kernels/quant.py", "line": 7, "name": "quantize_rows"}]
    theirs = [{"filename": "/x/site-packages/torch/autograd/graph.py", "line": 1, "name": "run_backward"}]
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": ours},
        {"action": "alloc", "addr": 2, "size": 50, "frames": theirs},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 80, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 100},
    ]
    peak, blocks = live_at_peak({"device_traces": [trace]})
    assert peak == 150
    assert blocks == [(100, "quant.py:7 quantize_rows"), (50, "run_backward")]


def test_sizes_that_do_not_divide_are_refused() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--seq", "3000"], capture_output=True, text=True)
    assert done.returncode == 2 and "--tokens must be a multiple of --seq; received 16384 and 3000" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_says_so() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 1 and "no CUDA device is available" in done.stderr
