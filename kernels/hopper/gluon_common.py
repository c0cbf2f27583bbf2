"""What the Gluon backward kernels for Hopper share: :mod:`.gluon_backward` (dK and dV, both its variants) and
:mod:`.gluon_dq` (dQ, both its variants). The quantization (SageBwd's INT8 codes and scales) and the scaling of
an int32 product; the grid order by head chunks and the wgmma layouts; per pass, what both partitions of the work
(two warpgroups splitting each tile, or one warpgroup per tile) compute alike: the program's place and shared
memory, the TMA loads, a tile's scores, codes and products, the epilogue; on the host, the TMA descriptors.

Each helper is the code the kernels had inline, moved here unchanged (the same operations in the same order): the
kernels compile to the same instructions. Where the partitions differ (the order in which a tile's products are
issued and waited for, the barriers, who loads what), the kernels keep their own code. The exceptions are the
scales' maxima across warps (:func:`_tile_amax`, :func:`_row_max`), which replaced Triton's nested reductions
with one exchange each: the same values (a maximum is exact in any order), fewer barriers.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from ..tiles import GLUON_BLOCK_M, GLUON_BLOCK_N, ds_scales_shape, rows_layout

try:  # Gluon's Hopper API as in Triton 3.6; older Tritons lack it and keep the portable kernels.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = hasattr(gl, "warp_specialize") and hasattr(tma, "async_copy_global_to_shared")
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

ROWS_BLOCK = 128  #: Queries per lse and delta tile (:func:`_rows_desc`): every kernel's query tile.


if HAVE_GLUON:
    _ROUNDER = gl.constexpr(12582912.0)
    _ROUNDER_BITS = gl.constexpr(0x4B400000)

    @gluon.constexpr_function
    def _wgmma_layout(warps_m, warps_n, instr_n, instr_k):
        """A wgmma accumulator's layout over ``warps_m x warps_n`` warps, instruction m16 x ``instr_n x instr_k``."""
        return gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[warps_m, warps_n], instr_shape=[16, instr_n, instr_k]
        )

    @gluon.jit
    def _max_nan(a, b):
        return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @gluon.jit
    def _nan_max(x, axis: gl.constexpr):
        """``max`` along ``axis`` that returns NaN when any element is NaN (``quant.nan_max``)."""
        return gl.reduce(x, axis, _max_nan)

    @gluon.jit
    def _int8_scale(amax):
        scale = amax / 127.0
        return gl.where(scale == 0.0, 1.0, scale)

    @gluon.jit
    def _int8_codes(x, scale):
        """``quant.int8_codes`` (not EXACT): the fma's rounded float's low byte is the code."""
        return gl.fma(x, 1.0 / scale, _ROUNDER).to(gl.int32, bitcast=True).to(gl.int8)

    @gluon.jit
    def _int8_codes_clamped(x, scale):
        """:func:`_int8_codes` with the codes held to ``[-127, 127]``: for a ``scale`` made by another kernel from
        its own copy of ``x`` (the dK/dV kernel's dS scale read by the dQ kernel), where a last-bit difference between
        the two copies could take a code to 128 and wrap it to -128. Where ``scale`` is ``x``'s own the clamp changes
        nothing (``|x| / scale`` is at most 127 to rounding)."""
        rounded = gl.fma(x, 1.0 / scale, _ROUNDER)
        rounded = gl.minimum(gl.maximum(rounded, _ROUNDER - 127.0), _ROUNDER + 127.0)
        return rounded.to(gl.int32, bitcast=True).to(gl.int8)

    @gluon.constexpr_function
    def _warp_split(shape, warp_bases, dims):
        """How :func:`_tile_amax` and :func:`_row_max` reshape a tile so that each warp's elements are apart.

        Each of ``dims`` of ``shape`` is split into runs of its index bits (most significant first) that the warps
        tell apart (a warp basis of the layout, ``warp_bases``) or do not; the other dims stay whole. Returns the new
        shape and, descending, the axes of the runs no warp tells apart (those a warp reduces alone, in registers and
        shuffles). A ``[64, 128]`` tile over warps ``[4, 2]`` (warp bases rows 16 and 32, column 64) splits into
        ``[4, 16, 2, 64]``, axes ``(3, 1)``; its columns alone into ``[64, 2, 64]``, axis ``(2,)``."""
        warp_bits = set()
        for basis in warp_bases:
            placed = [(dim, value) for dim, value in enumerate(basis) if value]
            if len(placed) > 1 or (placed and placed[0][1] & (placed[0][1] - 1)):
                raise ValueError(f"warp_bases must each hold one power of two; received {warp_bases}")
            if placed:
                warp_bits.add((placed[0][0], placed[0][1].bit_length() - 1))
        split, axes = [], []
        for dim, size in enumerate(shape):
            if dim not in dims:
                split.append(size)
                continue
            runs = []
            for bit in reversed(range(size.bit_length() - 1)):
                by_warps = (dim, bit) in warp_bits
                if runs and runs[-1][0] == by_warps:
                    runs[-1][1] += 1
                else:
                    runs.append([by_warps, 1])
            for by_warps, bits in runs:
                if not by_warps:
                    axes.append(len(split))
                split.append(2**bits)
        return tuple(split), tuple(sorted(axes, reverse=True))

    @gluon.constexpr_function
    def _whole_in_threads(count, lanes, warps):
        """The layout of a ``[count]`` tensor that every thread holds whole (``lanes`` and ``warps`` bases, none
        apart)."""
        return gl.DistributedLinearLayout(
            reg_bases=[[2**bit] for bit in range(count.bit_length() - 1)], lane_bases=[[0]] * lanes,
            warp_bases=[[0]] * warps, block_bases=[], shape=[count],
        )  # fmt: skip

    @gluon.constexpr_function
    def _rows_with_columns(rows, count):
        """The layout ``rows`` (a 1-D linear layout) with a second dim of ``count`` held in each thread's registers."""
        return gl.DistributedLinearLayout(
            reg_bases=[[b[0], 0] for b in rows.reg_bases] + [[0, 2**bit] for bit in range(count.bit_length() - 1)],
            lane_bases=[[b[0], 0] for b in rows.lane_bases], warp_bases=[[b[0], 0] for b in rows.warp_bases],
            block_bases=[], shape=[rows.shape[0], count],
        )  # fmt: skip

    @gluon.constexpr_function
    def _same_shape(a, b):
        """Whether two shapes are the same dims (a shared buffer's against a tensor's)."""
        return [int(d) for d in a] == [int(d) for d in b]

    @gluon.constexpr_function
    def _columns_by_warps(warp_bases):
        """Whether any warp basis of a 2-D layout lies along its columns (a row's elements in several warps)."""
        return any(basis[1] for basis in warp_bases)

    @gluon.jit
    def _warp_maxima(x, DIMS: gl.constexpr):
        """``x`` reshaped by :func:`_warp_split` over ``DIMS`` and reduced (NaN-propagating maximum) over the axes no
        warp tells apart: each warp's maxima of its own elements (registers, then shuffles), no exchange yet."""
        lin: gl.constexpr = gl.to_linear_layout(x.type.layout, x.shape)
        SPLIT: gl.constexpr = _warp_split(lin.shape, lin.warp_bases, DIMS)
        part = gl.reshape(x, SPLIT[0])
        for i in gl.static_range(len(SPLIT[1])):
            part = gl.reduce(part, SPLIT[1][i], _max_nan)
        return part

    @gluon.jit
    def _exchange(part, whole_l: gl.constexpr, scratch=None):
        """The warps' maxima ``part`` (one per warp, :func:`_warp_maxima`'s) in the layout ``whole_l`` that gives each
        thread all it needs: through the caller's ``scratch`` buffer of ``part``'s shape (one write, one barrier, one
        read), or with ``None`` a layout conversion through Triton's scratch."""
        if scratch is None:
            whole = gl.convert_layout(part, whole_l)
        else:
            gl.static_assert(_same_shape(scratch.shape, part.shape), "scratch: the shape of the warps' maxima")
            scratch.store(part)
            whole = scratch.load(whole_l)
        return whole

    @gluon.jit
    def _tile_amax(x, scratch=None):
        """The largest magnitude of the 2-D tile ``x`` (NaN if any element is), in every thread.

        The same value as ``_nan_max(_nan_max(|x|, 1), 0)`` (a maximum is exact in any order), with one exchange
        between the warps instead of one pair of barriers per axis the warps split (five in the dK/dV kernel's
        ``[64, 128]`` tile over two warpgroups): each warp reduces its own elements (registers, then shuffles), then
        one write of the warps' maxima to shared memory, one barrier, and every thread reads them all. ``scratch``: a
        ``[warps]`` fp32 buffer of the caller's for that exchange (allocated once, outside its loop: Triton's scratch
        for the conversion is shared with the kernel's other exchanges, and the barrier pass then waits for their
        readers before this write); ``None``, a layout conversion through Triton's scratch."""
        lin: gl.constexpr = gl.to_linear_layout(x.type.layout, x.shape)
        part = _warp_maxima(gl.abs(x), (0, 1))
        WARPS: gl.constexpr = part.numel
        part = gl.reshape(part, [WARPS])
        whole = _exchange(part, _whole_in_threads(WARPS, len(lin.lane_bases), len(lin.warp_bases)), scratch)
        return gl.reduce(whole, 0, _max_nan)

    @gluon.jit
    def _row_max(x, scratch=None):
        """``_nan_max(x, 1)``: each row's largest element of the 2-D tile ``x`` (NaN if any is), in the threads of the
        row's layout (``SliceLayout(1, x's)``). Where a row lies in several warps (the dK/dV kernel's two
        warpgroups, 64 of a key's 128 queries each), each reduces its part alone and one exchange through shared
        memory (one barrier) gives every thread of the row the others' (two barriers before); elsewhere the
        reduction as it was. ``scratch``: a ``[rows, warps along a row]`` fp32 buffer for that exchange, as
        :func:`_tile_amax`'s."""
        lin: gl.constexpr = gl.to_linear_layout(x.type.layout, x.shape)
        row_l: gl.constexpr = gl.SliceLayout(1, x.type.layout)
        if _columns_by_warps(lin.warp_bases):
            part = _warp_maxima(x, (1,))
            ROWS: gl.constexpr = x.shape[0]
            WARPS: gl.constexpr = part.numel // ROWS
            part = gl.reshape(part, [ROWS, WARPS])
            whole = _exchange(part, _rows_with_columns(gl.to_linear_layout(row_l, [ROWS]), WARPS), scratch)
            result = gl.convert_layout(gl.reduce(whole, 1, _max_nan), row_l, assert_trivial=True)
        else:
            result = _nan_max(x, 1)
        return result

    @gluon.jit
    def _tile_scale(x, scratch=None):
        """One INT8 scale for the whole 2-D tile ``x`` (dS's granularity): its largest magnitude over 127."""
        return _int8_scale(_tile_amax(x, scratch))

    @gluon.jit
    def _fp8_scale(amax):
        """``quant.fp8_scale``: ``amax / 448``, or 1 where that is 0."""
        scale = amax / 448.0
        return gl.where(scale == 0.0, 1.0, scale)

    @gluon.jit
    def _ds_operand(ds, DS_FMT: gl.constexpr):
        """dS (fp32) as a non-INT8 dS product's bf16 operand, as ``_dkdv_kernel`` and ``_dq_kernel`` make it, with
        ``(amax, scale)``: ``"fp8"``, its e4m3 codes for one scale over the tile (``quant.fp8_codes``: one multiply by
        the reciprocal) widened to bf16 (exact); ``"bf16"``, dS rounded to bf16 (scale 1, amax not computed: 0)."""
        if DS_FMT == "fp8":
            amax = _tile_amax(ds)
        else:
            amax = gl.to_tensor(0.0)
        values, scale = _ds_operand_from(ds, amax, DS_FMT)
        return values, amax, scale

    @gluon.jit
    def _ds_operand_from(ds, amax, DS_FMT: gl.constexpr):
        """:func:`_ds_operand` given the tile's largest magnitude ``amax`` (unused for bf16): ``(values, scale)``."""
        if DS_FMT == "fp8":
            scale = _fp8_scale(amax)
            # e4m3 -> fp32 -> bf16, both exact (e4m3 -> bf16 directly goes through f16 -> bf16, a quarter-rate F2F).
            values = (ds * (1.0 / scale)).to(gl.float8e4nv).to(gl.float32).to(gl.bfloat16)
        else:
            gl.static_assert(DS_FMT == "bf16", "DS_FMT is int8, fp8 or bf16")
            scale = gl.to_tensor(1.0)
            values = ds.to(gl.bfloat16)
        return values, scale

    @gluon.jit
    def _widen_codes(src, dst, ROWS: gl.constexpr, COLS: gl.constexpr, WARPS: gl.constexpr, VEC: gl.constexpr = 16):
        """``dst [ROWS, COLS]`` (bf16, NVMMA) ``= src [ROWS, COLS]`` (INT8 codes, NVMMA) in shared memory, by the
        ``WARPS`` warps that call it, a chunk of rows at a time (16 codes, one 128-bit load, per thread and chunk; the
        chunks keep few registers live). Every INT8 code is a bf16 exactly. The caller fences and synchronises
        before a wgmma reads ``dst``."""
        tpw_n: gl.constexpr = COLS // VEC
        CHUNK: gl.constexpr = (32 // tpw_n) * WARPS
        layout: gl.constexpr = gl.BlockedLayout(
            size_per_thread=[1, VEC], threads_per_warp=[32 // tpw_n, tpw_n], warps_per_cta=[WARPS, 1], order=[1, 0]
        )
        for c in gl.static_range(ROWS // CHUNK):
            codes = src.slice(c * CHUNK, CHUNK, 0).load(layout)
            dst.slice(c * CHUNK, CHUNK, 0).store(codes.to(gl.bfloat16))

    @gluon.jit
    def _head_chunk_order(lin, n_prog, n_heads, HEAD_CHUNK: gl.constexpr):
        """Program ``lin`` of a 1-D grid of ``n_prog * n_heads`` as ``(prog, head)``: the heads in chunks of
        ``HEAD_CHUNK``, and within a chunk program-major (``prog`` 0 of every head of the chunk, then 1, ...).

        A causal kernel whose ``prog`` 0 is its longest program thus dispatches the long ones first in each chunk
        and ends the grid on short ones (with ``prog`` fastest, the last head's longest program would start just
        before the end and run alone); a chunk's programs read the same few heads, which stay in L2."""
        per_chunk = HEAD_CHUNK * n_prog
        chunk = lin // per_chunk
        head0 = chunk * HEAD_CHUNK
        within = lin - chunk * per_chunk
        heads = gl.minimum(n_heads - head0, HEAD_CHUNK)
        return within // heads, head0 + within % heads

    @gluon.jit
    def _mma_key_order(x, AXIS: gl.constexpr):
        """:func:`..quant.mma_key_order` in Gluon (a Gluon kernel cannot call a ``tl`` function): the 2-D ``x`` with
        its keys along ``AXIS`` in :data:`..quant.MMA_KEY_ORDER`, a reshape and permute."""
        ROWS: gl.constexpr = x.shape[0]
        COLS: gl.constexpr = x.shape[1]
        if AXIS == 0:
            x = x.reshape([ROWS // 16, 2, 2, 2, 2, COLS]).permute((0, 2, 3, 1, 4, 5))
        else:
            x = x.reshape([ROWS, COLS // 16, 2, 2, 2, 2]).permute((0, 1, 3, 4, 2, 5))
        return x.reshape([ROWS, COLS])

    @gluon.jit
    def _int32_scaled(x, scale):
        """``quant.int32_scaled``: ``x.to(fp32) * scale`` for an int32 INT8 product, one fma per element."""
        c = (scale.to(gl.int32, bitcast=True) & -4).to(gl.float32, bitcast=True)
        return gl.fma((x + _ROUNDER_BITS).to(gl.float32, bitcast=True), c, -(c * _ROUNDER))

    # dK and dV (gluon_backward, both variants): a program holds KEYS keys of one kv head (64, or 128 as two
    # 64-key halves, HALVES) and walks every query tile of every query head of its group.

    @gluon.jit
    def _head_origin(bh, lay):
        """Row and column, in the 2-D view of a ``[B, H, N, D]`` tensor :func:`rows_view` makes, of head ``bh``'s (``b *
        H + h``) first row; ``lay`` is ``(H, rows a batch, rows a head, columns a head)``: contiguous ``(H, H * N, N,
        0)`` gives ``(bh * N, 0)``, a model's ``[B, N, H, D]`` memory ``(H, N, 0, D)`` gives ``(b * N, h * D)``."""
        heads, rows_b, rows_h, cols_h = lay
        b = bh // heads
        h = bh - b * heads
        return b * rows_b + h * rows_h, h * cols_h

    @gluon.jit
    def _view_lays(HEADS, GROUP, DO_RB, DO_RH, DO_CH, V_RB, V_RH, V_CH):
        """dO's and V's layouts in their :func:`rows_view` views as both backward kernels take them (their
        ``DO_*``/``V_*`` arguments), for :func:`_view_origins`: ``((HEADS, DO_RB, DO_RH, DO_CH), (GROUP, V_RB, V_RH,
        V_CH))``. Only the arguments, nothing computed: V's head count (``HEADS // GROUP``) is divided where the
        origins are, so a kernel that computes them in its load partition passes the partition its arguments."""
        return (HEADS, DO_RB, DO_RH, DO_CH), (GROUP, V_RB, V_RH, V_CH)

    @gluon.jit
    def _view_origins(bh, kv_bh, lays):
        """Where both backward kernels place dO's and V's tiles from: ``((do_row, do_col), (v_row, v_col))``, query
        head ``bh``'s first row and column in dO's view and kv head ``kv_bh``'s in V's (:func:`_head_origin`, ``lays``
        from :func:`_view_lays`). The dQ kernel takes them in its prologue, the dK/dV kernel in its load partition
        (:func:`_load_origins`). Tuples are unpacked one level at a time: Triton 3.6's cache key cannot hash a tuple
        unpacked inside a tuple."""
        do_lay, v_lay = lays
        heads, _, _, _ = do_lay
        group, v_rb, v_rh, v_ch = v_lay
        return _head_origin(bh, do_lay), _head_origin(kv_bh, (heads // group, v_rb, v_rh, v_ch))

    @gluon.jit
    def _dkdv_program(
        BKV, HEADS, GROUP, SEQ_Q, SEQ_K, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, KEYS: gl.constexpr,
        CAUSAL: gl.constexpr, HEAD_CHUNK: gl.constexpr,
    ):  # fmt: skip
        """This program's ``(pid_n, pid_bkv, lo_tile, n_m, total, row_q0, col_t0, kv_row)``: its key block and kv
        head; its first query tile and their count per query head; its flat iterations (query heads x tiles); its
        group's first row in the ``[B*H*N, D]`` and ``[B*H*D, N]`` views; its first key's row in ``[B*Hkv*Nk, D]``."""
        # Causal: program 0 of a kv head (its first keys) sees every query tile, the longest first.
        pid_n, pid_bkv = _head_chunk_order(gl.program_id(0), SEQ_K // KEYS, BKV, HEAD_CHUNK)
        kv_heads = HEADS // GROUP
        b = pid_bkv // kv_heads
        m_blocks = gl.cdiv(SEQ_Q, BLOCK_M)
        lo_tile = 0
        if CAUSAL:
            # Query tiles that end before this program's first key see none of its keys.
            lo_tile = pid_n * KEYS // BLOCK_M
        n_m = m_blocks - lo_tile
        total = GROUP * n_m
        bh0 = b * HEADS + (pid_bkv % kv_heads) * GROUP
        return pid_n, pid_bkv, lo_tile, n_m, total, bh0 * SEQ_Q, bh0 * HEAD_DIM, pid_bkv * SEQ_K + pid_n * KEYS

    @gluon.jit
    def _dkdv_origins(col_t0, HEADS, GROUP, SEQ_K, DO_RB, DO_RH, DO_CH, V_RB, V_RH, V_CH):
        """What the loads place their tiles by, beside :func:`_dkdv_program`'s rows, as the kernel's arguments have
        it (nothing computed in the consumers' partition): :func:`_load_origins` turns it into origins where the
        loads are issued."""
        return col_t0, _view_lays(HEADS, GROUP, DO_RB, DO_RH, DO_CH, V_RB, V_RH, V_CH), SEQ_K

    @gluon.jit
    def _load_origins(origins, row_q0, kv_row, SEQ_Q):
        """:func:`_dkdv_origins`' numbers as the loads take them, ``(col_t0, do_org, v_org)``: the group's first head's
        first row and column in dO's view (:func:`_view_origins`) with a head's row and column step (its query heads
        are consecutive), and the row and column in V's view of the program's first V tile (``kv_row``'s in K'^'s
        ``[B*Hkv*Nk, D]``). Once per program, in the partition that loads."""
        col_t0, lays, seq_k = origins
        do_lay, _ = lays
        _, _, do_rh, do_ch = do_lay
        pid_bkv = kv_row // seq_k
        do_org, v_org = _view_origins(row_q0 // SEQ_Q, pid_bkv, lays)
        do_row, do_col = do_org
        v_row, v_col = v_org
        return col_t0, (do_row, do_col, do_rh, do_ch), (v_row + (kv_row - pid_bkv * seq_k), v_col)

    @gluon.jit
    def _dkdv_smem(
        desc_q, desc_qt, desc_k, desc_v, desc_do, desc_dot, desc_lse, desc_delta, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HALVES: gl.constexpr, HP_DS: gl.constexpr = False,
        Q_WIDE: gl.constexpr = False,
    ):  # fmt: skip
        """Shared memory: K'^ and V of the program (``HALVES`` 64-key tiles; one is not indexed), a ``STAGES``-deep
        ring of Q'^, Q'^T, dO, dO^T, lse and delta tiles, the codes of P^T and dS^T (per half), the ring's
        ``ready``/``empty`` mbarriers (``empty`` released by each of the ``HALVES`` consumers) and K/V's. Returns
        ``(bufs, bars)`` as :func:`_dkdv_loader` and the consumers unpack them.

        With ``HP_DS`` (a non-INT8 dS) no Q'^T is loaded: its slot holds one bf16 ``[BLOCK_M, D]`` tile per half, Q'^
        widened by that half's consumer (the dK product's B operand; two halves run apart, so each widens its own),
        and dS^T's tiles are bf16 (with two halves there are none: each half's stays in registers). With ``Q_WIDE``
        as well, ``desc_qt`` is Q'^ already widened to bf16 (the backward's preprocess makes the copy): with two
        halves the slot is a ring of its ``[BLOCK_M, D]`` tiles, loaded beside Q'^'s; with one (:func:`_load_wide`)
        it is one such tile outside the ring, loaded for each iteration once the one before has released it, behind a
        ``ready``/``empty`` pair of its own (index ``STAGES`` of both: at D=128 a ring of them would take 2 x 16 KiB
        more than the 227 KiB there are at two stages)."""
        # Q'^ in bf16 from the preprocess in one buffer beside the ring (the two-warpgroup kernel).
        WIDE_ONE: gl.constexpr = HP_DS and Q_WIDE and HALVES == 1
        codes_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], gl.int8)
        if HALVES == 1:
            k_smem = gl.allocate_shared_memory(desc_k.dtype, desc_k.block_type.shape, desc_k.layout)
            v_smem = gl.allocate_shared_memory(desc_v.dtype, desc_v.block_type.shape, desc_v.layout)
        else:
            k_smem = gl.allocate_shared_memory(desc_k.dtype, [HALVES] + desc_k.block_type.shape, desc_k.layout)
            v_smem = gl.allocate_shared_memory(desc_v.dtype, [HALVES] + desc_v.block_type.shape, desc_v.layout)
        q_smem = gl.allocate_shared_memory(desc_q.dtype, [STAGES] + desc_q.block_type.shape, desc_q.layout)
        if WIDE_ONE:
            qt_smem = gl.allocate_shared_memory(desc_qt.dtype, desc_qt.block_type.shape, desc_qt.layout)
        elif not HP_DS or Q_WIDE:
            qt_smem = gl.allocate_shared_memory(desc_qt.dtype, [STAGES] + desc_qt.block_type.shape, desc_qt.layout)
        else:
            qb_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(desc_q.block_type.shape, gl.bfloat16)
            if HALVES == 1:
                qt_smem = gl.allocate_shared_memory(gl.bfloat16, desc_q.block_type.shape, qb_layout)
            else:
                qt_smem = gl.allocate_shared_memory(gl.bfloat16, [HALVES] + desc_q.block_type.shape, qb_layout)
        do_smem = gl.allocate_shared_memory(desc_do.dtype, [STAGES] + desc_do.block_type.shape, desc_do.layout)
        dot_smem = gl.allocate_shared_memory(desc_dot.dtype, [STAGES] + desc_dot.block_type.shape, desc_dot.layout)
        lse_smem = gl.allocate_shared_memory(desc_lse.dtype, [STAGES] + desc_lse.block_type.shape, desc_lse.layout)
        delta_smem = gl.allocate_shared_memory(
            desc_delta.dtype, [STAGES] + desc_delta.block_type.shape, desc_delta.layout
        )
        if HALVES == 1:
            p_smem = gl.allocate_shared_memory(gl.int8, [BLOCK_N, BLOCK_M], codes_layout)
            if not HP_DS:
                ds_smem = gl.allocate_shared_memory(gl.int8, [BLOCK_N, BLOCK_M], codes_layout)
            else:
                ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], gl.bfloat16)
                ds_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_M], ds_layout)
        else:
            p_smem = gl.allocate_shared_memory(gl.int8, [HALVES, BLOCK_N, BLOCK_M], codes_layout)
            if not HP_DS:
                ds_smem = gl.allocate_shared_memory(gl.int8, [HALVES, BLOCK_N, BLOCK_M], codes_layout)
            else:
                ds_smem = p_smem  # unused: each half's dS^T stays in registers, the dK product's A operand
        BARRIERS: gl.constexpr = STAGES + 1 if WIDE_ONE else STAGES
        ready = gl.allocate_shared_memory(gl.int64, [BARRIERS, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [BARRIERS, 1], mbarrier.MBarrierLayout())
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(BARRIERS):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=HALVES)
        mbarrier.init(kv_bar, count=1)
        fence_async_shared()
        bufs = (k_smem, v_smem, q_smem, qt_smem, do_smem, dot_smem, p_smem, ds_smem, lse_smem, delta_smem)
        return bufs, (ready, empty, kv_bar)

    @gluon.jit
    def _load_kv(desc_k, desc_v, k_smem, v_smem, kv_bar, kv_row, origins, HALVES: gl.constexpr):
        """TMA loads of the program's K'^ and V (``HALVES`` consecutive 64-key tiles from row ``kv_row`` of K'^'s
        ``[B*Hkv*Nk, D]`` view; V's from its own view, ``origins``: :func:`_load_origins`), once."""
        _, _, v_org = origins
        v_row, v_col = v_org
        mbarrier.expect(kv_bar, HALVES * (desc_k.block_type.nbytes + desc_v.block_type.nbytes))
        if HALVES == 1:
            tma.async_copy_global_to_shared(desc_k, [kv_row, 0], kv_bar, k_smem)
            tma.async_copy_global_to_shared(desc_v, [v_row, v_col], kv_bar, v_smem)
        else:
            half: gl.constexpr = desc_k.block_type.shape[0]
            for h in gl.static_range(HALVES):
                tma.async_copy_global_to_shared(desc_k, [kv_row + h * half, 0], kv_bar, k_smem.index(h))
                tma.async_copy_global_to_shared(desc_v, [v_row + h * half, v_col], kv_bar, v_smem.index(h))

    @gluon.jit
    def _tile_rows(t, n_m, lo_tile, row_q0, SEQ_Q, BLOCK_M: gl.constexpr):
        """Flat iteration ``t`` of a dK/dV program (group member ``t // n_m``, query tile ``lo_tile + t % n_m``):
        ``(g, start_m, row)``, the member, its tile's first query and that query's row in the ``[B*H*N, D]`` views
        (``row_q0``: the group's first head's first row)."""
        g = t // n_m
        start_m = (lo_tile + t % n_m) * BLOCK_M
        return g, start_m, row_q0 + g * SEQ_Q + start_m

    @gluon.jit
    def _issue_loads(
        t, total, n_m, lo_tile, row_q0, origins, desc_q, desc_qt, desc_do, desc_dot, desc_lse, desc_delta,
        q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, ready,
        SEQ_Q, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, PREDICATED: gl.constexpr = True,
        LOAD_QT: gl.constexpr = True, Q_WIDE: gl.constexpr = False,
    ):  # fmt: skip
        """TMA loads of flat iteration ``t`` (group member ``t // n_m``, query tile ``lo_tile + t % n_m``) into
        stage ``t % STAGES``; with ``PREDICATED``, nothing when ``t >= total`` (without, ``t < total`` is the
        caller's). ``row_q0``: the group's first head's first row in the ``[B*H*N, D]`` views; ``origins``
        (:func:`_load_origins`): its first row in the ``[B*H*D, N]`` views, and its first row and column in dO's view.
        Without ``LOAD_QT`` (a non-INT8 dS) no Q'^T tile is loaded; with ``Q_WIDE``
        ``desc_qt`` is Q'^ widened to bf16 (``[B*H*N, D]``, a non-INT8 dS's dK operand), its tile loaded as Q'^'s."""
        s = t % STAGES
        if PREDICATED:
            live = t < total
        else:
            live = True
        g, start_m, row = _tile_rows(t, n_m, lo_tile, row_q0, SEQ_Q, BLOCK_M)
        col_t0, do_org, _ = origins
        row_t = col_t0 + g * HEAD_DIM
        # dO's first row and column of the group's first head, and a head's step (its query heads are consecutive)
        do_row0, do_col0, do_rh, do_ch = do_org
        do_row = do_row0 + g * do_rh
        do_col = do_col0 + g * do_ch
        bar = ready.index(s)
        nbytes: gl.constexpr = (
            desc_q.block_type.nbytes + (desc_qt.block_type.nbytes if LOAD_QT else 0) + desc_do.block_type.nbytes
            + desc_dot.block_type.nbytes + desc_lse.block_type.nbytes + desc_delta.block_type.nbytes
        )  # fmt: skip
        mbarrier.expect(bar, nbytes, pred=live)
        tma.async_copy_global_to_shared(desc_q, [row, 0], bar, q_smem.index(s), pred=live)
        if LOAD_QT:
            if Q_WIDE:
                tma.async_copy_global_to_shared(desc_qt, [row, 0], bar, qt_smem.index(s), pred=live)
            else:
                tma.async_copy_global_to_shared(desc_qt, [row_t, start_m], bar, qt_smem.index(s), pred=live)
        tma.async_copy_global_to_shared(desc_do, [do_row + start_m, do_col], bar, do_smem.index(s), pred=live)
        tma.async_copy_global_to_shared(desc_dot, [row_t, start_m], bar, dot_smem.index(s), pred=live)
        # The tile's lse and delta (512 bytes each) come with it.
        tma.async_copy_global_to_shared(desc_lse, [row], bar, lse_smem.index(s), pred=live)
        tma.async_copy_global_to_shared(desc_delta, [row], bar, delta_smem.index(s), pred=live)

    @gluon.jit
    def _load_wide(t, n_m, lo_tile, row_q0, desc_qt, qt_smem, ready, empty, SEQ_Q, BLOCK_M: gl.constexpr,
                   STAGES: gl.constexpr):  # fmt: skip
        """Iteration ``t``'s tile of Q'^ in bf16 (``desc_qt``, ``[B*H*N, D]``: the preprocess's copy) into the one
        buffer ``qt_smem`` beside the ring (:func:`_dkdv_smem` with ``Q_WIDE`` and one half), once the consumers have
        released iteration ``t - 1``'s (``empty.index(STAGES)``); it lands on ``ready.index(STAGES)``."""
        mbarrier.wait(empty.index(STAGES), (t & 1) ^ 1)
        _, _, row = _tile_rows(t, n_m, lo_tile, row_q0, SEQ_Q, BLOCK_M)
        bar = ready.index(STAGES)
        mbarrier.expect(bar, desc_qt.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_qt, [row, 0], bar, qt_smem)

    @gluon.jit
    def _dkdv_loader(
        descs, bufs, bars, total, n_m, lo_tile, row_q0, origins, kv_row, SEQ_Q,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, HALVES: gl.constexpr,
        LOAD_QT: gl.constexpr = True, Q_WIDE: gl.constexpr = False,
    ):  # fmt: skip
        """The load partition (one warp): K'^ and V once (:func:`_load_kv`), then every iteration's Q'^, Q'^T (or
        with ``Q_WIDE`` Q'^ in bf16), dO and dO^T tiles (with lse and delta) into the ring, each stage refilled once the
        consumers have released it (``empty``). With one half its loads are predicated on ``t < total``
        (:func:`_issue_loads`); with one half and ``Q_WIDE`` (``LOAD_QT`` false: no Q'^T) each iteration's Q'^ in bf16
        goes into one buffer beside the ring (:func:`_load_wide`) after the iteration's ring loads."""
        desc_q, desc_qt, desc_k, desc_v, desc_do, desc_dot, desc_lse, desc_delta = descs
        k_smem, v_smem, q_smem, qt_smem, do_smem, dot_smem, p_smem, ds_smem, lse_smem, delta_smem = bufs
        ready, empty, kv_bar = bars
        origins = _load_origins(origins, row_q0, kv_row, SEQ_Q)
        _load_kv(desc_k, desc_v, k_smem, v_smem, kv_bar, kv_row, origins, HALVES)
        for t in range(total):
            # A fresh mbarrier counts as having completed the phase before its first: the first pass of the
            # ring does not wait.
            mbarrier.wait(empty.index(t % STAGES), ((t // STAGES) & 1) ^ 1)
            _issue_loads(
                t, total, n_m, lo_tile, row_q0, origins, desc_q, desc_qt, desc_do, desc_dot, desc_lse, desc_delta,
                q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, ready, SEQ_Q, HEAD_DIM, BLOCK_M, STAGES,
                HALVES == 1, LOAD_QT, Q_WIDE,
            )  # fmt: skip
            if Q_WIDE and HALVES == 1:
                _load_wide(t, n_m, lo_tile, row_q0, desc_qt, qt_smem, ready, empty, SEQ_Q, BLOCK_M, STAGES)

    @gluon.jit
    def _dkdv_zeros(
        s_layout: gl.constexpr, dp_layout: gl.constexpr, acc_layout: gl.constexpr, key_l: gl.constexpr,
        BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
    ):  # fmt: skip
        """Zeros: S^T's, dP^T's and the INT8 products' accumulators, dK, dV, the per-key dS statistics."""
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.int32, s_layout)
        dp_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, dp_layout)
        acc_zero = gl.zeros([BLOCK_N, HEAD_DIM], gl.int32, acc_layout)
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        err2 = gl.zeros([BLOCK_N], gl.float32, key_l)
        norm2 = gl.zeros([BLOCK_N], gl.float32, key_l)
        return s_zero, dp_zero, acc_zero, dk, dv, err2, norm2

    @gluon.jit
    def _dkdv_tile(t, n_m, lo_tile, bh0, m_blocks, offs_q_tile, Q_SCALE, DO_SCALE, BLOCK_M: gl.constexpr):
        """Flat iteration ``t``'s query tile: its first query, its queries' offsets, its Q and dO scales."""
        g = t // n_m
        m_block = lo_tile + t % n_m
        start_m = m_block * BLOCK_M
        bh = bh0 + g
        offs_q = start_m + offs_q_tile
        q_scale = gl.load(Q_SCALE + bh * m_blocks + m_block)
        do_scale = gl.load(DO_SCALE + bh * m_blocks + m_block)
        return start_m, offs_q, q_scale, do_scale

    @gluon.jit
    def _p_codes(s_int, scale, lse, p_smem, offs_key, offs_q, masked, CAUSAL: gl.constexpr, scratch=None):
        """P^T ``[keys, queries]`` of a tile from S^T's int32 product (zero where a key comes after its query when
        ``CAUSAL`` and ``masked``), its codes into ``p_smem``, one scale per key; returns ``(p, p_scale)``."""
        p = gl.exp2(_int32_scaled(s_int, scale) - lse[None, :])
        if CAUSAL:
            if masked:
                p = gl.where(offs_key[:, None] > offs_q[None, :], 0.0, p)
        # P's codes, one scale per key over the tile's 128 queries.
        p_scale = _int8_scale(_row_max(p, scratch))
        p_smem.store(_int8_codes(p, p_scale[:, None]))
        return p, p_scale

    @gluon.jit
    def _p_codes_lean(
        s_int, scale, lse, p_smem, offs_key, start_m, masked, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
        query_l: gl.constexpr, scratch=None,
    ):  # fmt: skip
        """:func:`_p_codes` with the queries' offsets made in the masked branch (from the tile's first query
        ``start_m``) rather than held through the loop: the registers a non-INT8 dS's path needs."""
        p = gl.exp2(_int32_scaled(s_int, scale) - lse[None, :])
        if CAUSAL:
            if masked:
                offs_q = start_m + gl.arange(0, BLOCK_M, layout=query_l)
                p = gl.where(offs_key[:, None] > offs_q[None, :], 0.0, p)
        p_scale = _int8_scale(_row_max(p, scratch))
        p_smem.store(_int8_codes(p, p_scale[:, None]))
        return p, p_scale

    @gluon.jit
    def _ds_t(p, dp, delta, fold=None):
        """dS^T ``= P^T (dP^T - delta)`` of a dK/dV tile (``delta`` per query, its columns); with ``fold``, Q's tile
        scale ``c``, dS^T times it as ``P^T fma(dP^T, c, -(delta c))`` (a bf16 dS's dK operand)."""
        if fold is None:
            ds = p * (dp - delta[None, :])
        else:
            ds = p * gl.fma(dp, fold, -(delta * fold)[None, :])
        return ds

    @gluon.jit
    def _ds_codes(p, dp, delta, ds_smem, err2, norm2, WITH_STATS: gl.constexpr, scratch=None):
        """dS^T ``= P^T (dP^T - delta)``, its codes into ``ds_smem`` with one scale for the tile, and with
        ``WITH_STATS`` its quantization error and norm added per key into ``err2`` and ``norm2``; returns
        ``(ds_scale, err2, norm2)``."""
        ds = _ds_t(p, dp, delta)
        ds_scale = _tile_scale(ds, scratch)
        ds_smem.store(_int8_codes(ds, ds_scale))
        if WITH_STATS:
            err = ds - ((ds / ds_scale + _ROUNDER) - _ROUNDER) * ds_scale
            err2 += gl.sum(err * err, axis=1)
            norm2 += gl.sum(ds * ds, axis=1)
        return ds_scale, err2, norm2

    @gluon.jit
    def _dkdv_products(p_smem, ds_smem, dot_tile, qt_tile, acc_zero):
        """Once every consumer warp has stored its codes: the tile's dV and dK INT8 products in flight, A = the codes
        ``[64 keys, 128 queries]``, B = dO^ and Q'^ (K-major, ``[D, 128]``); returns their tokens."""
        fence_async_shared()
        gl.thread_barrier()
        dv_tok = warpgroup_mma(p_smem, dot_tile.permute((1, 0)), acc_zero, use_acc=False, is_async=True)
        dk_tok = warpgroup_mma(ds_smem, qt_tile.permute((1, 0)), acc_zero, use_acc=False, is_async=True)
        return dv_tok, dk_tok

    @gluon.jit
    def _dkdv_accumulate(dv_tok, dk_tok, dv, dk, p_scale, do_scale, ds_scale, q_scale, acc_row_l: gl.constexpr):
        """Waits for the tile's dV and dK products and adds them, scaled, into ``dv`` and ``dk``; returns both."""
        dv_int = warpgroup_mma_wait(num_outstanding=1, deps=[dv_tok])
        p_scale_acc = gl.convert_layout(p_scale, acc_row_l)
        dv += _int32_scaled(dv_int, p_scale_acc[:, None] * do_scale)
        dk_int = warpgroup_mma_wait(num_outstanding=0, deps=[dk_tok])
        dk += _int32_scaled(dk_int, ds_scale * q_scale)
        return dv, dk

    @gluon.jit
    def _ds_values(p, dp, delta, ds_smem, err2, norm2, WITH_STATS: gl.constexpr, DS_FMT: gl.constexpr, fold=None):
        """:func:`_ds_codes` for a non-INT8 dS (``_dkdv_kernel``'s): dS^T as the dK product's bf16 operand
        (``"fp8"``: e4m3 codes, one scale for the tile; ``"bf16"``: dS rounded, or with ``fold``, Q's tile scale
        ``c``, ``P^T fma(dP^T, c, -(delta c))`` rounded: dS times it, so nothing scales the product), stored into
        ``ds_smem`` unless it is None, and with ``WITH_STATS`` the INT8 error of dS (what the controller would return
        to) as :func:`_ds_codes` adds it; returns ``(ds_scale, err2, norm2, values)`` (``ds_scale`` 1 for bf16)."""
        if WITH_STATS:
            ds_scale, err, norm, values = _ds_values_sums(p, dp, delta, ds_smem, DS_FMT, fold)
            err2 += err
            norm2 += norm
        else:
            values, _, ds_scale = _ds_operand(_ds_t(p, dp, delta, fold), DS_FMT)
            if ds_smem is not None:
                ds_smem.store(values)
        return ds_scale, err2, norm2, values

    @gluon.jit
    def _ds_values_sums(p, dp, delta, ds_smem, DS_FMT: gl.constexpr, fold=None):
        """:func:`_ds_values` with the statistics, which it leaves to the caller to add: ``(ds_scale, err, norm,
        values)``, the tile's per-key sums of the INT8 error squared and of dS squared (``_ds_values`` adds them into
        ``err2`` and ``norm2``; the ``wg`` kernel keeps those in shared memory). The statistics are dS's own, also
        with ``fold``."""
        ds = _ds_t(p, dp, delta)
        # The tile's largest magnitude: the INT8 scale of the statistics (and FP8's, made from it).
        amax = _tile_amax(ds)
        # (With fold the product's operand is dS times Q's tile scale; the statistics stay dS's own.)
        values, ds_scale = _ds_operand_from(ds if fold is None else _ds_t(p, dp, delta, fold), amax, DS_FMT)
        if ds_smem is not None:
            ds_smem.store(values)
        stat_scale = _int8_scale(amax)
        err = ds - ((ds / stat_scale + _ROUNDER) - _ROUNDER) * stat_scale
        return ds_scale, gl.sum(err * err, axis=1), gl.sum(ds * ds, axis=1), values

    @gluon.jit
    def _dkdv_products_hp(p_smem, ds_smem, dot_tile, qb_tile, acc_zero, dk_acc, INTO_DK: gl.constexpr = False):
        """:func:`_dkdv_products` for a non-INT8 dS: dV's INT8 product as there; dK's in bf16 with fp32
        accumulation, A = dS^T's bf16 operand ``[64 keys, 128 queries]`` (``ds_smem``: in shared memory, or a
        register tensor in a dot-operand layout), B = Q'^ widened to bf16 ``[128, D]`` as stored (16-bit wgmma reads
        B either way: no transposed copy), into zeros, or with ``INTO_DK`` added into ``dk_acc`` (dK itself: a bf16
        dS that took Q's tile scale)."""
        fence_async_shared()
        gl.thread_barrier()
        dv_tok = warpgroup_mma(p_smem, dot_tile.permute((1, 0)), acc_zero, use_acc=False, is_async=True)
        dk_tok = warpgroup_mma(ds_smem, qb_tile, dk_acc, use_acc=INTO_DK, is_async=True)
        return dv_tok, dk_tok

    @gluon.jit
    def _dkdv_accumulate_hp(
        dv_tok, dk_tok, dv, dk, p_scale, do_scale, ds_scale, q_scale, acc_layout: gl.constexpr,
        DS_FMT: gl.constexpr, INTO_DK: gl.constexpr = False,
    ):  # fmt: skip
        """:func:`_dkdv_accumulate` for a non-INT8 dS: dK's fp32 product times ``ds_scale * q_scale`` (fp8), as
        ``_dkdv_kernel``'s ``hp_dot(...) * scale``; a bf16 dS's (which took Q's tile scale) added as it is, or with
        ``INTO_DK`` (the product added into dK itself) dK as the product left it (its accumulator's layout)."""
        acc_row_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
        dv_int = warpgroup_mma_wait(num_outstanding=1, deps=[dv_tok])
        p_scale_acc = gl.convert_layout(p_scale, acc_row_l)
        dv += _int32_scaled(dv_int, p_scale_acc[:, None] * do_scale)
        if INTO_DK:
            dk = warpgroup_mma_wait(num_outstanding=0, deps=[dk_tok])
        elif DS_FMT == "fp8":
            dk_acc = gl.convert_layout(warpgroup_mma_wait(num_outstanding=0, deps=[dk_tok]), acc_layout)
            dk += dk_acc * (ds_scale * q_scale)
        else:
            dk += gl.convert_layout(warpgroup_mma_wait(num_outstanding=0, deps=[dk_tok]), acc_layout)
        return dv, dk

    @gluon.jit
    def _dkdv_store(
        dk, dv, err2, norm2, key0, pid_bkv, SEQ_K, DK, DV, STATS, tau, acc_layout: gl.constexpr,
        HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, WITH_STATS: gl.constexpr,
    ):  # fmt: skip
        """dK (times ``tau``) and dV of keys ``key0`` on to global memory; the dS statistics into ``STATS``."""
        acc_row_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
        acc_col_l: gl.constexpr = gl.SliceLayout(0, acc_layout)
        rows = key0 + gl.arange(0, BLOCK_N, layout=acc_row_l)
        cols = gl.arange(0, HEAD_DIM, layout=acc_col_l)
        out = (pid_bkv * SEQ_K + rows)[:, None] * HEAD_DIM + cols[None, :]
        io_dtype: gl.constexpr = DK.dtype.element_ty
        gl.store(DK + out, (dk * tau).to(io_dtype))
        gl.store(DV + out, dv.to(io_dtype))
        if WITH_STATS:
            gl.atomic_add(STATS, gl.sum(err2, axis=0))
            gl.atomic_add(STATS + 1, gl.sum(norm2, axis=0))

    # dQ (gluon_dq, both variants): a program holds Q_BLOCKS 128-query blocks of one query head and walks the key
    # tiles of its kv head.

    @gluon.jit
    def _dq_smem(
        desc_q, desc_do, desc_k, desc_v, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, Q_BLOCKS: gl.constexpr, KT_BUFS: gl.constexpr, CODES_IN_REGISTERS: gl.constexpr,
        EMPTY_COUNT: gl.constexpr, KT_EMPTY_COUNT: gl.constexpr, HP_DS: gl.constexpr = False,
    ):  # fmt: skip
        """Shared memory: Q'^ and dO of the program (``Q_BLOCKS`` blocks), a ``STAGES``-deep ring of K'^ and V
        tiles, ``KT_BUFS`` transposed K'^ tiles, the dS codes (unless ``CODES_IN_REGISTERS``), the ring's
        ``ready``/``empty`` mbarriers (``empty`` counting ``EMPTY_COUNT`` arrivals), Q's and the transposed tiles'
        ``kt_ready``/``kt_empty`` (two, ``kt_empty`` counting ``KT_EMPTY_COUNT``). Returns ``(bufs, bars)``. With
        ``HP_DS`` (a non-INT8 dS) the ``KT_BUFS`` tiles hold K'^ widened to bf16 ``[64, D]`` (not transposed: 16-bit
        wgmma reads B either way) and the dS tile is bf16."""
        codes_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.int8)
        kt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_N], gl.int8)
        q_smem = gl.allocate_shared_memory(desc_q.dtype, [Q_BLOCKS] + desc_q.block_type.shape, desc_q.layout)
        do_smem = gl.allocate_shared_memory(desc_do.dtype, [Q_BLOCKS] + desc_do.block_type.shape, desc_do.layout)
        k_smem = gl.allocate_shared_memory(desc_k.dtype, [STAGES] + desc_k.block_type.shape, desc_k.layout)
        if HP_DS:
            kb_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.bfloat16)
            kt_smem = gl.allocate_shared_memory(gl.bfloat16, [KT_BUFS, BLOCK_N, HEAD_DIM], kb_layout)
        else:
            kt_smem = gl.allocate_shared_memory(gl.int8, [KT_BUFS, HEAD_DIM, BLOCK_N], kt_layout)
        v_smem = gl.allocate_shared_memory(desc_v.dtype, [STAGES] + desc_v.block_type.shape, desc_v.layout)
        if CODES_IN_REGISTERS:
            ds_smem = q_smem  # unused
        elif HP_DS:
            ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)
            ds_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N], ds_layout)
        else:
            ds_smem = gl.allocate_shared_memory(gl.int8, [BLOCK_M, BLOCK_N], codes_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kt_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        kt_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=EMPTY_COUNT)
        for i in gl.static_range(2):
            mbarrier.init(kt_ready.index(i), count=1)
            mbarrier.init(kt_empty.index(i), count=KT_EMPTY_COUNT)
        mbarrier.init(q_bar, count=1)
        fence_async_shared()
        return (q_smem, do_smem, k_smem, kt_smem, v_smem, ds_smem), (ready, empty, q_bar, kt_ready, kt_empty)

    @gluon.jit
    def _dq_block(
        m_block, bh, Q_SCALE, LSE, DELTA, SEQ_Q, m_blocks, s_layout: gl.constexpr, dp_layout: gl.constexpr,
        acc_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
        Q_BLOCK: gl.constexpr = 0,
    ):  # fmt: skip
        """Query block ``m_block`` of head ``bh``: its offsets (and a key tile's), Q's scale, lse, delta, and the
        zeros of S's, dP's and the INT8 product's accumulators and of dQ. ``Q_BLOCK``: the rows of Q's quantization
        block when a query block is a part of one (``0``: ``BLOCK_M``, and ``m_blocks`` Q's blocks a head)."""
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
        offs_m = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_l)
        offs_n_tile = gl.arange(0, BLOCK_N, layout=col_l)
        if Q_BLOCK == 0:
            q_scale = gl.load(Q_SCALE + bh * m_blocks + m_block)
        else:
            q_scale = gl.load(Q_SCALE + bh * gl.cdiv(SEQ_Q, Q_BLOCK) + (m_block * BLOCK_M) // Q_BLOCK)
        lse = gl.load(LSE + bh * SEQ_Q + offs_m)
        delta = gl.load(DELTA + bh * SEQ_Q + offs_m)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, s_layout)
        dp_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, dp_layout)
        acc_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.int32, acc_layout)
        dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
        return offs_m, offs_n_tile, q_scale, lse, delta, s_zero, dp_zero, acc_zero, dq

    @gluon.jit
    def _dq_ds(
        s_tok, dp_tok, scale, lse, delta, offs_m, offs_n_tile, start_n, full_hi, s_layout: gl.constexpr,
        BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, ds_fold=None, keep=None,
    ):  # fmt: skip
        """A tile's S and dP products waited for (S first, dP after P is computed), P ``[queries, keys]`` (zero
        above the diagonal on the tiles from ``full_hi`` on when ``CAUSAL``) and ``dS = P (dP - delta)`` in fp32, which
        :mod:`.gluon_dq`'s kernel then codes for its dQ product (INT8 with the tile's scale or one it is given, FP8 or
        bf16). ``offs_n_tile``: the keys' offsets within a tile, made once by the caller, or ``None`` to make them in
        the masked branch (where the registers are scarce: :mod:`.gluon_dq`'s ``wg`` warpgroup would spill holding
        them through the loop). ``ds_fold``: a scalar ``c`` dS is times, as ``P fma(dP, c, -(delta c))`` (a bf16 dS
        takes K's tile scale so, as ``_dq_kernel``'s). ``keep``: a register operand of a product still in flight
        (the tile before's dQ), kept alive until S's wait, which that product finishes before."""
        if keep is None:
            s_int = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
        else:
            s_int, _ = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok, keep])
        p = gl.exp2(_int32_scaled(s_int, scale) - lse[:, None])
        if CAUSAL:
            # _dq_kernel's masked tiles: those from full_hi on (the key tiles that reach the diagonal).
            if start_n >= full_hi:
                if offs_n_tile is None:
                    col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
                    offs_n = start_n + gl.arange(0, BLOCK_N, layout=col_l)
                else:
                    offs_n = start_n + offs_n_tile
                p = gl.where(offs_n[None, :] > offs_m[:, None], 0.0, p)
        dp = gl.convert_layout(warpgroup_mma_wait(num_outstanding=0, deps=[dp_tok]), s_layout)
        if ds_fold is None:
            ds = p * (dp - delta[:, None])
        else:
            ds = p * gl.fma(dp, ds_fold, -(delta * ds_fold)[:, None])
        return ds

    @gluon.jit
    def _dq_store(dq, m_block, bh, SEQ_Q, DQ, tau, acc_layout: gl.constexpr, HEAD_DIM: gl.constexpr,
                  BLOCK_M: gl.constexpr):  # fmt: skip
        """dQ (times ``tau``) of query block ``m_block`` of head ``bh`` to global memory."""
        acc_row_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
        acc_col_l: gl.constexpr = gl.SliceLayout(0, acc_layout)
        rows = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=acc_row_l)
        cols = gl.arange(0, HEAD_DIM, layout=acc_col_l)
        out = (bh * SEQ_Q + rows)[:, None] * HEAD_DIM + cols[None, :]
        gl.store(DQ + out, (dq * tau).to(DQ.dtype.element_ty))


