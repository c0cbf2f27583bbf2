"""Where SageBwd's Triton kernels stand on a Hopper GPU: the device's ceilings, tile variants, and the PTX.

One run, in this order (issue #4's method: measure the ceilings, then one lever at a time):

1. ceilings: the 8-bit and bf16 matrix rates (``torch._int_mm`` and ``torch.mm`` at 8192^3, cuBLAS) and the
   device-memory copy bandwidth (a 2 GiB ``copy_``);
2. tile variants of SageBwd (``block_m`` x ``block_n``, which are also the quantization blocks of Q and of
   K and V): accuracy against float64 attention (cosine of O, dQ, dK, dV; B=1, H=4, N=4096, D=128), then
   forward and forward+backward timings (``do_bench`` median) at ``B x N = 16K``, D=128, N=4096, causal and
   not, with SDPA's flash and cuDNN backends timed in the same run;
3. the PTX of every kernel compiled in the run (Triton's cache is pointed at a fresh folder before Triton is
   imported): counts of Hopper ``wgmma`` instructions by operand type, and of the older ``mma.sync``;
4. a table, last.

Writes ``speed-<device>-<date>-probe.json`` (format: ../shared/RESULTS.md; speed rows carry ``block_m``,
``block_n`` and, for the variants, the accuracy cosines) and a ``.md`` table into ``--out-dir``.

Example::

    python benchmarks/hopper_probe.py --out-dir /tmp/probe
"""

from __future__ import annotations

import os
import tempfile

# Before Triton is imported: every kernel this run compiles lands in a fresh cache, where its PTX is read.
_CACHE = tempfile.mkdtemp(prefix="triton-probe-")
os.environ["TRITON_CACHE_DIR"] = _CACHE

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy import _commit, _versions, compare, device_name, device_slug, to_json  # noqa: E402
from sage_lightning.kernels import AttentionPrecision  # noqa: E402
from sage_lightning.kernels.ops import sage_attention_triton  # noqa: E402
from sage_lightning.kernels.reference import exact_attention  # noqa: E402
from speed import BACKENDS, _attention, flops  # noqa: E402

#: (block_m, block_n) tried; the first is the shipped default.
VARIANTS: tuple[tuple[int, int], ...] = ((128, 64), (128, 128), (64, 64), (64, 128))


def ceilings() -> list[dict]:
    """The device's 8-bit and bf16 matrix rates (TFLOPS/TOPS, cuBLAS) and copy bandwidth (GB/s, read + write).

    Example::

        rows = ceilings()    # [{"what": "int8 matmul", "rate": ...}, ...]
    """
    from triton.testing import do_bench

    n = 8192
    a8 = torch.randint(-127, 128, (n, n), device="cuda", dtype=torch.int8)
    b8 = torch.randint(-127, 128, (n, n), device="cuda", dtype=torch.int8).t().contiguous().t()
    a16 = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b16 = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    rows = []
    for what, fn in (
        ("int8 matmul (torch._int_mm)", lambda: torch._int_mm(a8, b8)),
        ("bf16 matmul", lambda: a16 @ b16),
    ):
        ms = do_bench(fn, return_mode="median")
        rows.append({"what": what, "ms": ms, "rate": 2 * n**3 / ms / 1e9, "unit": "TFLOPS"})
    src = torch.empty(2**30, device="cuda", dtype=torch.int16)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    rows.append(
        {"what": "device copy (2 GiB read + 2 GiB write)", "ms": ms, "rate": 2 * 2**31 / ms / 1e6, "unit": "GB/s"}
    )
    return rows


