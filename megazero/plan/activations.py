"""Activation memory: the bytes autograd saves for backward during one micro-batch's forward on one rank, which
is what :class:`megazero.observe.memory.ActivationMemoryCounter` measures (metrics.jsonl's
``activation_peak_bytes``), per family and recomputation mode; :mod:`megazero.plan.estimate` re-exports these
functions and builds the peak on them.

GPT-2 follows Korthikanti et al. (arXiv 2205.05198), whose per-layer figure is ``sbh(34 + 5as/h)`` bytes in
16 bits with dropout and unfused attention, adapted to this implementation (:func:`activation_bytes`);
:func:`korthikanti_layer_bytes` gives the paper's figure for comparison. A Llama block saves other tensors
(:func:`activation_bytes` lists them): RMSNorm's, no biases, rotary tables and rotated q/k, GQA's smaller
q/k/v projection but K/V repeated to the query heads before attention, and SwiGLU's gate/up output, its silu
and the product, which make the MLP ``4F`` wide (GPT-2's ``2 x 4H``). Llama 3 8B at tp 8 keeps 0.42 GB per
layer and micro-batch of 8192 tokens on a GPU (0.83 GB on a CPU, whose RMSNorm saves fp32 copies), against
0.37 GB for the GPT-2 count of the same shape.

Kernels differ between devices, and the figures follow the one asked for (the defaults are CUDA's, which the
dry run's meta tensors emulate, :mod:`megazero.model.kernels`):

* ``fused_attention``: SDPA's fused kernels (CUDA's flash/memory-efficient, the CPU's flash kernel without
  dropout) save q, k, v, the output and an fp32 log-sum-exp per query; the math path (CPU with dropout) saves
  the ``S x S`` probabilities and copies of q and k;
* ``mask_bytes``: dropout masks are bool on CUDA (1 byte), of the compute dtype on a CPU;
* ``fused_norm`` (Llama): CUDA's fused RMSNorm kernel saves its input and the fp32 ``rstd`` per token; the
  composite that runs on a CPU (and on meta outside the CUDA emulation) saves an fp32 copy of the input, the
  fp32 normalised input and ``rstd``, 8 bytes per element in any precision: 4x a bf16 GPU's 2 bytes. Pass
  ``fused_norm=False`` to predict a CPU run. (LayerNorm saves its input, mean and rstd on both.)
"""

from __future__ import annotations

from dataclasses import dataclass

from megazero.config.precision import ELEMENT_BYTES
from megazero.config.schema import ModelConfig
from megazero.tensor_parallel.layers import VOCAB_PAD_MULTIPLE, pad_size

__all__ = ["activation_bytes", "checkpoint_host_bytes", "korthikanti_layer_bytes", "recompute_bytes"]

_CHECKPOINTING = ("none", "selective", "full")


def korthikanti_layer_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, tp_size: int = 1,
                            sequence_parallel: bool = False, checkpointing: str = "none") -> float:
    """Korthikanti et al.'s activation bytes of one (GPT) transformer layer (16-bit, dropout, unfused attention).

    ``sbh(34 + 5as/h)`` with no parallelism; ``sbh(10 + 24/t + 5as/(ht))`` with TP; ``sbh/t (34 + 5as/h)``
    with TP and SP; selective recomputation drops the ``5as/h`` term; full recomputation keeps ``2sbh``
    (``2sbh/t`` with SP).
    """
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp_size
    sbh = s * b * h
    attn = 0.0 if checkpointing == "selective" else 5 * a * s / h
    if checkpointing == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    if sequence_parallel and t > 1:
        return sbh / t * (34 + attn)
    return sbh * (10 + 24 / t + attn / t)


@dataclass(frozen=True)
class _LayerBytes:
    """One transformer layer's saved bytes, split the way recomputation needs them."""

    total: float  # everything one layer saves for backward without recomputation
    core: float  # what selective recomputation drops: the attention core's own tensors beyond ``qkv``
    qkv: float  # the core's input, q, k, v of this rank's heads (what selective recomputation keeps)
    core_output: float  # the fused core's output, which shares storage with the projection's input
    layer_input: float  # the layer input (what full recomputation keeps), a sequence shard with SP


