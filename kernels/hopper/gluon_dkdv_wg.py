"""Gluon dK/dV kernel of SageBwd for Hopper (sm_90) with one warpgroup per 64 keys: the warpgroups run apart.

The numerics are :mod:`.gluon_backward`'s (and ``_dkdv_kernel``'s), tile for tile: P's codes per key over a
tile's 128 queries, one dS scale per 64-key x 128-query tile, the same int32 products summed in the same order;
dK and dV are bit for bit the same. What changes is who computes what:

* :mod:`.gluon_backward` gives a program 64 keys and splits each ``[64 keys, 128 queries]`` tile between its two
  consumer warpgroups by queries. P's per-key scale and dS's tile scale are then reductions across both
  warpgroups, through shared memory and CTA-wide barriers (eleven ``BAR.SYNC`` in its loop at D=64): the warpgroups
  run in lockstep and the tensor cores idle while both quantize.
* Here a program holds 128 keys, and each consumer warpgroup owns one 64-key half against all 128 queries of
  every tile. P's scale is a reduction within a thread quad (shuffles), dS's scale one within the warpgroup; the
  two warpgroups share only the TMA ring (each releases a stage on its own), so one quantizes while the other's
  products run. Each Q'^, Q'^T, dO, dO^T tile read from L2 serves 128 keys instead of 64.

The cost is registers: a warpgroup holds the whole ``[64, 128]`` S^T and dP^T (64 each per thread) and the
queries' lse and delta (32 each), so the variant serves D=64 only (its dK and dV are 32 registers each; at
D=128 they would be 64 and the consumers would spill). Key counts must be multiples of 128. lse and delta come
through the TMA ring with the tile (512 bytes each per stage) rather than as 64 global loads per thread: 1.08-1.14x
on the device (``benchmarks/NOTES.md``, device run 7).

Design, offline figures and the device results: ``benchmarks/NOTES.md`` (device run 7) and
``benchmarks/results/speed-h100-20261124-gluon-dkdv-wg.md``.
"""

from __future__ import annotations

import torch

from ..tiles import LOG2E
from .gluon_backward import BLOCK_M, BLOCK_N, HAVE_GLUON, LOAD_REGS, _desc, _rows_desc

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .gluon_backward import _ROUNDER, _head_chunk_order, _int8_codes, _int8_scale, _int32_scaled, _nan_max

#: Keys per program: one 64-key half (:data:`.gluon_backward.BLOCK_N`, the K quantization block) per warpgroup.
KEYS_PER_PROGRAM = 2 * BLOCK_N
#: Head dims it serves (register budget: see the module's docstring).
HEAD_DIMS = (64,)
#: kv heads per chunk of the grid's order (:func:`.gluon_backward._head_chunk_order`; at D=64 and N=4096 a query
#: head's Q'^, Q'^T, dO and dO^T codes take 1.25 MiB, so 16 kv heads without GQA stay in L2). Measured on an H100
#: against one head at a time: 1.07-1.16x causal, 1.04-1.07x non-causal (both take it).
HEAD_CHUNK = 16
#: The launch's register cap: 12 warps (two consumer warpgroups and the load warp's warpgroup) at 168 each;
#: after the load warpgroup drops to :data:`.gluon_backward.LOAD_REGS` each consumer holds 240.
WG_MAXNREG = 168
#: Registers per thread of the second consumer warpgroup (a worker partition, so its count is set explicitly;
#: the first, the default partition, gets the same from what the others leave).
CONSUMER_REGS = 240


