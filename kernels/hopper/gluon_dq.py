"""Gluon (``triton.experimental.gluon``) dQ kernel of SageBwd for Hopper (sm_90): TMA loads, async wgmma.

``backward.backward`` calls it for the dQ work where the plan (:func:`..plan.plan_attention`) takes it (by default
on a verified Hopper from :data:`AUTO_MIN_SCORES` scores, where it was measured faster); every other call keeps
the portable ``_dq_kernel``. Its first GPU run (H100, Triton 3.6) found it bitwise equal to ``_dq_kernel`` in every
case and 1.20x its time at N=4096, D=128 (``benchmarks/results/speed-h100-20261123-gluon-dq-crossover.md``).

The numerics are ``_dq_kernel``'s (:mod:`..backward`) for SageBwd's default formats (INT8 ``QK`` and ``dS``; ``dP``
in bf16; no Q-smoothing), tile for tile and in the same order of tile additions:

* ``S = int32_scaled(Q'^ K'^T, s_Q s_K tau log2(e))`` from the int32 product, ``P = exp2(S - lse)`` (zero above the
  diagonal on the causal diagonal tiles, top-left);
* ``dP = dO V^T`` in bf16 with fp32 accumulation, ``dS = P (dP - delta)``;
* ``dQ += int32_scaled(psi(dS) K'^, s_dS s_K)``, one dS scale per 128-query x 64-key tile; ``dQ`` times ``tau``
  at the end.

The orientation is ``_dq_kernel``'s: a program owns 128 queries of one query head and holds ``S`` and ``dP``
``[128 queries, 64 keys]`` over two warpgroups (``warps_per_cta=[8, 1]``: each warpgroup its 64 queries against
the tile's 64 keys, wgmma m64n64). The dS tile scale (a max over the whole tile) is a reduction across both
warpgroups (through shared memory), so both see the same scale. The dS codes are the A operand of the dQ
product, either from registers (``codes_in_registers``, the default: each warpgroup's own 64 rows, no shared-
memory round trip) or from an 8 KiB shared tile; B is ``K'^`` K-major over the keys as 8-bit wgmma requires
(m64nDk32). TMA does not transpose, so each ``K'^ [64, D]`` tile is copied into a ``[D, 64]`` shared buffer through
registers (``_transpose_k``): by a producer warpgroup in the warp-specialised kernel, off the consumers' path (two
buffers in turn, ``kt_ready``/``kt_empty`` mbarriers), or by the consumers themselves while S and dP run in the
one-partition kernel. No ``[D, Nk]`` copy of K'^ is made in global memory (it was 32 MiB at 16K tokens, D=128, and
a launch per backward).

dS in FP8 or bf16 (``DS_FMT``, issue 42) keeps ``_dq_kernel``'s numerics for those formats: dS's e4m3 codes (one scale
per tile), or for bf16 ``dS_K = P fma(dP, s_K, -(delta s_K))`` (dS times K's tile scale) rounded to bf16, from
registers, as the A operand of a bf16 wgmma with fp32 accumulation whose B operand is K'^'s INT8 codes widened to bf16
(exact) in shared memory, in place of the transposition (16-bit wgmma reads B as stored), then ``dQ += acc * s_dS
s_K`` (FP8); a bf16 dS's product adds into dQ inside the tensor core (dQ is its accumulator: no scaling, no second
accumulator; 20-23% fewer loop instructions at D=128 offline), and with two consumer warpgroups it stays in flight
until the next tile's S is waited for.

Per program: Q'^ and dO ``[128, D]`` once, then every key tile (``BLOCK_N = 64``) of the kv head the query head
reads (GQA: ``head // group``) up to the causal limit, through a ``STAGES``-deep ring of ``K'^ [64, D]`` and
``V [64, D]`` tiles with ``ready``/``empty`` mbarriers. Variants: warp-specialised (default: ``gl.warp_specialize``,
the two consumer warpgroups at 232 registers and the producer warpgroup, TMA loads and transpositions, at 40) or
one 8-warp partition that also issues the loads. On an H100 the producer's transposition made the kernel 1.10-1.18x
faster than the consumers' own at D=128 (``benchmarks/results/speed-h100-20261126-dq-producer-ab.md``). Design,
offline figures and the device check: ``benchmarks/pending/gluon-dq.md`` and ``benchmarks/NOTES.md``.

One warpgroup per 128-query block (``WG``, the launcher's ``wg=True``; the plan's ``gluon_dq_wg``, D=64 only): the
same numerics, tile for tile (one dS scale per 128-query x 64-key tile, the same int32 products added into dQ in the
same order of key tiles; dQ is bit for bit the same); what changes is who computes what, as :mod:`.gluon_backward`'s
``WG`` does for dK and dV:

* The kernel above gives a program 128 queries and splits each ``[128 queries, 64 keys]`` tile between its two
  consumer warpgroups by queries. The dS tile scale is then a reduction across both warpgroups (shared memory and
  CTA-wide barriers), so they run in lockstep and the tensor cores idle while both quantize.
* With ``WG`` a program holds two query blocks (256 queries of one head), and each consumer warpgroup owns one
  block's 128 queries against every key tile. The dS scale is a reduction within the warpgroup; the two warpgroups
  share only the TMA ring of ``K'^`` and ``V`` tiles (each releases a stage on its own), so one quantizes while the
  other's products run, and each key tile read from L2 serves 256 queries. The producer warpgroup
  (:func:`_dq_producer`) loads the ring and copies each tile's K'^ transposed into a ``[D, 64]`` buffer (two in turn)
  that both warpgroups read as the dQ product's B operand (K-major over the keys); ``empty`` counts three arrivals
  (both warpgroups and the producer), ``kt_empty`` two.

The cost is registers: a warpgroup holds the whole ``[128, 64]`` S and dP (64 each per thread) and its ``[128, D]``
dQ accumulator (64 at D=64), so the variant serves D=64 only (at D=128 dQ alone would take 128). Causal: the lower
block's warpgroup needs two key tiles fewer than the upper's; it waits for their transposition and hands them back
unread. With an odd number of query blocks the last program's upper warpgroup has no block: it hands every tile
back and writes nothing. Design and the device results: ``benchmarks/NOTES.md`` (device run 8).
With a bf16 dS the ``wg`` variant may take three consumer warpgroups of 64 queries (``consumers=3``, by default for
causal calls: :func:`wg_consumers`): 192 queries a program, each warpgroup reading its block's half of Q's 128-row
quantization block and its scale. A bf16 dS's dQ product takes no scale over the tile, so the split changes no
value: each row's products and their order of addition are the two-warpgroup kernel's (bit for bit, device run 34).
Three warpgroups at 152-168 registers (16 warps) give each scheduler three issuing warps instead of two; a 64-query
tile costs 1.33x the instructions a score (offline sm_90: 234 against 351 for 128 queries).
An INT8 dS takes three consumer warpgroups too when the backward has the ``wg`` dK/dV kernel store each tile's dS
scale (``ds_scale``; :func:`.gluon_backward.gluon_dkdv`'s ``ds_scale_out``, one fp32 per query head, 128-query block
and 64-key block): a warpgroup of 64 queries cannot take the max over the tile's 128, and the dK/dV kernel, which runs
first, has it (each of its warpgroups holds 64 keys against all 128 queries of a tile). Each warpgroup reads its
tile's scale with K's and codes dS with it, clamped to +-127 (a last-bit difference between the two kernels' dS
cannot wrap a code); the rest is the bf16 three-warpgroup kernel's. The two kernels compute the same dS (the same
int32 products, scales, exp2 and dP), so the scale is the one the two-warpgroup kernel reduces and dQ is the same
bit for bit. Offline sm_90: 330 loop instructions a 64-query tile against 525 a 128-query one (1.26x a score), no
spills; the dK/dV kernel's store costs it 9-21 instructions of 1,219-1,941.
"""

