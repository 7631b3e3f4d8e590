"""Attention, dropout and RMSNorm as a GPU runs them, with the dry run's seam on the meta device.

On a CPU or a GPU these are torch's own functions, unchanged: :func:`causal_attention` is
``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` (on a CUDA GPU of compute capability 8.0 or newer
torch picks FlashAttention-2 for fp16/bf16 and the memory-efficient kernel for fp32) and :func:`dropout` is
``F.dropout`` (on CUDA the fused ``native_dropout``, which keeps a bool mask for backward).

On the meta device torch has no CUDA kernel to pick and takes the paths of a CPU: attention on the unfused
math path, which saves the ``[B, nh, S, S]`` probabilities for backward, and dropout as a multiplication by a
mask of the input's dtype. Neither is what a GPU holds. Inside ``with emulate("cuda"):`` (the dry run of a GPU
run, :func:`megazero.plan.dryrun.dry_run`) these functions call the ops a CUDA run uses on meta tensors directly --
the fused attention op of :func:`fused_kernel` and ``native_dropout`` -- whose meta kernels return the same
outputs, so autograd saves what it saves on the GPU: for attention q, k, v (views of the input), the output and
the fp32 log-sum-exp per query plus the kernel's RNG seed and offset, no ``S x S`` tensor; for dropout a bool
mask. Backward runs through their meta kernels. Outside such a block (the default, ``"cpu"``) meta tensors take
torch's own paths, as a CPU run does. The choice is kept in a :class:`contextvars.ContextVar`.

RMSNorm likewise: ``F.rms_norm`` calls ``aten::_fused_rms_norm``, which has a CUDA kernel whose autograd formula
saves the input, the weight and the fp32 ``rstd`` per token; a CPU or the meta device has none and runs its
composite, whose autograd saves an fp32 copy of the input, the fp32 normalised input and ``rstd`` (8 bytes per
element in any precision, against the GPU's 2 in bf16). :func:`rms_norm` on meta emulating CUDA is an autograd
function that saves what the CUDA kernel's formula saves, its backward the op's own meta kernel
(``_fused_rms_norm_backward``). torch takes the composite on CUDA too when the weight's dtype differs from the
input's; so does the emulation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

__all__ = ["FLASH_MAX_HEAD_DIM", "causal_attention", "dropout", "emulate", "emulated", "fused_kernel", "rms_norm"]

FLASH_MAX_HEAD_DIM = 256  # FlashAttention-2's largest head dimension
_EMULATED: ContextVar[str] = ContextVar("megazero_meta_kernels", default="cpu")


@contextmanager
def emulate(device_type: str) -> Iterator[None]:
    """Within the block, meta tensors run the kernels of ``device_type``: ``"cuda"`` or ``"cpu"`` (torch's own
    meta paths, the default)."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device type {device_type!r} is not valid; choose cpu or cuda")
    token = _EMULATED.set(device_type)
    try:
        yield
    finally:
        _EMULATED.reset(token)


def emulated() -> str:
    """The device type whose kernels meta tensors run now (:func:`emulate`)."""
    return _EMULATED.get()


def _on_gpu_meta(x: torch.Tensor) -> bool:
    return x.device.type == "meta" and _EMULATED.get() == "cuda"


def fused_kernel(dtype: torch.dtype, head_dim: int) -> str | None:
    """The fused SDPA kernel torch's CUDA dispatch picks on an sm80+ GPU (A100, H100, H200, B200, L40S) for
    causal attention without a mask: ``"flash"`` for fp16/bf16 with a head dimension of at most 256,
    ``"efficient"`` for the other cases it supports (fp32, or larger heads); None where torch would pad the
    head dimension (not a multiple of 8) or fall back to the math path, which the meta device then runs.

    This follows torch's default priority order (``torch._C._get_sdp_priority_order()`` on torch 2.13: flash,
    memory-efficient, math, cuDNN); cuDNN's kernel, where a run prefers it, saves the same output and fp32
    log-sum-exp per query."""
    if head_dim % 8:
        return None
    if dtype in (torch.float16, torch.bfloat16) and head_dim <= FLASH_MAX_HEAD_DIM:
        return "flash"
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return "efficient"
    return None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention over ``[B, nh, S, hd]`` inputs -> ``[B, nh, S, hd]``.

    On the meta device emulating CUDA, the fused kernel of :func:`fused_kernel` (its dropout, like the GPU's,
    draws inside the kernel and saves no mask); anywhere else ``F.scaled_dot_product_attention``, unchanged.
    """
    kind = fused_kernel(q.dtype, q.shape[-1]) if _on_gpu_meta(q) else None
    if kind == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, True, False)[0]
    if kind == "efficient":
        lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, lse, dropout_p, True)[0]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``F.dropout(x, p, training)``; on the meta device emulating CUDA, CUDA's fused ``native_dropout`` (it saves
    a bool mask)."""
    if _on_gpu_meta(x) and training and 0 < p < 1:
        return torch.native_dropout(x, p, True)[0]
    return F.dropout(x, p, training)


class _FusedRMSNorm(torch.autograd.Function):
    """``aten::_fused_rms_norm`` as CUDA's autograd runs it, for meta tensors: saves input, fp32 rstd, weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, shape: tuple[int, ...],
                eps: float | None) -> torch.Tensor:
        stats = x.shape[: x.dim() - len(shape)] + (1,) * len(shape)
        rstd = x.new_empty(stats, dtype=torch.promote_types(x.dtype, torch.float32))  # the kernel's accumulator type
        ctx.save_for_backward(x, rstd, weight)
        ctx.shape = shape
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]]
        dx, dw = torch.ops.aten._fused_rms_norm_backward(grad, x, list(ctx.shape), rstd, weight, mask)
        return dx, dw, None, None


def rms_norm(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    """``F.rms_norm(x, shape, weight, eps)``; on the meta device emulating CUDA, what CUDA's fused kernel saves
    (module docstring)."""
    if _on_gpu_meta(x) and (weight is None or weight.dtype == x.dtype):
        return _FusedRMSNorm.apply(x, weight, tuple(shape), eps)
    return F.rms_norm(x, shape, weight, eps)