def _layer_bytes(model: ModelConfig, micro_batch: int, tp_size: int, sequence_parallel: bool, precision: str,
                 fused_attention: bool, mask_bytes: int, fused_norm: bool = True) -> _LayerBytes:
    if precision not in ELEMENT_BYTES:
        raise ValueError(f"precision must be one of {sorted(ELEMENT_BYTES)}, got {precision!r}")
    if model.arch == "llama":
        return _llama_layer_bytes(model, micro_batch, tp_size, sequence_parallel, ELEMENT_BYTES[precision],
                                  fused_attention, mask_bytes, fused_norm)
    e, t = ELEMENT_BYTES[precision], tp_size
    s, b, h, a = model.seq_len, micro_batch, model.hidden_size, model.num_heads
    sb, sbh = s * b, s * b * h
    sp = t if sequence_parallel and t > 1 else 1  # residual-stream tensors are split over the sequence
    drop = model.dropout > 0
    if fused_attention:
        core = 4 * a * sb / t
    else:  # the math path copies q (scaled) and k (transposed); v too when b > 1, else v's view keeps all of qkv
        core = e * a * s * sb / t + ((mask_bytes + e) * a * s * sb / t if drop else 0)
        core += 2 * e * sbh / t if micro_batch == 1 else 0
    total = (4 * e * sbh + 4 * e * sb) / sp + 12 * e * sbh / t + core + (2 * mask_bytes * sbh / sp if drop else 0)
    return _LayerBytes(total, core, 3 * e * sbh / t, e * sbh / t if fused_attention else 0.0, e * sbh / sp)