from __future__ import annotations

import torch
import triton

from ..tiles import GLUON_BLOCK_M, GLUON_BLOCK_N, LOG2E
from .gluon_backward import WG_MAXNREG, WS_MAXNREG
from .gluon_common import HAVE_GLUON, check_ds_scales, dq_operands

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

    from .gluon_common import (
        _dq_block,
        _dq_ds,
        _dq_smem,
        _dq_store,
        _ds_operand,
        _head_chunk_order,
        _int8_codes,
        _int8_codes_clamped,
        _int32_scaled,
        _mma_key_order,
        _tile_scale,
        _view_lays,
        _view_origins,
        _wgmma_layout,
        _widen_codes,
    )

#: Per head dim, the fewest scores (batch x query heads x queries x keys, halved when causal) for which ``auto``
#: takes a Gluon dQ kernel; head dims not listed keep ``_dq_kernel``. Measured on an H100 (whole backward with it
#: against without): at D=128 1.06-1.09x from 2^28 scores, 0.91-1.07x at 2^27 (host-bound there), slower below.
#: At D=64 the calls go to the ``wg`` variant (the two-warpgroup kernel measured 0.78-0.98x there): 1.03-1.05x the
#: whole backward from 2^29 scores (the kernel alone 1.10-1.26x from 2^28; below 2^29 the backward is bound by the
#: host, whose Gluon launch costs more).
AUTO_MIN_SCORES = {128: 2**28, 64: 2**29}
#: Head dims it serves.
HEAD_DIMS = (64, 128)
#: The query tile (the Q and dO quantization block) and key tile it is written for.
BLOCK_M = GLUON_BLOCK_M
BLOCK_N = GLUON_BLOCK_N
#: Per head dim, the query heads per chunk of the grid's order for causal calls
#: (:func:`.gluon_common._head_chunk_order`; the chunk's K'^, K'^T and V, 2 MiB per head at D=128 and N=4096, stay
#: in L2). Measured on an H100 against one head at a time: 1.05-1.07x causal at D=128; non-causal calls keep one
#: head at a time (0.99-1.01x with chunks).
HEAD_CHUNK = {64: 16, 128: 8}
#: Registers per thread of the producer warpgroup (TMA loads and the K'^ transposition: a 64 x D int8 tile is 16
#: registers per thread at D=128). With the launch's cap of :data:`.gluon_backward.WS_MAXNREG` over 12 warps the
#: two consumer warpgroups hold (168 * 12 - 40 * 4) / 8 = 232 each.
PRODUCER_REGS = 40
#: The ``wg`` variant (one warpgroup per 128-query block): queries per program, one block per warpgroup.
WG_QUERIES_PER_PROGRAM = 2 * BLOCK_M
#: Head dims the ``wg`` variant serves (register budget: see the module's docstring).
WG_HEAD_DIMS = (64,)
#: The ``wg`` variant's query heads per chunk of the grid's order for causal calls (16 heads' K'^, K'^T and V at
#: D=64 and N=4096 are 16 MiB, inside L2). Measured on an H100 against one head at a time: 1.07-1.25x causal;
#: non-causal calls keep one head at a time (0.98-1.00x with chunks).
WG_HEAD_CHUNK = 16
#: Registers per thread of the ``wg`` variant's second consumer warpgroup (a worker partition, so its count is set
#: explicitly; the first, the default partition, gets what the others leave of :data:`.gluon_backward.WG_MAXNREG`
#: over 12 warps: (168 * 12 - 232 * 4 - 40 * 4) / 4 = 232 with the producer warpgroup's :data:`PRODUCER_REGS`).
WG_CONSUMER_REGS = 232
#: The ``wg`` variant with three consumer warpgroups (``consumers=3``: a bf16 dS, whose dQ product needs no scale
#: across a 128-query tile, or an INT8 dS with the dK/dV kernel's tile scales): each warpgroup one block of
#: :data:`WG3_ROWS` queries (half of Q's quantization block, whose scale it reads), three a program. Sixteen warps at
#: the launch's cap of :data:`WG3_MAXNREG`: the two worker consumers hold :data:`WG3_CONSUMER_REGS`, the default
#: partition (128 * 16 - 152 * 8 - 40 * 4) / 4 = 168.
WG3_ROWS = 64
WG3_MAXNREG = 128
WG3_CONSUMER_REGS = 152


def wg_consumers(ds_fmt: str, is_causal: bool, ds_scale: bool = False) -> int:
    """The ``wg`` variant's consumer warpgroups when the caller names none: three with a bf16 dS, or for a causal
    call with an INT8 dS whose tile scales the dK/dV kernel stored (``ds_scale``: the caller has them, or
    :func:`..ops` asks whether to have them made), two otherwise. Measured on an H200 (device run 34, bf16 dS, dQ
    bit for bit): three took 1.10-1.11x less time causal (the training shape, B=64, 10/5 heads of 64, N=2048: 1.250
    against 1.125 ms; N=4096) and 0.96x non-causal, where a 64-query block's fixed work a tile (1.33x the loop's
    instructions a score) was not repaid by the third warpgroup's issue slots. Since a bf16 dS's product adds into
    dQ in the tensor core (device run 46), three are faster non-causal too (run 46c, dQ bit for bit: 1.021-1.043x
    at N=2048-8192, ``benchmarks/results/speed-h200-20261129-dq-consumers-35ff07b.md``). INT8 with the scales, on an
    H200 (device run 36c, dQ, dK and dV bit for bit): the dQ kernel 1.135x faster at the training shape and 1.099x at
    N=4096 causal, the dK/dV kernel's scale store 0.979-0.995x, forward+backward 1.03x
    (``benchmarks/results/speed-h200-20261128-dq3-int8-check-aa0a40d.md``).

    Example::

        wg_consumers("bf16", False), wg_consumers("int8", True), wg_consumers("int8", True, ds_scale=True)  # 3, 2, 3
    """
    return 3 if ds_fmt == "bf16" or (is_causal and ds_fmt == "int8" and ds_scale) else 2


