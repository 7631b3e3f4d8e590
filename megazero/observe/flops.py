"""FLOPs of a training step by Megatron-LM's count, the datasheet peaks of known GPUs, and the throughput figures
(tokens/s, TFLOP/s per GPU, MFU, HFU) a run logs and the planner's roofline predicts: one definition for both."""

from __future__ import annotations

import os
from typing import Any

import torch

from megazero.config.schema import ModelConfig

__all__ = ["PEAK_FLOPS", "flops_shape", "megatron_hardware_flops", "megatron_model_flops", "peak_flops_per_device",
           "throughput"]


def flops_shape(model: ModelConfig) -> dict[str, Any]:
    """The keyword arguments of this module's FLOP counts for ``model``: the key/value width (grouped-query
    attention), the MLP width and whether the MLP is gated (SwiGLU: three matrices instead of two)."""
    return {"kv_hidden": model.kv_heads * model.head_dim, "ffn_hidden": model.ffn_hidden_size,
            "gated": model.arch == "llama"}


def _layer_flops(seq_len: int, hidden: int, kv_hidden: int | None, ffn_hidden: int | None, gated: bool) -> float:
    """Forward FLOPs of one transformer layer per token: the q, k, v projections ``2h(h + 2·kv)``, ``QKᵀ`` and
    attention over V ``4·s·h`` (the full square, as Megatron-LM counts), the output projection ``2h²`` and the
    MLP ``4·h·f`` (``6·h·f`` gated). GPT-2 (kv = h, f = 4h) gives Megatron-LM's ``24h² + 4sh``."""
    h = hidden
    kv = h if kv_hidden is None else kv_hidden
    f = 4 * h if ffn_hidden is None else ffn_hidden
    return 2.0 * h * (h + 2 * kv) + 4.0 * seq_len * h + 2.0 * h * h + (6.0 if gated else 4.0) * h * f


def megatron_model_flops(batch: float, seq_len: int, num_layers: int, hidden: int, vocab: int, *,
                         kv_hidden: int | None = None, ffn_hidden: int | None = None, gated: bool = False) -> float:
    """Model FLOPs of one step (forward + backward) by Megatron-LM's count, no recomputation.

    ``72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))`` for ``batch`` = B sequences of ``seq_len`` = s tokens (the
    global batch), l layers, hidden size h and vocabulary V (Narayanan et al. 2021, appendix) for GPT-2; in
    general ``3·B·s·(l·layer + 2hV)`` with the per-token layer count of :func:`_layer_flops` (keyword arguments:
    :func:`flops_shape`). MFU always uses this count.
    """
    layer = _layer_flops(seq_len, hidden, kv_hidden, ffn_hidden, gated)
    return 3.0 * batch * seq_len * (num_layers * layer + 2.0 * hidden * vocab)


def megatron_hardware_flops(batch: float, seq_len: int, num_layers: int, hidden: int, vocab: int,
                            checkpointing: str = "none", *, kv_hidden: int | None = None,
                            ffn_hidden: int | None = None, gated: bool = False) -> float:
    """FLOPs the hardware executes in one step, recomputation included (the numerator of HFU).

    ``none``: the model FLOPs. ``full`` (every layer's forward run twice): Megatron-LM's
    ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))`` for GPT-2, ``B·s·(4·l·layer + 6hV)`` in general. ``selective``
    (attention core recomputed): the model FLOPs plus one more forward of the ``QKᵀ`` and attention-over-V
    matmuls, ``4·B·s²·h`` per layer.
    """
    s, h, n = seq_len, hidden, num_layers
    shape = {"kv_hidden": kv_hidden, "ffn_hidden": ffn_hidden, "gated": gated}
    if checkpointing == "full":
        return batch * s * (4.0 * n * _layer_flops(s, h, **shape) + 6.0 * h * vocab)
    model = megatron_model_flops(batch, seq_len, num_layers, hidden, vocab, **shape)
    if checkpointing == "selective":
        return model + 4.0 * batch * s * s * h * n
    return model


# Dense (no sparsity) peak FLOP/s per device by compute dtype, from the vendors' datasheets. "tf32" is the
# tensor-core rate fp32 matmuls get when torch.backends.cuda.matmul.allow_tf32 is on, "fp32" the plain rate.
# Matched against torch.cuda.get_device_name() in order, first hit wins (so "H100 PCIe" before "H100").
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    ("H100 NVL", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    ("H100", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM
    ("H200 NVL", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    ("H200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM
    ("GH200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("B200", {"bf16": 2250e12, "fp16": 2250e12, "tf32": 1100e12, "fp32": 80e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("A800", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183.2e12, "fp32": 91.6e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    ("A10", {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12}),
]


def peak_flops_per_device(precision: str, device: torch.device | str | None = None,
                          peak_tflops: float | None = None, device_name: str | None = None) -> float | None:
    """Dense peak FLOP/s of one device for ``precision`` (fp32 | bf16 | fp16), or None where unknown (CPU).

    ``peak_tflops`` (``--peak-tflops``), else ``MEGAZERO_PEAK_TFLOPS`` (TFLOP/s, per device), overrides the
    table; otherwise the CUDA device's name (or ``device_name``) is looked up in :data:`PEAK_FLOPS`. fp32
    uses the TF32 rate when PyTorch allows TF32 matmuls.
    """
    if peak_tflops is not None:
        return peak_tflops * 1e12
    env = os.environ.get("MEGAZERO_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12
    if device_name is None:
        dev = torch.device(device) if device is not None else None
        if dev is None or dev.type != "cuda" or not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name(dev)
    key = precision
    if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        key = "tf32"
    for pattern, peaks in PEAK_FLOPS:
        if pattern.lower() in device_name.lower():
            return peaks.get(key)
    return None


def throughput(tokens: int, seq_len: int, seconds: float, world_size: int, num_layers: int, hidden: int,
               vocab: int, checkpointing: str = "none", peak_flops: float | None = None,
               **shape: Any) -> dict[str, float | None]:
    """``tokens_per_s``, ``tflops_per_gpu`` (model FLOPs), ``mfu`` and ``hfu`` of one step over the whole job.

    ``tokens`` is the global batch's token count (so B = tokens / seq_len sequences), ``seconds`` the step's
    wall time, ``peak_flops`` one device's peak FLOP/s (``mfu``/``hfu`` are None without it). ``vocab`` is the
    (padded) vocabulary the LM head multiplies by; ``shape``: :func:`flops_shape` of a model other than GPT-2.
    """
    batch = tokens / seq_len
    model = megatron_model_flops(batch, seq_len, num_layers, hidden, vocab, **shape)
    hardware = megatron_hardware_flops(batch, seq_len, num_layers, hidden, vocab, checkpointing, **shape)
    per_gpu = model / seconds / world_size
    return {
        "tokens_per_s": tokens / seconds,
        "tflops_per_gpu": per_gpu / 1e12,
        "mfu": per_gpu / peak_flops if peak_flops else None,
        "hfu": hardware / seconds / world_size / peak_flops if peak_flops else None,
    }