@functools.cache
def _tile_layout(block: tuple[int, ...], dtype: torch.dtype) -> object:
    # Built once per tile shape and dtype: the layout object is the same every call and costs the host to make.
    gl_dtype = {torch.int8: gl.int8, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


def _desc(x: torch.Tensor, rows: int, cols: int, block: list[int]) -> TensorDescriptor:
    """A 2-D TMA descriptor over ``x`` viewed ``[rows, cols]`` (contiguous), tiles of ``block``."""
    return TensorDescriptor.from_tensor(x.reshape(rows, cols), block, _tile_layout(tuple(block), x.dtype))


@functools.cache
def _rows_layout() -> object:
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def rows_view(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``x`` ``[B, H, N, D]`` (dO or V) as the 2-D view its TMA descriptor reads, and where each head's first row lies
    in it, ``(rows a batch, rows a head, columns a head)`` (:func:`_head_origin`). Contiguous: ``[B*H*N, D]``, ``(H *
    N, N, 0)``; a model's ``[B, N, H, D]`` memory (heads split off the last dim, then transposed: what SDPA's callers
    hand) read where it lies, as ``[B*N, H*D]``, ``(N, 0, D)``; any other layout is copied contiguous first
    (:func:`..tiles.rows_layout`; the backward makes that copy once, before both of its kernels).

    Example::

        view, lay = rows_view(grad_out)   # grad_out = do.view(B, N, H, D).transpose(1, 2): [B*N, H*D], (N, 0, D)
    """
    batch, heads, seq, head_dim = x.shape
    x = rows_layout(x)
    if not x.is_contiguous():
        return x.transpose(1, 2).reshape(batch * seq, heads * head_dim), (seq, 0, head_dim)
    return x.view(batch * heads * seq, head_dim), (heads * seq, seq, 0)


def _rows_desc(x: torch.Tensor, rows: int) -> TensorDescriptor:
    """A 1-D TMA descriptor over the per-query fp32 ``x`` (lse or delta, ``[B, H, N]`` contiguous), tiles of
    :data:`ROWS_BLOCK` queries (512 bytes, no swizzle)."""
    return TensorDescriptor.from_tensor(x.reshape(rows), [ROWS_BLOCK], _rows_layout())


def dkdv_operands(
    grad_out: torch.Tensor,
    delta: torch.Tensor,
    do_codes_t: torch.Tensor,
    q_op: torch.Tensor,
    q_op_t: torch.Tensor | None,
    k_op: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    block_m: int,
    block_n: int,
    q_wide: torch.Tensor | None = None,
) -> tuple[tuple[TensorDescriptor, ...], torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """The dK/dV launchers' TMA descriptors (Q'^, Q'^T, K'^, V, dO, dO^T, lse, delta: the kernels' first eight
    arguments, tiles of ``block_m`` queries and ``block_n`` keys), the empty ``(dK, dV)`` they write, and dO's and V's
    layouts, three numbers each (:func:`rows_view`: read where they lie). ``q_op_t`` ``None`` (a kernel that
    reads no Q'^T: a non-INT8 dS): Q'^'s descriptor stands in its place, or with ``q_wide`` (Q'^ widened to bf16,
    ``[B, Hq, N, D]``) that copy's, in tiles of ``block_m`` queries as Q'^'s.

    Example::

        descs, dk, dv, layouts = dkdv_operands(grad_out, delta, codes_t, q_op, q_op_t, k_op, v, lse, 128, 64)
    """
    batch, heads, seq_q, head_dim = q_op.shape
    kv_heads, seq_k = k_op.shape[1], k_op.shape[2]
    (do, do_lay), (v_rows, v_lay) = rows_view(grad_out), rows_view(v)
    dk = torch.empty(batch, kv_heads, seq_k, head_dim, dtype=grad_out.dtype, device=grad_out.device)
    dv = torch.empty_like(dk)
    bh, bkv = batch * heads, batch * kv_heads
    desc_q = _desc(q_op, bh * seq_q, head_dim, [block_m, head_dim])
    if q_op_t is not None:
        desc_qt = _desc(q_op_t, bh * head_dim, seq_q, [head_dim, block_m])
    elif q_wide is not None:
        desc_qt = _desc(q_wide, bh * seq_q, head_dim, [block_m, head_dim])
    else:
        desc_qt = desc_q
    descs = (
        desc_q,
        desc_qt,
        _desc(k_op, bkv * seq_k, head_dim, [block_n, head_dim]),
        _desc(v_rows, *v_rows.shape, [block_n, head_dim]),
        _desc(do, *do.shape, [block_m, head_dim]),
        _desc(do_codes_t, bh * head_dim, seq_q, [head_dim, block_m]),
        _rows_desc(lse, bh * seq_q),
        _rows_desc(delta, bh * seq_q),
    )
    return descs, dk, dv, do_lay + v_lay


def check_ds_scales(name: str, argument: str, ds_scale: torch.Tensor, q_op: torch.Tensor, k_op: torch.Tensor) -> None:
    """Refuse a dS scale tensor that is not :func:`ds_scales_shape`'s fp32, contiguous, on Q'^'s device: the kernels
    index it as such, unchecked.

    Raises:
        ValueError: naming ``name`` (the launcher), ``argument``, what was received and what works.
    """
    shape = ds_scales_shape(tuple(q_op.shape), tuple(k_op.shape))
    fits = ds_scale.dtype == torch.float32 and tuple(ds_scale.shape) == shape and ds_scale.is_contiguous()
    if not fits or ds_scale.device != q_op.device:
        raise ValueError(
            f"{name}: {argument} must be fp32 {shape} (query heads, {GLUON_BLOCK_M}-query blocks, {GLUON_BLOCK_N}-key "
            f"blocks), contiguous, on "
            f"{q_op.device}; received {ds_scale.dtype} {tuple(ds_scale.shape)}, contiguous={ds_scale.is_contiguous()}, "
            f"on {ds_scale.device}"
        )


def dq_operands(
    grad_out: torch.Tensor, q_op: torch.Tensor, k_op: torch.Tensor, v: torch.Tensor, block_m: int, block_n: int
) -> tuple[tuple[TensorDescriptor, ...], torch.Tensor, tuple[int, ...]]:
    """The dQ launchers' TMA descriptors (Q'^, dO, K'^, V: the kernels' first four arguments, tiles of ``block_m``
    queries and ``block_n`` keys), the empty dQ they write, and dO's and V's layouts as :func:`dkdv_operands`'.

    Example::

        descs, dq, layouts = dq_operands(grad_out, q_op, k_op, v, 128, 64)
    """
    batch, heads, seq_q, head_dim = q_op.shape
    kv_heads, seq_k = k_op.shape[1], k_op.shape[2]
    (do, do_lay), (v_rows, v_lay) = rows_view(grad_out), rows_view(v)
    dq = torch.empty(batch, heads, seq_q, head_dim, dtype=grad_out.dtype, device=grad_out.device)
    bh, bkv = batch * heads, batch * kv_heads
    descs = (
        _desc(q_op, bh * seq_q, head_dim, [block_m, head_dim]),
        _desc(do, *do.shape, [block_m, head_dim]),
        _desc(k_op, bkv * seq_k, head_dim, [block_n, head_dim]),
        _desc(v_rows, *v_rows.shape, [block_n, head_dim]),
    )
    return descs, dq, do_lay + v_lay