def _llama_layer_bytes(model: ModelConfig, micro_batch: int, t: int, sequence_parallel: bool, e: int,
                       fused_attention: bool, mask_bytes: int, fused_norm: bool) -> _LayerBytes:
    """A Llama block (:func:`activation_bytes` lists the terms)."""
    s, b, h, a, d = model.seq_len, micro_batch, model.hidden_size, model.num_heads, model.head_dim
    sb, sbh, f = s * b, s * b * h, model.ffn_hidden_size
    sp = t if sequence_parallel and t > 1 else 1
    drop = model.dropout > 0
    kv_local = max(model.kv_heads // t, 1)  # this rank's K/V heads (one shared by tp / kv ranks when tp > kv)
    gqa = kv_local < a // t
    qkv = e * sb * (h / t + 2 * kv_local * d)  # the projection's output: q, k, v of this rank's heads
    norm = (e if fused_norm else 8) * sbh + 4 * sb  # saved input (fp32 copy + normalised: 8 bytes) and rstd
    rotary = 2 * e * s * d  # cos and sin [S, hd]
    # v: repeated to the query heads (GQA) or a view that keeps the whole qkv output alive (MHA, unless the math
    # path's reshape copies it, b > 1)
    v = e * sbh / t if gqa or not (fused_attention or b == 1) else qkv
    if fused_attention:  # rotated q; rotated k (repeated under GQA); v; fp32 log-sum-exp per query
        core = e * sbh / t + e * sbh / t + v + 4 * a * sb / t
    else:  # scaled q and transposed k (copies); v; probabilities (and the dropout's mask and output)
        core = 2 * e * sbh / t + v + e * a * s * sb / t + ((mask_bytes + e) * a * s * sb / t if drop else 0)
    core += rotary
    out = e * sbh / t  # the core's output, the output projection's input
    mlp = 4 * e * sb * f / t  # gate|up output, silu(gate), silu(gate) * up (the down projection's input)
    total = (2 * norm + 2 * e * sbh + (2 * mask_bytes * sbh if drop else 0)) / sp + core + out + mlp
    return _LayerBytes(total, core - qkv, qkv, out if fused_attention else 0.0, e * sbh / sp)


def _check_checkpointing(checkpointing: str) -> None:
    if checkpointing not in _CHECKPOINTING:
        raise ValueError(f"activation checkpointing must be one of {_CHECKPOINTING}, got {checkpointing!r}")


def activation_bytes(model: ModelConfig, micro_batch: int, *, tp_size: int = 1, sequence_parallel: bool = False,
                     precision: str = "bf16", checkpointing: str = "none", layers: int | None = None,
                     first_stage: bool = True, last_stage: bool = True, fused_attention: bool = True,
                     partition_activations: bool = False, cpu_checkpointing: bool = False,
                     mask_bytes: int = 1, fused_norm: bool = True) -> float:
    """Bytes autograd saves on the device during one micro-batch's forward on one rank (``layers`` layers).

    Per GPT-2 layer, with ``e`` bytes per element of the compute dtype and ``sbh`` = sequence x micro-batch x
    hidden:

    * LayerNorm inputs ``2e·sbh`` and their mean/rstd ``4e·sb`` (divided by t with SP);
    * inputs of the column-parallel layers (qkv, fc) ``2e·sbh``: replicated over TP; with SP only the sequence
      shard is saved and gathered again in backward (as Megatron-LM does), ``2e·sbh/t``;
    * TP-sharded tensors ``12e·sbh/t``: q, k, v (3), attention output = projection input (1), GELU input (4)
      and the second MLP input (4) -- the paper's 24/t in 16 bits;
    * attention core: fused (flash/efficient SDPA, no dropout in the kernel's memory) ``4·asb/t`` for the fp32
      log-sum-exp; unfused ``e·as²b/t`` for the softmax (+ ``(m + e)·as²b/t`` for its dropout mask and output)
      and, at micro-batch 1, ``2e·sbh/t`` more: the math path saves copies of q and k while v stays a view
      that keeps the whole qkv buffer alive (with b > 1 v is copied too, and the copies replace q, k, v);
    * with dropout: two masks ``2m·sbh`` (/t with SP).

    Per Llama layer (``kv`` = KV heads x head size, ``F`` the SwiGLU width, ``d`` the head size):

    * RMSNorm, twice: its input and fp32 rstd, ``e·sbh + 4sb`` with the fused kernel, ``8·sbh + 4sb`` for the
      composite (module docstring); /t with SP;
    * inputs of the qkv and gate|up projections ``2e·sbh`` (/t with SP), as GPT-2;
    * rotary tables cos and sin ``2e·sd`` (every layer makes its own; the rotation itself saves nothing else);
    * attention, fused: rotated q ``e·sbh/t``; k, rotated and (GQA) repeated to the query heads ``e·sbh/t``;
      v repeated ``e·sbh/t`` under GQA, while without GQA v is a view of the projection's output and keeps all
      of it alive, ``e·sb(h + 2kv)/t``; the fp32 log-sum-exp ``4·asb/t``; the output ``e·sbh/t``. Unfused, the
      math path's copies of q (scaled) and k (transposed) replace the rotated ones, v as above (copied when
      b > 1), and the probabilities as GPT-2's;
    * SwiGLU ``4e·sbF/t``: the gate|up output (silu keeps its gate half, a view of it; the product keeps the up
      half), silu(gate), and the product, which the down projection saves as its input;
    * dropout masks as GPT-2's; no biases anywhere.

    ``m`` = ``mask_bytes`` is the size of a dropout-mask element: 1 where kernels keep bool masks (CUDA), the
    compute dtype's ``e`` on CPU, whose kernels keep them as floats (and run attention with dropout unfused).
    ``fused_norm`` (Llama): CUDA's fused RMSNorm (True) or the CPU's composite.

    The first stage adds the token ids (and the vocab-parallel lookup's masked ids and mask), the last the
    final norm (as a layer's), the LM head's input (a sequence shard with SP), the logits of this rank's
    vocabulary slice in the compute dtype (the chunked cross-entropy keeps them for backward, no fp32 copy), its
    fp32 log-sum-exp per token and the targets.

    Recomputation (:mod:`megazero.tensor_parallel.recompute`) changes what the forward saves:

    * ``full`` keeps only each layer's input, ``e·sbh`` (/t with SP; /t with ``partition_activations``, which
      splits the TP-replicated input over the TP ranks; 0 with ``cpu_checkpointing``, which holds it in host
      memory, see :func:`checkpoint_host_bytes`);
    * ``selective`` drops the attention core's tensors and keeps its input: q, k, v as the projection made them
      (``3e·sbh/t`` for GPT-2, ``e·sb(h + 2kv)/t`` for Llama; 0 on the device with ``cpu_checkpointing``).

    Backward then recomputes one layer (or core) at a time; that transient is not part of this per-micro-batch
    figure but comes once per rank on top of the stash, :func:`recompute_bytes`.
    """
    _check_checkpointing(checkpointing)
    t = tp_size
    lb = _layer_bytes(model, micro_batch, t, sequence_parallel, precision, fused_attention, mask_bytes, fused_norm)
    e = ELEMENT_BYTES[precision]
    s, b, h = model.seq_len, micro_batch, model.hidden_size
    sb, sbh = s * b, s * b * h
    sp = t if sequence_parallel and t > 1 else 1
    n_layers = model.num_layers if layers is None else layers
    drop = model.dropout > 0

    if checkpointing == "none":
        total = n_layers * lb.total
    elif checkpointing == "selective":
        total = n_layers * (lb.total - lb.core - (lb.qkv if cpu_checkpointing else 0))
    else:
        kept = 0.0 if cpu_checkpointing else lb.layer_input / (t if partition_activations and sp == 1 else 1)
        total = n_layers * kept

    if first_stage:
        total += 8 * sb if t == 1 else 9 * sb  # ids; vocab-parallel: masked local ids + out-of-range mask
        total += mask_bytes * sbh / sp if drop else 0
    if last_stage:
        v_local = pad_size(model.vocab_size, VOCAB_PAD_MULTIPLE * t) // t
        if model.arch == "llama":  # the final RMSNorm (as a layer's), the LM-head input
            total += ((e if fused_norm else 8) * sbh + 4 * sb + e * sbh) / sp
        else:  # final LayerNorm input and stats, LM-head input
            total += (2 * e * sbh + 2 * e * sb) / sp
        total += e * sb * v_local  # the logits of this rank's vocabulary slice, kept by the chunked loss
        total += 4 * sb + 8 * sb  # the loss's fp32 log-sum-exp per token; the int64 targets
    return total


def recompute_bytes(model: ModelConfig, micro_batch: int, *, tp_size: int = 1, sequence_parallel: bool = False,
                    precision: str = "bf16", checkpointing: str = "none", fused_attention: bool = True,
                    mask_bytes: int = 1, fused_norm: bool = True) -> float:
    """Bytes one recomputation saves for its own backward: the transient that recomputation adds, once per
    rank, on top of the stashed micro-batches (what :class:`~megazero.tensor_parallel.recompute.CheckpointStats`
    measures as ``recompute_peak_bytes``).

    ``full``: one whole layer, its restored input included (:func:`activation_bytes` with no recomputation,
    per layer). ``selective``: q, k, v again (views of the kept qkv), the core's tensors and, for a fused core,
    its output, which in the recomputation is a new tensor. ``none``: 0. Counting the restored input in full
    makes this an upper bound by ``e·sbh`` where the kept input itself is reused (no partitioning, no offload).
    """
    _check_checkpointing(checkpointing)
    lb = _layer_bytes(model, micro_batch, tp_size, sequence_parallel, precision, fused_attention, mask_bytes,
                      fused_norm)
    if checkpointing == "full":
        return lb.total
    if checkpointing == "selective":
        return lb.qkv + lb.core + lb.core_output
    return 0.0


def checkpoint_host_bytes(model: ModelConfig, micro_batch: int, *, tp_size: int = 1,
                          sequence_parallel: bool = False, precision: str = "bf16", checkpointing: str = "none",
                          layers: int | None = None, partition_activations: bool = False) -> float:
    """Host bytes ``cpu_checkpointing`` holds for one micro-batch: the kept inputs of ``layers`` layers
    (``full``: each layer's input, /t when partitioned; ``selective``: q, k, v)."""
    _check_checkpointing(checkpointing)
    lb = _layer_bytes(model, micro_batch, tp_size, sequence_parallel, precision, True, 1)
    n_layers = model.num_layers if layers is None else layers
    split = tp_size if partition_activations and not (sequence_parallel and tp_size > 1) else 1
    kept = {"none": 0.0, "selective": lb.qkv, "full": lb.layer_input / split}[checkpointing]
    return n_layers * kept
