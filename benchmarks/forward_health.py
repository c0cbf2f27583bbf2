"""The measurement behind ``qk_rel_err`` and its threshold (issue 16, case 6): for healthy inputs at three scales
and for one q outlier of 100, 300 and 1000, the forward-health signal as the controller computes it, and the probe's
O, dQ, dK cosines (against float64 attention) at the base precision, with ``smooth_q`` and with ``qk="bf16"``.

CPU reference path, B=1, H=2, N=1024, D=64, bf16, causal (about a minute)::

    python benchmarks/forward_health.py > benchmarks/results/forward-health-cpu-$(date +%Y%m%d).md
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from sage_lightning.kernels import AttentionPrecision  # noqa: E402
from sage_lightning.kernels.interface import use_backend  # noqa: E402

from sage_lightning.forward_health import qk_quant_error, qk_rel_err  # noqa: E402
from sage_lightning.layer import compare_with_full_precision  # noqa: E402

INPUTS = {
    "N(0,1)": (1.0, None),
    "N(0,16)": (4.0, None),
    "N(0,100)": (10.0, None),
    "one q entry of 100": (1.0, 100.0),
    "one q entry of 300": (1.0, 300.0),
    "one q entry of 1000": (1.0, 1000.0),
}
SETTINGS = {
    "base": AttentionPrecision(),
    "smooth_q": AttentionPrecision(smooth_q=True),
    "qk_bf16": AttentionPrecision(qk="bf16"),
}


def main() -> None:
    print("| input | `qk_rel_err` | " + " | ".join(f"{name}: O / dQ / dK cos" for name in SETTINGS) + " |")
    print("|---|---:|" + "---|" * len(SETTINGS))
    for label, (scale, outlier) in INPUTS.items():
        generator = torch.Generator().manual_seed(0)
        q, k, v, grad = (torch.randn(1, 2, 1024, 64, generator=generator) for _ in range(4))
        q, k = q * scale, k * scale
        if outlier is not None:
            q[0, 0, 5, 3] = outlier
        q, k, v, grad = (t.bfloat16() for t in (q, k, v, grad))
        health = qk_rel_err(qk_quant_error(q, k, smooth_q=False, smooth_k=True).tolist())
        cells = []
        for precision in SETTINGS.values():
            with use_backend("reference"):
                probe = compare_with_full_precision(q, k, v, grad, is_causal=True, precision=precision)
            cells.append(" / ".join(f"{probe[t]['cos']:.5f}" for t in ("O", "dQ", "dK")))
        print(f"| {label} | {health:.3f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
