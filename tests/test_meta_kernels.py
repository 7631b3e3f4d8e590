"""The dry run's attention and dropout save what a GPU's fused kernels save (megazero/model/kernels.py).

On the meta device torch has no CUDA kernel and runs attention on the math path, which keeps the S x S
probabilities for backward, and dropout with a mask of the input's dtype; inside ``kernels.emulate("cuda")``
(the dry run of a GPU run) the model's seam calls the ops a CUDA run uses instead. The activation bytes of one
transformer layer, measured by the dry run's own tracker (the difference between a 2-layer and a 1-layer
model's activation peak), must equal the bytes a CUDA run with FlashAttention-2 (bf16) or the memory-efficient
kernel (fp32) and fused dropout saves, computed here from the shapes alone; the unfused paths are the controls.
"""

from __future__ import annotations

import math

import pytest
import torch

import megazero.model.gpt as gpt
import megazero.model.kernels as kernels
from megazero.config.cli import parse_args
from megazero.distributed.context import RankGrid
from megazero.plan.role import run_role

B, S, H, HEADS = 2, 48, 128, 4


def _layer_activation_bytes(precision: str, dropout: float, device_type: str = "cuda") -> int:
    """Activation peak of a 2-layer minus a 1-layer model, both dry-run as the single rank of a 1-GPU run."""
    acts = []
    for layers in (1, 2):
        cfg = parse_args(["--num-layers", str(layers), "--hidden-size", str(H), "--num-heads", str(HEADS),
                          "--seq-len", str(S), "--vocab-size", "256", "--dropout", str(dropout),
                          "--precision", precision, "--micro-batch-size", str(B), "--global-batch-size", str(B),
                          "--no-compile"]).resolve(1)
        with kernels.emulate(device_type):
            acts.append(run_role(cfg, RankGrid(1, 1, 1, 1), 0).peak_by_category["activations"])
    return acts[1] - acts[0]


def _expected_layer_bytes(precision: str, dropout: float) -> int:
    """What one GPT-2 layer saves for backward on a CUDA GPU with fused attention (tp 1)."""
    e = {"bf16": 2, "fp32": 4}[precision]
    bsh, bs = B * S * H, B * S
    layer_norms = 2 * (e * bsh + 2 * 4 * bs)  # input; fp32 mean and rstd per token
    linear_inputs = 2 * e * bsh  # qkv's and fc's inputs (the LayerNorm outputs)
    qkv = 3 * e * bsh  # q, k, v: views of the qkv projection's output
    out = e * bsh  # the kernel's output, which the output projection saves as its input (a view of it)
    if precision == "bf16":  # FlashAttention-2: fp32 log-sum-exp per query; philox seed [2] and offset, uint64
        lse, rng = 4 * HEADS * B * S, 2 * 8 + 8
    else:  # memory-efficient kernel: log-sum-exp padded to a multiple of 32 queries; int64 seed and offset
        lse, rng = 4 * HEADS * B * math.ceil(S / 32) * 32, 8 + 8
    mlp = 4 * e * bsh + 4 * e * bsh  # GELU input, second linear's input
    masks = 2 * bsh if dropout else 0  # bool masks of the two residual dropouts (the kernel's own keeps none)
    return layer_norms + linear_inputs + qkv + out + lse + rng + mlp + masks


@pytest.mark.parametrize("precision,dropout", [("bf16", 0.0), ("fp32", 0.0), ("bf16", 0.1)])
def test_a_dry_run_layer_saves_what_fused_attention_saves(precision, dropout, monkeypatch):
    expected = _expected_layer_bytes(precision, dropout)
    assert _layer_activation_bytes(precision, dropout) == expected
    # control: the unfused math path (what the meta device ran before the seam) keeps the S x S probabilities
    monkeypatch.setattr(kernels, "fused_kernel", lambda dtype, head_dim: None)
    assert _layer_activation_bytes(precision, dropout) > expected
    monkeypatch.undo()  # control: the meta device's own paths (a CPU run's, which the faithfulness tests want)
    assert _layer_activation_bytes(precision, dropout, "cpu") > expected
    if dropout:  # control: CPU-style dropout (the meta device's own path) keeps masks of 2 bytes per element
        monkeypatch.undo()
        monkeypatch.setattr(gpt, "dropout", torch.nn.functional.dropout)
        assert _layer_activation_bytes(precision, dropout) == expected + 2 * B * S * H


def test_the_seam_leaves_the_cpu_path_alone(monkeypatch):
    """Off the meta device the seam is F.scaled_dot_product_attention itself (same values, same gradient)."""
    calls = []
    monkeypatch.setattr(kernels, "fused_kernel", lambda *a: calls.append(a) or "flash")
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    out = kernels.causal_attention(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(out, ref) and not calls


def test_fused_kernel_choice():
    assert kernels.fused_kernel(torch.bfloat16, 64) == "flash"
    assert kernels.fused_kernel(torch.float16, 256) == "flash"
    assert kernels.fused_kernel(torch.float32, 128) == "efficient"
    assert kernels.fused_kernel(torch.bfloat16, 60) is None  # torch pads such heads: left to the math path


def _block_saved_bytes(device: str, dropout: float) -> int:
    """Bytes of the distinct storages one bf16 GPT-2 block saves for backward on ``device`` (parameters left
    out; the block's input, which the first LayerNorm saves, counted), seen by saved-tensor hooks; meta tensors
    run CUDA's kernels."""
    from megazero.config.schema import ModelConfig
    from megazero.distributed import device_io
    from megazero.model.gpt import Block

    cfg = ModelConfig(num_layers=1, hidden_size=H, num_heads=HEADS, seq_len=S, vocab_size=256, dropout=dropout)
    with torch.device(device):
        block = Block(cfg, None).to(torch.bfloat16)
        x = torch.randn(B, S, H, dtype=torch.bfloat16, requires_grad=True)
    skip = {device_io.storage_key(p) for p in block.parameters()}
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if device_io.storage_key(t) not in skip:
            saved[device_io.storage_key(t)] = t  # held, so that no storage is freed and its key reused meanwhile
        return t

    with kernels.emulate("cuda"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(t.untyped_storage().nbytes() for t in saved.values())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_block_on_meta_saves_the_formula(dropout):
    assert _block_saved_bytes("meta", dropout) == _expected_layer_bytes("bf16", dropout)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_block_on_meta_saves_what_it_saves_on_a_gpu(dropout):
    """On a GPU (sm80+): the meta emulation saves what CUDA saves, up to the RNG state tensors' few bytes."""
    assert abs(_block_saved_bytes("meta", dropout) - _block_saved_bytes("cuda", dropout)) <= 64
