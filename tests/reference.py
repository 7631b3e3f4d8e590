"""An independent single-process reference trainer: Hugging Face GPT-2 or Llama, ``torch.optim.AdamW``,
``LambdaLR``.

It shares with megazero only what the issue allows: the token data (the built-in corpus as megazero
tokenises it), the initial weights (megazero's initialisation, mapped to GPT-2's or Llama's names by
:mod:`megazero.model.hf`) and the data order as DESIGN.md defines it (the stream of one permutation per
epoch, seeded ``(seed, epoch)``; global batch ``k`` is stream positions ``k*G .. k*G + G - 1``), which is
written out here again rather than taken from megazero's sampler. Everything else is plain PyTorch written
for this file: the model (``transformers.GPT2LMHeadModel`` or ``LlamaForCausalLM``), the loss (one mean cross-entropy over the
whole global batch), the optimizer (``torch.optim.AdamW``, decay on matrices only), the clipping
(``torch.nn.utils.clip_grad_norm_``) and the learning-rate schedule (``LambdaLR``: linear warm-up, cosine
to ``min_lr``, flat after). So a bug in megazero's sampler, loss normalisation, schedule or Adam cannot
cancel out of a parity test against it.

The hyper-parameters are spelled out in :class:`RefSpec` (defaults: ``tests/common.py``'s ``SMALL_FLAGS``
with a global batch of 8 and megazero's documented defaults; :data:`LLAMA` for the Llama run), not read from
megazero's config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["LLAMA", "RefResult", "RefSpec", "lr_lambda", "reference_batches", "run_reference"]


@dataclass(frozen=True)
class RefSpec:
    """What the reference trains: tests/common.py's SMALL_FLAGS, global batch 8, megazero's defaults."""

    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    seq_len: int = 32
    vocab_size: int = 512
    train_steps: int = 10
    warmup_steps: int = 2
    decay_steps: int | None = None  # None: train_steps
    lr: float = 3e-3
    min_lr: float = 0.0
    clip_grad: float = 0.5
    global_batch: int = 8
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    seed: int = 1234
    eval_fraction: float = 0.01
    arch: str = "gpt2"  # llama: the fields below
    num_kv_heads: int | None = None
    ffn_size: int | None = None
    rope_theta: float = 10000.0
    tie_embeddings: bool | None = None

    def with_(self, **kw) -> RefSpec:
        return replace(self, **kw)

    def model_config(self):
        """The shape as megazero's ModelConfig (to initialise megazero's weights and name the HF config's fields)."""
        from megazero.config.schema import ModelConfig

        return ModelConfig(num_layers=self.num_layers, hidden_size=self.hidden_size, num_heads=self.num_heads,
                           seq_len=self.seq_len, vocab_size=self.vocab_size, arch=self.arch,
                           num_kv_heads=self.num_kv_heads, ffn_size=self.ffn_size, rope_theta=self.rope_theta,
                           tie_embeddings=self.tie_embeddings)


# tests/test_llama.py's model: 4 layers (pp 2 interleaved needs 4 chunks), 4 query heads on 2 KV heads (one per
# rank at tp 2), SwiGLU 96, untied; 4 steps (8-rank worlds run it too), the lr decaying over them
LLAMA = RefSpec(num_layers=4, train_steps=4, arch="llama", num_kv_heads=2, ffn_size=96)


@dataclass
class RefResult:
    losses: list[float]
    grad_norms: list[float]  # pre-clipping global norms (clip_grad_norm_'s return value)
    lrs: list[float]
    initial: dict[str, torch.Tensor]  # megazero names, full unpadded fp32
    final: dict[str, torch.Tensor]  # megazero names, full unpadded fp32
    eval_loss: float  # after training: mean loss over the eval split's first global batch (in order)


def lr_lambda(spec: RefSpec):
    """LambdaLR factor of optimizer step ``i``: (i + 1) / W during warm-up, then cosine to min_lr, then flat."""
    decay_end = spec.decay_steps or spec.train_steps
    floor = spec.min_lr / spec.lr

    def factor(i: int) -> float:
        if i < spec.warmup_steps:
            return (i + 1) / spec.warmup_steps
        if i >= decay_end:
            return floor
        t = (i - spec.warmup_steps) / (decay_end - spec.warmup_steps)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
    return factor


def reference_batches(num_samples: int, spec: RefSpec, steps: int, start: int = 0) -> list[list[int]]:
    """Sample indices of global batches ``start .. start + steps - 1`` of the documented data order."""
    g = spec.global_batch
    out = []
    for k in range(start, start + steps):
        idx = []
        for pos in range(k * g, (k + 1) * g):
            epoch, offset = divmod(pos, num_samples)
            idx.append(int(np.random.default_rng([spec.seed, epoch]).permutation(num_samples)[offset]))
        out.append(idx)
    return out