def accuracy(block_m: int, block_n: int) -> dict[str, float]:
    """Cosine of O, dQ, dK, dV of one tile variant against float64 attention (B=1, H=4, N=4096, D=128)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, 4, 4096, 128, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = sage_attention_triton(*leaves, precision=AttentionPrecision(), block_m=block_m, block_n=block_n)
    got = dict(zip(("O", "dQ", "dK", "dV"), (out, *torch.autograd.grad(out, leaves, do)), strict=True))
    ref = exact_attention(q, k, v, do)
    return {f"cos_{name}": compare(got[name].detach(), ref[name])[0] for name in got}


def timings(impl: str, causal: bool, block_m: int = 128, block_n: int = 64, seq: int = 4096) -> dict[str, float]:
    """Median ms of forward and forward+backward at ``B x N = 16K``, D=128, 16 heads."""
    from triton.testing import do_bench

    batch, heads, head_dim = 16384 // seq, 16, 128
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    attention = _attention(impl, block_m=block_m, block_n=block_n)  # the tiles matter to sage only
    fwd_ms = do_bench(lambda: attention(q, k, v, causal), return_mode="median")
    both_ms = do_bench(lambda: torch.autograd.grad(attention(q, k, v, causal), (q, k, v), do), return_mode="median")
    return {
        "batch": batch, "heads": heads, "kv_heads": heads, "seq": seq, "head_dim": head_dim, "causal": causal,
        "fwd_ms": fwd_ms, "fwd+bwd_ms": both_ms,
        "fwd_tflops": flops(batch, heads, seq, head_dim, causal, "fwd") / fwd_ms / 1e9,
        "fwd+bwd_tflops": flops(batch, heads, seq, head_dim, causal, "fwd+bwd") / both_ms / 1e9,
    }  # fmt: skip


_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.(\w+)\.(\w+)\.(\w+)")


def ptx_report(cache: str = _CACHE) -> list[dict]:
    """Per compiled kernel (name, warps, stages): wgmma instructions by shape and types, and ``mma.sync`` count.

    Example::

        for row in ptx_report(): print(row["kernel"], row["wgmma"])
    """
    rows = []
    for ptx in sorted(Path(cache).rglob("*.ptx")):
        text = ptx.read_text()
        meta_file = ptx.with_suffix(".json")
        meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
        wgmma: dict[str, int] = {}
        for match in _WGMMA.finditer(text):
            key = ".".join(match.groups())
            wgmma[key] = wgmma.get(key, 0) + 1
        rows.append(
            {
                "kernel": ptx.stem,
                "num_warps": meta.get("num_warps"),
                "num_stages": meta.get("num_stages"),
                "wgmma": wgmma,
                "mma_sync": len(re.findall(r"\bmma\.sync\.aligned", text)),
                "local_memory": len(re.findall(r"\bst\.local", text)),
            }
        )
    return rows


def table(result: dict) -> str:
    """The markdown summary of one probe result."""
    lines = [f"# Hopper probe: {result['device']}, {result['date']}, commit {result['commit']}", ""]
    lines += [
        f"`{result['command']}`",
        "",
        "## Ceilings (cuBLAS / copy)",
        "",
        "| what | ms | rate |",
        "|---|---:|---:|",
    ]
    lines += [f"| {c['what']} | {c['ms']:.3f} | {c['rate']:.0f} {c['unit']} |" for c in result["ceilings"]]
    lines += ["", "## Tile variants (D=128, N=4096, B x N = 16K, 16 heads)", ""]
    lines += [
        "| impl | block_m x block_n | causal | fwd TFLOPS | fwd+bwd TFLOPS | fwd / cuDNN | fwd+bwd / cuDNN "
        "| fwd+bwd / flash | cos O | cos dQ | cos dK | cos dV |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {(r["impl"], r["causal"]): r for r in result["rows"] if r["impl"] != "sage"}
    for r in result["rows"]:
        cudnn, flash = base[("sdpa_cudnn", r["causal"])], base[("sdpa_flash", r["causal"])]
        tiles = f"{r['block_m']} x {r['block_n']}" if r["impl"] == "sage" else ""
        cos = " | ".join(f"{r[f'cos_{t}']:.5f}" if f"cos_{t}" in r else "" for t in ("O", "dQ", "dK", "dV"))
        lines.append(
            f"| {r['impl']} | {tiles} | {r['causal']} | {r['fwd_tflops']:.0f} | {r['fwd+bwd_tflops']:.0f} | "
            f"{cudnn['fwd_ms'] / r['fwd_ms']:.2f} | {cudnn['fwd+bwd_ms'] / r['fwd+bwd_ms']:.2f} | "
            f"{flash['fwd+bwd_ms'] / r['fwd+bwd_ms']:.2f} | {cos} |"
        )
    lines += ["", "## PTX of the compiled kernels", "", "| kernel | warps | stages | wgmma | mma.sync | st.local |"]
    lines += ["|---|---:|---:|---|---:|---:|"]
    for p in result["ptx"]:
        wgmma = ", ".join(f"{k}: {n}" for k, n in sorted(p["wgmma"].items())) or "none"
        lines.append(
            f"| {p['kernel']} | {p['num_warps']} | {p['num_stages']} | {wgmma} | {p['mma_sync']} "
            f"| {p['local_memory']} |"
        )
    for failure in result.get("failures", []):
        lines += ["", f"## Variant {failure['block_m']} x {failure['block_n']} failed", "", "```"]
        lines += [failure["error"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    """Run the probe; print the table; write JSON and markdown into ``--out-dir``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--variants", default=",".join(f"{m}x{n}" for m, n in VARIANTS), help="e.g. 128x64,128x128")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("hopper_probe.py: needs a CUDA GPU")
    variants = [tuple(int(x) for x in v.split("x")) for v in args.variants.split(",")]
    result = {
        "kind": "speed",
        "device": device_name("cuda"),
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "command": "python benchmarks/hopper_probe.py " + shlex.join(argv),
        "versions": _versions(),
        "ceilings": ceilings(),
        "rows": [],
        "failures": [],
    }
    print("ceilings:", result["ceilings"], flush=True)
    for causal in (False, True):
        for impl in BACKENDS:
            result["rows"].append({"impl": impl, **timings(impl, causal)})
    for block_m, block_n in variants:
        try:
            cos = accuracy(block_m, block_n)
            for causal in (False, True):
                row = {
                    "impl": "sage",
                    "block_m": block_m,
                    "block_n": block_n,
                    **timings("sage", causal, block_m, block_n),
                }
                result["rows"].append({**row, **cos})
                print(result["rows"][-1], flush=True)
        except Exception as err:  # a variant that does not compile is a finding, not the end of the run
            # Kept whole (its last lines name the kernel and the resource), in the JSON and at the table's end.
            text = "".join(traceback.format_exception(err))[-3000:]
            result["failures"].append({"block_m": block_m, "block_n": block_n, "error": text})
            print(f"variant {block_m}x{block_n} failed:\n{text}", flush=True)
        torch.cuda.empty_cache()
    result["ptx"] = ptx_report()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = f"speed-{device_slug(result['device'])}-{result['date'].replace('-', '')}-probe"
    (args.out_dir / f"{name}.json").write_text(to_json(result))
    text = table(result)
    (args.out_dir / f"{name}.md").write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
