"""Gluon (``triton.experimental.gluon``) dK/dV kernel of SageBwd for Hopper (sm_90): TMA loads, async wgmma.

``backward.backward`` calls it for the dK/dV work where the plan (:func:`..plan.plan_attention`) takes it (by
default on a compute capability 9.0 GPU under Triton 3.6, SageBwd's default formats, large enough calls); every
other call keeps the portable ``_dkdv_kernel``. On an H100 its dK and dV equal ``_dkdv_kernel``'s bit for bit and
it takes 2.59 against 4.27 ms at B=4, 16 heads, N=4096, D=128 (``benchmarks/gluon_dkdv_check.py``).

The numerics are ``_dkdv_kernel``'s (:mod:`..backward`) for SageBwd's default formats (INT8 ``QK``, ``dV``,
``dS``; ``dP`` in bf16; no Q-smoothing), tile for tile:

* ``S = tau log2(e) s_Q s_K (Q'^ K'^T)`` from the int32 product, ``P = exp2(S - lse)`` (zero where masked);
* ``dP = dO V^T`` in bf16 with fp32 accumulation, ``dS = P (dP - delta)``;
* ``dV += (psi(P)^T dO^) s_P s_dO``, P coded per key column of the 128-query tile;
* ``dK += (psi(dS)^T Q'^) s_dS s_Q``, one dS scale per 128-query x 64-key tile; ``dK`` times ``tau`` at the end.

The layout is transposed against ``_dkdv_kernel``'s: a program holds ``S^T``, ``dP^T`` ``[64 keys, 128
queries]`` over two warpgroups (``warps_per_cta=[4, 2]``: each warpgroup computes the 64 keys against its 64
of the tile's 128 queries). P's per-key scale (a reduction over queries) and dS's tile scale (over the whole
tile) therefore cross both warpgroups; each warp reduces its own part, then one exchange through shared memory
completes each (:func:`.gluon_common._row_max`, :func:`.gluon_common._tile_amax`: one barrier each where Triton's
nested reductions took two and five), so both warpgroups see the same scales and the granularity is SageBwd's (one
scale per 128 x 64 tile). The codes of P^T and dS^T are
written to shared memory once per tile and are the A operands of ``dV`` and ``dK``'s INT8 wgmma (each
warpgroup computes half of D's columns). B operands are K-major as 8-bit wgmma requires: ``dO^`` and ``Q'^``
are read from their ``[D, N]`` copies (the ones ``_dkdv_kernel`` reads).

dS in FP8 or bf16 (``DS_FMT``, issue 42: the precision the controller escalates a layer to) keeps ``_dkdv_kernel``'s
numerics for those formats: dS's e4m3 codes (one scale per tile, ``max|dS| / 448``) or dS rounded to bf16, as the
bf16 A operand of a bf16 wgmma with fp32 accumulation whose B operand is Q'^'s INT8 codes widened to bf16 (exact)
in shared memory by the consumers, then ``dK += acc * s_dS s_Q`` (FP8); a bf16 dS enters as ``dS_Q = P^T fma(dP^T,
s_Q, -(delta s_Q))`` rounded (dS times Q's tile scale), so nothing scales its product: the ``wg`` kernel below adds
it into dK inside the tensor core (dK is its accumulator, with no accumulator of its own), this one adds it after
(in place it took 1.035x the time at D=128 non-causal, device run 47). No Q'^T is loaded (16-bit
wgmma reads B as stored); the dS statistics stay INT8's error, as the portable kernel's. Warp-specialised without
``defer``, the backward hands it Q'^ in bf16 from its preprocess (``q_wide``, ``Q_WIDE``; every INT8 code is exact in
bf16, so dK and dV are the same bit for bit): the load warp puts each tile's into the buffer the consumers widened
into (one ``[128, D]`` bf16 tile beside the ring, with a ``ready``/``empty`` barrier pair of its own: a ring of them
would take 242 KiB at D=128 and two stages), once the tile before's dK product has released it, and the consumers
wait for it just before dK's product. Issue 42's profile (H200, D=128, bf16 dS) put 14% of the kernel's stall samples
in the widening it replaces.

Per program: one kv head's ``BLOCK_N = 64`` keys; it walks every query tile of every query head of the group
(one flat loop, ``STAGES``-deep ring of TMA loads, ``ready``/``empty`` mbarriers per stage; the tile's lse and
delta come through the ring with it). Variants: warp-
specialised (default: ``gl.warp_specialize`` with the two consumer warpgroups as the default partition at 240
registers and one TMA load warp at 24) or one 8-warp partition that also issues the loads; ``defer`` waits for
each tile's dV/dK products in the next iteration, after its S and dP are issued. Design, offline figures and the
device test: ``benchmarks/gluon-dkdv.md``.

One warpgroup per 64 keys (``WG``, the launcher's ``wg=True``; the plan's ``gluon_dkdv_wg``, D=64 only): the same
numerics, tile for tile (P's codes per key over a tile's 128 queries, one dS scale per 64-key x 128-query tile, the
same int32 products summed in the same order; dK and dV are bit for bit the same); what changes is who computes what:

* The kernel above gives a program 64 keys and splits each ``[64 keys, 128 queries]`` tile between its two consumer
  warpgroups by queries. P's per-key scale and dS's tile scale are then reductions across both warpgroups, through
  shared memory and CTA-wide barriers (six ``BAR.SYNC`` in its loop at D=64 with an INT8 dS, eleven before
  :func:`.gluon_common._tile_amax`): the warpgroups run in lockstep and the tensor cores idle while both quantize.
* With ``WG`` a program holds 128 keys, and each consumer warpgroup owns one 64-key half against all 128 queries of
  every tile. P's scale is a reduction within a thread quad (shuffles), dS's scale one within the warpgroup; the two
  warpgroups share only the TMA ring (each releases a stage on its own), so one quantizes while the other's products
  run. Each Q'^, Q'^T, dO, dO^T tile read from L2 serves 128 keys instead of 64.

The cost is registers: a warpgroup holds the whole ``[64, 128]`` S^T and dP^T (64 each per thread) and the queries'
lse and delta (32 each), so the variant serves D=64 only (its dK and dV are 32 registers each; at D=128 they would be
64 and the consumers would spill). Key counts must be multiples of 128. lse and delta come through the TMA ring with
the tile (512 bytes each per stage) rather than as 64 global loads per thread: 1.08-1.14x on the device
(``benchmarks/NOTES.md``, device run 7).

An FP8 or bf16 dS with ``WG``: dS^T's e4m3 codes widened to bf16, or dS rounded to bf16, against the tile's Q'^ codes
in bf16 as above. The backward's preprocess launch writes Q'^ in bf16 once (``q_wide``, N x D x 2 bytes per query
head) and its tile comes through the TMA ring beside Q'^'s codes (``Q_WIDE``: 16 KiB more per stage at D=64, 8 KiB
less without Q'^T; dS^T takes none: each warpgroup's stays in its registers as the dK product's A operand, where
the accumulator layout of S^T and dP^T is already a 16-bit A operand's). Without that copy each warpgroup widens the
tile's codes into a buffer of its own (the two run apart; 16 KiB each), 160 more instructions per iteration and
spills (offline sm_90 compile, ``benchmarks/NOTES.md``). Design, offline figures and the device results:
``benchmarks/NOTES.md`` (device run 7) and ``benchmarks/results/speed-h100-20261124-gluon-dkdv-wg.md``.

With an INT8 dS the ``wg`` kernel can also store each tile's dS scale (``ds_scale_out``, ``WRITE_DS_SCALE``: one fp32
per query head, 128-query block and 64-key block) for :mod:`.gluon_dq`'s three-warpgroup kernel, whose warpgroups of
64 queries cannot reduce it over the tile's 128 (issue 42). One predicated store a tile, after its products are in;
without the argument the kernel compiles to the same SASS as before.
"""

