"""Where the host's time goes in one SageBwd attention call, function by function, against SDPA's own.

On a CUDA GPU, at the example's shape (the small config: ``B=8, Hq=10, Hkv=5, N=4096, D=64``, causal, bf16) or
``--shape``, the host's microseconds per call (launches queued, not waited for) of:

- ``layer``: a Lightning layer's ``scaled_dot_product_attention`` (:class:`sage_lightning.layer.AttentionLayerState`),
  forward, then the backward of its output (``torch.autograd.backward``), as a training step calls them;
- ``sage_attention``, ``sage_attention_triton``, the ``sagebwd_forward`` operator and the function it wraps,
  the same for the backward;
- SDPA's cuDNN and flash backends at the same shape, the same two passes.

Then one instrumented run of the layer (the functions below wrapped by a timer that adds their inclusive host time):
the share of the call each function takes. The wrapper costs about a microsecond per call; totals include it.
Writes ``--out`` (JSON) and prints two tables::

    python3 benchmarks/host_breakdown.py --out $OUT/host-breakdown.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import shlex
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accuracy import _commit, _versions, to_json  # noqa: E402
from device_check import host_ms  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

#: (module, attribute) pairs timed in the instrumented run: each module's own name for a function it calls.
TIMED = (
    ("sage_lightning.layer", "sage_attention"),
    ("sage_lightning.layer", "bind_sdpa_arguments"),
    ("sage_lightning.layer", "record"),
    ("sage_lightning.layer", "AttentionLayerState._route"),
    ("sage_lightning.layer", "AttentionLayerState._record_finiteness"),
    ("sage_lightning.kernels.interface", "check_inputs"),
    ("sage_lightning.kernels.interface", "sage_attention_triton"),
    ("sage_lightning.kernels.ops", "sagebwd_forward"),
    ("sage_lightning.kernels.ops", "sagebwd_backward"),
    ("sage_lightning.kernels.ops", "quantize_rows"),
    ("sage_lightning.kernels.ops", "hopper_forward"),
    ("sage_lightning.kernels.ops", "hopper_forward_applies"),
    ("sage_lightning.kernels.ops", "output_like"),
    ("sage_lightning.kernels.ops", "backward"),
    ("sage_lightning.kernels.backward", "backward_preprocess"),
    ("sage_lightning.kernels.backward", "transpose_rows"),
    ("sage_lightning.kernels.backward", "gluon_dkdv_applies"),
    ("sage_lightning.kernels.backward", "gluon_dq_applies"),
    ("sage_lightning.kernels.backward", "gluon_dkdv_wg"),
    ("sage_lightning.kernels.backward", "gluon_dkdv"),
    ("sage_lightning.kernels.backward", "gluon_dq_wg"),
    ("sage_lightning.kernels.backward", "gluon_dq"),
    ("sage_lightning.kernels.hopper.gluon_dkdv_wg", "_desc"),
    ("sage_lightning.kernels.hopper.gluon_dkdv_wg", "_rows_desc"),
    ("sage_lightning.kernels.hopper.gluon_dq_wg", "_desc"),
    ("triton.runtime.jit", "JITFunction.run"),
    ("triton.runtime.autotuner", "Autotuner.run"),
    ("triton.backends.nvidia.driver", "CudaLauncher.__call__"),
    ("triton.backends.nvidia.driver", "make_tensordesc_arg"),
    ("torch", "empty"),
)


def host_us(fn: Callable[[], object], calls: int = 20, repeats: int = 7) -> float:
    """Host microseconds per call of ``fn``: the median of ``repeats`` rounds of :func:`device_check.host_ms` (a
    shared host's time per call varies by a third from one round to the next), after three warm-up calls."""
    for _ in range(3):
        fn()
    return 1e3 * statistics.median(host_ms(fn, calls) for _ in range(repeats))


class Timers:
    """Wraps the :data:`TIMED` functions with timers that add their inclusive host time; ``restore()`` undoes it."""

    def __init__(self) -> None:
        import importlib

        self.total: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[object, str, object]] = []
        for module_name, attribute in TIMED:
            owner = importlib.import_module(module_name)
            *path, name = attribute.split(".")
            for part in path:
                owner = getattr(owner, part)
            original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
            if original is None:
                continue
            self._undo.append((owner, name, original))
            setattr(owner, name, self._wrap(f"{module_name.rsplit('.', 1)[-1]}.{attribute}", original))

    def _wrap(self, key: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[key] += time.perf_counter() - start
                self.count[key] += 1

        return timed

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)

    def reset(self) -> None:
        self.total.clear()
        self.count.clear()


