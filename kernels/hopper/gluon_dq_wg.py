"""Gluon dQ kernel of SageBwd for Hopper (sm_90) with one warpgroup per 128-query block: the warpgroups run apart.

The numerics are :mod:`.gluon_dq`'s (and ``_dq_kernel``'s), tile for tile: one dS scale per 128-query x 64-key
tile, the same int32 products, added into dQ in the same order of key tiles; dQ is bit for bit the same. What
changes is who computes what, as :mod:`.gluon_dkdv_wg` did for dK and dV:

* :mod:`.gluon_dq` gives a program 128 queries and splits each ``[128 queries, 64 keys]`` tile between its two
  consumer warpgroups by queries. The dS tile scale is then a reduction across both warpgroups (shared memory and
  CTA-wide barriers), so they run in lockstep and the tensor cores idle while both quantize.
* Here a program holds two query blocks (256 queries of one head), and each consumer warpgroup owns one block's
  128 queries against every key tile. The dS scale is a reduction within the warpgroup; the two warpgroups share
  only the TMA ring of ``K'^`` and ``V`` tiles (each releases a stage on its own, ``empty`` counts two arrivals), so
  one quantizes while the other's products run, and each key tile read from L2 serves 256 queries. The producer
  warpgroup of :mod:`.gluon_dq` (:func:`.gluon_dq._dq_producer`) loads the ring and copies each tile's K'^ transposed
  into a ``[D, 64]`` buffer (two in turn) that both warpgroups read as the dQ product's B operand (K-major over the
  keys); ``empty`` counts three arrivals (both warpgroups and the producer), ``kt_empty`` two.

The cost is registers: a warpgroup holds the whole ``[128, 64]`` S and dP (64 each per thread) and its ``[128, D]``
dQ accumulator (64 at D=64), so the variant serves D=64 only (at D=128 dQ alone would take 128). Causal: the lower
block's warpgroup needs two key tiles fewer than the upper's; it waits for their transposition and hands them back
unread. With
an odd number of query blocks the last program's upper warpgroup has no block: it hands every tile back and
writes nothing.

Design and the device results: ``benchmarks/NOTES.md`` (device run 8).
"""

from __future__ import annotations

import torch

from ..tiles import LOG2E
from .gluon_common import HAVE_GLUON, dq_operands
from .gluon_dkdv_wg import WG_MAXNREG
from .gluon_dq import BLOCK_M, BLOCK_N, PRODUCER_REGS

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

    from .gluon_common import (
        _dq_block,
        _dq_ds_codes,
        _dq_ds_values,
        _dq_smem,
        _dq_store,
        _head_chunk_order,
        _int32_scaled,
        _wgmma_layout,
    )
    from .gluon_dq import _dq_producer

#: Queries per program: one 128-query block (the Q and dO quantization block) per warpgroup.
QUERIES_PER_PROGRAM = 2 * BLOCK_M
#: Head dims it serves (register budget: see the module's docstring).
HEAD_DIMS = (64,)
#: Query heads per chunk of the grid's order for causal calls (:func:`.gluon_common._head_chunk_order`; 16 heads'
#: K'^, K'^T and V at D=64 and N=4096 are 16 MiB, inside L2). Measured on an H100 against one head at a time:
#: 1.07-1.25x causal; non-causal calls keep one head at a time (0.98-1.00x with chunks).
HEAD_CHUNK = 16
#: Registers per thread of the second consumer warpgroup (a worker partition, so its count is set explicitly; the
#: first, the default partition, gets what the others leave of :data:`.gluon_dkdv_wg.WG_MAXNREG` over 12 warps:
#: (168 * 12 - 232 * 4 - 40 * 4) / 4 = 232 with the producer warpgroup's :data:`.gluon_dq.PRODUCER_REGS`).
CONSUMER_REGS = 232