def _initial_state(spec: RefSpec) -> dict[str, torch.Tensor]:
    """megazero's initial full model (shared by design: every topology starts from it), unpadded."""
    from megazero.model.gpt import GPT, full_state_dict, init_parameters

    model = GPT(spec.model_config())
    init_parameters(model, spec.seed)
    return {k: v.clone() for k, v in full_state_dict(model).items()}


def _hf_model(spec: RefSpec, state: dict[str, torch.Tensor]):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from megazero.model.hf import (
        hf_gpt2_config,
        hf_llama_config,
        to_hf_gpt2_state_dict,
        to_hf_llama_state_dict,
    )

    cfg = spec.model_config()
    if spec.arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**hf_llama_config(cfg, bos_token_id=0, eos_token_id=0),
                                             attn_implementation="eager"))
        model.load_state_dict(to_hf_llama_state_dict(state, cfg), strict=True)
        return model, cfg
    model = GPT2LMHeadModel(GPT2Config(**hf_gpt2_config(cfg, bos_token_id=0, eos_token_id=0),
                                       attn_implementation="eager"))
    missing, unexpected = model.load_state_dict(to_hf_gpt2_state_dict(state, cfg), strict=False)
    assert not unexpected and all(".attn.bias" in k or ".attn.masked_bias" in k for k in missing), (missing,)
    return model, cfg


def _to_megazero_names(model, cfg) -> dict[str, torch.Tensor]:
    """The reference's weights under megazero's names and layouts (inverse of model/hf.py's map)."""
    from megazero.model.gpt import GPT
    from megazero.model.hf import from_hf_llama_tensors, to_hf_gpt2_tensor

    hf = dict(model.named_parameters())
    if cfg.arch == "llama":
        hf["lm_head.weight"] = model.lm_head.weight  # named_parameters lists a tied one once, as the embedding
        with torch.device("meta"):
            names = [n for n, _ in GPT(cfg).named_parameters()]
        return {n: from_hf_llama_tensors(n, hf, cfg).detach().clone() for n in names}
    out = {}
    for name in _initial_names(cfg):
        hf_name, _ = to_hf_gpt2_tensor(name, torch.zeros(1, 1), cfg)
        w = hf[hf_name].detach().clone()
        out[name] = w.t().contiguous() if name.endswith(("qkv.weight", "proj.weight", "fc.weight")) \
            and name.startswith("blocks.") else w
    return out


def _initial_names(cfg) -> list[str]:
    blocks = [f"blocks.{i}.{n}" for i in range(cfg.num_layers) for n in (
        "ln_1.weight", "ln_1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
        "ln_2.weight", "ln_2.bias", "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight", "mlp.proj.bias")]
    return ["wte.weight", "wpe.weight", *blocks, "ln_f.weight", "ln_f.bias"]


@lru_cache(maxsize=8)
def run_reference(cache_dir: str, spec: RefSpec = RefSpec(), lr_scale: float = 1.0) -> RefResult:
    """Train ``spec`` in one process on the built-in corpus (tokenised in ``cache_dir``); cached per session."""
    from megazero.data import build_datasets, resolve_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tok = resolve_tokenizer([], spec.vocab_size, cache_dir)
        train_ds, eval_ds = build_datasets([], tok, spec.seq_len, cache_dir, spec.eval_fraction)
        initial = _initial_state(spec)
        model, cfg = _hf_model(spec, initial)
        model.train()
        params = list(model.parameters())  # lm_head is tied to wte: listed once
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": spec.weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=spec.lr * lr_scale, betas=spec.betas, eps=spec.eps, foreach=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec))
        losses, norms, lrs = [], [], []
        def batch_loss(ds, idx: list[int]) -> torch.Tensor:
            batch = torch.stack([torch.as_tensor(np.asarray(ds[i]), dtype=torch.long) for i in idx])
            logits = model(input_ids=batch[:, :-1]).logits
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

        for idx in reference_batches(len(train_ds), spec, spec.train_steps):
            opt.zero_grad(set_to_none=True)
            loss = batch_loss(train_ds, idx)
            loss.backward()
            clip = spec.clip_grad if spec.clip_grad > 0 else float("inf")
            norms.append(torch.nn.utils.clip_grad_norm_(params, clip).item())
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            eval_loss = batch_loss(eval_ds, list(range(spec.global_batch))).item() \
                if eval_ds is not None and len(eval_ds) >= spec.global_batch else float("nan")
        return RefResult(losses, norms, lrs, initial, _to_megazero_names(model, cfg), eval_loss)
    finally:
        torch.set_num_threads(threads)
