"""Gluon (``triton.experimental.gluon``) forward of SageBwd for Hopper (sm_90) with FP8 ``P V`` (issue 42): a TMA load
warp and two consumer warpgroups that take turns on the tensor cores (FlashAttention-3's producer/consumer split and
ping-pong), each overlapping its softmax with its own ``P V`` product in flight.

The plan (:func:`..plan.plan_attention`) gives it the forward where ``SAGE_LIGHTNING_GLUON_FWD`` asks for it (``off``
by default until a GPU run has compared it) and :func:`gluon_forward_unmet` finds nothing it lacks: ``pv="fp8"``,
``qk`` INT8 or FP8, no Q-smoothing, D 64 or 128, bf16 or fp16, 64-key tiles. Its outputs are
``hopper.forward._hopper_forward_kernel``'s (``PV_FMT="fp8"``): ``O`` and the base-2 logsumexp, so the backward is
unchanged. The expressions are that kernel's, in its order:

* ``x``: INT8 ``bits(Q'^ K'^T + bits(1.5 * 2^23)) - 1.5 * 2^23`` (the add is the wgmma accumulator's initial value,
  exact in int32), FP8 the tensor core's fp32 sum; ``a = s_Q s_K tau log2(e)``; ``-inf`` where masked;
* ``t = rowmax(x) a``, ``m' = max(m, t)``, ``alpha = exp2(m - m')``, ``P~ = exp2(x a - m')``,
  ``l = l alpha + rowsum(P~)``, P's codes ``e4m3(448 P~)``;
* ``acc = codes . V^ + acc alpha``, the product added into the fp32 accumulator by the tensor core (wgmma's C);
* ``O = acc / l * (s_V / 448)`` per channel, ``lse = m + log2(l)``, NaN rows as :func:`..tiles.poison_rows`.

Each consumer warpgroup holds 64 of the program's 128 query rows in the per-row layout of the ``tl`` kernel's
candidates (a row's 64 scores on one quad of threads), so the row sums add in the same order. The one difference of
schedule changes no addition: tile j's ``P V`` is issued with tile j+1's ``Q K^T`` and waited for after tile j+1's
softmax, and ``acc alpha_{j+1}`` is taken after that wait, as the next product's C (the ``tl`` kernel's
``tl.dot(codes, V, acc * alpha)``). Design, protocol, offline figures, prediction and the device check:
``benchmarks/pending/gluon-forward-fp8.md``.
"""

from __future__ import annotations

import torch
import triton

from ..plan import UnsupportedAttention
from .forward import forward_launch
from .gluon_common import HAVE_GLUON

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
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

#: Head dims, key tiles (the K quantization block) and ``Q K^T`` formats it serves; ``P V`` is FP8 only.
HEAD_DIMS = (64, 128)
BLOCK_N = 64
QK_FORMATS = ("int8", "fp8")
#: Query rows per consumer warpgroup; a program has :data:`CONSUMERS` of them (2: 128 rows, 3: 192 rows), each 64-row
#: group inside one Q quantization block (``block_m``, a multiple of :data:`BLOCK_M`).
WG_ROWS = 64
BLOCK_M = 128
CONSUMERS = (2, 3)
#: Three: 1.00-1.12x the better two-warpgroup variant at every timed shape (1.07-1.25x two taking turns), bit for
#: bit the same O (device run 33).
DEFAULT_CONSUMERS = 3
#: Whether the consumer warpgroups take turns, by head dim, when the caller does not say: three warpgroups issuing
#: freely were faster in 10 of 12 timed cases at D=128, taking turns in 6 of 8 at D=64 (device run 33).
DEFAULT_PINGPONG = {64: True, 128: False}
#: Registers per thread of the load warp (the fewest setmaxnreg allows).
LOAD_REGS = 24
#: Per consumer count: the consumer warpgroups' registers and the launch's cap. 2: 4 + 4 + 1 warps take three
#: warpgroups, 65536 / (12 * 32) = 170 rounded down to 168, consumers at 240 (2 * 128 * 240 + 128 * 24 = 64512). 3:
#: 4 + 4 + 4 + 1 warps take four warpgroups, 65536 / (16 * 32) = 128, consumers at 160 (3 * 128 * 160 + 128 * 24 =
#: 64512): FlashAttention-3's split for three consumer warpgroups.
REGS = {2: (240, 168), 3: (160, 128)}
#: Depth of the K'^ / V^T ring (16 KiB a stage at D=128, 8 at D=64).
DEFAULT_STAGES = 4
#: Output dtypes (the ``tl`` kernel's ``to_dtype`` is a plain cast for these).
OUT_DTYPES = (torch.bfloat16, torch.float16)
_CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