from __future__ import annotations

import torch

from ..tiles import GLUON_BLOCK_M, GLUON_BLOCK_N, LOG2E
from .gluon_common import HAVE_GLUON, check_ds_scales, dkdv_operands

if HAVE_GLUON:  # Gluon's Hopper API as in Triton 3.6 (gluon_common); older Tritons keep the portable kernel.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

    from .gluon_common import (
        _dkdv_accumulate,
        _dkdv_accumulate_hp,
        _dkdv_loader,
        _dkdv_origins,
        _dkdv_products,
        _dkdv_products_hp,
        _dkdv_program,
        _dkdv_smem,
        _dkdv_store,
        _dkdv_tile,
        _dkdv_zeros,
        _ds_codes,
        _ds_values,
        _ds_values_sums,
        _int32_scaled,
        _issue_loads,
        _load_kv,
        _load_origins,
        _p_codes,
        _p_codes_lean,
        _wgmma_layout,
        _widen_codes,
    )

#: Per head dim, the fewest scores (batch x query heads x queries x keys, halved when causal) for which ``auto``
#: takes the Gluon kernel; head dims not listed keep ``_dkdv_kernel``. Measured on an H100
#: (``benchmarks/gluon_dkdv_check.py --crossover``, the whole backward with and without it): at D=128 1.35x at
#: 2^30 scores, 1.34x at 2^29 (causal), 1.14x at 2^27, 0.79x at 2^26 (causal) and about 1.0x or less below, where
#: the backward is bound by the host (0.5-0.8 ms per call) and the Gluon launch costs the host 0.1-0.2 ms more than
#: ``_dkdv_kernel``'s. At D=64: 0.67x at 2^27, 1.01x at 2^29 and 1.03x at 2^30; causal 1.08x at 2^28 and 1.06x at
#: 2^29 (``speed-h100-20261123-gluon-crossover.md``); from 2^29, where every measured call gained.
AUTO_MIN_SCORES = {128: 2**27, 64: 2**28}
#: Triton versions (major.minor) whose Gluon API the kernel is written against (``gl.warp_specialize`` taking a
#: list of (function, args), ``warpgroup_mma`` returning an accumulator token); it compiled offline under 3.6.0.
GLUON_TRITON = ("3.6",)
#: Head dims it serves.
HEAD_DIMS = (64, 128)
#: The query tile (the Q and dO quantization block) and key tile it is written for.
BLOCK_M = GLUON_BLOCK_M
BLOCK_N = GLUON_BLOCK_N
#: Per head dim, the kv heads per chunk of the grid's order for causal calls (:func:`_head_chunk_order`; the chunk's
#: query heads' Q'^, Q'^T, dO and dO^T codes, 2.5 MiB per head at D=128 and N=4096, stay in L2). Measured on an H100
#: against one head at a time: 0.98-1.01x causal at D=128 without GQA, 1.14x with 4 query heads per kv head;
#: non-causal calls keep one head at a time (0.99x with chunks).
HEAD_CHUNK = {64: 16, 128: 8}
#: Registers per thread of the load partition (the fewest setmaxnreg allows) and the launch's cap: 8 consumer
#: warps and 1 load warp take 3 warpgroups; 65536 registers over 12 warps are 170 each, rounded down to 168, so
#: that after the load warpgroup gives its surplus back the consumers hold (168 * 12 - 24 * 4) / 8 = 240.
LOAD_REGS = 24
WS_MAXNREG = 168
#: The ``wg`` variant (one warpgroup per 64 keys): keys per program, one 64-key half (:data:`BLOCK_N`, the K
#: quantization block) per warpgroup.
WG_KEYS_PER_PROGRAM = 2 * BLOCK_N
#: Head dims the ``wg`` variant serves (register budget: see the module's docstring).
WG_HEAD_DIMS = (64,)
#: The ``wg`` variant's kv heads per chunk of the grid's order (:func:`.gluon_common._head_chunk_order`; at D=64 and
#: N=4096 a query head's Q'^, Q'^T, dO and dO^T codes take 1.25 MiB, so 16 kv heads without GQA stay in L2). Measured
#: on an H100 against one head at a time: 1.07-1.16x causal, 1.04-1.07x non-causal (both take it).
WG_HEAD_CHUNK = 16
#: The ``wg`` variant's register cap: 12 warps (two consumer warpgroups and the load warp's warpgroup) at 168 each;
#: after the load warpgroup drops to :data:`LOAD_REGS` each consumer holds 240.
WG_MAXNREG = 168
#: Registers per thread of the ``wg`` variant's second consumer warpgroup (a worker partition, so its count is set
#: explicitly; the first, the default partition, gets the same from what the others leave).
WG_CONSUMER_REGS = 240


