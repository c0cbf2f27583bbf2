"""Where a training step of the example's model goes: the GPU's busy time against the step's wall time.

For each run (``pretrain_compare.py``'s grammar, e.g. ``sage:controller=off`` or ``full:controller=off,sdpa=cudnn``)
it trains the config for ``--start + --steps`` optimizer steps and profiles the last ``--steps`` with
``torch.profiler`` (the device synchronised at both ends of the window), then reports per step:

- ``wall_ms``: the window's wall time per step;
- ``device_ms``: the kernels' summed device time per step (one stream: the time the GPU was busy);
- ``idle``: ``1 - device_ms / wall_ms``, the share of the step the GPU waited for the host;
- ``attention_ms``: the device time of the attention's kernels (SageBwd's, or SDPA's cuDNN/flash kernels);
- the top kernels.

A step whose GPU idles is bound by the host: faster kernels do not speed it up, less host work per call does.
Writes ``--out`` (JSON, ``kind: "overhead"``-style rows) and prints a table::

    python3 benchmarks/step_profile.py --runs sage:controller=off full:controller=off,sdpa=cudnn \\
        --set data.seq_len=4096 --set data.batch_size=8 --out $OUT/step-profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from accuracy import _commit, _versions, device_name  # noqa: E402
from overhead_profile import ProfilerWindow  # noqa: E402
from pretrain_compare import (  # noqa: E402
    REPO,
    TextDataModule,
    build_model,
    load_config,
    parse_run,
    sdpa_backend,
)

#: Substrings of the attention's kernel names: SageBwd's Triton and Gluon kernels, SDPA's cuDNN and flash kernels.
ATTENTION_KERNELS = ("_forward_kernel", "_dkdv", "_dq_kernel", "_dq_wg_kernel", "_quantize_rows_kernel",
                     "_backward_preprocess_kernel", "_transpose_kernel", "cudnn", "flash", "fmha", "sdpa")  # fmt: skip


def is_attention(kernel: str) -> bool:
    """Whether ``kernel`` (a profiler's kernel name) is one of the attention's: :data:`ATTENTION_KERNELS`.

    Example::

        is_attention("_gluon_dkdv_wg_kernel")   # True
    """
    return any(part in kernel for part in ATTENTION_KERNELS)


def profile_run(config: dict, text: str, data: TextDataModule, start: int, steps: int) -> dict[str, Any]:
    """Train ``config`` as the run ``text`` says for ``start + steps`` steps; the window's figures per step."""
    spec = parse_run(text)
    L.seed_everything(int(config.get("seed_everything", 0) or 0), workers=True)
    model = build_model(config, spec, data)
    window = ProfilerWindow(start, steps, device_only=True)
    trainer_args = {k: v for k, v in (config.get("trainer") or {}).items() if k in ("precision", "accelerator")}
    trainer = L.Trainer(**trainer_args, max_steps=start + steps + 1, callbacks=[window], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with sdpa_backend(spec.sdpa_backend):
        trainer.fit(model, datamodule=data)
    found = window.per_step(top=200)
    wall_ms = 1e3 * window.wall_s / steps
    attention = sum(ms for name, ms in found["device_ms"].items() if is_attention(name))
    top = dict(list(found["device_ms"].items())[:20])
    busy = found["device_ms_total"]
    return {"what": spec.name, "run": text, "steps": steps, "step_ms": wall_ms, "device_ms": busy,
            "idle": 1 - busy / wall_ms, "attention_ms": attention, "top_kernels_ms": top}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "examples" / "configs" / "small.yaml")
    parser.add_argument("--runs", nargs="+", default=["sage:controller=off", "full:controller=off,sdpa=cudnn"])
    parser.add_argument("--set", action="append", default=[], help="SECTION.KEY=VALUE change to the config")
    parser.add_argument("--start", type=int, default=15, help="steps before the window (compile, autotune, warm)")
    parser.add_argument("--steps", type=int, default=10, help="profiled steps")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.start < 1 or args.steps < 1:
        parser.error(f"--start and --steps must be at least 1; received {args.start} and {args.steps}")
    config = load_config(args.config, args.set)
    data = TextDataModule(**(config.get("data") or {}))
    data.prepare_data()
    rows = [profile_run(config, text, data, args.start, args.steps) for text in args.runs]
    print("| run | step ms | GPU busy ms | GPU idle | attention kernels ms |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['what']} | {row['step_ms']:.2f} | {row['device_ms']:.2f} | {100 * row['idle']:.0f}% "
              f"| {row['attention_ms']:.2f} |")  # fmt: skip
    if args.out:
        device = device_name("cuda" if torch.cuda.is_available() else "cpu")
        command = "python benchmarks/step_profile.py " + " ".join(sys.argv[1:] if argv is None else argv)
        result = {"kind": "overhead", "device": device, "date": time.strftime("%Y-%m-%d"), "commit": _commit(),
                  "command": command, "versions": _versions(), "rows": rows}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