if HAVE_GLUON:

    @gluon.jit
    def _wg_loader(
        descs, bufs, bars, total, n_m, lo_tile, row_q0, col_t0, kv_row, SEQ_Q,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        """The load partition (one warp): both halves of K'^ and V once, then every iteration's Q'^, Q'^T, dO and
        dO^T tiles into the ring, each stage refilled once both consumer warpgroups have released it."""
        desc_q, desc_qt, desc_k, desc_v, desc_do, desc_dot, desc_lse, desc_delta = descs
        k_smem, v_smem, q_smem, qt_smem, do_smem, dot_smem, p_smem, ds_smem, lse_smem, delta_smem = bufs
        ready, empty, kv_bar = bars
        half: gl.constexpr = desc_k.block_type.shape[0]
        mbarrier.expect(kv_bar, 2 * (desc_k.block_type.nbytes + desc_v.block_type.nbytes))
        for h in gl.static_range(2):
            tma.async_copy_global_to_shared(desc_k, [kv_row + h * half, 0], kv_bar, k_smem.index(h))
            tma.async_copy_global_to_shared(desc_v, [kv_row + h * half, 0], kv_bar, v_smem.index(h))
        nbytes: gl.constexpr = (
            desc_q.block_type.nbytes + desc_qt.block_type.nbytes + desc_do.block_type.nbytes
            + desc_dot.block_type.nbytes + desc_lse.block_type.nbytes + desc_delta.block_type.nbytes
        )  # fmt: skip
        for t in range(total):
            s = t % STAGES
            # A fresh mbarrier counts as having completed the phase before its first: the first pass of the
            # ring does not wait.
            mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
            g = t // n_m
            start_m = (lo_tile + t % n_m) * BLOCK_M
            row = row_q0 + g * SEQ_Q + start_m
            row_t = col_t0 + g * HEAD_DIM
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(desc_q, [row, 0], bar, q_smem.index(s))
            tma.async_copy_global_to_shared(desc_qt, [row_t, start_m], bar, qt_smem.index(s))
            tma.async_copy_global_to_shared(desc_do, [row, 0], bar, do_smem.index(s))
            tma.async_copy_global_to_shared(desc_dot, [row_t, start_m], bar, dot_smem.index(s))
            tma.async_copy_global_to_shared(desc_lse, [row], bar, lse_smem.index(s))
            tma.async_copy_global_to_shared(desc_delta, [row], bar, delta_smem.index(s))

    @gluon.jit
    def _wg_compute(
        descs, bufs, bars, total, n_m, lo_tile, row_q0, SEQ_Q, SEQ_K, pid_n, pid_bkv,
        Q_SCALE, K_SCALE, DO_SCALE, DK, DV, STATS, qk_scale, tau,
        HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, WITH_STATS: gl.constexpr,
    ):  # fmt: skip
        """One consumer warpgroup: keys ``HALF * 64`` to ``HALF * 64 + 63`` of the program's 128 against every
        query tile; its dK and dV rows to global memory at the end."""
        k_all, v_all, q_smem, qt_smem, do_smem, dot_smem, p_all, ds_all, lse_smem, delta_smem = bufs
        ready, empty, kv_bar = bars
        k_smem = k_all.index(HALF)
        v_smem = v_all.index(HALF)
        p_smem = p_all.index(HALF)
        ds_smem = ds_all.index(HALF)
        # One warpgroup: its 4 warps split the 64 keys' rows; a row's 128 queries lie in one thread quad.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 32]
        )
        dp_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 32]
        )
        key_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        query_l: gl.constexpr = gl.SliceLayout(0, s_layout)
        acc_row_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
        acc_col_l: gl.constexpr = gl.SliceLayout(0, acc_layout)

        m_blocks = gl.cdiv(SEQ_Q, BLOCK_M)
        k_blocks = gl.cdiv(SEQ_K, BLOCK_N)
        key_block = pid_n * 2 + HALF
        key0 = key_block * BLOCK_N
        bh0 = row_q0 // SEQ_Q
        k_scale = gl.load(K_SCALE + pid_bkv * k_blocks + key_block)

        offs_key = key0 + gl.arange(0, BLOCK_N, layout=key_l)
        offs_q_tile = gl.arange(0, BLOCK_M, layout=query_l)
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.int32, s_layout)
        dp_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, dp_layout)
        acc_zero = gl.zeros([BLOCK_N, HEAD_DIM], gl.int32, acc_layout)
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        err2 = gl.zeros([BLOCK_N], gl.float32, key_l)
        norm2 = gl.zeros([BLOCK_N], gl.float32, key_l)
        mbarrier.wait(kv_bar, 0)

        for t in range(total):
            stage = t % STAGES
            g = t // n_m
            m_block = lo_tile + t % n_m
            start_m = m_block * BLOCK_M
            bh = bh0 + g
            offs_q = start_m + offs_q_tile
            q_scale = gl.load(Q_SCALE + bh * m_blocks + m_block)
            do_scale = gl.load(DO_SCALE + bh * m_blocks + m_block)

            mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
            # S^T = K'^ Q'^T (int32). dP^T's product is issued after P's codes are stored: with both accumulators
            # in flight beside lse, dK and dV the warpgroup would need more than its 240 registers (the other
            # warpgroup keeps the tensor cores busy meanwhile).
            s_tok = warpgroup_mma(k_smem, q_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_int = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
            # lse and delta of the tile's queries came with its tiles through the TMA ring.
            lse = lse_smem.index(stage).load(query_l)
            p = gl.exp2(_int32_scaled(s_int, q_scale * k_scale * qk_scale) - lse[None, :])
            if CAUSAL:
                # A tile whose first query comes before this half's last key holds masked scores (top-left).
                if start_m < key0 + BLOCK_N - 1:
                    p = gl.where(offs_key[:, None] > offs_q[None, :], 0.0, p)
            # P's codes, one scale per key over the tile's 128 queries (within the thread quad that holds the row).
            p_scale = _int8_scale(_nan_max(p, 1))
            p_smem.store(_int8_codes(p, p_scale[:, None]))
            dp_tok = warpgroup_mma(v_smem, do_smem.index(stage).permute((1, 0)), dp_zero, use_acc=False, is_async=True)
            delta = delta_smem.index(stage).load(query_l)
            dp = gl.convert_layout(warpgroup_mma_wait(num_outstanding=0, deps=[dp_tok]), s_layout)
            ds = p * (dp - delta[None, :])
            # One dS scale for this half's 64 x 128 tile (within the warpgroup).
            ds_scale = _int8_scale(_nan_max(_nan_max(gl.abs(ds), 1), 0))
            ds_smem.store(_int8_codes(ds, ds_scale))
            if WITH_STATS:
                err = ds - ((ds / ds_scale + _ROUNDER) - _ROUNDER) * ds_scale
                err2 += gl.sum(err * err, axis=1)
                norm2 += gl.sum(ds * ds, axis=1)
            fence_async_shared()
            gl.thread_barrier()
            # dV and dK: A = the codes [64 keys, 128 queries], B = dO^ and Q'^ (K-major, [D, 128]).
            dv_tok = warpgroup_mma(
                p_smem, dot_smem.index(stage).permute((1, 0)), acc_zero, use_acc=False, is_async=True
            )
            dk_tok = warpgroup_mma(
                ds_smem, qt_smem.index(stage).permute((1, 0)), acc_zero, use_acc=False, is_async=True
            )
            dv_int = warpgroup_mma_wait(num_outstanding=1, deps=[dv_tok])
            p_scale_acc = gl.convert_layout(p_scale, acc_row_l)
            dv += _int32_scaled(dv_int, p_scale_acc[:, None] * do_scale)
            dk_int = warpgroup_mma_wait(num_outstanding=0, deps=[dk_tok])
            dk += _int32_scaled(dk_int, ds_scale * q_scale)
            # The warpgroup is done with its codes and with this stage before it overwrites the one or hands
            # the other back (the load warp refills a stage once both warpgroups have).
            gl.thread_barrier()
            mbarrier.arrive(empty.index(stage), count=1)

        rows = key0 + gl.arange(0, BLOCK_N, layout=acc_row_l)
        cols = gl.arange(0, HEAD_DIM, layout=acc_col_l)
        out = (pid_bkv * SEQ_K + rows)[:, None] * HEAD_DIM + cols[None, :]
        io_dtype: gl.constexpr = DK.dtype.element_ty
        gl.store(DK + out, (dk * tau).to(io_dtype))
        gl.store(DV + out, dv.to(io_dtype))
        if WITH_STATS:
            gl.atomic_add(STATS, gl.sum(err2, axis=0))
            gl.atomic_add(STATS + 1, gl.sum(norm2, axis=0))

    @gluon.jit
    def _gluon_dkdv_wg_kernel(
        desc_q, desc_qt, desc_k, desc_v, desc_do, desc_dot, desc_lse, desc_delta,
        Q_SCALE, K_SCALE, DO_SCALE, DK, DV, STATS,
        BKV, HEADS, GROUP, SEQ_Q, SEQ_K, qk_scale, tau,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, WITH_STATS: gl.constexpr, HEAD_CHUNK: gl.constexpr, LOAD_REGS: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
    ):  # fmt: skip
        # Causal: program 0 of a head (its first keys) sees every query tile, the longest first.
        pid_n, pid_bkv = _head_chunk_order(gl.program_id(0), SEQ_K // (2 * BLOCK_N), BKV, HEAD_CHUNK)
        kv_heads = HEADS // GROUP
        b = pid_bkv // kv_heads
        m_blocks = gl.cdiv(SEQ_Q, BLOCK_M)
        lo_tile = 0
        if CAUSAL:
            # Query tiles that end before this program's first key see none of its keys.
            lo_tile = pid_n * 2 * BLOCK_N // BLOCK_M
        n_m = m_blocks - lo_tile
        total = GROUP * n_m
        bh0 = b * HEADS + (pid_bkv % kv_heads) * GROUP
        row_q0 = bh0 * SEQ_Q
        col_t0 = bh0 * HEAD_DIM
        kv_row = pid_bkv * SEQ_K + pid_n * 2 * BLOCK_N

        # Shared memory: both halves of K'^ and V, a STAGES-deep ring of Q'^, Q'^T, dO, dO^T tiles, each
        # warpgroup's codes.
        codes_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], gl.int8)
        k_smem = gl.allocate_shared_memory(desc_k.dtype, [2] + desc_k.block_type.shape, desc_k.layout)
        v_smem = gl.allocate_shared_memory(desc_v.dtype, [2] + desc_v.block_type.shape, desc_v.layout)
        q_smem = gl.allocate_shared_memory(desc_q.dtype, [STAGES] + desc_q.block_type.shape, desc_q.layout)
        qt_smem = gl.allocate_shared_memory(desc_qt.dtype, [STAGES] + desc_qt.block_type.shape, desc_qt.layout)
        do_smem = gl.allocate_shared_memory(desc_do.dtype, [STAGES] + desc_do.block_type.shape, desc_do.layout)
        dot_smem = gl.allocate_shared_memory(desc_dot.dtype, [STAGES] + desc_dot.block_type.shape, desc_dot.layout)
        lse_smem = gl.allocate_shared_memory(desc_lse.dtype, [STAGES] + desc_lse.block_type.shape, desc_lse.layout)
        delta_smem = gl.allocate_shared_memory(
            desc_delta.dtype, [STAGES] + desc_delta.block_type.shape, desc_delta.layout
        )
        p_smem = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N, BLOCK_M], codes_layout)
        ds_smem = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N, BLOCK_M], codes_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            # Released by both consumer warpgroups.
            mbarrier.init(empty.index(i), count=2)
        mbarrier.init(kv_bar, count=1)
        fence_async_shared()

        descs = (desc_q, desc_qt, desc_k, desc_v, desc_do, desc_dot, desc_lse, desc_delta)
        bufs = (k_smem, v_smem, q_smem, qt_smem, do_smem, dot_smem, p_smem, ds_smem, lse_smem, delta_smem)
        bars = (ready, empty, kv_bar)
        gl.warp_specialize(
            [
                (
                    _wg_compute,
                    (descs, bufs, bars, total, n_m, lo_tile, row_q0, SEQ_Q, SEQ_K, pid_n, pid_bkv, Q_SCALE, K_SCALE,
                     DO_SCALE, DK, DV, STATS, qk_scale, tau, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                     CAUSAL, WITH_STATS),
                ),
                (
                    _wg_compute,
                    (descs, bufs, bars, total, n_m, lo_tile, row_q0, SEQ_Q, SEQ_K, pid_n, pid_bkv, Q_SCALE, K_SCALE,
                     DO_SCALE, DK, DV, STATS, qk_scale, tau, 1, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                     CAUSAL, WITH_STATS),
                ),
                (
                    _wg_loader,
                    (descs, bufs, bars, total, n_m, lo_tile, row_q0, col_t0, kv_row, SEQ_Q, HEAD_DIM, BLOCK_M,
                     STAGES),
                ),
            ],
            [4, 1],
            [CONSUMER_REGS, LOAD_REGS],
        )  # fmt: skip