def wg_dp_beside_s(ds_fmt: str, is_causal: bool, q_wide: bool = True) -> bool:
    """Whether the ``wg`` variant issues each tile's dP^T product beside its S^T (both in flight while S^T is waited for
    and P computed) rather than after P's codes are stored: with a bf16 dS read from the preprocess's bf16 Q'^
    (``q_wide``; widening Q'^ itself, that variant spilled 580 bytes with the statistics, offline), and with an INT8 dS
    on non-causal calls. The same products in the same order (dK and dV bit for bit). Offline (sm_90, Triton 3.6, D=64):
    with a bf16 dS, whose dK product adds into dK (no accumulator of its own since device run 47), no spills, nothing
    serialized, the loop's instructions unchanged; with an INT8 dS 12 bytes spilled causal, none non-causal. On an H200
    (device run 47, the kernel's profiled GPU time against the same tree issuing dP^T after P): bf16 1.066x at the
    training shape (B=64, 10/5 heads of 64, N=2048, causal) and 1.080x at N=4096 non-causal; INT8 1.036x non-causal but
    0.966x at the training shape.

    Example::

        wg_dp_beside_s("bf16", True), wg_dp_beside_s("int8", False), wg_dp_beside_s("int8", True)  # True, True, False
    """
    return (ds_fmt == "bf16" and q_wide) or (ds_fmt == "int8" and not is_causal)