if HAVE_GLUON:

    @gluon.jit
    def _dqwg_compute(
        bufs, bars, n_tiles, pid_pair, bh, kv_bh, Q_SCALE, K_SCALE, LSE, DELTA, DQ, SEQ_Q, SEQ_K, qk_scale, tau,
        HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, DS_FMT: gl.constexpr,
    ):  # fmt: skip
        """One consumer warpgroup: query block ``2 * pid_pair + HALF`` against its key tiles (the first ``mine`` of
        the ring's ``n_tiles``), then its dQ rows to global memory. Each tile's K'^ comes transposed from the
        producer warpgroup (``kt_ready``), one copy for both warpgroups. With a non-INT8 ``DS_FMT`` (:mod:`.gluon_dq`'s
        numerics for it) the producer widens K'^ to bf16 instead and the dQ product runs in bf16, dS's operand from
        registers."""
        q_all, do_all, k_smem, kt_smem, v_smem = bufs
        ready, empty, q_bar, kt_ready, kt_empty = bars
        q_smem = q_all.index(HALF)
        do_smem = do_all.index(HALF)
        # One warpgroup: its 4 warps split the 128 queries' rows (two m64 repetitions); a row's 64 keys lie in one
        # thread quad.
        s_layout: gl.constexpr = _wgmma_layout(4, 1, BLOCK_N, 32)
        dp_layout: gl.constexpr = _wgmma_layout(4, 1, BLOCK_N, 16)
        acc_layout: gl.constexpr = _wgmma_layout(4, 1, HEAD_DIM, 32)
        # The dS codes as the dQ product's A operand in registers: 4 int8 per 32-bit register.
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4)
        # A non-INT8 dS: the dQ product in bf16 (k16 instructions), dS's bf16 operand from registers.
        hp_layout: gl.constexpr = _wgmma_layout(4, 1, HEAD_DIM, 16)
        hp_a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=hp_layout, k_width=2)

        m_blocks = gl.cdiv(SEQ_Q, BLOCK_M)
        k_blocks = gl.cdiv(SEQ_K, BLOCK_N)
        m_block = 2 * pid_pair + HALF
        live = m_block < m_blocks
        # key_range() of this block: the key tiles below hi are visited, those from full_hi on masked.
        hi = SEQ_K
        full_hi = SEQ_K
        if CAUSAL:
            hi = gl.minimum(SEQ_K, (m_block + 1) * BLOCK_M)
            full_hi = gl.minimum(SEQ_K, m_block * BLOCK_M)
        mine = hi // BLOCK_N
        if not live:
            mine = 0
        m_safe = gl.minimum(m_block, m_blocks - 1)
        offs_m, _, q_scale, lse, delta, s_zero, dp_zero, acc_zero, dq = _dq_block(
            m_safe, bh, Q_SCALE, LSE, DELTA, SEQ_Q, m_blocks, s_layout, dp_layout, acc_layout, BLOCK_M, BLOCK_N,
            HEAD_DIM,
        )  # fmt: skip
        mbarrier.wait(q_bar, 0)

        for t in range(mine):
            stage = t % STAGES
            start_n = t * BLOCK_N
            k_scale = gl.load(K_SCALE + kv_bh * k_blocks + t)
            mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
            # S = Q'^ K'^T (int32) and dP = dO V^T (fp32), both in flight at once; B = K'^ and V as stored
            # [64, D] read as [D, 64] (K-major over D).
            s_tok = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(do_smem, v_smem.index(stage).permute((1, 0)), dp_zero, use_acc=False, is_async=True)
            # P, dS and its codes; one dS scale for the 128 x 64 tile (within the warpgroup). The keys' offsets are
            # made in the masked branch (None), not held through the loop: here they would spill.
            if DS_FMT == "int8":
                ds_scale, codes = _dq_ds_codes(
                    s_tok, dp_tok, q_scale * k_scale * qk_scale, lse, delta, offs_m, None, start_n, full_hi, s_layout,
                    BLOCK_N, CAUSAL,
                )  # fmt: skip
            else:
                ds_scale, codes = _dq_ds_values(
                    s_tok, dp_tok, q_scale * k_scale * qk_scale, lse, delta, offs_m, None, start_n, full_hi, s_layout,
                    BLOCK_N, CAUSAL, DS_FMT,
                )  # fmt: skip
            kt_tile = kt_smem.index(t % 2)
            mbarrier.wait(kt_ready.index(t % 2), (t // 2) & 1)
            if DS_FMT == "int8":
                # dQ of the tile: A = the codes [128 queries, 64 keys] from registers, B = K'^ [64 keys, D] read from
                # its transposed [D, 64] copy (K-major over the keys).
                dq_tok = warpgroup_mma(
                    gl.convert_layout(codes, a_layout), kt_tile.permute((1, 0)), acc_zero, use_acc=False,
                    is_async=True,
                )  # fmt: skip
                dq_int = warpgroup_mma_wait(num_outstanding=0, deps=[dq_tok])
                dq += _int32_scaled(dq_int, ds_scale * k_scale)
            else:
                # bf16: A = dS's operand from registers, B = K'^ widened [64 keys, D] as stored.
                dq_tok = warpgroup_mma(
                    gl.convert_layout(codes, hp_a_layout), kt_tile,
                    gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, hp_layout), use_acc=False, is_async=True,
                )  # fmt: skip
                dq_acc = gl.convert_layout(warpgroup_mma_wait(num_outstanding=0, deps=[dq_tok]), acc_layout)
                if DS_FMT == "bf16":
                    dq += dq_acc * k_scale
                else:
                    dq += dq_acc * (ds_scale * k_scale)
            # The warpgroup is done with this stage and the transposed tile before it hands them back (the
            # producer refills a stage, or transposes into a buffer, once both warpgroups have).
            gl.thread_barrier()
            mbarrier.arrive(empty.index(stage), count=1)
            mbarrier.arrive(kt_empty.index(t % 2), count=1)
        # The ring's tiles this block does not read (the upper block's last diagonal tiles, or all of them when
        # this warpgroup has no block): wait for each one's transposition (which follows its load), so the
        # releases count towards its own phases, and hand both back.
        for t in range(mine, n_tiles):
            mbarrier.wait(kt_ready.index(t % 2), (t // 2) & 1)
            mbarrier.arrive(empty.index(t % STAGES), count=1)
            mbarrier.arrive(kt_empty.index(t % 2), count=1)

        if live:
            _dq_store(dq, m_block, bh, SEQ_Q, DQ, tau, acc_layout, HEAD_DIM, BLOCK_M)

    @gluon.jit
    def _gluon_dq_wg_kernel(
        desc_q, desc_do, desc_k, desc_v,
        Q_SCALE, K_SCALE, LSE, DELTA, DQ,
        BH, HEADS, GROUP, SEQ_Q, SEQ_K, qk_scale, tau,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, HEAD_CHUNK: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        DS_FMT: gl.constexpr = "int8",
    ):  # fmt: skip
        m_blocks = gl.cdiv(SEQ_Q, BLOCK_M)
        n_pairs = gl.cdiv(m_blocks, 2)
        pid_pair, bh = _head_chunk_order(gl.program_id(0), n_pairs, BH, HEAD_CHUNK)
        if CAUSAL:
            # The longest query blocks (most key tiles) first, so the short ones fill the tail of the grid.
            pid_pair = n_pairs - 1 - pid_pair
        b = bh // HEADS
        head = bh % HEADS
        kv_bh = b * (HEADS // GROUP) + head // GROUP
        # The ring carries the key tiles of the upper block (the lower one reads a prefix of them), or of the lower
        # block when the upper one is past the last query.
        upper = gl.minimum(2 * pid_pair + 1, m_blocks - 1)
        hi = SEQ_K
        if CAUSAL:
            hi = gl.minimum(SEQ_K, (upper + 1) * BLOCK_M)
        n_tiles = hi // BLOCK_N
        q_row = bh * SEQ_Q + 2 * pid_pair * BLOCK_M
        kv_row0 = kv_bh * SEQ_K

        # Shared memory: both blocks' Q'^ and dO, a STAGES-deep ring of K'^ and V tiles, two transposed K'^ tiles.
        # A stage is released by both consumer warpgroups and by the producer once it has transposed the stage's
        # K'^; a transposed tile by both consumer warpgroups.
        smem, bars = _dq_smem(
            desc_q, desc_do, desc_k, desc_v, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, 2, 2, True, 3, 2, DS_FMT != "int8"
        )
        bufs = (smem[0], smem[1], smem[2], smem[3], smem[4])  # no dS codes buffer: they stay in registers
        descs = (desc_q, desc_do, desc_k, desc_v)
        gl.warp_specialize(
            [
                (
                    _dqwg_compute,
                    (bufs, bars, n_tiles, pid_pair, bh, kv_bh, Q_SCALE, K_SCALE, LSE, DELTA, DQ, SEQ_Q, SEQ_K,
                     qk_scale, tau, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, DS_FMT),
                ),
                (
                    _dqwg_compute,
                    (bufs, bars, n_tiles, pid_pair, bh, kv_bh, Q_SCALE, K_SCALE, LSE, DELTA, DQ, SEQ_Q, SEQ_K,
                     qk_scale, tau, 1, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, DS_FMT),
                ),
                (
                    _dq_producer,
                    (descs, bufs, bars, n_tiles, q_row, kv_row0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, 2,
                     DS_FMT != "int8"),
                ),
            ],
            [4, 4],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


def gluon_dq_wg_serves(head_dim: int) -> bool:
    """Whether :func:`gluon_dq_wg` serves a call :func:`.gluon_dq.gluon_dq` serves: head dim in
    :data:`HEAD_DIMS`.

    Example::

        gluon_dq_wg_serves(64)   # True
    """
    return head_dim in HEAD_DIMS


def gluon_dq_wg(
    grad_out: torch.Tensor,
    delta: torch.Tensor,
    q_op: torch.Tensor,
    q_scale: torch.Tensor,
    k_op: torch.Tensor,
    k_scale: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
    stages: int = 4,
    ds_fmt: str = "int8",
) -> torch.Tensor:
    """dQ as :func:`.gluon_dq.gluon_dq` returns it, bit for bit, for the calls :func:`gluon_dq_wg_serves` accepts
    (arguments as there).

    Args:
        grad_out, delta, q_op, q_scale, k_op, k_scale, v, lse, is_causal, scale: as
            :func:`.gluon_dq.gluon_dq`.
        stages: depth of the TMA ring of key tiles, at least 2 (12 KiB each at D=64, beside 48 KiB of Q'^ and dO
            and 8 KiB of transposed K'^ tiles).
        ds_fmt: dS's format, as :func:`.gluon_dq.gluon_dq`'s (``"fp8"`` and ``"bf16"``: K'^ widened to bf16, 16 KiB).

    Returns:
        dQ ``[B, Hq, N, D]`` bf16, contiguous.

    Raises:
        ValueError: a head dim it does not serve, ``stages`` below 2, or a ``ds_fmt`` it does not take.

    Example::

        dq = gluon_dq_wg(grad_out, delta, q_op, q_scale, k_op, k_scale, v, lse, is_causal=True, scale=0.125)
    """
    batch, heads, seq_q, head_dim = q_op.shape
    kv_heads, seq_k = k_op.shape[1], k_op.shape[2]
    if not gluon_dq_wg_serves(head_dim):
        raise ValueError(f"gluon_dq_wg: serves head_dim in {HEAD_DIMS}; received head_dim={head_dim}")
    if ds_fmt not in ("int8", "fp8", "bf16"):
        raise ValueError(f"gluon_dq_wg: ds_fmt must be 'int8', 'fp8' or 'bf16'; received {ds_fmt!r}")
    if stages < 2:
        raise ValueError(f"gluon_dq_wg: stages must be at least 2 (the producer refills a stage one tile late); "
                         f"received stages={stages}")  # fmt: skip
    descs, dq = dq_operands(grad_out, q_op, k_op, v, BLOCK_M, BLOCK_N)
    bh = batch * heads
    n_pairs = (seq_q // BLOCK_M + 1) // 2
    _gluon_dq_wg_kernel[(n_pairs * bh,)](
        *descs, q_scale, k_scale, lse, delta, dq, bh, heads, heads // kv_heads, seq_q, seq_k, scale * LOG2E, scale,
        HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=stages, CAUSAL=is_causal,
        HEAD_CHUNK=HEAD_CHUNK if is_causal else 1,
        PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=CONSUMER_REGS,
        **({} if ds_fmt == "int8" else {"DS_FMT": ds_fmt}),
        num_warps=4, maxnreg=WG_MAXNREG,
    )  # fmt: skip
    return dq
