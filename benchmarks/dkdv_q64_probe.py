"""Measurement probe for issue 14's dK/dV lever at D=128: what would warpgroups that run apart be worth there?

At D=64 the backward's dK/dV work goes to ``gluon_dkdv_wg`` (one warpgroup per 64 keys against the whole 128-query
tile: P's per-key scale and dS's tile scale stay inside a warpgroup, so the two warpgroups run apart and one
quantizes while the other's products run); its dK/dV kernel is 1.17-1.32x faster than the lockstep ``gluon_dkdv``
(``results/speed-h100-20261124-gluon-dkdv-wg.md``). At D=128 that structure does not fit: a warpgroup would hold
S^T, P and dP^T ``[64, 128]`` (64 registers each per thread) beside dK and dV ``[64, 128]`` (64 each). So D=128 runs
the lockstep kernel, whose two warpgroups split each tile by queries and meet at two CTA barriers per tile for the
cross-warpgroup scale reductions.

With 64-query tiles a warpgroup's S^T, P and dP^T take 32 registers each and the structure fits, but SageBwd's
granularity changes: P's codes get one scale per key over 64 queries (not 128) and dS one scale per 64 x 64 tile
(not 128 x 64); Q'^ and dO^ keep their 128-row scales. That is finer quantization, so no less accurate, but it is a
numerics change that the reference (the oracle), the portable kernel and the accuracy bars would have to carry.
Before anyone pays for that, this probe measures both sides of it on the device:

* **speed**: the probe's kernel (below; a 128-key program, one warpgroup per 64 keys, a ring of 64-query tiles of
  Q'^, Q'^T, dO, dO^T, lse and delta, dV's and dK's products one after the other for registers) against the dK/dV
  kernel ``backward()`` takes at the same shape, same inputs, interleaved ``do_bench`` rounds;
* **accuracy**: dK and dV of both against float64 attention gradients (relative L2), at smaller shapes.

The probe's kernel is not a shipped path: nothing dispatches to it and no record carries it. Its first run (H200,
8241e05: ``results/speed-h200-20261126-dkdv-q64-probe.md``) found 1.01-1.10x the ``ws`` kernel at D=128 and dK's
error against float64 14-19% lower. With ``--fused-dq`` the kernel also accumulates dQ (fp32 atomics), against the
dK/dV and dQ kernels ``backward()`` takes: 0.76-0.77x at D=128 (it spills) and 0.86-0.90x at D=64 (7bb889b,
``results/speed-h200-20261126-dkdv-q64-fused-dq-probe.md``).

Run on the device (Triton 3.6), from the project root after ``pip install -e .``::

    python3 benchmarks/dkdv_q64_probe.py --out $OUT/dkdv-q64-probe.json

and offline, registers and spills for sm_90 without a GPU (``sm90_compile``'s stand-in driver)::

    python benchmarks/dkdv_q64_probe.py --compile-only
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("SAGE_LIGHTNING_GLUON_DKDV", "force")
if "--compile-only" in sys.argv:
    import sm90_compile as offline  # sets a fresh Triton cache before triton is imported

    offline._install()

import torch  # noqa: E402
import triton  # noqa: E402
from sage_lightning.kernels.hopper.gluon_backward import (  # noqa: E402
    BLOCK_N,
    LOAD_REGS,
    _desc,
    _head_chunk_order,
    _int8_codes,
    _int8_scale,
    _int32_scaled,
    _nan_max,
)
from sage_lightning.kernels.hopper.gluon_dkdv_wg import WG_MAXNREG, _wg_loader  # noqa: E402
from sage_lightning.kernels.hopper.gluon_dq import _transpose_k  # noqa: E402
from sage_lightning.kernels.tiles import LOG2E  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

#: Queries per tile of the probe's loop, and the Q / dO quantization block (the forward's and preprocess's).
TILE_M = 64
Q_BLOCK = 128
#: Consumer registers: (168 * 12 - 24 * 4) / 8, as in ``gluon_dkdv_wg``.
CONSUMER_REGS = 240


@gluon.jit
def _probe_compute(
    bufs, bars, total, n_m, lo_tile, row_q0, SEQ_Q, SEQ_K, pid_n, pid_bkv, Q_SCALE, K_SCALE, DO_SCALE, DK, DV,
    DQ_ACC, qk_scale, tau, HALF: gl.constexpr, HEAD_DIM: gl.constexpr, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr,
    Q_BLOCK: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, FUSED_DQ: gl.constexpr,
):  # fmt: skip
    """One consumer warpgroup: its 64 keys against every 64-query tile. P's scale per key over the tile's 64
    queries, one dS scale per 64 x 64 tile, both within the warpgroup; Q'^'s and dO^'s scales per 128 rows.

    ``FUSED_DQ``: also the tile's dQ partial ``int32_scaled(psi(dS) K'^, s_dS s_K)`` over this warpgroup's 64 keys,
    added into the fp32 ``DQ_ACC`` ``[B*H*N, D]`` with relaxed atomics (A = dS's codes stored again with the keys
    contiguous, B = this half's K'^ transposed once per program)."""
    k_all, v_all, q_smem, qt_smem, do_smem, dot_smem, p_all, ds_all, lse_smem, delta_smem, kt_all, dst_all = bufs
    ready, empty, kv_bar = bars
    k_smem = k_all.index(HALF)
    v_smem = v_all.index(HALF)
    p_smem = p_all.index(HALF)
    ds_smem = ds_all.index(HALF)
    kt_smem = kt_all.index(HALF)
    dst_smem = dst_all.index(HALF)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE_M, 32]
    )
    dp_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE_M, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 32]
    )
    key_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    query_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    acc_row_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
    acc_col_l: gl.constexpr = gl.SliceLayout(0, acc_layout)
    DQ_COLS: gl.constexpr = 32
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ_COLS, 32]
    )
    dq_row_l: gl.constexpr = gl.SliceLayout(1, dq_layout)
    dq_col_l: gl.constexpr = gl.SliceLayout(0, dq_layout)
    dq_zero = gl.zeros([TILE_M, DQ_COLS], gl.int32, dq_layout)

    q_blocks = gl.cdiv(SEQ_Q, Q_BLOCK)
    k_blocks = gl.cdiv(SEQ_K, BLOCK_N)
    key_block = pid_n * 2 + HALF
    key0 = key_block * BLOCK_N
    bh0 = row_q0 // SEQ_Q
    k_scale = gl.load(K_SCALE + pid_bkv * k_blocks + key_block)
    offs_key = key0 + gl.arange(0, BLOCK_N, layout=key_l)
    offs_q_tile = gl.arange(0, TILE_M, layout=query_l)
    s_zero = gl.zeros([BLOCK_N, TILE_M], gl.int32, s_layout)
    dp_zero = gl.zeros([BLOCK_N, TILE_M], gl.float32, dp_layout)
    acc_zero = gl.zeros([BLOCK_N, HEAD_DIM], gl.int32, acc_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    if FUSED_DQ:
        # dQ's B operand, K'^ K-major over the keys: this half's tile transposed once for the whole program.
        _transpose_k(k_smem, kt_smem, HEAD_DIM, 4)

    for t in range(total):
        stage = t % STAGES
        g = t // n_m
        start_m = (lo_tile + t % n_m) * TILE_M
        bh = bh0 + g
        offs_q = start_m + offs_q_tile
        q_scale = gl.load(Q_SCALE + bh * q_blocks + start_m // Q_BLOCK)
        do_scale = gl.load(DO_SCALE + bh * q_blocks + start_m // Q_BLOCK)

        mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
        s_tok = warpgroup_mma(k_smem, q_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_int = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
        lse = lse_smem.index(stage).load(query_l)
        p = gl.exp2(_int32_scaled(s_int, q_scale * k_scale * qk_scale) - lse[None, :])
        if CAUSAL:
            if start_m < key0 + BLOCK_N - 1:
                p = gl.where(offs_key[:, None] > offs_q[None, :], 0.0, p)
        p_scale = _int8_scale(_nan_max(p, 1))
        p_smem.store(_int8_codes(p, p_scale[:, None]))
        dp_tok = warpgroup_mma(v_smem, do_smem.index(stage).permute((1, 0)), dp_zero, use_acc=False, is_async=True)
        delta = delta_smem.index(stage).load(query_l)
        dp = gl.convert_layout(warpgroup_mma_wait(num_outstanding=0, deps=[dp_tok]), s_layout)
        ds = p * (dp - delta[None, :])
        ds_scale = _int8_scale(_nan_max(_nan_max(gl.abs(ds), 1), 0))
        ds_codes = _int8_codes(ds, ds_scale)
        ds_smem.store(ds_codes)
        if FUSED_DQ:
            dst_smem.store(gl.permute(ds_codes, (1, 0)))
        fence_async_shared()
        gl.thread_barrier()
        # One [64, D] int32 product in flight at a time (with dK and dV that is 192 registers per thread at D=128).
        dv_tok = warpgroup_mma(p_smem, dot_smem.index(stage).permute((1, 0)), acc_zero, use_acc=False, is_async=True)
        dv_int = warpgroup_mma_wait(num_outstanding=0, deps=[dv_tok])
        dv += _int32_scaled(dv_int, gl.convert_layout(p_scale, acc_row_l)[:, None] * do_scale)
        dk_tok = warpgroup_mma(ds_smem, qt_smem.index(stage).permute((1, 0)), acc_zero, use_acc=False, is_async=True)
        dk_int = warpgroup_mma_wait(num_outstanding=0, deps=[dk_tok])
        dk += _int32_scaled(dk_int, ds_scale * q_scale)
        if FUSED_DQ:
            # In column chunks of DQ_COLS: a [64, D] fp32 partial with its 64-bit addresses would not fit beside dK
            # and dV.
            dq_c = ds_scale * k_scale
            q_rows = bh * SEQ_Q + start_m + gl.arange(0, TILE_M, layout=dq_row_l)
            for c in gl.static_range(HEAD_DIM // DQ_COLS):
                b_tile = kt_smem.slice(c * DQ_COLS, DQ_COLS, dim=0).permute((1, 0))
                dq_tok = warpgroup_mma(dst_smem, b_tile, dq_zero, use_acc=False, is_async=True)
                dq_int = warpgroup_mma_wait(num_outstanding=0, deps=[dq_tok])
                q_cols = c * DQ_COLS + gl.arange(0, DQ_COLS, layout=dq_col_l)
                gl.atomic_add(
                    DQ_ACC + q_rows[:, None] * HEAD_DIM + q_cols[None, :], _int32_scaled(dq_int, dq_c), sem="relaxed"
                )
        gl.thread_barrier()
        mbarrier.arrive(empty.index(stage), count=1)

    rows = key0 + gl.arange(0, BLOCK_N, layout=acc_row_l)
    cols = gl.arange(0, HEAD_DIM, layout=acc_col_l)
    out = (pid_bkv * SEQ_K + rows)[:, None] * HEAD_DIM + cols[None, :]
    io_dtype: gl.constexpr = DK.dtype.element_ty
    gl.store(DK + out, (dk * tau).to(io_dtype))
    gl.store(DV + out, dv.to(io_dtype))


@gluon.jit
def _probe_kernel(
    desc_q, desc_qt, desc_k, desc_v, desc_do, desc_dot, desc_lse, desc_delta, Q_SCALE, K_SCALE, DO_SCALE, DK, DV,
    DQ_ACC, BKV, HEADS, GROUP, SEQ_Q, SEQ_K, qk_scale, tau, HEAD_DIM: gl.constexpr, TILE_M: gl.constexpr,
    BLOCK_N: gl.constexpr, Q_BLOCK: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    HEAD_CHUNK: gl.constexpr, LOAD_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, FUSED_DQ: gl.constexpr,
):  # fmt: skip
    pid_n, pid_bkv = _head_chunk_order(gl.program_id(0), SEQ_K // (2 * BLOCK_N), BKV, HEAD_CHUNK)
    kv_heads = HEADS // GROUP
    b = pid_bkv // kv_heads
    lo_tile = 0
    if CAUSAL:
        lo_tile = pid_n * 2 * BLOCK_N // TILE_M
    n_m = gl.cdiv(SEQ_Q, TILE_M) - lo_tile
    total = GROUP * n_m
    bh0 = b * HEADS + (pid_bkv % kv_heads) * GROUP
    row_q0 = bh0 * SEQ_Q
    col_t0 = bh0 * HEAD_DIM
    kv_row = pid_bkv * SEQ_K + pid_n * 2 * BLOCK_N

    codes_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, TILE_M], gl.int8)
    k_smem = gl.allocate_shared_memory(desc_k.dtype, [2] + desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(desc_v.dtype, [2] + desc_v.block_type.shape, desc_v.layout)
    q_smem = gl.allocate_shared_memory(desc_q.dtype, [STAGES] + desc_q.block_type.shape, desc_q.layout)
    qt_smem = gl.allocate_shared_memory(desc_qt.dtype, [STAGES] + desc_qt.block_type.shape, desc_qt.layout)
    do_smem = gl.allocate_shared_memory(desc_do.dtype, [STAGES] + desc_do.block_type.shape, desc_do.layout)
    dot_smem = gl.allocate_shared_memory(desc_dot.dtype, [STAGES] + desc_dot.block_type.shape, desc_dot.layout)
    lse_smem = gl.allocate_shared_memory(desc_lse.dtype, [STAGES] + desc_lse.block_type.shape, desc_lse.layout)
    delta_smem = gl.allocate_shared_memory(desc_delta.dtype, [STAGES] + desc_delta.block_type.shape, desc_delta.layout)
    p_smem = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N, TILE_M], codes_layout)
    ds_smem = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N, TILE_M], codes_layout)
    kt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_N], gl.int8)
    dst_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_M, BLOCK_N], gl.int8)
    if FUSED_DQ:
        kt_smem = gl.allocate_shared_memory(gl.int8, [2, HEAD_DIM, BLOCK_N], kt_layout)
        dst_smem = gl.allocate_shared_memory(gl.int8, [2, TILE_M, BLOCK_N], dst_layout)
    else:
        kt_smem = p_smem  # unused
        dst_smem = p_smem
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    mbarrier.init(kv_bar, count=1)
    fence_async_shared()

    descs = (desc_q, desc_qt, desc_k, desc_v, desc_do, desc_dot, desc_lse, desc_delta)
    load_bufs = (k_smem, v_smem, q_smem, qt_smem, do_smem, dot_smem, p_smem, ds_smem, lse_smem, delta_smem)
    bufs = (k_smem, v_smem, q_smem, qt_smem, do_smem, dot_smem, p_smem, ds_smem, lse_smem, delta_smem, kt_smem,
            dst_smem)  # fmt: skip
    bars = (ready, empty, kv_bar)
    gl.warp_specialize(
        [
            (_probe_compute, (bufs, bars, total, n_m, lo_tile, row_q0, SEQ_Q, SEQ_K, pid_n, pid_bkv, Q_SCALE, K_SCALE,
                              DO_SCALE, DK, DV, DQ_ACC, qk_scale, tau, 0, HEAD_DIM, TILE_M, BLOCK_N, Q_BLOCK, STAGES,
                              CAUSAL, FUSED_DQ)),
            (_probe_compute, (bufs, bars, total, n_m, lo_tile, row_q0, SEQ_Q, SEQ_K, pid_n, pid_bkv, Q_SCALE, K_SCALE,
                              DO_SCALE, DK, DV, DQ_ACC, qk_scale, tau, 1, HEAD_DIM, TILE_M, BLOCK_N, Q_BLOCK, STAGES,
                              CAUSAL, FUSED_DQ)),
            # gluon_dkdv_wg's load warp, its tile TILE_M queries.
            (_wg_loader, (descs, load_bufs, bars, total, n_m, lo_tile, row_q0, col_t0, kv_row, SEQ_Q, HEAD_DIM, TILE_M,
                             STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOAD_REGS],
    )  # fmt: skip


def probe_dkdv(x: dict, causal: bool, tau: float, stages: int = 3, fused_dq: bool = False) -> tuple:
    """dK and dV of the probe's kernel on ``gluon_dkdv_check.inputs``' tensors (keys a multiple of 128); with
    ``fused_dq`` also dQ, accumulated in fp32 by the same launch and converted to bf16 after (as cuDNN's
    ``convert_dq_to_16bits``)."""
    q_op, k_op, do = x["q_op"], x["k_op"], x["do"]
    batch, heads, seq_q, head_dim = q_op.shape
    kv_heads, seq_k = k_op.shape[1], k_op.shape[2]
    dk = torch.empty(batch, kv_heads, seq_k, head_dim, dtype=do.dtype, device=do.device)
    dv = torch.empty_like(dk)
    dq_acc = torch.zeros(q_op.shape, dtype=torch.float32, device=do.device) if fused_dq else dk
    bh, bkv = batch * heads, batch * kv_heads
    rows_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    desc_lse, desc_delta = (
        TensorDescriptor.from_tensor(t.reshape(bh * seq_q), [TILE_M], rows_layout) for t in (x["lse"], x["delta"])
    )
    _probe_kernel[(seq_k // (2 * BLOCK_N) * bkv,)](
        _desc(q_op, bh * seq_q, head_dim, [TILE_M, head_dim]),
        _desc(x["q_op_t"], bh * head_dim, seq_q, [head_dim, TILE_M]),
        _desc(k_op, bkv * seq_k, head_dim, [BLOCK_N, head_dim]),
        _desc(x["v"], bkv * seq_k, head_dim, [BLOCK_N, head_dim]),
        _desc(do, bh * seq_q, head_dim, [TILE_M, head_dim]),
        _desc(x["do_codes_t"], bh * head_dim, seq_q, [head_dim, TILE_M]),
        desc_lse, desc_delta, x["q_scale"], x["k_scale"], x["do_scale"], dk, dv, dq_acc,
        bkv, heads, heads // kv_heads, seq_q, seq_k, tau * LOG2E, tau,
        HEAD_DIM=head_dim, TILE_M=TILE_M, BLOCK_N=BLOCK_N, Q_BLOCK=Q_BLOCK, STAGES=stages, CAUSAL=causal,
        HEAD_CHUNK=16 if head_dim == 64 else 8, LOAD_REGS=LOAD_REGS, CONSUMER_REGS=CONSUMER_REGS,
        FUSED_DQ=fused_dq, num_warps=4, maxnreg=WG_MAXNREG,
    )  # fmt: skip
    if fused_dq:
        return dk, dv, (dq_acc * tau).to(do.dtype)
    return dk, dv


def float64_grads(raw: dict, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dK, dV and dQ of plain attention in float64 on the same inputs (GQA by repeating K and V)."""
    q, k, v, do = (raw[n].double() for n in ("q", "k", "v", "do"))
    group = q.shape[1] // k.shape[1]
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ kr.transpose(-1, -2)) * raw["tau"]
    if causal:
        n, nk = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, nk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    (torch.softmax(s, -1) @ vr).backward(do)
    return k.grad, v.grad, q.grad