if HAVE_GLUON:

    @gluon.jit
    def _dkdv_compute(
        descs, bufs, bars, total, n_m, lo_tile, row_q0, origins, kv_row, SEQ_Q, SEQ_K, pid_n, pid_bkv,
        Q_SCALE, K_SCALE, DO_SCALE, DK, DV, STATS, qk_scale, tau,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, WITH_STATS: gl.constexpr, WARP_SPECIALIZE: gl.constexpr, DEFER: gl.constexpr,
        DS_FMT: gl.constexpr, WG: gl.constexpr = False, HALF: gl.constexpr = 0, Q_WIDE: gl.constexpr = False,
        DS_SCALE=None, WRITE_DS_SCALE: gl.constexpr = False, DP_BESIDE_S: gl.constexpr = False,
    ):  # fmt: skip
        """The consumer warpgroups: every tile's products and scales, then dK and dV to global memory.

        Without ``WG``: the program's two consumer warpgroups on its 64 keys (``kv_row``; ``pid_n`` and ``pid_bkv``
        unused). Without ``WARP_SPECIALIZE`` they also issue the loads (``STAGES - 1`` iterations ahead; ``descs``,
        ``origins``: :func:`._dkdv_origins`). With a non-INT8 ``DS_FMT`` they widen each tile's Q'^ to bf16 in
        shared memory before its S and dP are issued (no Q'^T is loaded) and dK's product runs in bf16
        (:func:`._dkdv_products_hp`); with ``Q_WIDE`` (warp-specialised, no ``DEFER``) they read it instead from the
        preprocess's bf16 copy, which the load warp puts into one buffer beside the ring (its own barrier pair:
        :func:`._load_wide`), waited for just before dK's product and released with the stage.

        With ``WG`` (warp-specialised, no ``DEFER``; ``descs``, ``origins`` and ``kv_row`` unused): one consumer
        warpgroup, keys ``HALF * 64`` to ``HALF * 64 + 63`` of the program's 128 (key block ``2 * pid_n + HALF``)
        against every query tile. With a non-INT8 ``DS_FMT`` dK's product runs in bf16, A = dS^T from registers,
        against the tile's Q'^ in bf16: from the ring with ``Q_WIDE``, else widened by the warpgroup into its own
        buffer before the tile's S is issued. With ``WRITE_DS_SCALE`` (``WG`` and an INT8 dS) each tile's dS scale
        is also stored into ``DS_SCALE`` (``[B*Hq, m_blocks, k_blocks]``, fp32:
        :func:`.gluon_common.ds_scales_shape`), at its query head, query block and key block, for the dQ kernel's
        three consumer warpgroups."""
        k_smem, v_smem, q_smem, qt_smem, do_smem, dot_smem, p_smem, ds_smem, lse_smem, delta_smem = bufs
        ready, empty, kv_bar = bars
        if not WARP_SPECIALIZE:
            desc_q, desc_qt, desc_k, desc_v, desc_do, desc_dot, desc_lse, desc_delta = descs
        # The widened Q'^ (a non-INT8 dS without Q_WIDE): one buffer, or with WG one per half.
        qb_smem = qt_smem
        if WG:
            # This half's K'^, V and codes.
            k_smem = k_smem.index(HALF)
            v_smem = v_smem.index(HALF)
            p_smem = p_smem.index(HALF)
            ds_smem = ds_smem.index(HALF)
            if DS_FMT != "int8" and not Q_WIDE:
                qb_smem = qt_smem.index(HALF)
        # Accumulator layouts. Without WG, two warpgroups: [4, 2] splits the 64 keys' rows over a warpgroup's 4 warps
        # and the columns (queries of S^T and dP^T, head dims of dV and dK) over the 2 warpgroups. With WG, one
        # warpgroup: its 4 warps split the 64 keys' rows; a row's 128 queries lie in one thread quad.
        WARPS_N: gl.constexpr = 1 if WG else 2
        s_layout: gl.constexpr = _wgmma_layout(4, WARPS_N, BLOCK_M // WARPS_N, 32)
        dp_layout: gl.constexpr = _wgmma_layout(4, WARPS_N, BLOCK_M // WARPS_N, 16)
        acc_layout: gl.constexpr = _wgmma_layout(4, WARPS_N, HEAD_DIM // WARPS_N, 32)
        key_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        query_l: gl.constexpr = gl.SliceLayout(0, s_layout)
        acc_row_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
        # A non-INT8 dS: dK's bf16 product (k16 instructions), its fp32 accumulator.
        hp_layout: gl.constexpr = _wgmma_layout(4, WARPS_N, HEAD_DIM // WARPS_N, 16)
        LOAD_QT: gl.constexpr = DS_FMT == "int8"
        # With WG and a non-INT8 dS: dS^T stays in registers as the dK product's A operand.
        DS_REGS: gl.constexpr = WG and DS_FMT != "int8"
        ds_a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=hp_layout, k_width=2)
        gl.static_assert(not WRITE_DS_SCALE or (WG and DS_FMT == "int8"), "WRITE_DS_SCALE: the wg kernel, INT8 dS")
        gl.static_assert(not Q_WIDE or (WARP_SPECIALIZE and not DEFER), "Q_WIDE: warp-specialised, no DEFER")

        if not WG:
            # The key block and kv head from the program's first key row (as this partition has always had them).
            pid_bkv = kv_row // SEQ_K
            pid_n = (kv_row - pid_bkv * SEQ_K) // BLOCK_N
        m_blocks = gl.cdiv(SEQ_Q, BLOCK_M)
        k_blocks = gl.cdiv(SEQ_K, BLOCK_N)
        # This partition's 64 keys: the program's, or with WG its half of the program's 128.
        key_block = pid_n
        if WG:
            key_block = pid_n * 2 + HALF
            key0 = key_block * BLOCK_N
        bh0 = row_q0 // SEQ_Q
        if not WARP_SPECIALIZE:
            origins = _load_origins(origins, row_q0, kv_row, SEQ_Q)
            _load_kv(desc_k, desc_v, k_smem, v_smem, kv_bar, kv_row, origins, 1)
            # n_m is 0 or less where the key block starts past the last query (causal, more keys than queries):
            # total <= 0 and nothing loads, but _issue_loads still divides by n_m (undefined in LLVM IR for 0).
            # Inside the loop total > 0, so n_m >= 1 there.
            for i in gl.static_range(STAGES - 1):
                _issue_loads(
                    i, total, gl.maximum(n_m, 1), lo_tile, row_q0, origins, desc_q, desc_qt, desc_do, desc_dot,
                    desc_lse, desc_delta, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, ready, SEQ_Q,
                    HEAD_DIM, BLOCK_M, STAGES, LOAD_QT=LOAD_QT,
                )  # fmt: skip
        k_scale = gl.load(K_SCALE + pid_bkv * k_blocks + key_block)

        offs_key = key_block * BLOCK_N + gl.arange(0, BLOCK_N, layout=key_l)
        offs_q_tile = gl.arange(0, BLOCK_M, layout=query_l)
        s_zero, dp_zero, acc_zero, dk, dv, err2, norm2 = _dkdv_zeros(
            s_layout, dp_layout, acc_layout, key_l, BLOCK_N, BLOCK_M, HEAD_DIM
        )
        # With WG, a non-INT8 dS and the statistics: err2 and norm2 kept in shared memory through the loop (as
        # registers they crossed each tile's P^T and dP^T, where the warpgroup's 240 are short, and spilled).
        STATS_SMEM: gl.constexpr = WG and WITH_STATS and DS_FMT != "int8"
        if STATS_SMEM:
            stats_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
            err2_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N], stats_layout, err2)
            norm2_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N], stats_layout, norm2)
        # Without WG, the two exchanges between the warpgroups (P's per-key maxima, dS's per-warp maxima) in buffers of
        # their own: in Triton's shared scratch dS's write waited for P's readers (a barrier a tile).
        p_x = None
        ds_x = None
        if not WG:
            p_x = gl.allocate_shared_memory(gl.float32, [BLOCK_N, 2], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
            ds_x = gl.allocate_shared_memory(gl.float32, [8], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        # A bf16 dS enters dK's product times Q's tile scale (_ds_values' fold: the reference's numerics), so nothing
        # scales the product. With WG it adds into dK inside the tensor core: dK (dk_run, the product's accumulator
        # layout) is its accumulator, and the 32 registers of an accumulator of its own are free (for DP_BESIDE_S).
        # Without WG the product still runs into zeros and is added after it: in place, the D=128 kernel took 1.035x
        # the time non-causal (device run 47), with 10% fewer instructions in its loop.
        FOLD: gl.constexpr = DS_FMT == "bf16"
        INPLACE: gl.constexpr = FOLD and WG
        gl.static_assert(not DP_BESIDE_S or WG, "DP_BESIDE_S: the wg kernel")
        if INPLACE:
            dk_run = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, hp_layout)
        mbarrier.wait(kv_bar, 0)
        if DEFER:
            # The tile before's dV and dK products, finished in the next iteration (their scales with them).
            dv_tok = warpgroup_mma_init(acc_zero)
            if DS_FMT == "int8":
                dk_tok = warpgroup_mma_init(acc_zero)
            else:
                dk_tok = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, hp_layout))
            dv_c = gl.zeros([BLOCK_N], gl.float32, acc_row_l)
            dk_c = k_scale * 0.0

        for t in range(total):
            stage = t % STAGES
            if not WARP_SPECIALIZE and not DEFER:
                # Stage (t - 1) % STAGES was last read by iteration t - 1's products, which every warp waited
                # for before the barrier that ended that iteration: refill it with iteration t + STAGES - 1's.
                _issue_loads(
                    t + STAGES - 1, total, n_m, lo_tile, row_q0, origins, desc_q, desc_qt, desc_do, desc_dot,
                    desc_lse, desc_delta, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, ready, SEQ_Q,
                    HEAD_DIM, BLOCK_M, STAGES, LOAD_QT=LOAD_QT,
                )  # fmt: skip
            start_m, offs_q, q_scale, do_scale = _dkdv_tile(
                t, n_m, lo_tile, bh0, m_blocks, offs_q_tile, Q_SCALE, DO_SCALE, BLOCK_M
            )

            mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
            if DS_FMT != "int8" and not DEFER and not Q_WIDE:
                # Q'^ widened to bf16 (dK's B operand; the tile before's dK product was waited for at its end).
                # Before S and dP are issued: with their 64 accumulator registers in flight, the causal variant
                # with statistics spilled (offline sm_90 compile, 240 registers). With WG, while few registers are
                # live: before S's accumulator.
                _widen_codes(q_smem.index(stage), qb_smem, BLOCK_M, HEAD_DIM, 4 * WARPS_N, 8)
            if not DEFER and not WG:
                lse = lse_smem.index(stage).load(query_l)
                delta = delta_smem.index(stage).load(query_l)
            # S^T = K'^ Q'^T (int32) and dP^T = V dO^T (fp32), both in flight at once. With WG only where
            # DP_BESIDE_S (wg_dp_beside_s): otherwise dP^T's product is issued after P's codes are stored, since with
            # both accumulators in flight beside lse, dK and dV the warpgroup needed more than its 240 registers
            # (the other warpgroup keeps the tensor cores busy meanwhile).
            s_tok = warpgroup_mma(k_smem, q_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            if not WG or DP_BESIDE_S:
                dp_tok = warpgroup_mma(
                    v_smem, do_smem.index(stage).permute((1, 0)), dp_zero, use_acc=False, is_async=True
                )
            if WG:
                s_int = warpgroup_mma_wait(num_outstanding=1 if DP_BESIDE_S else 0, deps=[s_tok])
                # lse and delta of the tile's queries came with its tiles through the TMA ring.
                lse = lse_smem.index(stage).load(query_l)
            if DEFER:
                # The tile before's dV and dK were committed before S and dP: two groups may stay in flight.
                # Their scaling overlaps this tile's S and dP on the tensor cores; the order of the additions
                # into dV and dK is the same as without DEFER.
                dv_int = warpgroup_mma_wait(num_outstanding=2, deps=[dv_tok])
                dk_int = warpgroup_mma_wait(num_outstanding=2, deps=[dk_tok])
                dv += _int32_scaled(dv_int, dv_c[:, None])
                if DS_FMT == "int8":
                    dk += _int32_scaled(dk_int, dk_c)
                elif FOLD:
                    dk += gl.convert_layout(dk_int, acc_layout)
                else:
                    dk += gl.convert_layout(dk_int, acc_layout) * dk_c
                # Both warpgroups are done with the codes and the tile before's stage.
                gl.thread_barrier()
                if WARP_SPECIALIZE:
                    mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), count=1, pred=t > 0)
                else:
                    _issue_loads(
                        t + STAGES - 1, total, n_m, lo_tile, row_q0, origins, desc_q, desc_qt, desc_do, desc_dot,
                        desc_lse, desc_delta, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, ready, SEQ_Q,
                        HEAD_DIM, BLOCK_M, STAGES, LOAD_QT=LOAD_QT,
                    )  # fmt: skip
                # Loaded here, after the tile before's dV and dK are out of the registers.
                lse = lse_smem.index(stage).load(query_l)
                delta = delta_smem.index(stage).load(query_l)
                if DS_FMT != "int8":
                    # Q'^ widened to bf16 once the tile before's dK product (which read the buffer) is done.
                    _widen_codes(q_smem.index(stage), qt_smem, BLOCK_M, HEAD_DIM, 8, 8)
            if not WG:
                s_int = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
            # P's codes (its per-key scale a reduction across both warpgroups; with WG within the thread quad that
            # holds the row). Causal: only the first query tile of a key block can hold a key after its query
            # (top-left); with WG, a tile whose first query comes before this half's last key.
            if WG:
                masked = start_m < key0 + BLOCK_N - 1
            else:
                masked = start_m + 1 < (pid_n + 1) * BLOCK_N
            if DS_FMT == "int8":
                p, p_scale = _p_codes(
                    s_int, q_scale * k_scale * qk_scale, lse, p_smem, offs_key, offs_q, masked, CAUSAL, p_x
                )
            else:
                p, p_scale = _p_codes_lean(
                    s_int, q_scale * k_scale * qk_scale, lse, p_smem, offs_key, start_m, masked, CAUSAL, BLOCK_M,
                    query_l, p_x,
                )  # fmt: skip
            if WG and not DP_BESIDE_S:
                dp_tok = warpgroup_mma(
                    v_smem, do_smem.index(stage).permute((1, 0)), dp_zero, use_acc=False, is_async=True
                )
            dp = gl.convert_layout(warpgroup_mma_wait(num_outstanding=0, deps=[dp_tok]), s_layout)
            if WG:
                # delta once dP^T is in: loaded while dP^T's product ran, its 32 registers beside P^T, dP^T's
                # accumulator, dK and dV took the warpgroup past its 240 and dV spilled (issue 42).
                delta = delta_smem.index(stage).load(query_l)
            # One dS scale for the 64 x 128 tile (a reduction across both warpgroups; with WG within the warpgroup).
            if DS_FMT == "int8":
                ds_scale, err2, norm2 = _ds_codes(p, dp, delta, ds_smem, err2, norm2, WITH_STATS, ds_x)
                dv_tok, dk_tok = _dkdv_products(p_smem, ds_smem, dot_smem.index(stage), qt_smem.index(stage), acc_zero)
            else:
                ds_dst = None if DS_REGS else ds_smem
                if STATS_SMEM:
                    ds_scale, tile_err2, tile_norm2, ds_vals = _ds_values_sums(
                        p, dp, delta, ds_dst, DS_FMT, q_scale if FOLD else None
                    )
                    # The same additions into err2 and norm2 as _ds_values', in shared memory (each key's sums are its
                    # thread quad's; Triton puts a barrier between these reads and writes, and the products' and the
                    # loop's barriers come before the next tile's reads).
                    err2_t = err2_smem.load(key_l) + tile_err2
                    norm2_t = norm2_smem.load(key_l) + tile_norm2
                    err2_smem.store(err2_t)
                    norm2_smem.store(norm2_t)
                else:
                    ds_scale, err2, norm2, ds_vals = _ds_values(
                        p, dp, delta, ds_dst, err2, norm2, WITH_STATS, DS_FMT, q_scale if FOLD else None
                    )
                qb_tile = qb_smem
                if Q_WIDE:
                    if WG:
                        qb_tile = qt_smem.index(stage)  # the preprocess's bf16 copy of Q'^, through the ring
                    else:
                        # The preprocess's bf16 copy of Q'^: one buffer beside the ring, its own barrier pair
                        # (index STAGES; the load warp refills it once this iteration releases it).
                        mbarrier.wait(ready.index(STAGES), t & 1)
                        qb_tile = qt_smem
                ds_a = ds_smem
                if DS_REGS:
                    # dS^T's bf16 operand as the dK product's A from registers: the accumulator layout of S^T and
                    # dP^T holds it as a 16-bit A operand wants it (no data moves), and dS skips shared memory.
                    ds_a = gl.convert_layout(ds_vals, ds_a_layout)
                # With INPLACE the product adds into dK itself, else into zeros.
                dv_tok, dk_tok = _dkdv_products_hp(
                    p_smem, ds_a, dot_smem.index(stage), qb_tile, acc_zero,
                    dk_run if INPLACE else gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, hp_layout), INPLACE,
                )  # fmt: skip
            if DEFER:
                dv_c = gl.convert_layout(p_scale, acc_row_l) * do_scale
                if not FOLD:
                    dk_c = ds_scale * q_scale
            elif DS_FMT == "int8":
                dv, dk = _dkdv_accumulate(dv_tok, dk_tok, dv, dk, p_scale, do_scale, ds_scale, q_scale, acc_row_l)
                if WRITE_DS_SCALE:
                    # The tile's scale for the dQ kernel (its warpgroups of 64 queries cannot reduce over the
                    # tile's 128): query head bh0 + g, query block, this half's key block (the flat iteration as
                    # _dkdv_tile splits it). Here, once the products are in, it cost the fewest spills of the
                    # places tried (offline sm_90: before or after the products are issued, at the loop's end).
                    ds_index = ((bh0 + t // n_m) * m_blocks + lo_tile + t % n_m) * k_blocks + key_block
                    gl.store(DS_SCALE + ds_index, ds_scale)
            elif INPLACE:
                dv, dk_run = _dkdv_accumulate_hp(
                    dv_tok, dk_tok, dv, dk_run, p_scale, do_scale, ds_scale, q_scale, acc_layout, DS_FMT, True
                )
            else:
                dv, dk = _dkdv_accumulate_hp(
                    dv_tok, dk_tok, dv, dk, p_scale, do_scale, ds_scale, q_scale, acc_layout, DS_FMT, False
                )
            if not DEFER:
                # The consumers are done with the codes and this stage before either overwrites them (and, with the
                # load partition, before the stage is handed back to it; with WG each warpgroup on its own, the
                # load warp refilling a stage once both have).
                gl.thread_barrier()
                if WARP_SPECIALIZE:
                    mbarrier.arrive(empty.index(stage), count=1)
                    if Q_WIDE and not WG:
                        mbarrier.arrive(empty.index(STAGES), count=1)
        if DEFER:
            dv_int = warpgroup_mma_wait(num_outstanding=0, deps=[dv_tok])
            dk_int = warpgroup_mma_wait(num_outstanding=0, deps=[dk_tok])
            dv += _int32_scaled(dv_int, dv_c[:, None])
            if DS_FMT == "int8":
                dk += _int32_scaled(dk_int, dk_c)
            elif FOLD:
                dk += gl.convert_layout(dk_int, acc_layout)
            else:
                dk += gl.convert_layout(dk_int, acc_layout) * dk_c
        if INPLACE:
            dk = gl.convert_layout(dk_run, acc_layout)
        if STATS_SMEM:
            err2 = err2_smem.load(key_l)
            norm2 = norm2_smem.load(key_l)
        _dkdv_store(
            dk, dv, err2, norm2, key0 if WG else pid_n * BLOCK_N, pid_bkv, SEQ_K, DK, DV, STATS, tau, acc_layout,
            HEAD_DIM, BLOCK_N, WITH_STATS,
        )  # fmt: skip

    @gluon.jit
    def _gluon_dkdv_kernel(
        desc_q, desc_qt, desc_k, desc_v, desc_do, desc_dot, desc_lse, desc_delta,
        Q_SCALE, K_SCALE, DO_SCALE, DK, DV, STATS, DO_RB, DO_RH, DO_CH, V_RB, V_RH, V_CH,
        BKV, HEADS, GROUP, SEQ_Q, SEQ_K, qk_scale, tau,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, HEAD_CHUNK: gl.constexpr, WITH_STATS: gl.constexpr, WARP_SPECIALIZE: gl.constexpr,
        DEFER: gl.constexpr, LOAD_REGS: gl.constexpr, DS_FMT: gl.constexpr = "int8", WG: gl.constexpr = False,
        CONSUMER_REGS: gl.constexpr = 0, Q_WIDE: gl.constexpr = False, DS_SCALE=None,
        WRITE_DS_SCALE: gl.constexpr = False, DP_BESIDE_S: gl.constexpr = False,
    ):  # fmt: skip
        # A program's 64-key halves: one (both consumer warpgroups on it), or with WG two (a warpgroup each).
        HALVES: gl.constexpr = 2 if WG else 1
        # The program's keys (_dkdv_program: the grid's order, the query tiles it walks).
        pid_n, pid_bkv, lo_tile, n_m, total, row_q0, col_t0, kv_row = _dkdv_program(
            BKV, HEADS, GROUP, SEQ_Q, SEQ_K, HEAD_DIM, BLOCK_M, HALVES * BLOCK_N, CAUSAL, HEAD_CHUNK
        )
        # dO and V read where they lie (rows_view): their tiles' origins.
        origins = _dkdv_origins(col_t0, HEADS, GROUP, SEQ_K, DO_RB, DO_RH, DO_CH, V_RB, V_RH, V_CH)
        # Shared memory: K'^ and V of the program, a STAGES-deep ring of Q'^, Q'^T, dO, dO^T tiles, the codes (with
        # WG each warpgroup's; a stage is released by both consumer warpgroups).
        descs = (desc_q, desc_qt, desc_k, desc_v, desc_do, desc_dot, desc_lse, desc_delta)
        bufs, bars = _dkdv_smem(
            desc_q, desc_qt, desc_k, desc_v, desc_do, desc_dot, desc_lse, desc_delta, BLOCK_M, BLOCK_N, STAGES,
            HALVES, DS_FMT != "int8", Q_WIDE,  # an FP8 or bf16 dS's product: Q'^ in bf16, a ring or one buffer
        )  # fmt: skip
        if WG:
            gl.warp_specialize(
                [
                    (
                        _dkdv_compute,
                        (None, bufs, bars, total, n_m, lo_tile, row_q0, None, None, SEQ_Q, SEQ_K, pid_n, pid_bkv,
                         Q_SCALE, K_SCALE, DO_SCALE, DK, DV, STATS, qk_scale, tau, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                         CAUSAL, WITH_STATS, True, False, DS_FMT, True, 0, Q_WIDE, DS_SCALE, WRITE_DS_SCALE,
                         DP_BESIDE_S),
                    ),
                    (
                        _dkdv_compute,
                        (None, bufs, bars, total, n_m, lo_tile, row_q0, None, None, SEQ_Q, SEQ_K, pid_n, pid_bkv,
                         Q_SCALE, K_SCALE, DO_SCALE, DK, DV, STATS, qk_scale, tau, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                         CAUSAL, WITH_STATS, True, False, DS_FMT, True, 1, Q_WIDE, DS_SCALE, WRITE_DS_SCALE,
                         DP_BESIDE_S),
                    ),
                    (
                        _dkdv_loader,
                        (descs, bufs, bars, total, n_m, lo_tile, row_q0, origins, kv_row, SEQ_Q, HEAD_DIM, BLOCK_M,
                         STAGES, 2, DS_FMT == "int8" or Q_WIDE, Q_WIDE),
                    ),
                ],
                [4, 1],
                [CONSUMER_REGS, LOAD_REGS],
            )  # fmt: skip
        elif WARP_SPECIALIZE:
            gl.warp_specialize(
                [
                    (
                        _dkdv_compute,
                        (descs, bufs, bars, total, n_m, lo_tile, row_q0, origins, kv_row, SEQ_Q, SEQ_K, None, None,
                         Q_SCALE, K_SCALE, DO_SCALE, DK, DV, STATS, qk_scale, tau, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                         CAUSAL, WITH_STATS, WARP_SPECIALIZE, DEFER, DS_FMT, False, 0, Q_WIDE),
                    ),
                    (
                        _dkdv_loader,
                        (descs, bufs, bars, total, n_m, lo_tile, row_q0, origins, kv_row, SEQ_Q, HEAD_DIM, BLOCK_M,
                         STAGES, 1, DS_FMT == "int8", Q_WIDE),
                    ),
                ],
                [1],
                [LOAD_REGS],
            )  # fmt: skip
        else:
            _dkdv_compute(
                descs, bufs, bars, total, n_m, lo_tile, row_q0, origins, kv_row, SEQ_Q, SEQ_K, None, None, Q_SCALE,
                K_SCALE, DO_SCALE, DK, DV, STATS, qk_scale, tau, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL,
                WITH_STATS, WARP_SPECIALIZE, DEFER, DS_FMT,
            )  # fmt: skip


def gluon_dkdv_wg_serves(head_dim: int, seq_k: int) -> bool:
    """Whether :func:`gluon_dkdv`'s ``wg`` variant (the plan's ``gluon_dkdv_wg``) serves a call the two-warpgroup
    kernel serves: head dim in :data:`WG_HEAD_DIMS` and a key count that is a multiple of
    :data:`WG_KEYS_PER_PROGRAM`.

    Example::

        gluon_dkdv_wg_serves(64, 4096)   # True
    """
    return head_dim in WG_HEAD_DIMS and seq_k % WG_KEYS_PER_PROGRAM == 0


def gluon_dkdv(
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
    stages: int | None = None,
    warp_specialize: bool = True,
    defer: bool = False,
    ds_fmt: str = "int8",
    wg: bool = False,
    q_wide: torch.Tensor | None = None,
    ds_scale_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dK and dV as ``backward()``'s ``_dkdv_kernel`` launch returns them (and the dS statistics added into
    ``stats``), for the calls the plan (:func:`..plan.plan_attention`) gives it.

    Args:
        grad_out: dO ``[B, Hq, N, D]`` bf16, any strides: read where it lies when contiguous or a model's ``[B, N, H,
            D]`` memory, else copied contiguous (:func:`.gluon_common.rows_view`).
        delta, do_codes_t, do_scale: from :func:`..quant.backward_preprocess` (``codes_t=True``).
        q_op, q_op_t, q_scale, k_op, k_scale: the forward's INT8 Q'^ ``[B, Hq, N, D]``, its ``[B, Hq, D, N]``
            copy, scales per 128 rows; K'^ ``[B, Hkv, Nk, D]`` and its scales per 64 rows.
        v: V ``[B, Hkv, Nk, D]`` (dP's operand in bf16), read where it lies as ``grad_out``.
        lse: the forward's base-2 logsumexp ``[B, Hq, N]``.
        stats: fp32 ``(2,)`` the dS statistics are added into, or ``None``.
        is_causal, scale: as the forward.
        stages: depth of the TMA ring; ``None``: 2 at D=128 (202.5 KiB; 3 would need 282), 3 at D=64 (151.6 KiB).
            With ``wg`` (3 at D=64): 40 KiB per stage beside 56 KiB of K, V and codes; with a non-INT8 dS and
            ``q_wide`` 49 KiB per stage beside 40 KiB, without ``q_wide`` 33 KiB per stage beside 72 KiB. Without
            ``wg``, a non-INT8 dS: 210.5 KiB at D=128 (65 KiB per stage beside 80 KiB, the widened tile's 32 among
            them; with ``q_wide`` the same, its tile in the widened one's place), 151.6 KiB at D=64.
        warp_specialize: a one-warp load partition beside the two consumer warpgroups (FA3's structure), or
            one partition of 8 warps that also issues the loads.
        defer: finish each tile's dV and dK products in the next iteration, after its S and dP are issued, so
            their scaling overlaps the tensor cores (same values, same order of additions).
        ds_fmt: dS's format, as ``_dkdv_kernel``'s ``DS_FMT``: ``"int8"`` (SageBwd's); ``"fp8"`` (e4m3 codes, one
            scale per tile) or ``"bf16"``, whose dK product runs in bf16 against Q'^'s codes widened to bf16 in
            shared memory (``q_op_t`` is not read).
        wg: one warpgroup per 64 keys (the plan's ``gluon_dkdv_wg``: the module's docstring), the same dK and dV bit
            for bit, for the calls :func:`gluon_dkdv_wg_serves` accepts; it is warp-specialised without ``defer``
            (``warp_specialize`` and ``defer`` left as they are by default).
        q_wide: with a non-INT8 ``ds_fmt``, Q'^ widened to bf16, ``[B, Hq, N, D]`` contiguous (``backward``'s
            ``widen_q``: the preprocess launch writes it), read by the warp-specialised variants without ``defer``:
            with ``wg`` loaded through the TMA ring beside Q'^; without, into one buffer beside the ring (in the
            place of the widened tile: the same shared memory, 210 KiB at D=128), loaded once the tile before's dK
            product has released it. ``None``: the consumers widen every tile's codes in shared memory (the same dK
            and dV, more instructions: issue 42's D=128 profile put 14% of the kernel's stalls there).
        ds_scale_out: with ``wg`` and an INT8 dS, fp32 ``[B, Hq, N / 128, Nk / 64]`` contiguous
            (:func:`.gluon_common.ds_scales_shape`; ``backward``'s ``share_ds_scales`` allocates it) into which each
            tile's dS scale is stored, at its query head, query block and key block: what :func:`.gluon_dq.gluon_dq`'s
            three consumer warpgroups (``ds_scale=``) read in place of a reduction over 128 queries that a warpgroup
            of 64 cannot make. The scale is ``max|dS| / 127`` over the tile (1 where that is 0), the one dK's codes
            take. A causal call leaves the tiles no query of which sees a key of the block unwritten (the dQ kernel
            does not visit them either). ``None``: nothing stored (the kernel compiles as without the argument).

    Returns:
        ``(dK, dV)`` ``[B, Hkv, Nk, D]`` bf16, contiguous.

    Raises:
        ValueError: a ``ds_fmt`` it does not take; with ``wg`` a call :func:`gluon_dkdv_wg_serves` refuses or another
            variant; a ``q_wide`` with ``defer`` or without ``warp_specialize``, with an INT8 dS or not of Q'^'s shape
            in bf16, contiguous; a ``ds_scale_out`` without ``wg`` and an INT8 dS, or not of
            :func:`.gluon_common.ds_scales_shape` in fp32, contiguous.

    Example::

        dk, dv = gluon_dkdv(grad_out, delta, codes_t, dscale, q_op, q_op_t, q_scale, k_op, k_scale, v, lse, None,
                            is_causal=False, scale=0.125)
        dk, dv = gluon_dkdv(grad_out, delta, codes_t, dscale, q_op, q_op_t, q_scale, k_op, k_scale, v, lse, None,
                            is_causal=False, scale=0.125, wg=True)
    """
    batch, heads, seq_q, head_dim = q_op.shape
    kv_heads, seq_k = k_op.shape[1], k_op.shape[2]
    name = "gluon_dkdv_wg" if wg else "gluon_dkdv"
    if wg and not gluon_dkdv_wg_serves(head_dim, seq_k):
        raise ValueError(
            f"gluon_dkdv_wg: serves head_dim in {WG_HEAD_DIMS} and seq_k a multiple of {WG_KEYS_PER_PROGRAM}; "
            f"received head_dim={head_dim}, seq_k={seq_k}"
        )
    if wg and not (warp_specialize and not defer):
        received = f"warp_specialize={warp_specialize}, defer={defer}"
        raise ValueError(f"gluon_dkdv_wg: is warp-specialised without defer; received {received}")
    if ds_fmt not in ("int8", "fp8", "bf16"):
        raise ValueError(f"{name}: ds_fmt must be 'int8', 'fp8' or 'bf16'; received {ds_fmt!r}")
    if q_wide is not None and not (warp_specialize and not defer):
        raise ValueError(
            f"{name}: q_wide is read by the warp-specialised variants without defer (warp_specialize=True, "
            f"defer=False); received warp_specialize={warp_specialize}, defer={defer}"
        )
    if q_wide is not None and (
        ds_fmt == "int8" or q_wide.dtype != torch.bfloat16 or q_wide.shape != q_op.shape or not q_wide.is_contiguous()
    ):
        raise ValueError(
            f"{name}: q_wide must be Q'^ in bf16 {tuple(q_op.shape)}, contiguous, with ds_fmt 'fp8' or 'bf16'; "
            f"received {q_wide.dtype} {tuple(q_wide.shape)}, contiguous={q_wide.is_contiguous()}, ds_fmt={ds_fmt!r}"
        )
    if ds_scale_out is not None:
        if not (wg and ds_fmt == "int8"):
            raise ValueError(
                f"{name}: ds_scale_out is written by the wg variant with an INT8 dS only (wg=True, ds_fmt='int8'); "
                f"received wg={wg}, ds_fmt={ds_fmt!r}"
            )
        check_ds_scales(name, "ds_scale_out", ds_scale_out, q_op, k_op)
    stages = stages if stages is not None else (3 if head_dim == 64 else 2)
    q_op_t = q_op_t if ds_fmt == "int8" else None  # Q'^ in bf16 (q_wide, or widened in the kernel) stands in
    descs, dk, dv, layouts = dkdv_operands(
        grad_out, delta, do_codes_t, q_op, q_op_t, k_op, v, lse, BLOCK_M, BLOCK_N, q_wide=q_wide
    )
    bkv = batch * kv_heads
    if wg:
        beside = wg_dp_beside_s(ds_fmt, is_causal, q_wide is not None)
        programs = seq_k // WG_KEYS_PER_PROGRAM
        head_chunk = WG_HEAD_CHUNK
        variant = dict(
            WG=True, CONSUMER_REGS=WG_CONSUMER_REGS, **({} if q_wide is None else {"Q_WIDE": True}), num_warps=4,
            maxnreg=WG_MAXNREG,
            **({} if ds_scale_out is None else {"DS_SCALE": ds_scale_out, "WRITE_DS_SCALE": True}),
            **({"DP_BESIDE_S": True} if beside else {}),
        )  # fmt: skip
    else:
        programs = seq_k // BLOCK_N
        head_chunk = HEAD_CHUNK[head_dim] if is_causal else 1
        variant = dict(
            num_warps=8, **({"maxnreg": WS_MAXNREG} if warp_specialize else {}),
            **({} if q_wide is None else {"Q_WIDE": True}),
        )  # fmt: skip
    _gluon_dkdv_kernel[(programs * bkv,)](
        *descs, q_scale, k_scale, do_scale, dk, dv, stats if stats is not None else delta, *layouts,
        bkv, heads, heads // kv_heads, seq_q, seq_k, scale * LOG2E, scale,
        HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=stages, CAUSAL=is_causal, HEAD_CHUNK=head_chunk,
        WITH_STATS=stats is not None, WARP_SPECIALIZE=warp_specialize, DEFER=defer, LOAD_REGS=LOAD_REGS,
        **({} if ds_fmt == "int8" else {"DS_FMT": ds_fmt}),
        **variant,
    )  # fmt: skip
    return dk, dv