def main(argv: list[str] | None = None) -> int:
    from sage_lightning.kernels import AttentionPrecision, sage_attention
    from sage_lightning.kernels.ops import (
        _sagebwd_backward,
        _sagebwd_forward,
        sage_attention_triton,
        sagebwd_backward,
        sagebwd_forward,
    )

    from sage_lightning.layer import AttentionLayerState

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shape", type=int, nargs=5, default=[8, 10, 5, 4096, 64],
                        metavar=("B", "HQ", "HKV", "N", "D"))  # fmt: skip
    parser.add_argument("--causal", type=int, default=1)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)
    batch, heads, kv_heads, seq, head_dim = args.shape
    causal = bool(args.causal)
    dev = torch.device("cuda")
    # The model's layout: [B, N, H, D] memory handed over as [B, H, N, D] views.
    q = torch.randn(batch, seq, heads, head_dim, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(batch, seq, kv_heads, head_dim, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    v = torch.randn(batch, seq, kv_heads, head_dim, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    grad = torch.randn(batch, seq, heads, head_dim, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    layer = AttentionLayerState("bench")
    precision = AttentionPrecision()
    gqa = heads != kv_heads

    def backward_of(make: Callable[[], torch.Tensor]) -> Callable[[], None]:
        out = make()
        return lambda: torch.autograd.backward(out, grad, retain_graph=True)

    tau = head_dim**-0.5
    op_args = (q, k, v, None, causal, tau, "int8", "int8", "int8", "bf16", "int8", True, False, 128, 64)
    saved = sagebwd_forward(*op_args)
    out, lse, q_op, q_scale, q_mean, k_op, k_scale = saved
    bwd_args = (grad, out, lse, q_op, q_scale, q_mean, k_op, k_scale, v.detach(), None, causal, tau,
                "int8", "int8", "bf16", "int8", 128, 64)  # fmt: skip
    # Reference functions: the layer's, the interface's, the operators' (with and without torch.library's dispatch).
    fwd = {
        "layer": lambda: layer.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
        "sage_attention": lambda: sage_attention(q, k, v, is_causal=causal, precision=precision),
        "sage_attention_triton": lambda: sage_attention_triton(q, k, v, is_causal=causal, with_lse=False),
        "sagebwd_forward op": lambda: sagebwd_forward(*op_args),
        "sagebwd_forward body": lambda: _sagebwd_forward(*op_args),
    }
    bwd = {
        "layer": backward_of(fwd["layer"]),
        "sage_attention_triton": backward_of(lambda: fwd["sage_attention_triton"]()[0]),
        "sagebwd_backward op": lambda: sagebwd_backward(*bwd_args),
        "sagebwd_backward body": lambda: _sagebwd_backward(*bwd_args),
    }
    for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):

        def sdpa(backend=backend) -> torch.Tensor:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        fwd[name] = sdpa
        bwd[name] = backward_of(sdpa)
    rows = []
    print(f"shape B={batch} Hq={heads} Hkv={kv_heads} N={seq} D={head_dim} causal={causal:d}")
    print("| call | pass | host us |\n|---|---|---:|")
    for pass_name, fns in (("fwd", fwd), ("bwd", bwd)):
        for name, fn in fns.items():
            row = {"call": name, "pass": pass_name, "host_us": host_us(fn, args.calls)}
            rows.append(row)
            print(f"| {name} | {pass_name} | {row['host_us']:.1f} |", flush=True)
    timers = Timers()
    shares = {}
    try:
        for pass_name, fn in (("fwd", fwd["layer"]), ("bwd", bwd["layer"])):
            fn()
            torch.cuda.synchronize()
            timers.reset()
            calls = 5 * args.calls
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            total = (time.perf_counter() - start) * 1e6 / calls
            torch.cuda.synchronize()
            shares[pass_name] = {"total_us": total, "functions": {
                key: {"us": timers.total[key] * 1e6 / calls, "calls": timers.count[key] / calls}
                for key in sorted(timers.total, key=lambda key: -timers.total[key])}}  # fmt: skip
            print(f"\ninstrumented layer {pass_name}: {total:.1f} us per call")
            print("| function | us | calls |\n|---|---:|---:|")
            for key, value in shares[pass_name]["functions"].items():
                print(f"| {key} | {value['us']:.1f} | {value['calls']:.1f} |")
    finally:
        timers.restore()
    if args.out:
        args.out.write_text(to_json(record(rows, shares, args.shape, causal, argv)))
    return 0


def record(rows: list[dict], shares: dict, shape: list[int], causal: bool, argv: list[str] | None) -> dict:
    """The result file (``../shared/RESULTS.md``'s header, kind ``overhead``): one row per call and pass, ``what``
    naming them, with the shape; the instrumented run's functions beside the rows."""
    command = "python3 benchmarks/host_breakdown.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    batch, heads, kv_heads, seq, head_dim = shape
    return {
        "kind": "overhead",
        "device": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "command": command.strip(),
        "versions": _versions(),
        "rows": [
            {
                "what": f"{row['call']} {row['pass']}",
                **row,
                "batch": batch,
                "heads": heads,
                "kv_heads": kv_heads,
                "seq": seq,
                "head_dim": head_dim,
                "causal": causal,
            }
            for row in rows
        ],  # fmt: skip
        "instrumented": shares,
    }


if __name__ == "__main__":
    raise SystemExit(main())