def compile_only() -> int:
    """Compile the probe's kernel for sm_90 offline (D=64 and 128, causal or not) and print registers and spills."""
    failures = 0
    for head_dim in (128, 64):
        x = offline.backward_inputs(1, 2, 2, 1024, head_dim)
        x["do"] = x["grad_out"]
        for causal, fused in ((False, False), (True, False), (False, True), (True, True)):
            offline._CASE["name"] = f"q64{'+dq' if fused else ''} D={head_dim} causal={causal}"
            try:
                probe_dkdv(x, causal, head_dim**-0.5, fused_dq=fused)
            except Exception as error:  # noqa: BLE001 - reported, the other cases go on
                failures += 1
                print(f"{offline._CASE['name']}: {type(error).__name__}: {error}"[:4000])
    offline.report_gluon_compile(f"Triton {triton.__version__}, sm_90 offline", None, False, case_width=30)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 offline, print resources")
    parser.add_argument(
        "--fused-dq", action="store_true",
        help="the probe's kernel also accumulates dQ (fp32 atomics), against the dK/dV and dQ kernels backward() takes",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.compile_only:
        return compile_only()
    import functools

    from accuracy import _commit, _versions, to_json
    from device_check import rel_l2
    from gluon_dkdv_check import gluon, inputs
    from sage_lightning.kernels.hopper import gluon_dkdv_wg as wg
    from sage_lightning.kernels.hopper.gluon_dq import gluon_dq
    from sage_lightning.kernels.hopper.gluon_dq_wg import gluon_dq_wg
    from triton.testing import do_bench

    names = ("dk", "dv", "dq") if args.fused_dq else ("dk", "dv")

    def current(x: dict, causal: bool, tau: float, variant: str) -> tuple:
        dkdv = gluon(x, causal, tau, None, variant)
        if not args.fused_dq:
            return dkdv
        dq_fn = gluon_dq_wg if x["q_op"].shape[-1] == 64 else gluon_dq
        dq = dq_fn(x["do"], x["delta"], x["q_op"], x["q_scale"], x["k_op"], x["k_scale"], x["v"], x["lse"],
                   is_causal=causal, scale=tau)  # fmt: skip
        return (*dkdv, dq)

    rows = []
    accuracy_shapes = [(1, 4, 4, 2048, 2048, 128), (1, 8, 2, 1024, 1024, 128), (1, 4, 4, 2048, 2048, 64)]
    timed_shapes = [(4, 16, 16, 4096, 4096, 128), (8, 16, 16, 2048, 2048, 128), (2, 16, 16, 8192, 8192, 128),
                    (8, 10, 10, 4096, 4096, 64)]  # fmt: skip
    for shape in accuracy_shapes + timed_shapes:
        timed = shape in timed_shapes
        for causal in (False, True):
            x, raw = inputs(shape, causal)
            tau = raw["tau"]
            variant = "wg" if wg.gluon_dkdv_wg_serves(shape[-1], shape[4]) else "ws"
            row = {"shape": list(shape), "causal": causal, "current": variant}
            cur = current(x, causal, tau, variant)
            new = probe_dkdv(x, causal, tau, fused_dq=args.fused_dq)
            for name, a, b in zip(names, new, cur, strict=True):
                a32, b32 = a.float(), b.float()
                row[f"{name}_finite"] = bool(torch.isfinite(a32).all())
                row[f"{name}_cos_vs_current"] = round(torch.nn.functional.cosine_similarity(
                    a32.flatten(), b32.flatten(), dim=0).item(), 7)  # fmt: skip
            if not timed:
                ref = float64_grads(raw, causal)
                for name, a, b, r in zip(names, new, cur, ref[: len(names)], strict=True):
                    row[f"{name}_rel_l2_probe"] = round(rel_l2(a, r), 6)
                    row[f"{name}_rel_l2_current"] = round(rel_l2(b, r), 6)
            else:
                run_probe = functools.partial(probe_dkdv, x, causal, tau, fused_dq=args.fused_dq)
                run_current = functools.partial(current, x, causal, tau, variant)
                probe_ms, cur_ms = [], []
                for _ in range(3):
                    probe_ms.append(do_bench(run_probe, warmup=25, rep=200))
                    cur_ms.append(do_bench(run_current, warmup=25, rep=200))
                row.update(probe_ms=round(min(probe_ms), 4), current_ms=round(min(cur_ms), 4),
                           probe_all=[round(v, 4) for v in probe_ms],
                           current_all=[round(v, 4) for v in cur_ms])  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    print("\n| shape (B,H,Hkv,N,Nk,D) | causal | current | probe ms | current ms | current / probe | "
          + " | ".join(f"{n} rel L2 vs fp64 probe / current" for n in names) + " |")  # fmt: skip
    print("|---|:-:|:-:|---:|---:|---:|" + "---:|" * len(names))
    for r in rows:
        speed = (f"{r['probe_ms']:.3f} | {r['current_ms']:.3f} | {r['current_ms'] / r['probe_ms']:.3f}x"
                 if "probe_ms" in r else "- | - | -")  # fmt: skip
        acc = " | ".join("-" for _ in names)
        if "dk_rel_l2_probe" in r:
            acc = " | ".join(f"{r[f'{n}_rel_l2_probe']:.5f} / {r[f'{n}_rel_l2_current']:.5f}" for n in names)
        print(f"| {tuple(r['shape'])} | {'yes' if r['causal'] else 'no'} | {r['current']} | {speed} | {acc} |")
    if args.out:
        result = {"kind": "speed", "device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                  "commit": _commit(),
                  "command": " ".join(["python3 benchmarks/dkdv_q64_probe.py", *(argv or sys.argv[1:])]),
                  "versions": _versions(), "rows": rows}  # fmt: skip
        args.out.write_text(to_json(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
