"""Block-wise symmetric integer quantization for ZeRO++'s communication (qwZ weights, qgZ gradients), in torch ops.

A tensor of ``rows`` x ``n`` values is cut, row by row, into blocks of ``block`` consecutive values (the last block
of a row zero-padded). Each block keeps one fp32 scale ``s = max|x| / qmax`` (``qmax`` = 127 for INT8, 7 for
INT4) and its values as ``q = round(x / s)`` clipped to ``[-qmax, qmax]``; dequantizing gives ``q * s``.

**Error bound.** Rounding to the nearest multiple of ``s`` moves a value by at most ``s / 2``, and no value is
clipped (``|x| <= max|x| = qmax * s``), so every element of a block satisfies

    |x - dequantize(quantize(x))| <= max|x_block| / (2 * qmax)

up to fp32 rounding of the division (a relative 2^-23 of ``|x|``). A value's error scales with its *block's*
largest magnitude, not the tensor's: that is why blocks are small, and why one outlier costs only its block.

**Block sizes**, chosen from measured error (``bench/zeropp_bench.py --blocks``: the normwise round-trip error
over the 2-D weights and gradients of a small GPT after 10 AdamW steps; bench/README.md): weights travel as INT8
in blocks of :data:`WEIGHT_BLOCK` = 256 values, gradients as INT4 in blocks of :data:`GRAD_BLOCK` = 128. INT8
weights: 0.63% at 128, 0.68% at 256, 0.77% at 1024, 0.85% at 4096: the error grows slowly with the block, so
256 keeps the scales' cost at 1.6% of the INT8 bytes (4 bytes per block) for 8% more error than 128. INT4
gradients: 8.8% at 32, 13.2% at 128, 15.7% at 256, 23.5% at 1024: here the block matters, and 128 costs 6.3% of
the INT4 bytes in scales (3.1% at 256) for a sixth less error than 256.

**Packing.** INT8 values are stored as ``int8``; INT4 values as two per ``uint8`` (the value plus 8 in each
nibble, even positions low), so a block of ``block`` INT4 values costs ``block / 2`` bytes.

**Non-finite values stay non-finite.** A block holding inf or NaN gets an inf or NaN scale, and every one of its
dequantized values becomes NaN (``0 * inf``): an overflow is never rounded away, so the optimizer's non-finite
check still sees it and skips the step on every rank.
"""

from __future__ import annotations

import torch

__all__ = ["GRAD_BLOCK", "WEIGHT_BLOCK", "dequantize", "error_bound", "quantize"]

WEIGHT_BLOCK = 256  # qwZ: INT8 values per scale (module docstring)
GRAD_BLOCK = 128  # qgZ: INT4 (or INT8) values per scale


def _qmax(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"quantization to {bits} bits: megazero quantizes to 4 or 8 bits")
    return (1 << (bits - 1)) - 1


def blocks_per_row(n: int, block: int) -> int:
    """Blocks covering ``n`` values."""
    return -(-n // block)


def quantize(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the rows (last dimension) of ``x`` (any float dtype, any strides, any leading dimensions, read as
    ``rows`` = their product): ``(values, scales)``, values ``rows x nb*block`` int8 (8 bits) or
    ``rows x nb*block/2`` uint8 (4 bits, packed), scales ``rows x nb`` fp32."""
    qmax = _qmax(bits)
    if bits == 4 and block % 2:
        raise ValueError(f"INT4 blocks pack two values per byte: the block size must be even, got {block}")
    n = x.shape[-1]
    rows = x.numel() // n
    nb = blocks_per_row(n, block)
    xf = torch.zeros(rows, nb * block, dtype=torch.float32, device=x.device)
    xf.view(*x.shape[:-1], nb * block)[..., :n].copy_(x)  # the one pass over x: through its strides (no copy
    # of a reordered input: qgZ's peer-major view is read in place)
    xb = xf.view(rows, nb, block)
    scales = xb.abs().amax(dim=2).div_(qmax)  # inf/NaN blocks keep an inf/NaN scale
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = xb.div_(safe.unsqueeze(2)).round_().clamp_(-qmax, qmax).nan_to_num_(0.0)
    if bits == 8:
        return q.to(torch.int8).view(rows, nb * block), scales
    u = (q.view(rows, nb * block // 2, 2) + 8).to(torch.uint8)
    return (u[..., 0] | (u[..., 1] << 4)).contiguous(), scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, bits: int, block: int, n: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``rows x n`` fp32 values of :func:`quantize`'s output, written into ``out`` (any dtype) when given."""
    rows, nb = scales.shape
    if bits == 8:
        q = values.view(rows, nb, block).to(torch.float32)
    else:
        _qmax(bits)
        u = values.view(rows, nb * block // 2)
        q = torch.stack(((u & 15).to(torch.float32), (u >> 4).to(torch.float32)), dim=2).sub_(8)
        q = q.view(rows, nb, block)
    x = q.mul_(scales.unsqueeze(2)).view(rows, nb * block)[:, :n]
    if out is None:
        return x
    out.copy_(x)
    return out


def error_bound(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Per-element bound on the round trip's error for the rows of ``x``: ``max|x_block| / (2 qmax)`` plus the
    fp32 division's rounding (module docstring); same shape as ``x``."""
    rows, n = x.shape
    nb = blocks_per_row(n, block)
    xf = torch.zeros(rows, nb * block, dtype=torch.float32, device=x.device)
    xf[:, :n].copy_(x)
    amax = xf.view(rows, nb, block).abs().amax(dim=2, keepdim=True)
    bound = (amax / (2 * _qmax(bits))).expand(rows, nb, block).reshape(rows, nb * block)[:, :n]
    return bound + xf[:, :n].abs() * 2.0**-22
