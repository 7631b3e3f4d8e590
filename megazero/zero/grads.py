"""Gradient precision and this rank's owned gradients as the optimizer step reads them.

Gradients are accumulated over micro-batches and reduced over the DP group in one dtype
(``ZeroConfig.grad_dtype``, ``--grad-dtype``, DeepSpeed's ``communication_data_type`` /
``data_types.grad_accum_dtype``):

=========  ======================  ============================================================================
setting    bf16 training           fp16 training
=========  ======================  ============================================================================
``auto``   fp32 (4 bytes/param)    fp16 (2 bytes/param): DeepSpeed's default and the ZeRO paper's 2Ψ
``fp32``   fp32                    fp32: unscaled sums never overflow in the reduction
``model``  bf16 (2 bytes/param)    fp16
=========  ======================  ============================================================================

``auto`` in bf16 is what Megatron-LM (``accumulate_allreduce_grads_in_fp32``) and DeepSpeed's bf16 optimizer
do: bf16 keeps 8 bits of mantissa, so summing 8 micro-batches over 16 ranks in bf16 loses the low bits.
Model-state bytes per parameter with Adam (fp32 master + 2 moments = 12 bytes), Ψ parameters, Nd ranks, and
g the gradient bytes (2 or 4): stage 0 (2 + g + 12)Ψ, stage 1 (2 + g)Ψ + 12Ψ/Nd, stage 2 2Ψ + (g + 12)Ψ/Nd,
stage 3 (2 + g + 12)Ψ/Nd; bf16 with fp32 gradients is 18Ψ at stage 0 and 2Ψ + 16Ψ/Nd at stage 2.

:class:`OwnedGrads` presents the owned gradient segments (views into the store's buffers, no copy) in the
optimizer's owned coordinates, converting 16-bit pieces to fp32 only a run at a time.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from megazero.config.precision import GRAD_DTYPES, PRECISION_DTYPES

__all__ = ["OwnedGrads", "grad_dtype_for", "split_runs"]


def grad_dtype_for(precision: str, setting: str = "auto") -> torch.dtype:
    """The dtype gradients are accumulated and reduced in, for ``--precision`` and ``--grad-dtype``."""
    if precision not in PRECISION_DTYPES:
        raise ValueError(f"--precision must be one of {', '.join(PRECISION_DTYPES)}, got {precision!r}")
    if setting == precision:  # a DeepSpeed dtype name equal to the model's
        setting = "model"
    if setting not in GRAD_DTYPES:
        raise ValueError(f"--grad-dtype must be one of {', '.join(GRAD_DTYPES)} (or the --precision name), got "
                         f"{setting!r}")
    if setting == "fp32" or (setting == "auto" and precision == "bf16"):
        return torch.float32
    return PRECISION_DTYPES[precision]


def split_runs(runs: Sequence[tuple[int, int]], bounds: Sequence[int]) -> list[tuple[int, int]]:
    """``runs`` (``[a, b)`` ranges) cut at every boundary in the sorted ``bounds``, so none spans two segments."""
    out = []
    for a, b in runs:
        i = bisect.bisect_right(bounds, a)
        while i < len(bounds) and bounds[i] < b:
            out.append((a, bounds[i]))
            a, i = bounds[i], i + 1
        out.append((a, b))
    return out


class OwnedGrads:
    """This rank's reduced gradients in owned coordinates: ``parts`` are ``(start, tensor)`` pairs laid end to
    end (the store's segment buffers, used in place). Ranges read through :meth:`slice` or :meth:`fp32` must
    lie within one part (cut them with :func:`split_runs` at :attr:`bounds`).

    :meth:`scale_` multiplies fp32 parts in place and remembers the factor for 16-bit parts, which
    :meth:`fp32` applies to the fp32 copy it makes of a range (so 16-bit gradients are never scaled in 16 bits
    and never copied whole).
    """

    def __init__(self, parts: Sequence[tuple[int, torch.Tensor]]) -> None:
        self.parts = [t.reshape(-1) for _, t in parts]
        self.bounds = [a for a, _ in parts]
        self._factor = 1.0

    def slice(self, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)`` in their stored dtype (a view)."""
        i = bisect.bisect_right(self.bounds, a) - 1
        start = self.bounds[i]
        t = self.parts[i]
        if b - start > t.numel():
            raise ValueError(f"owned gradient range [{a}, {b}) spans two segments")
        return t[a - start: b - start]

    def fp32(self, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)`` in fp32, scaled: a view of fp32 parts, a new tensor for 16-bit ones."""
        t = self.slice(a, b)
        if t.dtype == torch.float32:
            return t
        out = t.float()
        return out if _is_one(self._factor) else out.mul_(self._factor)

    def fp32_runs(self, runs: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """:meth:`fp32` of each ``[a, b)`` of ``runs`` (sorted, each within one part): views of fp32 parts; for
        16-bit parts one conversion of the span the part's runs cover (not one per run), sliced."""
        out: list[torch.Tensor] = []
        i = 0
        while i < len(runs):
            a0 = runs[i][0]
            part = bisect.bisect_right(self.bounds, a0) - 1
            j = i
            while j + 1 < len(runs) and bisect.bisect_right(self.bounds, runs[j + 1][0]) - 1 == part:
                j += 1
            z = runs[j][1]
            span = self.fp32(a0, z)
            out += [span[a - a0: b - a0] for a, b in runs[i: j + 1]]
            i = j + 1
        return out

    def scale_(self, factor: float | torch.Tensor) -> None:
        """Multiply every gradient by ``factor`` (unscaling and clipping): a number, or a 0-dim device tensor
        (a coefficient decided on the device, never read back)."""
        if _is_one(factor):
            return
        for t in self.parts:
            if t.dtype == torch.float32:
                t.mul_(factor)
        self._factor = self._factor * factor


def _is_one(factor: float | torch.Tensor) -> bool:
    """Whether ``factor`` is the number 1 (a tensor is never taken as one: comparing it would read the device)."""
    return not isinstance(factor, torch.Tensor) and factor == 1.0
