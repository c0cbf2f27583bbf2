"""Compile every Triton kernel of a forward and backward for a Hopper GPU, on a machine without one.

A stand-in CUDA driver in Triton (target ``sm_90``, 227 KiB of shared memory per block, launches that do nothing)
lets SageBwd's entry points run on CPU tensors, so every kernel and autotuning candidate compiles as on
the GPU (nothing is checked numerically). Per kernel: launch config, tile constexprs, shared memory and whether it
fits, registers and spills, blocks per SM, the hot loop's SASS size (:data:`QUARTER_RATE`), ``wgmma``/``mma.sync``
and local memory. Run it with the GPU image's Triton (3.6) in a CPU-only environment, as ``.ci/run`` makes one
(``SAGE_SM90_TRITON_PYTHON``)::

    python -m benchmarks.kernels.sm90_compile --head-dim 128 --tiles 128x64 128x128 --out /tmp/sm90.json

Exits 1 when an entry point fails; candidates the autotuner would skip are marked ``!`` (too much shared memory) or
FAILED.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("sm90_compile.py compiles for the GPU: unset TRITON_INTERPRET (received TRITON_INTERPRET=1)")

# A fresh cache: every kernel is compiled in this run, none is read back from an earlier one.
_CACHE = tempfile.mkdtemp(prefix="triton-sm90-")
os.environ["TRITON_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.compiler  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.driver import CudaDriver  # noqa: E402
from triton.runtime import autotuner  # noqa: E402
from triton.runtime import driver as triton_driver  # noqa: E402

#: Shared memory one block may use on an H100/H200 (``cudaDevAttrMaxSharedMemoryPerBlockOptin``: 227 KiB).
SM90_MAX_SHARED = 232448
#: Per streaming multiprocessor on sm_90: registers, shared memory (228 KiB, of which 1 KiB per block is
#: reserved by the driver), resident warps and blocks.
SM90_REGS_PER_SM = 65536
SM90_SHARED_PER_SM = 233472
SM90_WARPS_PER_SM = 64
SM90_BLOCKS_PER_SM = 32
#: ``--path`` choices: which of SageBwd's kernel paths each case compiles.
PATHS = {"portable": ("portable",), "hopper": ("hopper",), "both": ("portable", "hopper")}
#: The variable that picks the path (``kernels/plan.py``); set per case.
HOPPER_ENV = "SAGE_LIGHTNING_HOPPER"


def blocks_per_sm(registers: int, num_warps: int, shared: int) -> int:
    """Thread blocks of a kernel resident on one SM at once (the occupancy calculator's rule for sm_90: registers
    per warp in units of 256, 8 per thread; 1 KiB of shared memory reserved per block)."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = SM90_REGS_PER_SM // (per_warp * num_warps) if per_warp else SM90_BLOCKS_PER_SM
    by_shared = SM90_SHARED_PER_SM // (shared + 1024)
    return min(by_registers, by_shared, SM90_WARPS_PER_SM // num_warps, SM90_BLOCKS_PER_SM)


_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.(\w+)\.(\w+)\.(\w+)")
_MMA_SYNC = re.compile(r"\bmma\.sync\.aligned")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass
class Compiled:
    """What one compiled kernel needs on the device, and which tensor-core instructions it uses."""

    kernel: str
    case: str
    constants: dict
    num_warps: int
    num_stages: int
    shared: int = 0
    fits: bool = True
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    wgmma: dict = field(default_factory=dict)
    mma_sync: int = 0
    local_memory_ops: int | None = None
    blocks_per_sm: int | None = None
    loop_instructions: int | None = None
    loop_fast_path: int | None = None
    loop_quarter_rate: int | None = None
    loop_opcodes: dict = field(default_factory=dict)
    wgmma_serialized: bool | None = None
    error: str | None = None


class _NoLaunch:
    """Triton's launcher, replaced: a compiled kernel is \"launched\" by doing nothing."""

    def __init__(self, src: object, metadata: object) -> None:
        self.metadata = metadata

    def __call__(self, *args: object, **kwargs: object) -> None:
        return None


class OfflineHopperDriver(CudaDriver):
    """Triton's CUDA driver with a Hopper (``capability`` 90: H100/H200) as the current device and no CUDA under it."""

    def __init__(self, capability: int = 90) -> None:  # CudaDriver.__init__ would load libcuda
        self.capability = capability
        self.launcher_cls = _NoLaunch
        properties = {"max_shared_mem": SM90_MAX_SHARED, "multiprocessor_count": 132, "max_num_regs": 65536}
        self.utils = SimpleNamespace(
            get_device_properties=lambda device: dict(properties),
            load_binary=lambda name, kernel, shared, device: (0, 0, 0, 0, 1024),
        )
        self.get_current_device = lambda: 0
        self.set_current_device = lambda device: None
        self.get_current_stream = lambda device=None: 0
        self.get_device_capability = lambda device=None: divmod(capability, 10)

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.capability, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def is_active() -> bool:
        return True


_RECORDS: list[Compiled] = []
_CASE = {"name": ""}


def _bin(name: str) -> str:
    """A tool Triton ships beside its ptxas (``ptxas``, ``cuobjdump``, ``nvdisasm``)."""
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _ptxas_usage(ptx: str, arch: str) -> tuple[int | None, int | None, int | None, bool]:
    """Registers, spill bytes (stores, loads) of a PTX module from ``ptxas -v``, and whether ptxas serialized its
    wgmma (its notes C7512 and C7514, "wgmma.mma_async instructions are serialized ...": each waited for at once)."""
    log = ""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        # Triton 3.6's PTX suits its ptxas; newer Tritons write a PTX version only their ptxas-blackwell reads.
        for ptxas in ("ptxas", "ptxas-blackwell"):
            command = [_bin(ptxas), "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "k.cubin")]
            done = subprocess.run(command, capture_output=True, text=True)
            log = done.stdout + done.stderr
            if done.returncode == 0:
                break
    regs, spill = _PTXAS_REGS.search(log), _PTXAS_SPILL.search(log)
    return (
        int(regs.group(1)) if regs else None,
        int(spill.group(1)) if spill else None,
        int(spill.group(2)) if spill else None,
        "wgmma.mma_async instructions are serialized" in log,
    )


_SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)([^;]*);", re.M)
_BRANCH_TARGET = re.compile(r"BRA\s+(?:`\()?(?:\.L_x_\d+\))?\s*(0x[0-9a-f]+)")
#: Opcodes issued at 16 per clock per SM on sm_90 (the multi-function unit and type conversions), against
#: 128 for float adds and multiplies: each costs the issue slots of about eight full-rate instructions.
#: F2IP (two floats to packed integers) is counted with them, conservatively.
QUARTER_RATE = ("MUFU", "I2F", "I2FP", "F2I", "F2IP", "F2F", "I2I")


def _sass(cubin: bytes) -> str | None:
    """``cuobjdump -sass`` of a cubin, or ``None`` when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        done = subprocess.run([_bin("cuobjdump"), "-sass", str(path)], capture_output=True, text=True)
    return None if done.returncode else done.stdout


def hot_loop(sass: str) -> dict | None:
    """The innermost loop that issues tensor-core instructions (``*GMMA``): its instruction count, how many of
    those are quarter-rate (:data:`QUARTER_RATE`) and the opcode counts; ``None`` when there is no such loop (a
    loop: a branch back to a lower address; the innermost: the shortest span holding a GMMA)."""
    lines = [(int(addr, 16), op, rest) for addr, op, rest in _SASS_LINE.findall(sass)]
    branches = [(a, int(t.group(1), 16)) for a, o, r in lines if o == "BRA" and (t := _BRANCH_TARGET.search(o + r))]
    loops = []
    for addr, target in branches:
        if target < addr:
            body = [(a, o) for a, o, _ in lines if target <= a <= addr]
            if any(o.endswith("GMMA") for _, o in body):
                loops.append((target, addr, body))
    if not loops:
        return None
    start, end, body = min(loops, key=lambda loop: len(loop[2]))
    opcodes = collections.Counter(o for _, o in body)
    # Forward branches inside the loop skip a region (a tile's mask, taken only on some iterations): the
    # instructions left when every such region is skipped estimate the common iteration.
    skipped = set()
    for addr, target in branches:
        if start <= addr < target <= end:
            skipped.update(a for a, _ in body if addr < a < target)
    return {
        "instructions": len(body),
        "fast_path": len(body) - len(skipped),
        "quarter_rate": sum(n for o, n in opcodes.items() if o in QUARTER_RATE),
        "opcodes": dict(opcodes.most_common()),
    }


_DUMP = {"dir": None}


def _dump(kernel: object, sass: str | None) -> None:
    """Write the kernel's PTX and SASS into ``--dump`` for reading."""
    folder = Path(_DUMP["dir"])
    folder.mkdir(parents=True, exist_ok=True)
    meta = kernel.metadata
    stem = f"{len(_RECORDS):03d}-{kernel.name}-w{meta.num_warps}s{meta.num_stages}"
    (folder / f"{stem}.ptx").write_text(kernel.asm.get("ptx", ""))
    if sass is not None:
        (folder / f"{stem}.sass").write_text(sass)


def _describe(kernel: object) -> Compiled:
    """Read a compiled kernel's metadata, PTX and cubin into a :class:`Compiled` row."""
    meta = kernel.metadata
    constants = {}
    for key, value in getattr(kernel.src, "constants", {}).items():
        index = key[0] if isinstance(key, tuple) else key
        name = kernel.src.fn.arg_names[index] if isinstance(index, int) else str(index)
        if name.isupper():  # the kernels' constexpr parameters are upper-case; lower-case ones are specialised 1s
            constants[name] = value if isinstance(value, (int, float, bool, str)) else str(value)
    ptx = kernel.asm.get("ptx", "")
    wgmma = collections.Counter(".".join(m) for m in _WGMMA.findall(ptx))
    arch = f"sm_{meta.target.arch}a" if meta.target.arch == 90 else "sm_90"
    regs, stores, loads, serialized = _ptxas_usage(ptx, arch)
    sass = _sass(kernel.asm["cubin"]) if "cubin" in kernel.asm else None
    if _DUMP["dir"] is not None:
        _dump(kernel, sass)
    loop = hot_loop(sass) if sass else None
    return Compiled(
        kernel=kernel.name,
        case=_CASE["name"],
        constants=constants,
        num_warps=meta.num_warps,
        num_stages=meta.num_stages,
        shared=meta.shared,
        fits=meta.shared <= SM90_MAX_SHARED,
        registers=regs,
        spill_stores=stores,
        spill_loads=loads,
        wgmma=dict(wgmma),
        wgmma_serialized=serialized,
        mma_sync=len(_MMA_SYNC.findall(ptx)),
        local_memory_ops=len(re.findall(r"\b(?:LDL|STL)\b", sass)) if sass else None,
        loop_instructions=loop["instructions"] if loop else None,
        loop_fast_path=loop["fast_path"] if loop else None,
        loop_quarter_rate=loop["quarter_rate"] if loop else None,
        loop_opcodes=loop["opcodes"] if loop else {},
        blocks_per_sm=blocks_per_sm(regs, meta.num_warps, meta.shared) if regs is not None else None,
    )


def _install() -> None:
    """Set the stand-in driver, record every compile, and make autotuning compile each candidate, not time it."""
    triton_driver.set_active(OfflineHopperDriver())
    original_compile = triton.compiler.compile

    def compile_and_record(src: object, *args: object, **kwargs: object) -> object:
        kernel = original_compile(src, *args, **kwargs)
        _RECORDS.append(_describe(kernel))
        return kernel

    triton.compiler.compile = compile_and_record

    def bench(self: autotuner.Autotuner, *args: object, config: triton.Config, **kwargs: object) -> float:
        current = {**kwargs, **config.all_kwargs(), "warmup": True}
        try:
            if config.pre_hook:  # as the tuner's own benchmark does (the Hopper path's descriptors take the tiles)
                config.pre_hook({**self.nargs, **current})
            kernel = self.fn.run(*args, **current)
        except Exception as error:  # noqa: BLE001 - a candidate that fails is reported, the others go on
            _RECORDS.append(
                Compiled(
                    kernel=self.base_fn.__name__,
                    case=_CASE["name"],
                    constants={k: v for k, v in config.kwargs.items()},
                    num_warps=config.num_warps,
                    num_stages=config.num_stages,
                    fits=False,
                    error=f"{type(error).__name__}: {error}"[:2000],
                )
            )
            return float("inf")
        if kernel.metadata.shared > SM90_MAX_SHARED:
            return float("inf")  # as on the GPU, where loading it raises OutOfResources and the tuner skips it
        return float(len(_RECORDS))  # any finite number: the first candidate that compiles and fits is launched

    autotuner.Autotuner._bench = bench


def _cases(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """(name, settings) of every entry point call this run compiles."""
    cases = []
    for head_dim in args.head_dim:
        for causal in (False, True):
            for tile in args.tiles:
                block_m, block_n = (int(x) for x in tile.split("x"))
                for path in PATHS[args.path]:
                    name = f"sagebwd D={head_dim} causal={causal} {block_m}x{block_n} {path}"
                    cases.append((name, dict(head_dim=head_dim, causal=causal, tiles=(block_m, block_n), path=path)))
    return cases


def _run_case(settings: dict, seq: int, heads: int, dtype: torch.dtype) -> None:
    """One entry point's forward and backward on CPU tensors, at ``settings.get("precision")`` (None: the default)."""
    from sage_lightning.kernels import plan
    from sage_lightning.kernels.ops import sage_attention_triton

    # The Hopper path is taken only on a verified GPU; here it is forced (or switched off) for the call.
    os.environ[HOPPER_ENV] = {"hopper": "force", "portable": "off"}[settings["path"]]
    plan.refresh_settings()
    shape = (1, heads, seq, settings["head_dim"])
    q, k, v = (torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3))
    kw = dict(zip(("block_m", "block_n"), settings["tiles"], strict=True), precision=settings.get("precision"))
    out, _ = sage_attention_triton(q, k, v, is_causal=settings["causal"], with_lse=False, **kw)
    out.backward(torch.randn_like(out))


def _loop_cell(row: Compiled) -> str:
    if not row.loop_instructions:
        return "-"
    return f"{row.loop_instructions}/{row.loop_fast_path}/{row.loop_quarter_rate}"


def backward_inputs(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int) -> dict:
    """CPU tensors of the shapes and dtypes the backward's launches take (dK/dV and dQ; values never read), for
    the Gluon compile scripts (``benchmarks.kernels.gluon_*_compile``)."""
    i8, f32, bf16 = torch.int8, torch.float32, torch.bfloat16
    return dict(
        grad_out=torch.zeros(batch, heads, seq, head_dim, dtype=bf16),
        out=torch.zeros(batch, heads, seq, head_dim, dtype=bf16),
        delta=torch.zeros(batch, heads, seq, dtype=f32),
        do_codes_t=torch.zeros(batch, heads, head_dim, seq, dtype=i8),
        do_scale=torch.zeros(batch, heads, seq // 128, dtype=f32),
        q_op=torch.zeros(batch, heads, seq, head_dim, dtype=i8),
        q_op_t=torch.zeros(batch, heads, head_dim, seq, dtype=i8),
        q_scale=torch.zeros(batch, heads, seq // 128, dtype=f32),
        k_op=torch.zeros(batch, kv_heads, seq, head_dim, dtype=i8),
        k_op_t=torch.zeros(batch, kv_heads, head_dim, seq, dtype=i8),
        k_scale=torch.zeros(batch, kv_heads, seq // 64, dtype=f32),
        v=torch.zeros(batch, kv_heads, seq, head_dim, dtype=bf16),
        lse=torch.zeros(batch, heads, seq, dtype=f32),
        stats=torch.zeros(2, dtype=f32),
    )


def report(
    seq: int,
    out: Path | None,
    verbose: bool = False,
    *,
    case_width: int = 42,
    kernel_width: int = 26,
    skip: tuple[str, ...] = (),
) -> None:
    """The compile scripts' table: one line per compiled kernel of :data:`_RECORDS` (its tiles, warps, stages, shared
    memory, registers, spills, local-memory operations, CTAs per SM, hot-loop SASS, ptxas's C7514 (wgmma serialized)
    and tensor-core instructions), and the records as JSON in ``out``.
    """
    cw, kw = case_width, kernel_width
    print(f"Triton {triton.__version__}, target sm_90 (offline), seq {seq}, bf16")
    print(f"{'case':<{cw}} {'kernel':<{kw}} {'tiles':>7} {'w':>2} {'s':>2} {'smem KiB':>8} {'regs':>4} {'spill':>5} "
          f"{'LDL/STL':>7} {'CTA/SM':>6} {'loop':>14} {'serial':>6}  wgmma")  # fmt: skip
    for row in _RECORDS:
        if row.kernel in skip:
            continue
        if row.error:
            print(f"{row.case:<{cw}} {row.kernel[:kw]:<{kw}} FAILED {row.error.splitlines()[0][:160]}")
            if verbose:
                print(row.error)
            continue
        tiles = "x".join(str(row.constants[k]) for k in ("BLOCK_M", "BLOCK_N") if k in row.constants)
        mma = ", ".join(f"{n}x {shape}" for shape, n in sorted(row.wgmma.items())) or "none"
        if row.mma_sync:
            mma += f", {row.mma_sync}x mma.sync"
        print(
            f"{row.case:<{cw}} {row.kernel[:kw]:<{kw}} {tiles:>7} {row.num_warps:>2} {row.num_stages:>2} "
            f"{row.shared / 1024:>7.1f}{'' if row.fits else '!'} {row.registers or 0:>4} {row.spill_stores or 0:>5} "
            f"{row.local_memory_ops if row.local_memory_ops is not None else '?':>7} "
            f"{row.blocks_per_sm if row.blocks_per_sm is not None else '?':>6} {_loop_cell(row):>14} "
            f"{'yes' if row.wgmma_serialized else '-':>6}  {mma}"
        )
    if out:
        found = {"triton": triton.__version__, "target": "sm_90", "seq": seq, "rows": [asdict(r) for r in _RECORDS]}
        out.write_text(json.dumps(found, indent=1))


def main(argv: list[str] | None = None) -> int:
    """Compile, print a table, write ``--out`` (JSON); 1 when an entry point fails, else 0."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128], help="head dims (default: 64 128)")
    parser.add_argument("--tiles", nargs="+", default=["128x64"], help="SageBwd BLOCK_MxBLOCK_N (default: 128x64)")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length of the calls (default: 4096)")
    parser.add_argument(
        "--path", choices=sorted(PATHS), default="both",
        help="SageBwd's kernels: the portable ones, the Hopper path's (kernels/hopper), or both (default)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--dump", type=Path, help="write each kernel's PTX and SASS into this folder")
    args = parser.parse_args(argv)
    _DUMP["dir"] = args.dump
    for tile in args.tiles:
        if not re.fullmatch(r"\d+x\d+", tile):
            parser.error(f"--tiles takes BLOCK_MxBLOCK_N such as 128x64; received {tile!r}")

    _install()
    failures = 0
    for name, settings in _cases(args):
        _CASE["name"] = name
        try:
            _run_case(settings, args.seq, heads=2, dtype=torch.bfloat16)
        except Exception as error:  # noqa: BLE001 - reported as a row, the other cases go on
            failures += 1
            _RECORDS.append(
                Compiled(kernel="(entry point)", case=name, constants={}, num_warps=0, num_stages=0, fits=False,
                         error=f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=3)}"[:3000])
            )  # fmt: skip
    # A candidate that does not fit or fails to compile is skipped by the autotuner (as on the GPU); the run
    # fails only when an entry point does (no candidate of a kernel left, or a kernel without candidates).
    skipped = sum(1 for row in _RECORDS if row.kernel != "(entry point)" and (row.error or not row.fits))

    report(args.seq, args.out)
    print(f"{len(_RECORDS)} kernels; {skipped} autotuning candidates skipped (do not fit or fail); "
          f"{failures} entry points failed")  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
