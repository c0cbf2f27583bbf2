"""The forward's quantization health, per layer: how much of Q' and K' their INT8 block quantization destroys.

The dS statistics see the backward; an outlier in q (one entry of 300 among N(0, 1) values) spoils the INT8
scale of its whole block of query rows, so every other row of that block loses its scores, yet ``ds_rel_err`` does
not move (issue 16: 0.039-0.042 against O cosines of 0.944). This signal measures it directly, on the steps that
measure dS: Q' (Q, Q-smoothed per block of query rows when ``smooth_q``) and K' (K minus its mean over tokens when
``smooth_k``) are quantized the way the kernels do (``quantize_int8``'s ``psi``, one scale per block of ``BLOCK_M``
query rows or ``BLOCK_N`` keys), and each row's relative error ``|X_i - deq(psi(X))_i|^2 / |X_i|^2`` is summed. Per
row, not over the whole tensor: an outlier's own norm would otherwise hide the rows it ruined.

``qk_rel_err = sqrt(mean_rows(rel_Q) + mean_rows(rel_K))`` (the relative errors of a product's two operands add in
quadrature). Measured on N(0, 1), N(0, 16) and N(0, 100) inputs it is 0.013 whatever the scale; one q outlier of
100, 300, 1000 reads 0.059, 0.17, 0.25 (``docs/controller.md``). It is computed in PyTorch from the layer's q and
k on measured steps only, no kernel change: a fixed number of batched operations per call (47 at the default
precision, whatever the batch size and the head counts), no host sync, and one float32 temporary of q's size (two
with ``smooth_q``) and two of k's, plus a zero-padded copy where the length is not a multiple of the block. The
block sizes are the reference's (128 query rows, 64 keys); autotuned Triton blocks may differ, which makes it an
estimate of the same quantity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sage_lightning.kernels.reference import DEFAULT_BLOCK_M, DEFAULT_BLOCK_N, INT8_MAX


def row_relative_error(x: torch.Tensor, block: int, *, smooth_block_mean: bool = False) -> torch.Tensor:
    """``[sum over rows of |err_i|^2 / |x_i|^2, rows]`` of ``x``'s INT8 quantization, one scale per ``block`` rows.

    All batch elements and heads at once, in a fixed number of operations; ``x`` itself is not copied to float32
    (the quantization reads it where it is) and never written.

    Args:
        x: ``[B, H, N, D]``.
        block: rows per quantization block (the last block is zero-padded; padded and all-zero rows do not count).
        smooth_block_mean: subtract each block's mean row first (Q-smoothing).

    Returns:
        A float64 tensor of 2 elements on ``x``'s device (sums, so they add across calls and ranks).

    Example::

        err, rows = row_relative_error(torch.randn(1, 2, 256, 64), 128).tolist()
        (err / rows) ** 0.5   # about 0.009
    """
    return torch.stack(_row_sums(_readable(x), block, smooth_block_mean))


def _readable(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached, in a dtype read as it is (bf16 and fp16 are computed with in float32, as ``x.float()`` would
    be); any other dtype as float32, as the kernels would see it."""
    x = x.detach()
    return x if x.dtype in (torch.float32, torch.float16, torch.bfloat16) else x.float()


def _row_sums(x: torch.Tensor, block: int, smooth_block_mean: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum rel, rows)`` as float64 scalars on ``x``'s device; see :func:`row_relative_error`."""
    n = x.shape[2]
    count = -(-n // block)
    tail = n - (count - 1) * block  # the rows of the last block
    if tail != block:
        x = F.pad(x, (0, 0, 0, count * block - n))
    blocks = x.unflatten(2, (count, block))  # [B, H, blocks, block, D]
    if smooth_block_mean:
        rows = torch.full((count, 1, 1), float(block), device=x.device)
        if tail != block:
            rows[-1] = tail
        blocks = blocks - blocks.sum(dim=3, keepdim=True, dtype=torch.float32) / rows
        if tail != block:
            blocks[:, :, -1, tail:] = 0.0
    # psi (kernels/reference.py: quantize_int8) dequantized, one scale per block, minus the block: the error.
    scale = torch.linalg.vector_norm(blocks, float("inf"), dim=(-2, -1), keepdim=True, dtype=torch.float32) / INT8_MAX
    scale.masked_fill_(scale == 0, 1.0)
    error = blocks / scale  # float32 whatever x's dtype; the ops below work in it, in place
    error.round_().clamp_(-INT8_MAX, INT8_MAX).mul_(scale).sub_(blocks)
    err2 = torch.linalg.vector_norm(error, dim=-1).square()
    norm2 = torch.linalg.vector_norm(blocks, dim=-1, dtype=torch.float32).square()
    counted = norm2 > 0
    rel = torch.where(counted, err2 / norm2, 0.0)
    # Per batch element in float32, then across them in float64 (as the sums of one element at a time added).
    return rel.sum(dim=(1, 2, 3)).sum(dtype=torch.float64), counted.sum(dtype=torch.float64)


def qk_quant_error(q: torch.Tensor, k: torch.Tensor, *, smooth_q: bool, smooth_k: bool) -> torch.Tensor:
    """``[sum rel_Q, rows_Q, sum rel_K, rows_K]`` of one attention call (float64, on the inputs' device).

    ``qk_rel_err = sqrt(sum_rel_Q / rows_Q + sum_rel_K / rows_K)`` once summed over calls and ranks. A fixed
    number of batched operations whatever the batch size and the head counts (GQA included); no host sync.

    Example::

        sums = qk_quant_error(q, k, smooth_q=False, smooth_k=True)
    """
    keys = _readable(k)
    if smooth_k:
        keys = keys - keys.mean(dim=2, keepdim=True, dtype=torch.float32)
    return torch.stack([*_row_sums(_readable(q), DEFAULT_BLOCK_M, smooth_q), *_row_sums(keys, DEFAULT_BLOCK_N, False)])


def qk_rel_err(sums: list[float]) -> float | None:
    """``qk_rel_err`` from the four sums of :func:`qk_quant_error` (summed); ``None`` when no row was measured."""
    rel_q, rows_q, rel_k, rows_k = sums
    if rows_q <= 0 or rows_k <= 0:
        return None
    return (rel_q / rows_q + rel_k / rows_k) ** 0.5