def gluon_dkdv_wg_serves(head_dim: int, seq_k: int) -> bool:
    """Whether :func:`gluon_dkdv_wg` serves a call :func:`.gluon_backward.gluon_dkdv` serves: head dim
    in :data:`HEAD_DIMS` and a key count that is a multiple of :data:`KEYS_PER_PROGRAM`.

    Example::

        gluon_dkdv_wg_serves(64, 4096)   # True
    """
    return head_dim in HEAD_DIMS and seq_k % KEYS_PER_PROGRAM == 0


def gluon_dkdv_wg(
    grad_out: torch.Tensor,
    delta: torch.Tensor,
    do_codes_t: torch.Tensor,
    do_scale: torch.Tensor,
    q_op: torch.Tensor,
    q_op_t: torch.Tensor,
    q_scale: torch.Tensor,
    k_op: torch.Tensor,
    k_scale: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    stats: torch.Tensor | None,
    *,
    is_causal: bool,
    scale: float,
    stages: int = 3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dK and dV as :func:`.gluon_backward.gluon_dkdv` returns them, bit for bit, for the calls
    :func:`gluon_dkdv_wg_serves` accepts (arguments as there).

    Args:
        grad_out, delta, do_codes_t, do_scale, q_op, q_op_t, q_scale, k_op, k_scale, v, lse, stats, is_causal,
            scale: as :func:`.gluon_backward.gluon_dkdv`.
        stages: depth of the TMA ring (3 at D=64: 40 KiB per stage beside 56 KiB of K, V and codes).

    Returns:
        ``(dK, dV)`` ``[B, Hkv, Nk, D]`` bf16, contiguous.

    Example::

        dk, dv = gluon_dkdv_wg(grad_out, delta, codes_t, dscale, q_op, q_op_t, q_scale, k_op, k_scale, v, lse,
                               None, is_causal=False, scale=0.125)
    """
    batch, heads, seq_q, head_dim = q_op.shape
    kv_heads, seq_k = k_op.shape[1], k_op.shape[2]
    if not gluon_dkdv_wg_serves(head_dim, seq_k):
        raise ValueError(
            f"gluon_dkdv_wg: serves head_dim in {HEAD_DIMS} and seq_k a multiple of {KEYS_PER_PROGRAM}; "
            f"received head_dim={head_dim}, seq_k={seq_k}"
        )
    do = grad_out if grad_out.is_contiguous() else grad_out.contiguous()
    dk = torch.empty(batch, kv_heads, seq_k, head_dim, dtype=grad_out.dtype, device=grad_out.device)
    dv = torch.empty_like(dk)
    bh, bkv = batch * heads, batch * kv_heads
    desc_q = _desc(q_op, bh * seq_q, head_dim, [BLOCK_M, head_dim])
    desc_qt = _desc(q_op_t, bh * head_dim, seq_q, [head_dim, BLOCK_M])
    desc_k = _desc(k_op, bkv * seq_k, head_dim, [BLOCK_N, head_dim])
    desc_v = _desc(v, bkv * seq_k, head_dim, [BLOCK_N, head_dim])
    desc_do = _desc(do, bh * seq_q, head_dim, [BLOCK_M, head_dim])
    desc_dot = _desc(do_codes_t, bh * head_dim, seq_q, [head_dim, BLOCK_M])
    desc_lse, desc_delta = (_rows_desc(x, bh * seq_q) for x in (lse, delta))
    _gluon_dkdv_wg_kernel[(seq_k // KEYS_PER_PROGRAM * bkv,)](
        desc_q, desc_qt, desc_k, desc_v, desc_do, desc_dot, desc_lse, desc_delta,
        q_scale, k_scale, do_scale, dk, dv, stats if stats is not None else delta,
        bkv, heads, heads // kv_heads, seq_q, seq_k, scale * LOG2E, scale,
        HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=stages, CAUSAL=is_causal,
        WITH_STATS=stats is not None, HEAD_CHUNK=HEAD_CHUNK, LOAD_REGS=LOAD_REGS, CONSUMER_REGS=CONSUMER_REGS,
        num_warps=4, maxnreg=WG_MAXNREG,
    )  # fmt: skip
    return dk, dv