if HAVE_GLUON:
    _ROUNDER = gl.constexpr(12582912.0)
    _ROUNDER_BITS = gl.constexpr(0x4B400000)
    _FP8_MAX = gl.constexpr(448.0)
    _WG_ROWS = gl.constexpr(WG_ROWS)

    @gluon.jit
    def _fwd_loader(
        descs, bufs, bars, q_row, kv_row, vt_row, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        N_WG: gl.constexpr,
    ):  # fmt: skip
        """The load partition (one warp): the program's ``N_WG`` 64-row Q'^ tiles once, then K'^ and V^T of every
        key tile into the ``STAGES``-deep ring, a stage refilled once every consumer warpgroup released it."""
        desc_q, desc_k, desc_vt = descs
        q_smem, k_smem, vt_smem, p_smem = bufs
        ready, empty, q_bar, turn = bars
        mbarrier.expect(q_bar, N_WG * desc_q.block_type.nbytes)
        for h in gl.static_range(N_WG):
            tma.async_copy_global_to_shared(desc_q, [q_row + h * _WG_ROWS, 0], q_bar, q_smem.index(h))
        nbytes: gl.constexpr = desc_k.block_type.nbytes + desc_vt.block_type.nbytes
        for j in range(n_tiles):
            s = j % STAGES
            # A fresh mbarrier counts as having completed the phase before its first: the first round does not wait.
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(desc_k, [kv_row + j * BLOCK_N, 0], ready.index(s), k_smem.index(s))
            tma.async_copy_global_to_shared(desc_vt, [vt_row, j * BLOCK_N], ready.index(s), vt_smem.index(s))

    @gluon.jit
    def _take_turn(turn, k, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Wait for this warpgroup's ``k``-th turn on the tensor cores, round robin from warpgroup 0: warpgroup 0's
        once the last warpgroup passed its turn ``k - 1`` (its first at once: a fresh mbarrier counts the phase before
        its first as complete), warpgroup ``w > 0``'s once warpgroup ``w - 1`` passed turn ``k``. No warpgroup gets a
        turn ahead of the one before it, so no barrier completes two phases between a warpgroup's waits."""
        if PINGPONG:
            if WG == 0:
                mbarrier.wait(turn.index(0), (k & 1) ^ 1)
            else:
                mbarrier.wait(turn.index(WG), k & 1)

    @gluon.jit
    def _pass_turn(turn, WG: gl.constexpr, N_WG: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(turn.index((WG + 1) % N_WG), count=1)

    @gluon.jit
    def _issue_scores(q, k_tile, s_init, QK_INT8: gl.constexpr):
        """``Q'^ K'^T`` of one key tile, async: INT8 into an int32 accumulator that starts at the rounder's bits, FP8
        into a fresh fp32 one."""
        if QK_INT8:
            return warpgroup_mma(q, k_tile.permute((1, 0)), s_init, use_acc=True, is_async=True)
        else:
            return warpgroup_mma(q, k_tile.permute((1, 0)), s_init, use_acc=False, is_async=True)

    @gluon.jit
    def _softmax_tile(
        s, m_i, l_i, a, start_n, full_hi, offs_m, offs_n_tile, SEQ_Q, SEQ_K, CAUSAL: gl.constexpr,
        QK_INT8: gl.constexpr,
    ):  # fmt: skip
        """One key tile's online-softmax step (``_hopper_forward_kernel``'s ``PV_FMT="fp8"`` branch, in its order):
        ``(codes, m', l', alpha)`` with P's e4m3 codes of ``448 exp2(x a - m')``."""
        if QK_INT8:
            x = s.to(gl.float32, bitcast=True) - _ROUNDER
        else:
            x = s
        if start_n >= full_hi:
            offs_n = start_n + offs_n_tile
            invalid = (offs_m[:, None] >= SEQ_Q) | (offs_n[None, :] >= SEQ_K)
            if CAUSAL:
                invalid = invalid | (offs_n[None, :] > offs_m[:, None])
            x = gl.where(invalid, float("-inf"), x)
        tile_max = gl.max(x, axis=1) * a
        m_new = gl.maximum(m_i, tile_max)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(x * a - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return (p * _FP8_MAX).to(gl.float8e4nv), m_new, l_i, alpha

    @gluon.jit
    def _p_operand(codes, p_buf, p_op_l: gl.constexpr, P_IN_REGS: gl.constexpr):
        """P's codes as the ``P V`` wgmma's A operand: in registers (the dot-operand layout) or stored to ``p_buf``
        (this warpgroup's shared tile; the wgmma that reads it is issued after a barrier of the partition)."""
        if P_IN_REGS:
            return gl.convert_layout(codes, p_op_l)
        else:
            p_buf.store(codes)
            fence_async_shared()
            return p_buf

    @gluon.jit
    def _fwd_consumer(
        descs, bufs, bars, prog, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HEAD_DIM: gl.constexpr,
        Q_BLOCK: gl.constexpr, CAUSAL: gl.constexpr, QK_INT8: gl.constexpr, PINGPONG: gl.constexpr,
        P_IN_REGS: gl.constexpr, CONFINED: gl.constexpr, N_WG: gl.constexpr, WG: gl.constexpr,
    ):  # fmt: skip
        """Consumer warpgroup ``WG``: rows ``64 WG`` to ``64 WG + 63`` of the program's ``64 N_WG``, every key tile
        (``prog``: the program's values, as :func:`_gluon_forward_kernel` packs them).

        Turn 0: ``S_0``, its softmax. Turn j + 1: ``S_{j+1}`` and ``P_j V_j + acc`` issued together; ``S_{j+1}``'s
        softmax while ``P_j V_j`` runs (and the other warpgroups' products); then ``acc`` = the product, stage j
        released, ``acc alpha_{j+1}`` (the next product's C). Turn n: the last ``P V``; the epilogue."""
        (q_row, kv_row, vt_row, n_tiles, Q_SCALE, K_SCALE, V_SCALE, LSE, OUT, ROW_POISON, FIRST_BAD, o_base, stride_on,
         pid_m, pid_bh, kv_bh, SEQ_Q, SEQ_K, full_hi, qk_scale) = prog  # fmt: skip
        desc_q, desc_k, desc_vt = descs
        q_smem, k_smem, vt_smem, p_smem = bufs
        ready, empty, q_bar, turn = bars
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 32]
        )
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_row_l: gl.constexpr = gl.SliceLayout(1, o_layout)
        p_op_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)

        k_base = K_SCALE + kv_bh * gl.cdiv(SEQ_K, BLOCK_N)
        first_row = pid_m * (N_WG * _WG_ROWS) + WG * _WG_ROWS
        q_scale = gl.load(Q_SCALE + pid_bh * gl.cdiv(SEQ_Q, Q_BLOCK) + first_row // Q_BLOCK)
        offs_m = first_row + gl.arange(0, _WG_ROWS, layout=row_l)
        offs_n_tile = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if QK_INT8:
            s_init = gl.full([_WG_ROWS, BLOCK_N], _ROUNDER_BITS, gl.int32, s_layout)
        else:
            s_init = gl.zeros([_WG_ROWS, BLOCK_N], gl.float32, s_layout)
        m_i = gl.full([_WG_ROWS], float("-inf"), gl.float32, row_l)
        l_i = gl.zeros([_WG_ROWS], gl.float32, row_l)
        acc = gl.zeros([_WG_ROWS, HEAD_DIM], gl.float32, o_layout)
        q = q_smem.index(WG)

        # Turn 0: S_0 and its softmax. No wgmma is in flight across the loop's back edge (ptxas serializes wgmma
        # whose accumulators a loop-carried copy reads while in flight: note C7514).
        mbarrier.wait(q_bar, 0)
        _take_turn(turn, 0, WG, PINGPONG)
        mbarrier.wait(ready.index(0), 0)
        s_tok = _issue_scores(q, k_smem.index(0), s_init, QK_INT8)
        _pass_turn(turn, WG, N_WG, PINGPONG)
        k_scale = gl.load(k_base)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
        codes, m_i, l_i, alpha = _softmax_tile(
            s, m_i, l_i, q_scale * k_scale * qk_scale, 0, full_hi, offs_m, offs_n_tile, SEQ_Q, SEQ_K, CAUSAL, QK_INT8
        )
        acc = acc * gl.convert_layout(alpha, o_row_l)[:, None]
        p_op = _p_operand(codes, p_smem.index(2 * WG), p_op_l, P_IN_REGS)
        for j in range(n_tiles - 1):
            nxt = (j + 1) % STAGES
            _take_turn(turn, j + 1, WG, PINGPONG)
            mbarrier.wait(ready.index(nxt), ((j + 1) // STAGES) & 1)
            s_tok = _issue_scores(q, k_smem.index(nxt), s_init, QK_INT8)
            # acc = codes_j . V_j + acc alpha_j in the tensor core (the tl kernel's tl.dot(codes, V, acc * alpha)).
            pv_tok = warpgroup_mma(p_op, vt_smem.index(j % STAGES).permute((1, 0)), acc, use_acc=True, is_async=True)
            _pass_turn(turn, WG, N_WG, PINGPONG)
            k_scale = gl.load(k_base + j + 1)
            s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
            codes, m_i, l_i, alpha = _softmax_tile(
                s, m_i, l_i, q_scale * k_scale * qk_scale, (j + 1) * BLOCK_N, full_hi, offs_m, offs_n_tile, SEQ_Q,
                SEQ_K, CAUSAL, QK_INT8,
            )  # fmt: skip
            if not P_IN_REGS:
                # The other buffer: P V of tile j still reads this one's (double buffering, per warpgroup).
                p_op = _p_operand(codes, p_smem.index(2 * WG + (j + 1) % 2), p_op_l, P_IN_REGS)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok])
            # Stage j (K'^ read by S_j, V^T by P V of tile j) goes back to the loader.
            mbarrier.arrive(empty.index(j % STAGES), count=1)
            acc = acc * gl.convert_layout(alpha, o_row_l)[:, None]
            if P_IN_REGS:
                p_op = _p_operand(codes, p_smem.index(0), p_op_l, P_IN_REGS)
        # Turn n_tiles: the last P V.
        _take_turn(turn, n_tiles, WG, PINGPONG)
        pv_tok = warpgroup_mma(
            p_op, vt_smem.index((n_tiles - 1) % STAGES).permute((1, 0)), acc, use_acc=True, is_async=True
        )
        _pass_turn(turn, WG, N_WG, PINGPONG)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok])
        _fwd_epilogue(
            acc, m_i, l_i, V_SCALE, LSE, OUT, ROW_POISON, FIRST_BAD, o_base, stride_on, first_row, pid_bh, kv_bh,
            SEQ_Q, SEQ_K, HEAD_DIM, CAUSAL, CONFINED, s_layout, o_layout,
        )  # fmt: skip

    @gluon.jit
    def _fwd_epilogue(
        acc, m_i, l_i, V_SCALE, LSE, OUT, ROW_POISON, FIRST_BAD, o_base, stride_on, first_row, pid_bh, kv_bh, SEQ_Q,
        SEQ_K, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, CONFINED: gl.constexpr, s_layout: gl.constexpr,
        o_layout: gl.constexpr,
    ):  # fmt: skip
        """``O = acc / l * (s_V / 448)`` and ``lse = m + log2(l)`` (NaN in the rows :func:`..tiles.poison_rows`
        names) of the warpgroup's 64 rows from ``first_row``, stored for the rows below ``SEQ_Q``: O at ``o_base + row *
        stride_on`` (the caller's layout)."""
        o_row_l: gl.constexpr = gl.SliceLayout(1, o_layout)
        o_col_l: gl.constexpr = gl.SliceLayout(0, o_layout)
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        rows = first_row + gl.arange(0, _WG_ROWS, layout=o_row_l)
        offs_m = first_row + gl.arange(0, _WG_ROWS, layout=row_l)
        cols = gl.arange(0, HEAD_DIM, layout=o_col_l)
        out = acc / gl.convert_layout(l_i, o_row_l)[:, None]
        # V's per-channel scales and P's 1 / 448.
        out = out * (gl.load(V_SCALE + kv_bh * HEAD_DIM + cols) / _FP8_MAX)[None, :]
        lse = m_i + gl.log2(l_i)
        if CONFINED:
            poison = gl.load(ROW_POISON + pid_bh * SEQ_Q + offs_m, mask=offs_m < SEQ_Q, other=0.0)
            first_bad = gl.load(FIRST_BAD + kv_bh)
            if CAUSAL:
                attends_bad = first_bad <= offs_m
            else:
                attends_bad = (offs_m * 0 + first_bad) < SEQ_K
            poison = gl.where(attends_bad, float("nan"), poison)
            out = out + gl.convert_layout(poison, o_row_l)[:, None]
            lse = lse + poison
        # 64-bit offsets: O may hold 2**31 elements or more.
        gl.store(
            OUT + o_base + rows.to(gl.int64)[:, None] * stride_on + cols[None, :],
            out.to(OUT.dtype.element_ty),
            mask=(rows < SEQ_Q)[:, None],
        )
        gl.store(LSE + pid_bh * SEQ_Q + offs_m, lse, mask=offs_m < SEQ_Q)

    @gluon.jit
    def _gluon_forward_kernel(
        desc_q, desc_k, desc_vt, Q_SCALE, K_SCALE, V_SCALE, LSE, OUT, ROW_POISON, FIRST_BAD,
        stride_ob, stride_oh, stride_on, HEADS, GROUP, SEQ_Q, SEQ_K, qk_scale,
        HEAD_DIM: gl.constexpr, Q_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, QK_INT8: gl.constexpr, PINGPONG: gl.constexpr, P_IN_REGS: gl.constexpr,
        CONFINED: gl.constexpr, N_WG: gl.constexpr, LOAD_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    ):  # fmt: skip
        PROG_M: gl.constexpr = N_WG * _WG_ROWS
        if CAUSAL:
            # Heads vary fastest and the longest query tiles go first (as _hopper_forward_kernel).
            pid_bh = gl.program_id(0)
            pid_m = gl.num_programs(1) - 1 - gl.program_id(1)
        else:
            pid_m = gl.program_id(0)
            pid_bh = gl.program_id(1)
        b = pid_bh // HEADS
        kv_bh = b * (HEADS // GROUP) + (pid_bh % HEADS) // GROUP
        # tiles.key_range for PROG_M-row programs: key tiles below hi are visited, those below full_hi need no mask.
        hi = SEQ_K
        full_hi = (SEQ_K // BLOCK_N) * BLOCK_N
        if CAUSAL:
            hi = gl.minimum(SEQ_K, (pid_m + 1) * PROG_M)
            full_hi = gl.minimum(full_hi, (pid_m * PROG_M // BLOCK_N) * BLOCK_N)
        n_tiles = gl.cdiv(hi, BLOCK_N)
        q_row = pid_bh * SEQ_Q + pid_m * PROG_M
        o_base = b.to(gl.int64) * stride_ob + (pid_bh % HEADS).to(gl.int64) * stride_oh

        # Shared memory: Q'^ (a 64-row tile per warpgroup), the K'^ / V^T ring, P's codes (two buffers per
        # warpgroup), barriers.
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_WG_ROWS, BLOCK_N], gl.float8e4nv)
        q_smem = gl.allocate_shared_memory(desc_q.dtype, [N_WG] + desc_q.block_type.shape, desc_q.layout)
        k_smem = gl.allocate_shared_memory(desc_k.dtype, [STAGES] + desc_k.block_type.shape, desc_k.layout)
        vt_smem = gl.allocate_shared_memory(desc_vt.dtype, [STAGES] + desc_vt.block_type.shape, desc_vt.layout)
        p_smem = gl.allocate_shared_memory(gl.float8e4nv, [1 if P_IN_REGS else 2 * N_WG, _WG_ROWS, BLOCK_N], p_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [N_WG, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=N_WG)  # one arrival per consumer warpgroup
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(N_WG):
            mbarrier.init(turn.index(i), count=1)
        fence_async_shared()

        descs = (desc_q, desc_k, desc_vt)
        bufs = (q_smem, k_smem, vt_smem, p_smem)
        bars = (ready, empty, q_bar, turn)
        kv_row = kv_bh * SEQ_K
        vt_row = kv_bh * HEAD_DIM
        # A partition's constexpr arguments are written in its tuple (one built beforehand would pass them as values);
        # the consumer warpgroups' differ in WG alone, the last.
        prog = (
            q_row, kv_row, vt_row, n_tiles, Q_SCALE, K_SCALE, V_SCALE, LSE, OUT, ROW_POISON, FIRST_BAD, o_base,
            stride_on, pid_m, pid_bh, kv_bh, SEQ_Q, SEQ_K, full_hi, qk_scale,
        )  # fmt: skip
        if N_WG == 3:
            gl.warp_specialize(
                [
                    (_fwd_consumer, (descs, bufs, bars, prog, BLOCK_N, STAGES, HEAD_DIM, Q_BLOCK, CAUSAL, QK_INT8,
                                     PINGPONG, P_IN_REGS, CONFINED, N_WG, 0)),
                    (_fwd_consumer, (descs, bufs, bars, prog, BLOCK_N, STAGES, HEAD_DIM, Q_BLOCK, CAUSAL, QK_INT8,
                                     PINGPONG, P_IN_REGS, CONFINED, N_WG, 1)),
                    (_fwd_consumer, (descs, bufs, bars, prog, BLOCK_N, STAGES, HEAD_DIM, Q_BLOCK, CAUSAL, QK_INT8,
                                     PINGPONG, P_IN_REGS, CONFINED, N_WG, 2)),
                    (_fwd_loader, (descs, bufs, bars, q_row, kv_row, vt_row, n_tiles, BLOCK_N, STAGES, N_WG)),
                ],
                [4, 4, 1],
                [CONSUMER_REGS, CONSUMER_REGS, LOAD_REGS],
            )  # fmt: skip
        else:
            gl.warp_specialize(
                [
                    (_fwd_consumer, (descs, bufs, bars, prog, BLOCK_N, STAGES, HEAD_DIM, Q_BLOCK, CAUSAL, QK_INT8,
                                     PINGPONG, P_IN_REGS, CONFINED, N_WG, 0)),
                    (_fwd_consumer, (descs, bufs, bars, prog, BLOCK_N, STAGES, HEAD_DIM, Q_BLOCK, CAUSAL, QK_INT8,
                                     PINGPONG, P_IN_REGS, CONFINED, N_WG, 1)),
                    (_fwd_loader, (descs, bufs, bars, q_row, kv_row, vt_row, n_tiles, BLOCK_N, STAGES, N_WG)),
                ],
                [4, 1],
                [CONSUMER_REGS, LOAD_REGS],
            )  # fmt: skip


def gluon_forward_unmet(
    q_shape: tuple[int, ...], k_shape: tuple[int, ...], dtype: torch.dtype, formats: dict, scale: float,
    block_m: int, block_n: int,
) -> str | None:  # fmt: skip
    """What :func:`gluon_forward` lacks to serve a call, as a need (``"FP8 pv"``), or ``None`` when it serves it.

    Args:
        q_shape, k_shape: ``[B, Hq, N, D]`` and ``[B, Hkv, Nk, D]``.
        dtype: the inputs' (and O's) dtype.
        formats: the product formats (``AttentionPrecision.formats``) and ``"smooth_q"``.
        scale, block_m, block_n: the softmax scale and SageBwd's tiles.

    Example::

        gluon_forward_unmet((1, 8, 4096, 128), (1, 8, 4096, 128), torch.bfloat16,
                            {"qk": "int8", "pv": "fp8", "smooth_q": False}, 0.088, 128, 64)   # None
    """
    needs = (
        (formats["pv"] == "fp8", "FP8 pv"),
        (formats["qk"] in QK_FORMATS, "INT8 or FP8 qk"),
        (not formats.get("smooth_q", False), "no Q-smoothing"),
        (dtype in OUT_DTYPES, "bf16 or fp16 inputs"),
        (q_shape[-1] in HEAD_DIMS, f"head dim in {HEAD_DIMS}"),
        (q_shape[2] > 0 and k_shape[2] > 0, "at least one query and one key"),
        (k_shape[2] % 16 == 0, "a key count that is a multiple of 16"),
        (scale > 0, "a positive scale"),
        (block_m % BLOCK_M == 0, f"block_m a multiple of {BLOCK_M}"),
        (block_n == BLOCK_N, f"block_n {BLOCK_N}"),
    )
    return next((need for met, need in needs if not met), None)


def _desc(x: torch.Tensor, rows: int, cols: int, block: list[int]) -> TensorDescriptor:
    """A 2-D TMA descriptor over ``x`` (contiguous 8-bit codes) viewed ``[rows, cols]``, tiles of ``block``."""
    dtype = gl.int8 if x.dtype == torch.int8 else gl.float8e4nv
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return TensorDescriptor.from_tensor(x.reshape(rows, cols), block, layout)


def gluon_forward(
    q_op: torch.Tensor,
    q_scale: torch.Tensor,
    q_mean: torch.Tensor | None,
    k_op: torch.Tensor,
    k_scale: torch.Tensor,
    v_op: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    is_causal: bool,
    scale: float,
    block_m: int,
    block_n: int,
    qk: str = "int8",
    pv: str = "fp8",
    out: torch.Tensor | None = None,
    row_poison: torch.Tensor | None = None,
    first_bad: torch.Tensor | None = None,
    stages: int | None = None,
    pingpong: bool | None = None,
    p_in_regs: bool = False,
    consumers: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward through the warp-specialised Gluon kernel, for the calls :func:`gluon_forward_unmet` passes;
    arguments and results are :func:`.forward.hopper_forward`'s (``pv="fp8"``).

    Rows of a head past its last query or key read the next head's through the 2-D descriptors (the last head's are
    zero-filled); they are masked to ``-inf`` as in ``_hopper_forward_kernel`` and their outputs are not stored.

    Args:
        q_op, q_scale, q_mean, k_op, k_scale: Q'^ and K'^ (int8, or e4m3 for ``qk="fp8"``) ``[B, H, N, D]``
            contiguous with their scales per ``block_m`` and ``block_n`` rows; ``q_mean`` must be ``None``.
        v_op, v_scale: V^ e4m3 ``[B, Hkv, D, Nk]`` and its per-channel scales ``[B, Hkv, D]``.
        out_dtype, is_causal, scale, block_m, block_n, qk, pv, out, row_poison, first_bad: as
            :func:`.forward.hopper_forward` (``out``: any strides whose last is 1).
        stages: depth of the K'^ / V^T ring (``None``: :data:`DEFAULT_STAGES`; at least 2).
        pingpong: the consumer warpgroups take turns issuing their wgmma (mbarrier hand-off, round robin), so one's
            softmax overlaps the others' products; ``False`` lets them issue freely; ``None``: by head dim,
            :data:`DEFAULT_PINGPONG`.
        p_in_regs: P's codes as the ``P V`` wgmma's A operand from registers; ``False`` (default) through shared
            memory (two buffers per warpgroup).
        consumers: consumer warpgroups a program, 64 query rows each (``None``: :data:`DEFAULT_CONSUMERS`): 2 at
            240 registers, or 3 at 160 (more warps to issue from, as the ``tl`` kernel's three programs an SM).

    Returns:
        ``O`` ``[B, Hq, N, D]`` in ``out_dtype`` and the base-2 logsumexp ``[B, Hq, N]`` fp32.

    Raises:
        UnsupportedAttention: a call it does not serve (the need it lacks), fewer than 2 stages, or a consumer count
            not in :data:`CONSUMERS`.

    Example::

        out, lse2 = gluon_forward(q_op, q_scale, None, k_op, k_scale, v_codes, v_scale, out_dtype=torch.bfloat16,
                                  is_causal=True, scale=0.125, block_m=128, block_n=64, qk="int8", pv="fp8")
    """
    formats = {"qk": qk, "pv": pv, "smooth_q": q_mean is not None}
    unmet = gluon_forward_unmet(q_op.shape, k_op.shape, out_dtype, formats, scale, block_m, block_n)
    if unmet is None and q_op.dtype != _CODE_DTYPES[qk]:
        unmet = f"Q'^ and K'^ as {qk} codes"
    if unmet is None and (stages or DEFAULT_STAGES) < 2:
        unmet = "a ring of at least 2 stages"
    n_wg = consumers or DEFAULT_CONSUMERS
    if unmet is None and n_wg not in CONSUMERS:
        unmet = f"consumers in {CONSUMERS} (received {consumers})"
    if unmet is not None:
        raise UnsupportedAttention("q, k, v", f"{tuple(q_op.shape)} {qk}/{pv}", f"need {unmet}", caller="gluon_forward")
    # The shapes, O and lse, and the arguments both launchers pass alike: hopper_forward's, after the refusals above.
    at = forward_launch(
        q_op, k_op, out_dtype=out_dtype, is_causal=is_causal, scale=scale, out=out, row_poison=row_poison,
        first_bad=first_bad,
    )  # fmt: skip
    head_dim, out = at.head_dim, at.out
    bh, bkv = at.batch * at.heads, at.batch * at.kv_heads
    desc_q = _desc(q_op, bh * at.seq_q, head_dim, [WG_ROWS, head_dim])
    desc_k = _desc(k_op, bkv * at.seq_k, head_dim, [block_n, head_dim])
    desc_vt = _desc(v_op, bkv * head_dim, at.seq_k, [head_dim, block_n])
    consumer_regs, maxnreg = REGS[n_wg]
    turns = DEFAULT_PINGPONG[head_dim] if pingpong is None else pingpong
    _gluon_forward_kernel[at.grid(triton.cdiv(at.seq_q, n_wg * WG_ROWS))](
        desc_q, desc_k, desc_vt, q_scale, k_scale, v_scale, at.lse, out, at.row_poison, at.first_bad,
        out.stride(0), out.stride(1), out.stride(2), at.heads, at.heads // at.kv_heads, at.seq_q, at.seq_k,
        at.qk_scale, HEAD_DIM=head_dim, Q_BLOCK=block_m, BLOCK_N=block_n, STAGES=stages or DEFAULT_STAGES,
        CAUSAL=is_causal, QK_INT8=qk == "int8", PINGPONG=turns, P_IN_REGS=p_in_regs, CONFINED=at.confined, N_WG=n_wg,
        LOAD_REGS=LOAD_REGS, CONSUMER_REGS=consumer_regs, num_warps=4, maxnreg=maxnreg,
    )  # fmt: skip
    return out, at.lse