if HAVE_GLUON:

    @gluon.jit
    def _issue_kv(
        t, n_tiles, kv_row0, desc_k, desc_v, k_smem, v_smem, ready, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        """TMA loads of key tile ``t`` (K'^ and V) into stage ``t % STAGES``; nothing when ``t >= n_tiles``.
        ``kv_row0``: the kv head's first row in K'^'s ``[B*Hkv*Nk, D]`` view, then its first row and column in V's view
        (:func:`.gluon_common.rows_view`)."""
        s = t % STAGES
        live = t < n_tiles
        start_n = t * BLOCK_N
        bar = ready.index(s)
        nbytes: gl.constexpr = desc_k.block_type.nbytes + desc_v.block_type.nbytes
        mbarrier.expect(bar, nbytes, pred=live)
        tma.async_copy_global_to_shared(desc_k, [kv_row0[0] + start_n, 0], bar, k_smem.index(s), pred=live)
        tma.async_copy_global_to_shared(desc_v, [kv_row0[1] + start_n, kv_row0[2]], bar, v_smem.index(s), pred=live)

    @gluon.constexpr_function
    def _mma_order_layout(keys, head_dim, warps):
        """The layout :func:`_transpose_k` loads a ``[keys, D]`` tile in: each thread 4 dims of keys ``k, k + 1, k + 8,
        k + 9`` (slots ``4 j ... 4 j + 3`` of :data:`..quant.MMA_KEY_ORDER`: one 32-bit store a dim once reordered), a
        warp's lanes 4 x 4 dims and keys ``2, 4, 16`` apart, its warps the dims first, then the keys; what they do not
        cover repeats in registers."""
        regs = [[0, 1], [0, 2], [1, 0], [8, 0]]
        lanes = [[0, 4], [0, 8], [2, 0], [4, 0], [16, 0]]
        warps_k = (warps * 16 + head_dim - 1) // head_dim
        warp_bases = []
        d, n = 16, warps // warps_k
        while n > 1:
            warp_bases.append([0, d])
            d, n = d * 2, n // 2
        kb, n = 32, warps_k
        while n > 1:
            warp_bases.append([kb, 0])
            kb, n = kb * 2, n // 2
        while d < head_dim:
            regs.append([0, d])
            d *= 2
        while kb < keys:
            regs.append([kb, 0])
            kb *= 2
        return gl.DistributedLinearLayout(
            reg_bases=regs, lane_bases=lanes, warp_bases=warp_bases, block_bases=[], shape=[keys, head_dim]
        )

    @gluon.jit
    def _transpose_k(k_tile, kt_tile, HEAD_DIM: gl.constexpr, WARPS: gl.constexpr):
        """``kt_tile [D, 64] = k_tile [64, D]^T`` through registers, by the ``WARPS`` warps that call it (4 or 8),
        visible to the CTA's next wgmma when it returns (the callers' own, or another partition's after an
        mbarrier arrival).

        8-bit wgmma wants its B operand K-major, here over the keys, and TMA copies without transposing: the
        ``[64, D]`` tile the ring brings (D contiguous, as S's product reads it) is stored again with the keys
        contiguous, each 16 in :data:`..quant.MMA_KEY_ORDER` (the dQ kernel's dS codes enter the product in the
        order their accumulator holds them). Each thread holds 4 keys x 4 dims, keys ``k, k + 1, k + 8, k + 9``,
        which that order puts in 4 consecutive slots (32-bit loads along the dims, 32-bit stores along the slots;
        :func:`_mma_order_layout`). Device run 10 modelled the shared-memory wavefronts for 4 consecutive keys a
        thread (a warp's load 4, its store 2: 384 per D=128 tile, against 1,088 for 32 lanes along the dims;
        ``benchmarks/NOTES.md``); this order's lanes span keys 2, 4 and 16 apart instead of 4, 8 and 16."""
        k = k_tile.load(_mma_order_layout(k_tile.shape[0], HEAD_DIM, WARPS))
        # Slot p of each 16 keys holds key MMA_KEY_ORDER[p] (quant.py): the dQ product's A operand, dS's codes, then
        # comes from the registers of dS's accumulator as they are.
        kt_tile.store(gl.permute(_mma_key_order(k, 0), (1, 0)))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _widen_k(k_tile, kb_tile, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, WARPS: gl.constexpr):
        """A non-INT8 dS's :func:`_transpose_k`: ``kb_tile [64, D]`` (bf16) ``= k_tile [64, D]`` (INT8 codes) in
        shared memory, by the ``WARPS`` warps that call it, visible to the CTA's next wgmma when it returns. The
        dQ product's B operand in bf16 needs no transposition (16-bit wgmma reads B in either order), only the
        widening (every INT8 code is a bf16 exactly)."""
        _widen_codes(k_tile, kb_tile, BLOCK_N, HEAD_DIM, WARPS, 16)
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _key_range(m_block, SEQ_K, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
        """``tiles.key_range`` of query block ``m_block`` (``SEQ_K % BLOCK_N == 0``): ``(hi, full_hi)``, the key tiles
        below ``hi`` are visited, those from ``full_hi`` on masked."""
        hi = SEQ_K
        full_hi = SEQ_K
        if CAUSAL:
            hi = gl.minimum(SEQ_K, (m_block + 1) * BLOCK_M)
            full_hi = gl.minimum(SEQ_K, m_block * BLOCK_M)
        return hi, full_hi

    @gluon.jit
    def _issue_q(desc_q, desc_do, q_smem, do_smem, q_bar, q_row, BLOCK_M: gl.constexpr, Q_BLOCKS: gl.constexpr):
        """TMA loads of the program's ``Q_BLOCKS`` consecutive blocks of Q'^ and dO (once) into ``q_smem`` and
        ``do_smem`` (``[Q_BLOCKS, BLOCK_M, D]`` each). ``q_row``: the first block's row in Q'^'s ``[B*H*N, D]`` view,
        then its row and column in dO's view (:func:`.gluon_common.rows_view`)."""
        mbarrier.expect(q_bar, Q_BLOCKS * (desc_q.block_type.nbytes + desc_do.block_type.nbytes))
        for h in gl.static_range(Q_BLOCKS):
            tma.async_copy_global_to_shared(desc_q, [q_row[0] + h * BLOCK_M, 0], q_bar, q_smem.index(h))
            tma.async_copy_global_to_shared(desc_do, [q_row[1] + h * BLOCK_M, q_row[2]], q_bar, do_smem.index(h))

    @gluon.jit
    def _dq_producer(
        descs, bufs, bars, n_tiles, q_row, kv_row0, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, Q_BLOCKS: gl.constexpr, HP_DS: gl.constexpr = False,
    ):  # fmt: skip
        """The producer partition (one warpgroup): the program's ``Q_BLOCKS`` blocks of Q'^ and dO once
        (:func:`_issue_q`), every key tile into the ring, and each tile's
        K'^ transposed into a ``[D, 64]`` buffer (two, used in turn) for the consumers' dQ products, off their path.

        Tile ``t``: once it has landed (``ready``) and the consumers are done with the buffer's tile before
        (``kt_empty``), its transposition, then ``kt_ready``; its stage is released on this side (``empty`` counts
        the consumers' arrival and this one), and the stage of tile ``t - 1`` is refilled with tile
        ``t - 1 + STAGES`` once the consumers have released it too. The producer thus runs at most two tiles ahead
        of the consumers' dQ products. With ``HP_DS`` (a non-INT8 dS) the tile is widened to bf16
        (:func:`_widen_k`) in place of the transposition."""
        desc_q, desc_do, desc_k, desc_v = descs
        q_smem, do_smem, k_smem, kt_smem, v_smem = bufs[0], bufs[1], bufs[2], bufs[3], bufs[4]
        ready, empty, q_bar, kt_ready, kt_empty = bars
        _issue_q(desc_q, desc_do, q_smem, do_smem, q_bar, q_row, BLOCK_M, Q_BLOCKS)
        for i in gl.static_range(STAGES):
            _issue_kv(i, n_tiles, kv_row0, desc_k, desc_v, k_smem, v_smem, ready, BLOCK_N, STAGES)
        for t in range(n_tiles):
            stage = t % STAGES
            kb = t % 2
            mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
            # A fresh mbarrier counts as having completed the phase before its first: the first pass does not wait.
            mbarrier.wait(kt_empty.index(kb), ((t // 2) & 1) ^ 1)
            if HP_DS:
                _widen_k(k_smem.index(stage), kt_smem.index(kb), HEAD_DIM, BLOCK_N, 4)
            else:
                _transpose_k(k_smem.index(stage), kt_smem.index(kb), HEAD_DIM, 4)
            mbarrier.arrive(kt_ready.index(kb), count=1)
            mbarrier.arrive(empty.index(stage), count=1)
            if t > 0:
                prev = (t - 1) % STAGES
                mbarrier.wait(empty.index(prev), ((t - 1) // STAGES) & 1)
                _issue_kv(t - 1 + STAGES, n_tiles, kv_row0, desc_k, desc_v, k_smem, v_smem, ready, BLOCK_N, STAGES)

    @gluon.jit
    def _dq_compute(
        descs, bufs, bars, n_tiles, q_row, kv_row0, pid, bh, kv_bh, Q_SCALE, K_SCALE, LSE, DELTA, DQ, SEQ_Q, SEQ_K,
        qk_scale, tau, full_hi, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, WARP_SPECIALIZE: gl.constexpr, CODES_IN_REGISTERS: gl.constexpr,
        DEFER: gl.constexpr, DS_FMT: gl.constexpr, WG: gl.constexpr = False, HALF: gl.constexpr = 0,
        N_WG: gl.constexpr = 2, Q_BLOCK: gl.constexpr = 0, DS_SCALE=None, DS_SCALED: gl.constexpr = False,
    ):  # fmt: skip
        """The consumer warpgroups: every key tile's S, dP, dS codes and dQ product, then dQ to global memory.

        Without ``WG``: the program's two consumer warpgroups, query block ``pid`` (``full_hi``: its first masked key
        tile's offset). With ``WARP_SPECIALIZE`` the producer warpgroup transposes each tile's K'^ (``kt_ready``, two
        buffers in turn); without, these warps issue the loads (``STAGES - 1`` tiles ahead; ``descs``, ``q_row``,
        ``kv_row0``) and, while a tile's S and dP run, copy its K'^ transposed into ``kt_smem`` themselves (one buffer;
        two with ``DEFER``, whose dQ product of the tile before still reads the other). With ``DEFER`` each tile's dQ
        product is waited for in the next iteration, after the next tile's S and dP are issued.

        With ``WG`` (warp-specialised, codes in registers, no ``DEFER``; ``descs``, ``q_row``, ``kv_row0`` and
        ``full_hi`` unused): one consumer warpgroup, query block ``N_WG * pid + HALF`` against its key tiles (the first
        ``mine`` of the ring's ``n_tiles``), then its dQ rows; each tile's K'^ comes transposed from the producer
        warpgroup, one copy for both warpgroups.

        With a non-INT8 ``DS_FMT`` the dQ product runs in bf16 with fp32 accumulation (``_dq_kernel``'s): A = dS's
        e4m3 codes or bf16 values, B = K'^ widened to bf16 (:func:`_widen_k`, by whoever would transpose it).

        With ``DS_SCALED`` (``WG`` with three warpgroups of 64 queries, an INT8 dS) each tile's dS scale is read from
        ``DS_SCALE`` (the dK/dV kernel's, one per 128-query x 64-key tile: :func:`..tiles.ds_scales_shape`), at
        the query block of Q_BLOCK rows this block is half of, rather than reduced over the warpgroup's 64 queries,
        and the codes take it (clamped: :func:`.gluon_common._int8_codes_clamped`)."""
        q_all, do_all, k_smem, kt_smem, v_smem = bufs[0], bufs[1], bufs[2], bufs[3], bufs[4]
        ready, empty, q_bar, kt_ready, kt_empty = bars
        if not WARP_SPECIALIZE:
            desc_q, desc_do, desc_k, desc_v = descs
        if not CODES_IN_REGISTERS:
            ds_smem = bufs[5]
        q_smem = q_all.index(HALF)
        do_smem = do_all.index(HALF)
        # Without WG, [8, 1]: each warpgroup holds 64 of the 128 queries (rows) against all the tile's keys / head
        # dims. With WG, one warpgroup: its 4 warps split the 128 queries' rows (two m64 repetitions); a row's 64 keys
        # lie in one thread quad.
        WARPS: gl.constexpr = 4 if WG else 8
        s_layout: gl.constexpr = _wgmma_layout(WARPS, 1, BLOCK_N, 32)
        dp_layout: gl.constexpr = _wgmma_layout(WARPS, 1, BLOCK_N, 16)
        acc_layout: gl.constexpr = _wgmma_layout(WARPS, 1, HEAD_DIM, 32)
        # The dS codes as the dQ product's A operand in registers: 4 int8 per 32-bit register.
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4)
        # A non-INT8 dS: the dQ product in bf16 (k16 instructions), dS's bf16 operand from registers, 2 per register.
        hp_layout: gl.constexpr = _wgmma_layout(WARPS, 1, HEAD_DIM, 16)
        hp_a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=hp_layout, k_width=2)

        m_blocks = gl.cdiv(SEQ_Q, BLOCK_M)
        k_blocks = gl.cdiv(SEQ_K, BLOCK_N)
        # The query block whose rows are loaded, and the key tiles this warpgroup reads.
        m_block = pid
        rows_block = pid
        mine = n_tiles
        if WG:
            m_block = N_WG * pid + HALF
            live = m_block < m_blocks
            hi, full_hi = _key_range(m_block, SEQ_K, BLOCK_M, CAUSAL)
            mine = hi // BLOCK_N
            if not live:
                mine = 0
            # A block past the last query (the upper one of the last program) loads the last block's rows, unused.
            rows_block = gl.minimum(m_block, m_blocks - 1)
        if not WARP_SPECIALIZE:
            _issue_q(desc_q, desc_do, q_all, do_all, q_bar, q_row, BLOCK_M, 1)
            for i in gl.static_range(STAGES - 1):
                _issue_kv(i, n_tiles, kv_row0, desc_k, desc_v, k_smem, v_smem, ready, BLOCK_N, STAGES)
        offs_m, offs_n_tile, q_scale, lse, delta, s_zero, dp_zero, acc_zero, dq = _dq_block(
            rows_block, bh, Q_SCALE, LSE, DELTA, SEQ_Q, m_blocks, s_layout, dp_layout, acc_layout, BLOCK_M, BLOCK_N,
            HEAD_DIM, Q_BLOCK,
        )  # fmt: skip
        if WG:
            # The keys' offsets are made in the masked branch, not held through the loop: here they would spill.
            offs_n_tile = None
        if DS_SCALED:
            gl.static_assert(WG and N_WG == 3 and DS_FMT == "int8", "DS_SCALED: three warpgroups, an INT8 dS")
            # This block's row of tile scales: its query head, the 128-query block (of Q_BLOCK rows) it is half of.
            ds_scales = DS_SCALE + (bh * gl.cdiv(SEQ_Q, Q_BLOCK) + (rows_block * BLOCK_M) // Q_BLOCK) * k_blocks
        mbarrier.wait(q_bar, 0)
        # A bf16 dS enters the dQ product times K's tile scale (_dq_ds's ds_fold), so each tile's product adds into dQ
        # inside the tensor core: dQ is the product's accumulator (no scaling after it, no second accumulator). With
        # the producer warpgroup and two consumer warpgroups (LAZY) the product is left in flight: the next tile's S
        # wait finishes it (wgmma groups complete in order), and its K'^ buffer is handed back then. Not with WG: a
        # warpgroup holding dQ, the next S and dP and the product's A operand at once has too few registers, and ptxas
        # then serializes every wgmma (its note C7512).
        INPLACE: gl.constexpr = DS_FMT == "bf16"
        LAZY: gl.constexpr = INPLACE and WARP_SPECIALIZE and not DEFER and not WG
        if INPLACE:
            dq_run = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, hp_layout))
            if LAZY and CODES_IN_REGISTERS:
                a_keep = gl.zeros([BLOCK_M, BLOCK_N], gl.bfloat16, hp_a_layout)
        if DEFER:
            # The tile before's dQ product and its scale, finished in the next iteration.
            if DS_FMT == "int8":
                dq_tok = warpgroup_mma_init(acc_zero)
            else:
                dq_tok = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, hp_layout))
            dq_c = q_scale * 0.0

        for t in range(mine):
            stage = t % STAGES
            if not WARP_SPECIALIZE and not DEFER:
                # Stage (t - 1) % STAGES was last read by tile t - 1's products, which every warp waited for
                # before the barrier that ended that iteration: refill it with tile t + STAGES - 1.
                _issue_kv(t + STAGES - 1, n_tiles, kv_row0, desc_k, desc_v, k_smem, v_smem, ready, BLOCK_N, STAGES)
            start_n = t * BLOCK_N
            k_scale = gl.load(K_SCALE + kv_bh * k_blocks + t)
            if DS_SCALED:
                # Loaded with K's scale, its latency under the tile's S and dP products.
                ds_scale = gl.load(ds_scales + t)
            mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
            # S = Q'^ K'^T (int32) and dP = dO V^T (fp32), both in flight at once; B = K'^ and V as stored
            # [64, D] read as [D, 64] (K-major over D).
            s_tok = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(do_smem, v_smem.index(stage).permute((1, 0)), dp_zero, use_acc=False, is_async=True)
            if not WG:
                kt_tile = kt_smem.index(t % kt_smem.shape[0])
            if not WARP_SPECIALIZE:
                if DS_FMT == "int8":
                    _transpose_k(k_smem.index(stage), kt_tile, HEAD_DIM, 8)
                else:
                    _widen_k(k_smem.index(stage), kt_tile, HEAD_DIM, BLOCK_N, 8)
            if DEFER:
                # The tile before's dQ product was committed before S and dP: two groups may stay in flight. Its
                # scaling overlaps this tile's S and dP on the tensor cores; the additions into dQ keep their order.
                if not INPLACE:
                    dq_int = warpgroup_mma_wait(num_outstanding=2, deps=[dq_tok])
                    if DS_FMT == "int8":
                        dq += _int32_scaled(dq_int, dq_c)
                    else:
                        dq += gl.convert_layout(dq_int, acc_layout) * dq_c
                # Both warpgroups are done with the tile before's stage (and the codes).
                gl.thread_barrier()
                if WARP_SPECIALIZE:
                    mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), count=1, pred=t > 0)
                    mbarrier.arrive(kt_empty.index((t + 1) % 2), count=1, pred=t > 0)
                else:
                    _issue_kv(t + STAGES - 1, n_tiles, kv_row0, desc_k, desc_v, k_smem, v_smem, ready, BLOCK_N, STAGES)
            # P, dS and its codes; one dS scale for the 128 x 64 tile (without WG a reduction across both
            # warpgroups, with WG within the warpgroup; with DS_SCALED the dK/dV kernel's, read above).
            ds = _dq_ds(
                s_tok, dp_tok, q_scale * k_scale * qk_scale, lse, delta, offs_m, offs_n_tile, start_n, full_hi,
                s_layout, BLOCK_N, CAUSAL, k_scale if INPLACE else None,
                a_keep if LAZY and CODES_IN_REGISTERS else None,
            )  # fmt: skip
            if LAZY:
                # S and dP are done, and with them the tile before's dQ product: hand back this tile's stage and the
                # tile before's K'^ buffer.
                gl.thread_barrier()
                mbarrier.arrive(empty.index(stage), count=1)
                mbarrier.arrive(kt_empty.index((t + 1) % 2), count=1, pred=t > 0)
            if DS_SCALED:
                # Codes clamped to [-127, 127]: the scale was made from the whole tile, this warpgroup's half included.
                codes = _int8_codes_clamped(ds, ds_scale)
            elif DS_FMT == "int8":
                ds_scale = _tile_scale(ds)
                codes = _int8_codes(ds, ds_scale)
            else:
                # An FP8 or bf16 dS: the dQ product's bf16 operand (ds_scale 1 for bf16).
                codes, _amax, ds_scale = _ds_operand(ds, DS_FMT)
            if DS_FMT == "int8":
                # Each 16 keys in K'^T's order (_transpose_k, quant.MMA_KEY_ORDER): as the 8-bit A operand from
                # registers the codes are then the accumulator's registers as they are.
                codes = _mma_key_order(codes, 1)
            if WG:
                # (Here, after dS, in this variant's order of operations: its instructions as they were.)
                kt_tile = kt_smem.index(t % kt_smem.shape[0])
            if WARP_SPECIALIZE:
                mbarrier.wait(kt_ready.index(t % 2), (t // 2) & 1)
            # dQ of the tile: A = the codes [128 queries, 64 keys], B = K'^ [64 keys, D] read from its transposed
            # [D, 64] copy (K-major over the keys).
            if INPLACE:
                # bf16: A = dS_K rounded [128 queries, 64 keys], B = K'^ widened [64 keys, D] as stored, into dQ.
                if CODES_IN_REGISTERS:
                    a_op = gl.convert_layout(codes, hp_a_layout)
                    dq_run = warpgroup_mma(a_op, kt_tile, dq_run, use_acc=True, is_async=True)
                    if LAZY:
                        a_keep = a_op
                else:
                    ds_smem.store(codes)
                    fence_async_shared()
                    gl.thread_barrier()
                    dq_run = warpgroup_mma(ds_smem, kt_tile, dq_run, use_acc=True, is_async=True)
                if not LAZY:
                    dq_run = warpgroup_mma_init(warpgroup_mma_wait(num_outstanding=0, deps=[dq_run]))
            elif DS_FMT != "int8":
                # FP8: A = dS's e4m3 codes widened [128 queries, 64 keys], B = K'^ widened [64 keys, D] as stored.
                hp_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, hp_layout)
                if CODES_IN_REGISTERS:
                    dq_tok = warpgroup_mma(
                        gl.convert_layout(codes, hp_a_layout), kt_tile, hp_zero, use_acc=False, is_async=True
                    )
                else:
                    ds_smem.store(codes)
                    fence_async_shared()
                    gl.thread_barrier()
                    dq_tok = warpgroup_mma(ds_smem, kt_tile, hp_zero, use_acc=False, is_async=True)
            elif CODES_IN_REGISTERS:
                dq_tok = warpgroup_mma(
                    gl.convert_layout(codes, a_layout), kt_tile.permute((1, 0)), acc_zero, use_acc=False,
                    is_async=True,
                )  # fmt: skip
            else:
                ds_smem.store(codes)
                fence_async_shared()
                gl.thread_barrier()
                dq_tok = warpgroup_mma(ds_smem, kt_tile.permute((1, 0)), acc_zero, use_acc=False, is_async=True)
            if DEFER:
                if DS_FMT == "bf16":
                    dq_c = k_scale
                else:
                    dq_c = ds_scale * k_scale
            elif DS_FMT == "int8":
                dq_int = warpgroup_mma_wait(num_outstanding=0, deps=[dq_tok])
                dq += _int32_scaled(dq_int, ds_scale * k_scale)
            elif not INPLACE:
                # _dq_kernel's hp_dot(...) * (ds_scale * k_scale) (fp8).
                dq_acc = gl.convert_layout(warpgroup_mma_wait(num_outstanding=0, deps=[dq_tok]), acc_layout)
                dq += dq_acc * (ds_scale * k_scale)
            if not DEFER and not LAZY:
                # The consumers are done with this stage (and the codes) before it is handed back or overwritten
                # (with WG, the producer refills a stage, or transposes into a buffer, once both warpgroups have).
                gl.thread_barrier()
                if WARP_SPECIALIZE:
                    mbarrier.arrive(empty.index(stage), count=1)
                    mbarrier.arrive(kt_empty.index(t % 2), count=1)
        if LAZY:
            # The last tile's dQ product, then its K'^ buffer back (before the tiles below, whose buffers alternate).
            dq = gl.convert_layout(warpgroup_mma_wait(num_outstanding=0, deps=[dq_run]), acc_layout)
            gl.thread_barrier()
            mbarrier.arrive(kt_empty.index((mine + 1) % 2), count=1, pred=mine > 0)
        elif INPLACE:
            dq = gl.convert_layout(warpgroup_mma_wait(num_outstanding=0, deps=[dq_run]), acc_layout)
        if WG:
            # The ring's tiles this block does not read (the upper block's last diagonal tiles, or all of them when
            # this warpgroup has no block): wait for each one's transposition (which follows its load), so the
            # releases count towards its own phases, and hand both back.
            for t in range(mine, n_tiles):
                mbarrier.wait(kt_ready.index(t % 2), (t // 2) & 1)
                mbarrier.arrive(empty.index(t % STAGES), count=1)
                mbarrier.arrive(kt_empty.index(t % 2), count=1)
        if DEFER and not INPLACE:
            dq_int = warpgroup_mma_wait(num_outstanding=0, deps=[dq_tok])
            if DS_FMT == "int8":
                dq += _int32_scaled(dq_int, dq_c)
            else:
                dq += gl.convert_layout(dq_int, acc_layout) * dq_c
        if WG:
            if live:
                _dq_store(dq, m_block, bh, SEQ_Q, DQ, tau, acc_layout, HEAD_DIM, BLOCK_M)
        else:
            _dq_store(dq, m_block, bh, SEQ_Q, DQ, tau, acc_layout, HEAD_DIM, BLOCK_M)

    @gluon.jit
    def _gluon_dq_kernel(
        desc_q, desc_do, desc_k, desc_v,
        Q_SCALE, K_SCALE, LSE, DELTA, DQ, DO_RB, DO_RH, DO_CH, V_RB, V_RH, V_CH,
        BH, HEADS, GROUP, SEQ_Q, SEQ_K, qk_scale, tau,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, HEAD_CHUNK: gl.constexpr, WARP_SPECIALIZE: gl.constexpr,
        CODES_IN_REGISTERS: gl.constexpr, DEFER: gl.constexpr, PRODUCER_REGS: gl.constexpr,
        DS_FMT: gl.constexpr = "int8", WG: gl.constexpr = False, CONSUMER_REGS: gl.constexpr = 0,
        N_WG: gl.constexpr = 2, Q_BLOCK: gl.constexpr = 0, DS_SCALE=None, DS_SCALED: gl.constexpr = False,
    ):  # fmt: skip
        # A program's query blocks: one (both consumer warpgroups on it), or with WG N_WG (a warpgroup each; with
        # three, blocks of 64 rows, halves of Q's quantization blocks of Q_BLOCK rows).
        Q_BLOCKS: gl.constexpr = N_WG if WG else 1
        m_blocks = gl.cdiv(SEQ_Q, BLOCK_M)
        n_programs = gl.cdiv(m_blocks, N_WG) if WG else m_blocks
        pid, bh = _head_chunk_order(gl.program_id(0), n_programs, BH, HEAD_CHUNK)
        if CAUSAL:
            # The longest query tiles (most key tiles) first, so the short ones fill the tail of the grid.
            pid = n_programs - 1 - pid
        b = bh // HEADS
        head = bh % HEADS
        kv_bh = b * (HEADS // GROUP) + head // GROUP
        # The ring carries the key tiles of the program's last query block: its own, or with WG the upper one's (the
        # lower one reads a prefix of them), or the lower one's when the upper one is past the last query.
        last = gl.minimum(N_WG * pid + N_WG - 1, m_blocks - 1) if WG else pid
        # The ring's key tiles: the last block's; full_hi is pid's own where the consumers take it (without WG, last
        # is pid; with WG each warpgroup finds its block's range).
        hi, full_hi = _key_range(last, SEQ_K, BLOCK_M, CAUSAL)
        n_tiles = hi // BLOCK_N
        # The loads' rows (and dO's and V's columns: read where they lie, rows_view), as _issue_q, _issue_kv take them.
        do_org, v_org = _view_origins(bh, kv_bh, _view_lays(HEADS, GROUP, DO_RB, DO_RH, DO_CH, V_RB, V_RH, V_CH))
        do_row, do_col = do_org
        v_row, v_col = v_org
        q_row = (bh * SEQ_Q + Q_BLOCKS * pid * BLOCK_M, do_row + Q_BLOCKS * pid * BLOCK_M, do_col)
        kv_row0 = (kv_bh * SEQ_K, v_row, v_col)

        # Shared memory: Q'^ and dO of the program, a STAGES-deep ring of K'^ and V tiles, K'^ transposed (two
        # buffers with the producer warpgroup or DEFER), the dS codes (unless in registers). A stage is released
        # by the consumers (with WG each warpgroup on its own) and, with the producer warpgroup, by it once it has
        # transposed the stage's K'^; with WG a transposed tile by both consumer warpgroups.
        bufs, bars = _dq_smem(
            desc_q, desc_do, desc_k, desc_v, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, Q_BLOCKS,
            2 if DEFER or WARP_SPECIALIZE else 1, CODES_IN_REGISTERS, (N_WG + 1 if WG else 2) if WARP_SPECIALIZE else 1,
            Q_BLOCKS, DS_FMT != "int8",
        )  # fmt: skip
        descs = (desc_q, desc_do, desc_k, desc_v)
        if WG and N_WG == 3:
            bufs = (bufs[0], bufs[1], bufs[2], bufs[3], bufs[4])  # no dS codes buffer: they stay in registers
            gl.warp_specialize(
                [
                    (
                        _dq_compute,
                        (None, bufs, bars, n_tiles, None, None, pid, bh, kv_bh, Q_SCALE, K_SCALE, LSE, DELTA, DQ,
                         SEQ_Q, SEQ_K, qk_scale, tau, None, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, True, True,
                         False, DS_FMT, True, 0, 3, Q_BLOCK, DS_SCALE, DS_SCALED),
                    ),
                    (
                        _dq_compute,
                        (None, bufs, bars, n_tiles, None, None, pid, bh, kv_bh, Q_SCALE, K_SCALE, LSE, DELTA, DQ,
                         SEQ_Q, SEQ_K, qk_scale, tau, None, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, True, True,
                         False, DS_FMT, True, 1, 3, Q_BLOCK, DS_SCALE, DS_SCALED),
                    ),
                    (
                        _dq_compute,
                        (None, bufs, bars, n_tiles, None, None, pid, bh, kv_bh, Q_SCALE, K_SCALE, LSE, DELTA, DQ,
                         SEQ_Q, SEQ_K, qk_scale, tau, None, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, True, True,
                         False, DS_FMT, True, 2, 3, Q_BLOCK, DS_SCALE, DS_SCALED),
                    ),
                    (
                        _dq_producer,
                        (descs, bufs, bars, n_tiles, q_row, kv_row0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, 3,
                         DS_FMT != "int8"),
                    ),
                ],
                [4, 4, 4],
                [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
            )  # fmt: skip
        elif WG:
            bufs = (bufs[0], bufs[1], bufs[2], bufs[3], bufs[4])  # no dS codes buffer: they stay in registers
            gl.warp_specialize(
                [
                    (
                        _dq_compute,
                        (None, bufs, bars, n_tiles, None, None, pid, bh, kv_bh, Q_SCALE, K_SCALE, LSE, DELTA, DQ,
                         SEQ_Q, SEQ_K, qk_scale, tau, None, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, True, True,
                         False, DS_FMT, True, 0),
                    ),
                    (
                        _dq_compute,
                        (None, bufs, bars, n_tiles, None, None, pid, bh, kv_bh, Q_SCALE, K_SCALE, LSE, DELTA, DQ,
                         SEQ_Q, SEQ_K, qk_scale, tau, None, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, True, True,
                         False, DS_FMT, True, 1),
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
        elif WARP_SPECIALIZE:
            gl.warp_specialize(
                [
                    (
                        _dq_compute,
                        (descs, bufs, bars, n_tiles, q_row, kv_row0, pid, bh, kv_bh, Q_SCALE, K_SCALE, LSE, DELTA,
                         DQ, SEQ_Q, SEQ_K, qk_scale, tau, full_hi, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL,
                         WARP_SPECIALIZE, CODES_IN_REGISTERS, DEFER, DS_FMT),
                    ),
                    (
                        _dq_producer,
                        (descs, bufs, bars, n_tiles, q_row, kv_row0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, 1,
                         DS_FMT != "int8"),
                    ),
                ],
                [4],
                [PRODUCER_REGS],
            )  # fmt: skip
        else:
            _dq_compute(
                descs, bufs, bars, n_tiles, q_row, kv_row0, pid, bh, kv_bh, Q_SCALE, K_SCALE, LSE, DELTA, DQ, SEQ_Q,
                SEQ_K, qk_scale, tau, full_hi, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, WARP_SPECIALIZE,
                CODES_IN_REGISTERS, DEFER, DS_FMT,
            )  # fmt: skip


def default_stages(head_dim: int) -> int:
    """The TMA ring's depth: 4 key tiles (24 KiB each at D=128: 152 KiB with Q'^, dO and K'^'s transposed tile;
    12 KiB at D=64)."""
    return 4


def gluon_dq_wg_serves(head_dim: int) -> bool:
    """Whether :func:`gluon_dq`'s ``wg`` variant (the plan's ``gluon_dq_wg``) serves a call the two-warpgroup kernel
    serves: head dim in :data:`WG_HEAD_DIMS`.

    Example::

        gluon_dq_wg_serves(64)   # True
    """
    return head_dim in WG_HEAD_DIMS


def gluon_dq(
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
    stages: int | None = None,
    warp_specialize: bool = True,
    codes_in_registers: bool = True,
    defer: bool = False,
    ds_fmt: str = "int8",
    wg: bool = False,
    consumers: int | None = None,
    ds_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """dQ as ``backward()``'s ``_dq_kernel`` launch returns it, for the calls the plan
    (:func:`..plan.plan_attention`) gives it.

    Args:
        grad_out: dO ``[B, Hq, N, D]`` bf16, any strides: read where it lies when contiguous or a model's ``[B, N, H,
            D]`` memory, else copied contiguous (:func:`.gluon_common.rows_view`).
        delta: ``rowsum(dO * O)`` ``[B, Hq, N]`` fp32 (:func:`..quant.backward_preprocess`).
        q_op, q_scale: the forward's INT8 Q'^ ``[B, Hq, N, D]`` and its scales per 128 rows.
        k_op, k_scale: K'^ ``[B, Hkv, Nk, D]`` and its scales per 64 rows (the kernel transposes each key tile in
            shared memory: no ``[D, Nk]`` copy).
        v: V ``[B, Hkv, Nk, D]`` bf16 (dP's operand), read where it lies as ``grad_out``.
        lse: the forward's base-2 logsumexp ``[B, Hq, N]``.
        is_causal, scale: as the forward.
        stages: depth of the TMA ring of key tiles; ``None``: :func:`default_stages`. At least 2 with ``defer`` (it
            hands a stage back one tile late) or ``warp_specialize`` (the producer refills tile ``t``'s stage after
            transposing tile ``t + 1``): with one stage the loads would wait for it forever. With ``wg``: 12 KiB
            each at D=64, beside 48 KiB of Q'^ and dO and 8 KiB of transposed K'^ tiles.
        warp_specialize: a producer warpgroup (TMA loads and K'^'s transposition) beside the two consumer
            warpgroups, or one partition of 8 warps that also issues the loads and transposes.
        codes_in_registers: the dS codes as the dQ product's A operand from registers, or through shared memory.
        defer: finish each tile's dQ product in the next iteration, after the next tile's S and dP are issued, so
            its scaling overlaps the tensor cores (same values, same order of additions). Under Triton 3.6 ptxas
            serializes this variant's wgmma (C7514: the dQ token crosses the loop's back edge), so it checks the
            protocol rather than promising speed.
        ds_fmt: dS's format, as ``_dq_kernel``'s ``DS_FMT``: ``"int8"`` (SageBwd's); ``"fp8"`` (e4m3 codes, one
            scale per tile) or ``"bf16"``, whose dQ product runs in bf16 against K'^'s codes widened to bf16 in
            shared memory (in place of their transposition; with ``wg`` 16 KiB).
        wg: one warpgroup per 128-query block (the plan's ``gluon_dq_wg``: the module's docstring), the same dQ bit
            for bit, for the head dims :func:`gluon_dq_wg_serves` accepts; it is warp-specialised with the codes in
            registers (``warp_specialize``, ``codes_in_registers`` and ``defer`` left as they are by default).
        consumers: the ``wg`` variant's consumer warpgroups a program: 2 (128 queries each) or 3 (64 queries each,
            :data:`WG3_ROWS`; ``ds_fmt="bf16"``, or ``"int8"`` with ``ds_scale``: an INT8 or FP8 dS takes one scale
            over 128 queries, which a warpgroup of 64 cannot reduce). The same dQ bit for bit: each row's products and
            their order of addition are the same (INT8: with the dK/dV kernel's scales, equal to this kernel's own
            while both kernels compute the same dS). ``None``: with ``wg`` :func:`wg_consumers`' choice (given
            ``ds_scale`` or not), else 2.
        ds_scale: with ``wg`` and an INT8 dS, the dK/dV kernel's dS tile scales (:func:`.gluon_backward.gluon_dkdv`'s
            ``ds_scale_out``, written by the backward's dK/dV launch before this one: fp32 ``[B, Hq, N / 128, Nk /
            64]`` contiguous, :func:`..tiles.ds_scales_shape`), which three consumer warpgroups read in place of
            their own reduction (the codes clamped to +-127 in case the two kernels' dS differ in a last bit); two
            consumer warpgroups reduce their own and do not read it.

    Returns:
        dQ ``[B, Hq, N, D]`` bf16, contiguous.

    Raises:
        ValueError: a ring of fewer stages than the variant needs (2 with ``defer``, ``warp_specialize`` or
            ``wg``), a ``ds_fmt`` it does not take, or with ``wg`` a head dim it does not serve or another variant;
            ``consumers`` not 2 or 3, or 3 without ``wg`` and ``ds_fmt="bf16"`` or ``"int8"``; 3 with an INT8 dS and
            no ``ds_scale``; a ``ds_scale`` without ``wg`` and an INT8 dS, or not of
            :func:`..tiles.ds_scales_shape` in fp32, contiguous.

    Example::

        dq = gluon_dq(grad_out, delta, q_op, q_scale, k_op, k_scale, v, lse, is_causal=True, scale=0.125)
        dq = gluon_dq(grad_out, delta, q_op, q_scale, k_op, k_scale, v, lse, is_causal=True, scale=0.125, wg=True)
    """
    batch, heads, seq_q, head_dim = q_op.shape
    kv_heads, seq_k = k_op.shape[1], k_op.shape[2]
    name = "gluon_dq_wg" if wg else "gluon_dq"
    if wg and not gluon_dq_wg_serves(head_dim):
        raise ValueError(f"gluon_dq_wg: serves head_dim in {WG_HEAD_DIMS}; received head_dim={head_dim}")
    if wg and not (warp_specialize and codes_in_registers and not defer):
        received = f"warp_specialize={warp_specialize}, codes_in_registers={codes_in_registers}, defer={defer}"
        raise ValueError(f"gluon_dq_wg: is warp-specialised with the codes in registers; received {received}")
    if ds_fmt not in ("int8", "fp8", "bf16"):
        raise ValueError(f"{name}: ds_fmt must be 'int8', 'fp8' or 'bf16'; received {ds_fmt!r}")
    if ds_scale is not None:
        if not (wg and ds_fmt == "int8"):
            raise ValueError(f"{name}: ds_scale is read by the wg variant with an INT8 dS only (wg=True, "
                             f"ds_fmt='int8'); received wg={wg}, ds_fmt={ds_fmt!r}")  # fmt: skip
        check_ds_scales(name, "ds_scale", ds_scale, q_op, k_op)
    if consumers is None:
        consumers = wg_consumers(ds_fmt, is_causal, ds_scale is not None) if wg else 2
    if consumers not in (2, 3) or (consumers == 3 and not (wg and ds_fmt in ("bf16", "int8"))):
        raise ValueError(f"{name}: consumers must be 2, or 3 with wg=True and ds_fmt='bf16' or 'int8'; received "
                         f"consumers={consumers!r}, wg={wg}, ds_fmt={ds_fmt!r}")  # fmt: skip
    if consumers == 3 and ds_fmt == "int8" and ds_scale is None:
        raise ValueError(f"{name}: consumers=3 with ds_fmt='int8' reads the dK/dV kernel's dS tile scales "
                         "(ds_scale=, gluon_dkdv's ds_scale_out): a warpgroup of 64 queries cannot reduce the scale "
                         "over the tile's 128; received ds_scale=None. Pass ds_scale, or consumers=2")  # fmt: skip
    stages = stages if stages is not None else default_stages(head_dim)
    if wg and stages < 2:
        raise ValueError(f"gluon_dq_wg: stages must be at least 2 (the producer refills a stage one tile late); "
                         f"received stages={stages}")  # fmt: skip
    if stages < (2 if defer or warp_specialize else 1):
        needs = "defer" if defer else "the producer warpgroup (warp_specialize=True)"
        raise ValueError(f"gluon_dq: stages={stages} would deadlock with {needs}; use stages >= 2")
    rows = WG3_ROWS if consumers == 3 else BLOCK_M
    descs, dq, layouts = dq_operands(grad_out, q_op, k_op, v, rows, BLOCK_N)
    bh = batch * heads
    if consumers == 3:
        programs = triton.cdiv(triton.cdiv(seq_q, rows), 3)
        head_chunk = WG_HEAD_CHUNK
        variant = dict(WG=True, N_WG=3, Q_BLOCK=BLOCK_M, CONSUMER_REGS=WG3_CONSUMER_REGS, num_warps=4,
                       maxnreg=WG3_MAXNREG)  # fmt: skip
        if ds_fmt == "int8":
            variant.update(DS_SCALE=ds_scale, DS_SCALED=True)
    elif wg:
        programs = (seq_q // BLOCK_M + 1) // 2
        head_chunk = WG_HEAD_CHUNK
        variant = dict(WG=True, CONSUMER_REGS=WG_CONSUMER_REGS, num_warps=4, maxnreg=WG_MAXNREG)
    else:
        programs = seq_q // BLOCK_M
        head_chunk = HEAD_CHUNK[head_dim]
        variant = dict(num_warps=8, **({"maxnreg": WS_MAXNREG} if warp_specialize else {}))
    _gluon_dq_kernel[(programs * bh,)](
        *descs, q_scale, k_scale, lse, delta, dq, *layouts, bh, heads, heads // kv_heads, seq_q, seq_k, scale * LOG2E,
        scale,
        HEAD_DIM=head_dim, BLOCK_M=rows, BLOCK_N=BLOCK_N, STAGES=stages, CAUSAL=is_causal,
        HEAD_CHUNK=head_chunk if is_causal else 1,
        WARP_SPECIALIZE=warp_specialize, CODES_IN_REGISTERS=codes_in_registers, DEFER=defer,
        PRODUCER_REGS=PRODUCER_REGS,
        **({} if ds_fmt == "int8" else {"DS_FMT": ds_fmt}),
        **variant,
    )  # fmt: skip
    return dq
