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

dS in FP8 or bf16 (``DS_FMT``, issue 42: the precision the controller escalates a layer to) takes
:mod:`.gluon_backward`'s numerics for those formats: dS^T's e4m3 codes (one scale per tile) widened to bf16, or dS
rounded to bf16, as the A operand of a bf16 wgmma with fp32 accumulation whose B operand is the tile's Q'^ codes
in bf16 (exact); no Q'^T is loaded. The backward's preprocess launch writes Q'^ in bf16 once (``q_wide``, N x D x 2
bytes per query head) and its tile comes through the TMA ring beside Q'^'s codes (``Q_WIDE``: 16 KiB more per stage
at D=64, 8 KiB less without Q'^T; dS^T's bf16 tiles take 8 KiB more per warpgroup). Without that copy each warpgroup
widens the tile's codes into a buffer of its own (the two run apart; 16 KiB each), 160 more instructions per
iteration and spills (offline sm_90 compile, ``benchmarks/NOTES.md``).

Design, offline figures and the device results: ``benchmarks/NOTES.md`` (device run 7) and
``benchmarks/results/speed-h100-20261124-gluon-dkdv-wg.md``.
"""

from __future__ import annotations

import torch

from ..tiles import LOG2E
from .gluon_backward import BLOCK_M, BLOCK_N, LOAD_REGS
from .gluon_common import HAVE_GLUON, dkdv_operands

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

    from .gluon_common import (
        _dkdv_accumulate,
        _dkdv_accumulate_hp,
        _dkdv_loader,
        _dkdv_products,
        _dkdv_products_hp,
        _dkdv_program,
        _dkdv_smem,
        _dkdv_store,
        _dkdv_tile,
        _dkdv_zeros,
        _ds_codes,
        _ds_values,
        _p_codes,
        _p_codes_lean,
        _wgmma_layout,
        _widen_codes,
    )

#: Keys per program: one 64-key half (:data:`.gluon_backward.BLOCK_N`, the K quantization block) per warpgroup.
KEYS_PER_PROGRAM = 2 * BLOCK_N
#: Head dims it serves (register budget: see the module's docstring).
HEAD_DIMS = (64,)
#: kv heads per chunk of the grid's order (:func:`.gluon_common._head_chunk_order`; at D=64 and N=4096 a query
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
    def _wg_compute(
        descs, bufs, bars, total, n_m, lo_tile, row_q0, SEQ_Q, SEQ_K, pid_n, pid_bkv,
        Q_SCALE, K_SCALE, DO_SCALE, DK, DV, STATS, qk_scale, tau,
        HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, WITH_STATS: gl.constexpr, DS_FMT: gl.constexpr,
        Q_WIDE: gl.constexpr,
    ):  # fmt: skip
        """One consumer warpgroup: keys ``HALF * 64`` to ``HALF * 64 + 63`` of the program's 128 against every
        query tile; its dK and dV rows to global memory at the end. With a non-INT8 ``DS_FMT`` dK's product runs in
        bf16 against the tile's Q'^ in bf16: from the ring with ``Q_WIDE``, else widened by the warpgroup into its
        own buffer before the tile's S is issued."""
        k_all, v_all, q_smem, qt_smem, do_smem, dot_smem, p_all, ds_all, lse_smem, delta_smem = bufs
        ready, empty, kv_bar = bars
        k_smem = k_all.index(HALF)
        v_smem = v_all.index(HALF)
        p_smem = p_all.index(HALF)
        ds_smem = ds_all.index(HALF)
        if DS_FMT != "int8" and not Q_WIDE:
            qb_smem = qt_smem.index(HALF)  # this half's Q'^ widened to bf16 (no Q'^T ring)
        # One warpgroup: its 4 warps split the 64 keys' rows; a row's 128 queries lie in one thread quad.
        s_layout: gl.constexpr = _wgmma_layout(4, 1, BLOCK_M, 32)
        dp_layout: gl.constexpr = _wgmma_layout(4, 1, BLOCK_M, 16)
        acc_layout: gl.constexpr = _wgmma_layout(4, 1, HEAD_DIM, 32)
        key_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        query_l: gl.constexpr = gl.SliceLayout(0, s_layout)
        acc_row_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
        # A non-INT8 dS: dK's bf16 product (k16 instructions), its fp32 accumulator.
        hp_layout: gl.constexpr = _wgmma_layout(4, 1, HEAD_DIM, 16)

        m_blocks = gl.cdiv(SEQ_Q, BLOCK_M)
        k_blocks = gl.cdiv(SEQ_K, BLOCK_N)
        key_block = pid_n * 2 + HALF
        key0 = key_block * BLOCK_N
        bh0 = row_q0 // SEQ_Q
        k_scale = gl.load(K_SCALE + pid_bkv * k_blocks + key_block)

        offs_key = key0 + gl.arange(0, BLOCK_N, layout=key_l)
        offs_q_tile = gl.arange(0, BLOCK_M, layout=query_l)
        s_zero, dp_zero, acc_zero, dk, dv, err2, norm2 = _dkdv_zeros(
            s_layout, dp_layout, acc_layout, key_l, BLOCK_N, BLOCK_M, HEAD_DIM
        )
        mbarrier.wait(kv_bar, 0)

        for t in range(total):
            stage = t % STAGES
            start_m, offs_q, q_scale, do_scale = _dkdv_tile(
                t, n_m, lo_tile, bh0, m_blocks, offs_q_tile, Q_SCALE, DO_SCALE, BLOCK_M
            )

            mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
            if DS_FMT != "int8" and not Q_WIDE:
                # Q'^ widened to bf16 (dK's B operand; this warpgroup's dK product of the tile before was waited for
                # at its end), while few registers are live: before S's accumulator.
                _widen_codes(q_smem.index(stage), qb_smem, BLOCK_M, HEAD_DIM, 4, 8)
            # S^T = K'^ Q'^T (int32). dP^T's product is issued after P's codes are stored: with both accumulators
            # in flight beside lse, dK and dV the warpgroup would need more than its 240 registers (the other
            # warpgroup keeps the tensor cores busy meanwhile).
            s_tok = warpgroup_mma(k_smem, q_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_int = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
            # lse and delta of the tile's queries came with its tiles through the TMA ring.
            lse = lse_smem.index(stage).load(query_l)
            # P's codes (its per-key scale within the thread quad that holds the row). Causal: a tile whose first
            # query comes before this half's last key holds masked scores (top-left).
            masked = start_m < key0 + BLOCK_N - 1
            if DS_FMT == "int8":
                p, p_scale = _p_codes(
                    s_int, q_scale * k_scale * qk_scale, lse, p_smem, offs_key, offs_q, masked, CAUSAL
                )
            else:
                p, p_scale = _p_codes_lean(
                    s_int, q_scale * k_scale * qk_scale, lse, p_smem, offs_key, start_m, masked, CAUSAL, BLOCK_M,
                    query_l,
                )  # fmt: skip
            dp_tok = warpgroup_mma(v_smem, do_smem.index(stage).permute((1, 0)), dp_zero, use_acc=False, is_async=True)
            delta = delta_smem.index(stage).load(query_l)
            dp = gl.convert_layout(warpgroup_mma_wait(num_outstanding=0, deps=[dp_tok]), s_layout)
            # One dS scale for this half's 64 x 128 tile (within the warpgroup).
            if DS_FMT == "int8":
                ds_scale, err2, norm2 = _ds_codes(p, dp, delta, ds_smem, err2, norm2, WITH_STATS)
                dv_tok, dk_tok = _dkdv_products(p_smem, ds_smem, dot_smem.index(stage), qt_smem.index(stage), acc_zero)
                dv, dk = _dkdv_accumulate(dv_tok, dk_tok, dv, dk, p_scale, do_scale, ds_scale, q_scale, acc_row_l)
            else:
                ds_scale, err2, norm2 = _ds_values(p, dp, delta, ds_smem, err2, norm2, WITH_STATS, DS_FMT)
                if Q_WIDE:
                    qb_tile = qt_smem.index(stage)  # the preprocess's bf16 copy of Q'^, through the ring
                else:
                    qb_tile = qb_smem
                dv_tok, dk_tok = _dkdv_products_hp(
                    p_smem, ds_smem, dot_smem.index(stage), qb_tile, acc_zero,
                    gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, hp_layout),
                )  # fmt: skip
                dv, dk = _dkdv_accumulate_hp(
                    dv_tok, dk_tok, dv, dk, p_scale, do_scale, ds_scale, q_scale, acc_layout, DS_FMT
                )
            # The warpgroup is done with its codes and with this stage before it overwrites the one or hands
            # the other back (the load warp refills a stage once both warpgroups have).
            gl.thread_barrier()
            mbarrier.arrive(empty.index(stage), count=1)
        _dkdv_store(
            dk, dv, err2, norm2, key0, pid_bkv, SEQ_K, DK, DV, STATS, tau, acc_layout, HEAD_DIM, BLOCK_N, WITH_STATS
        )

    @gluon.jit
    def _gluon_dkdv_wg_kernel(
        desc_q, desc_qt, desc_k, desc_v, desc_do, desc_dot, desc_lse, desc_delta,
        Q_SCALE, K_SCALE, DO_SCALE, DK, DV, STATS,
        BKV, HEADS, GROUP, SEQ_Q, SEQ_K, qk_scale, tau,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, WITH_STATS: gl.constexpr, HEAD_CHUNK: gl.constexpr, LOAD_REGS: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, DS_FMT: gl.constexpr = "int8", Q_WIDE: gl.constexpr = False,
    ):  # fmt: skip
        # Two 64-key halves per program (_dkdv_program: the grid's order, the query tiles it walks).
        pid_n, pid_bkv, lo_tile, n_m, total, row_q0, col_t0, kv_row = _dkdv_program(
            BKV, HEADS, GROUP, SEQ_Q, SEQ_K, HEAD_DIM, BLOCK_M, 2 * BLOCK_N, CAUSAL, HEAD_CHUNK
        )
        # Shared memory: both halves of K'^ and V, a STAGES-deep ring of Q'^, Q'^T, dO, dO^T tiles, each
        # warpgroup's codes; a stage is released by both consumer warpgroups.
        descs = (desc_q, desc_qt, desc_k, desc_v, desc_do, desc_dot, desc_lse, desc_delta)
        bufs, bars = _dkdv_smem(
            desc_q, desc_qt, desc_k, desc_v, desc_do, desc_dot, desc_lse, desc_delta, BLOCK_M, BLOCK_N, STAGES, 2,
            DS_FMT != "int8", Q_WIDE,  # an FP8 or bf16 dS's product: Q'^ in bf16, a ring or one buffer per half
        )  # fmt: skip
        gl.warp_specialize(
            [
                (
                    _wg_compute,
                    (descs, bufs, bars, total, n_m, lo_tile, row_q0, SEQ_Q, SEQ_K, pid_n, pid_bkv, Q_SCALE, K_SCALE,
                     DO_SCALE, DK, DV, STATS, qk_scale, tau, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                     CAUSAL, WITH_STATS, DS_FMT, Q_WIDE),
                ),
                (
                    _wg_compute,
                    (descs, bufs, bars, total, n_m, lo_tile, row_q0, SEQ_Q, SEQ_K, pid_n, pid_bkv, Q_SCALE, K_SCALE,
                     DO_SCALE, DK, DV, STATS, qk_scale, tau, 1, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                     CAUSAL, WITH_STATS, DS_FMT, Q_WIDE),
                ),
                (
                    _dkdv_loader,
                    (descs, bufs, bars, total, n_m, lo_tile, row_q0, col_t0, kv_row, SEQ_Q, HEAD_DIM, BLOCK_M,
                     STAGES, 2, DS_FMT == "int8" or Q_WIDE, Q_WIDE),
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
    ds_fmt: str = "int8",
    q_wide: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dK and dV as :func:`.gluon_backward.gluon_dkdv` returns them, bit for bit, for the calls
    :func:`gluon_dkdv_wg_serves` accepts (arguments as there).

    Args:
        grad_out, delta, do_codes_t, do_scale, q_op, q_op_t, q_scale, k_op, k_scale, v, lse, stats, is_causal,
            scale: as :func:`.gluon_backward.gluon_dkdv`.
        stages: depth of the TMA ring (3 at D=64: 40 KiB per stage beside 56 KiB of K, V and codes; with a non-INT8
            dS and ``q_wide`` 49 KiB per stage beside 72 KiB, without ``q_wide`` 33 KiB per stage beside 104 KiB).
        ds_fmt: dS's format, as :func:`.gluon_backward.gluon_dkdv`'s: ``"int8"``; ``"fp8"`` or ``"bf16"``, whose dK
            product runs in bf16 against Q'^'s codes in bf16 (``q_op_t`` is not read).
        q_wide: with a non-INT8 ``ds_fmt``, Q'^ widened to bf16, ``[B, Hq, N, D]`` contiguous (``backward``'s
            ``widen_q``: the preprocess launch writes it), loaded through the TMA ring beside Q'^; ``None``: each
            warpgroup widens every tile's codes in shared memory (the same dK and dV, more instructions).

    Returns:
        ``(dK, dV)`` ``[B, Hkv, Nk, D]`` bf16, contiguous.

    Raises:
        ValueError: a call :func:`gluon_dkdv_wg_serves` refuses, a ``ds_fmt`` it does not take, or a ``q_wide`` with
            an INT8 dS or not of Q'^'s shape in bf16, contiguous.

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
    if ds_fmt not in ("int8", "fp8", "bf16"):
        raise ValueError(f"gluon_dkdv_wg: ds_fmt must be 'int8', 'fp8' or 'bf16'; received {ds_fmt!r}")
    if q_wide is not None and (
        ds_fmt == "int8" or q_wide.dtype != torch.bfloat16 or q_wide.shape != q_op.shape or not q_wide.is_contiguous()
    ):
        raise ValueError(
            f"gluon_dkdv_wg: q_wide must be Q'^ in bf16 {tuple(q_op.shape)}, contiguous, with ds_fmt 'fp8' or 'bf16'; "
            f"received {q_wide.dtype} {tuple(q_wide.shape)}, contiguous={q_wide.is_contiguous()}, ds_fmt={ds_fmt!r}"
        )
    q_op_t = q_op_t if ds_fmt == "int8" else None  # Q'^ in bf16 (q_wide, or widened in the kernel) stands in
    descs, dk, dv = dkdv_operands(
        grad_out, delta, do_codes_t, q_op, q_op_t, k_op, v, lse, BLOCK_M, BLOCK_N, q_wide=q_wide
    )
    bkv = batch * kv_heads
    _gluon_dkdv_wg_kernel[(seq_k // KEYS_PER_PROGRAM * bkv,)](
        *descs, q_scale, k_scale, do_scale, dk, dv, stats if stats is not None else delta,
        bkv, heads, heads // kv_heads, seq_q, seq_k, scale * LOG2E, scale,
        HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=stages, CAUSAL=is_causal,
        WITH_STATS=stats is not None, HEAD_CHUNK=HEAD_CHUNK, LOAD_REGS=LOAD_REGS, CONSUMER_REGS=CONSUMER_REGS,
        **({} if ds_fmt == "int8" else {"DS_FMT": ds_fmt}), **({} if q_wide is None else {"Q_WIDE": True}),
        num_warps=4, maxnreg=WG_MAXNREG,
    )  # fmt: skip
    return dk, dv
