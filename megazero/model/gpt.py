"""GPT-2 and Llama, written to read like a single-file GPT, built from tensor-parallel layers.

One block structure serves both families; a family is the small set of choices in :data:`FAMILIES` (norm,
positions, MLP, biases) plus the attention heads and tying of its :class:`ModelConfig`:

* ``gpt2`` is exactly GPT-2: learned token and position embeddings, pre-LayerNorm blocks of causal
  self-attention and a tanh-GELU MLP, biases everywhere, a final LayerNorm, an LM head tied to the token
  embedding;
* ``llama``: token embedding only, pre-RMSNorm blocks whose attention rotates q and k by their position
  (rotary, :mod:`.layers`) and shares each key/value head among ``num_heads / kv_heads`` query heads
  (grouped-query attention), a SwiGLU MLP, no biases, a final RMSNorm and an untied output layer ``lm_head``
  (unless ``tie_embeddings``).

With ``tp_group`` of size 1 the parallel layers are ordinary linear layers. Tensor parallelism splits query
heads and key/value heads alike (each rank holds ``kv_heads / tp`` KV heads and the query heads that use them;
with more TP ranks than KV heads, each KV head is held by ``tp / kv_heads`` consecutive ranks, as Megatron-LM
replicates query groups, and its weight gradient is summed over them, the ``kv_group``),
the MLP's hidden units (SwiGLU's gate and up rows together) and the vocabulary. Parameter names are the same
for both families (``blocks.3.attn.qkv.weight``: q, k and v rows stacked, as Hugging Face's q/k/v_proj
concatenated; ``blocks.3.mlp.fc.weight``: gate rows then up rows), see :mod:`.hf` for the mapping.

Shapes in comments: B batch, S sequence, H hidden, V/tp this rank's vocabulary slice, nh/tp this rank's query
heads, nkv/tp its key/value heads, hd the head size, F the MLP width.
With ``sequence_parallel`` the residual stream (LayerNorms, dropout, residual adds) holds [B, S/tp, H]: each TP
rank keeps one chunk of the sequence, all-gathered on entry to a TP layer and reduce-scattered on exit. The
TP-replicated parameters (norms, row-parallel biases, positions) then get partial gradients, summed over TP once
per step by the optimizer (:mod:`megazero.tensor_parallel.finalize`; ``finalize_grads`` without it).

Activation checkpointing (``activation_checkpointing``, :mod:`megazero.tensor_parallel.recompute`):
``full`` keeps only each block's input and recomputes the block in backward; ``selective`` recomputes only the
attention core (q, k, v -> softmax(QK^T)V, Megatron-LM's selective recompute), whose saved tensors grow with
S^2 when attention dropout runs unfused. Dropout masks are identical in the recomputation (RNG states restored).

For pipeline parallelism, one :class:`GPT` holds a contiguous range of layers: ``pre_process`` adds the
embeddings (first stage), ``post_process`` the final norm and the output layer (last stage: ``lm_head``, or
when tied its own copy of the token embedding, kept equal to the first stage's by the pipeline). Blocks are keyed by their global
layer index, so a parameter has the same name (``blocks.5.mlp.fc.weight``) in every topology.

Context parallelism (``cp_group`` of size > 1): the model takes this CP rank's chunks ``i`` and ``2cp-1-i`` of
each sequence ([B, S/cp]), reads positions (learned or rotary) at their true offsets (``local_positions``) and
attends with ``context_parallel_attention`` (which masks by true offsets); all else is per token (under SP the
CP-local sequence is split over TP). The engine sums the per-token loss over DP x CP; decoding never splits.

Decoding runs these same modules with a :class:`~megazero.model.cache.KVCache` (``forward(x, cache=cache)``):
each attention appends the new positions' keys and values to its layer's slot and attends over the cached
prefix, and positions start at the cache's length (learned positions index their table with it, rotary ones
rotate the new queries and keys by it). Without a cache nothing of this runs: training keeps the
fused causal kernel, recomputation and compiled blocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from megazero.config.schema import ActivationCheckpointingConfig, ModelConfig
from megazero.context_parallel import context_parallel_attention, local_positions
from megazero.distributed.group import Group
from megazero.model.cache import KVCache, LayerKV
from megazero.model.init import init_parameters, initial_value, parameter_initializer
from megazero.model.kernels import causal_attention, dropout, emulated
from megazero.model.layers import LayerNorm, RMSNorm, apply_rotary, rotary_tables
from megazero.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_from_tp_region,
    vocab_parallel_cross_entropy,
)
from megazero.tensor_parallel.layers import replicated_parameter, tp_size_rank, unshard_tensor
from megazero.tensor_parallel.random import RNGTracker
from megazero.tensor_parallel.recompute import CheckpointOptions, CheckpointStats, checkpoint
from megazero.tensor_parallel.weight_grad import TiedGrad

__all__ = ["FAMILIES", "GPT", "Block", "CausalSelfAttention", "Dropout", "Family", "MLP", "full_state_dict",
           "init_parameters", "initial_value", "parameter_initializer"]


@dataclass(frozen=True)
class Family:
    """What distinguishes a model family inside the shared blocks (heads and tying come from the config)."""

    norm: type[nn.Module]  # LayerNorm or RMSNorm, before attention, MLP and the output layer
    rotary: bool  # rotary positions in attention (else a learned position table added to the embedding)
    swiglu: bool  # silu(gate) * up (else tanh-GELU)
    bias: bool  # biases on every linear layer


FAMILIES = {"gpt2": Family(LayerNorm, rotary=False, swiglu=False, bias=True),
            "llama": Family(RMSNorm, rotary=True, swiglu=True, bias=False)}


class Dropout(nn.Dropout):
    """Dropout that draws from the TP rank's own RNG stream when its input is sharded across TP ranks."""

    def __init__(self, p: float, rng_tracker: RNGTracker | None = None, sharded: bool = False) -> None:
        super().__init__(p)
        self.rng_tracker = rng_tracker if sharded else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rng_tracker is None or not self.training or self.p == 0:
            return dropout(x, self.p, self.training)
        return self._forked(x)

    @torch.compiler.disable
    def _forked(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout on the TP rank's own stream; eager under torch.compile (the RNG state swap is not traced)."""
        with self.rng_tracker.fork():
            return dropout(x, self.p, self.training)


class CausalSelfAttention(nn.Module):
    """Causal attention; each TP rank owns ``num_heads / tp`` query heads and the ``kv_heads / tp`` key/value
    heads they use (query head j uses KV head j // (num_heads / kv_heads), as Hugging Face Llama). With more TP
    ranks than KV heads, ``tp / kv_heads`` consecutive ranks share one (``ShardSpec.replicas``), its k/v rows'
    gradient summed over them, ``kv_group`` (without it the layer runs forward only)."""

    def __init__(self, cfg: ModelConfig, tp_group: Group | None, sequence_parallel: bool = False,
                 rng_tracker: RNGTracker | None = None, recompute: CheckpointOptions | None = None,
                 cp_group: Group | None = None, cp_attention: str = "ring", kv_group: Group | None = None) -> None:
        super().__init__()
        tp_size, _ = tp_size_rank(tp_group)
        self.cp_group = cp_group if cp_group is not None and cp_group.size > 1 else None
        self.cp_attention = cp_attention
        if self.cp_group is not None and cfg.dropout > 0:
            raise ValueError(f"--dropout {cfg.dropout} with --cp: context-parallel attention has no dropout")
        if cfg.num_heads % tp_size:
            raise ValueError(f"--num-heads ({cfg.num_heads}) must be divisible by --tp ({tp_size})")
        if cfg.num_heads % cfg.kv_heads or (cfg.kv_heads % tp_size and tp_size % cfg.kv_heads):
            raise ValueError(f"--num-kv-heads ({cfg.kv_heads}) must divide --num-heads ({cfg.num_heads}) and be "
                             f"a multiple or a divisor of --tp ({tp_size})")
        family = FAMILIES[cfg.arch]
        self.kv_replicas = max(tp_size // cfg.kv_heads, 1)  # TP ranks sharing one KV head
        self.local_heads, self.local_kv_heads = cfg.num_heads // tp_size, max(cfg.kv_heads // tp_size, 1)
        self.head_dim = cfg.head_dim
        self.rotary_theta = cfg.rope_theta if family.rotary else None
        self.rope_scaling = cfg.rope_scaling  # Llama 3.1's, or None
        self.dropout = cfg.dropout
        self.rng_tracker = rng_tracker
        self.recompute = recompute  # selective recomputation of the attention core
        resid_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        sp = sequence_parallel
        # qkv is one fused weight [(nh + 2 nkv) hd, H]: the q, k, v blocks, each split over TP so that every rank
        # holds the q, k and v rows of its own heads (``blocks`` only where GQA makes the three sizes differ)
        kv, bias = cfg.kv_heads * cfg.head_dim, family.bias
        blocks = None if cfg.kv_heads == cfg.num_heads else (cfg.num_heads, cfg.kv_heads, cfg.kv_heads)
        replicas = (1, self.kv_replicas, self.kv_replicas) if self.kv_replicas > 1 else None
        self.qkv = ColumnParallelLinear(cfg.hidden_size, cfg.hidden_size + 2 * kv, tp_group, bias=bias,
                                        std=cfg.init_std, stride=3, blocks=blocks, sequence_parallel=sp,
                                        replicas=replicas, replica_group=kv_group)
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, tp_group, bias=bias, std=resid_std,
                                      sequence_parallel=sp)
        self.resid_dropout = Dropout(cfg.dropout, rng_tracker, sharded=sp)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.cp_group is not None:
            return self._attend_cp(q, k, v)
        dropout_p = self.dropout if self.training else 0.0
        if dropout_p == 0 or self.rng_tracker is None:
            return causal_attention(q, k, v, dropout_p)
        return self._attend_forked(q, k, v, dropout_p)

    @torch.compiler.disable
    def _attend_forked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        with self.rng_tracker.fork():  # this rank's heads: its own dropout mask (eager under torch.compile)
            return causal_attention(q, k, v, dropout_p)

    @torch.compiler.disable
    def _attend_cp(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """This CP rank's queries over the whole sequence (K/V heads unrepeated); eager under torch.compile."""
        return context_parallel_attention(q, k, v, self.cp_group, mode=self.cp_attention)

    @staticmethod
    def _attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The new positions' queries [B, nh/tp, S, hd] over every cached key [B, nh/tp, past + S, hd] (KV heads
        repeated for their query heads)."""
        past = k.shape[2] - q.shape[2]
        # query i sits at position past + i and sees keys 0 .. past + i (is_causal would align it to key 0)
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(past)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def _core(self, qkv: torch.Tensor, kv: LayerKV | None = None) -> torch.Tensor:
        """The attention core: [B, S, (nh + 2 nkv) hd / tp] -> [B, S, H/tp], this rank's heads (over ``kv``'s
        prefix too). Under SP the qkv layer has gathered the whole (CP-local) sequence, so positions start at 0
        (at the cache's length when decoding; at this CP rank's true positions under CP)."""
        hd = self.head_dim
        q, k, v = qkv.split([self.local_heads * hd, self.local_kv_heads * hd, self.local_kv_heads * hd], dim=-1)
        q = rearrange(q, "b s (nh hd) -> b nh s hd", hd=hd)  # [B, nh/tp, S, hd]
        k, v = (rearrange(t, "b s (nkv hd) -> b nkv s hd", hd=hd) for t in (k, v))  # [B, nkv/tp, S, hd]
        if self.rotary_theta is not None:
            if kv is None and self.cp_group is not None:  # chunks i and 2cp-1-i of the whole sequence
                cp = self.cp_group
                positions = local_positions(q.shape[2] * cp.size, cp.rank, cp.size, device=q.device)  # [S/cp]
            else:
                start = 0 if kv is None else kv.length
                positions = torch.arange(start, start + q.shape[2], device=q.device)  # [S]
            cos, sin = rotary_tables(positions, hd, self.rotary_theta, q.dtype, self.rope_scaling)  # [S, hd] each
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv is not None:
            k, v = kv.append(k, v)  # the cache holds KV heads: [B, nkv/tp, past + S, hd]
        if self.local_kv_heads != self.local_heads and (self.cp_group is None or kv is not None):
            # each KV head serves nh / nkv consecutive query heads (the CP attention takes them unrepeated)
            k, v = (t.repeat_interleave(self.local_heads // self.local_kv_heads, dim=1) for t in (k, v))
        y = self._attend(q, k, v) if kv is None else self._attend_cached(q, k, v)  # [B, nh/tp, S, hd]
        return rearrange(y, "b nh s hd -> b s (nh hd)")  # [B, S, H/tp]

    @torch.compiler.disable
    def _recomputed_core(self, qkv: torch.Tensor) -> torch.Tensor:
        """The core under selective recomputation; eager under torch.compile (re-entrant checkpoint)."""
        return checkpoint(self._core, qkv, options=self.recompute)

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None) -> torch.Tensor:
        """[B, S, H] -> [B, S, H]; with ``kv`` (decoding) ``x`` holds the new positions after the cached ones."""
        qkv = self.qkv(x)  # [B, S, (nh + 2 nkv) hd / tp]
        if self.recompute is None or kv is not None:
            y = self._core(qkv, kv)
        else:  # keep only qkv; recompute the core in backward (its heads differ per rank: never partitioned)
            y = self._recomputed_core(qkv)
        return self.resid_dropout(self.proj(y))  # [B, S, H] summed over TP ranks ([B, S/tp, H] with SP)


class MLP(nn.Module):
    """H -> F (column-parallel) -> tanh-GELU -> H (row-parallel); or SwiGLU: H -> gate and up, F each (one
    column-parallel weight, stride 2: every rank holds the gate and up rows of its own hidden units) ->
    silu(gate) * up -> H."""

    def __init__(self, cfg: ModelConfig, tp_group: Group | None, sequence_parallel: bool = False,
                 rng_tracker: RNGTracker | None = None) -> None:
        super().__init__()
        resid_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        sp, family, ffn = sequence_parallel, FAMILIES[cfg.arch], cfg.ffn_hidden_size
        self.swiglu = family.swiglu
        self.fc = ColumnParallelLinear(cfg.hidden_size, 2 * ffn if self.swiglu else ffn, tp_group, bias=family.bias,
                                       std=cfg.init_std, stride=2 if self.swiglu else 1, sequence_parallel=sp)
        self.proj = RowParallelLinear(ffn, cfg.hidden_size, tp_group, bias=family.bias, std=resid_std,
                                      sequence_parallel=sp)
        self.dropout = Dropout(cfg.dropout, rng_tracker, sharded=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.fc(x).chunk(2, dim=-1)  # 2 x [B, S, F/tp]
            h = F.silu(gate) * up
        else:
            h = F.gelu(self.fc(x), approximate="tanh")  # [B, S, F/tp]
        return self.dropout(self.proj(h))  # [B, S, H]


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)) (LayerNorm or RMSNorm)."""

    def __init__(self, cfg: ModelConfig, tp_group: Group | None, sequence_parallel: bool = False,
                 rng_tracker: RNGTracker | None = None, recompute_attention: CheckpointOptions | None = None,
                 cp_group: Group | None = None, cp_attention: str = "ring", kv_group: Group | None = None) -> None:
        super().__init__()
        norm = FAMILIES[cfg.arch].norm
        self.ln_1 = norm(cfg.hidden_size, cfg.layernorm_eps)
        self.attn = CausalSelfAttention(cfg, tp_group, sequence_parallel, rng_tracker, recompute_attention,
                                        cp_group, cp_attention, kv_group)
        self.ln_2 = norm(cfg.hidden_size, cfg.layernorm_eps)
        self.mlp = MLP(cfg, tp_group, sequence_parallel, rng_tracker)

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 or Llama, by ``cfg.arch`` (or the part of it one pipeline stage holds).

    ``forward(tokens_or_hidden, targets)``: the first stage takes token ids [B, S], later stages the hidden
    states [B, S, H] of the previous one. The last stage returns the per-token loss [B, S] (fp32) when
    ``targets`` is given, else this rank's vocabulary slice of the logits; other stages return hidden states.
    ``forward(x, cache=cache)`` decodes: ``x`` holds the positions after the cached ones (:meth:`_decode`).

    ``rng_tracker`` gives dropout on TP-sharded activations its per-rank RNG stream (:mod:`.random`).
    ``cp_group`` (size > 1) makes the model context-parallel: it then takes and returns this CP rank's tokens
    (module docstring), attending with ``cp_attention`` ("ring" or "allgather"). ``kv_group``: the TP ranks
    that share this rank's K/V heads when tp exceeds them (:class:`CausalSelfAttention`).
    ``activation_checkpointing`` selects recomputation (module docstring); ``checkpoint_stats`` then counts
    the host bytes of ``cpu_checkpointing`` and the bytes a recomputation saves in backward.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        tp_group: Group | None = None,
        layers: range | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        sequence_parallel: bool = False,
        rng_tracker: RNGTracker | None = None,
        activation_checkpointing: ActivationCheckpointingConfig | None = None,
        cp_group: Group | None = None,
        cp_attention: str = "ring",
        kv_group: Group | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp_group = tp_group
        self.cp_size, self.cp_rank = tp_size_rank(cp_group)
        self.layers = range(cfg.num_layers) if layers is None else layers
        self.pre_process, self.post_process = pre_process, post_process
        tp_size, self.tp_rank = tp_size_rank(tp_group)
        sp = self.sequence_parallel = sequence_parallel and tp_size > 1
        if cfg.hidden_size % cfg.num_heads:
            raise ValueError(f"--hidden-size ({cfg.hidden_size}) must be divisible by --num-heads ({cfg.num_heads})")
        if sp and cfg.seq_len % tp_size:
            raise ValueError(f"--sequence-parallel needs --seq-len ({cfg.seq_len}) divisible by --tp ({tp_size})")
        family = FAMILIES[cfg.arch]
        if pre_process or (post_process and cfg.tied):  # a tied output layer is the token embedding
            self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_group, std=cfg.init_std,
                                              sequence_parallel=sp)
        if pre_process and not family.rotary:
            self.wpe = nn.Module()
            self.wpe.weight = replicated_parameter((cfg.seq_len, cfg.hidden_size), "normal", cfg.init_std)
        if pre_process:
            self.drop = Dropout(cfg.dropout, rng_tracker, sharded=sp)
        ac = activation_checkpointing or ActivationCheckpointingConfig()
        if ac.mode not in ("none", "full", "selective"):
            raise ValueError(f"--activation-checkpointing must be none, full or selective, got {ac.mode!r}")
        self.checkpointing = ac.mode
        self.checkpoint_stats = CheckpointStats()
        # partition_activations splits inputs replicated over TP; under SP the block input is a sequence shard
        self.recompute = CheckpointOptions(tp_group if ac.partition_activations and not sp else None,
                                           ac.cpu_checkpointing, rng_tracker, self.checkpoint_stats)
        self.partition_block_input = ac.partition_activations and not sp
        selective = self.recompute if ac.mode == "selective" else None
        self.blocks = nn.ModuleDict({str(i): Block(cfg, tp_group, sp, rng_tracker, selective, cp_group, cp_attention,
                                                   kv_group) for i in self.layers})
        if post_process:
            self.ln_f = family.norm(cfg.hidden_size, cfg.layernorm_eps)
        if post_process and not cfg.tied:  # the untied output layer, vocabulary-parallel like the embedding
            self.lm_head = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_group, std=cfg.init_std,
                                                  sequence_parallel=sp)

    def compile_blocks(self, **options) -> None:
        """``torch.compile`` each transformer block's forward (``options`` go to ``torch.compile``).

        The embeddings, the LM head and the chunked loss stay eager. Inside a block, what Dynamo cannot trace
        (the TP collectives, the RNG tracker's state swap, selective recomputation) splits the block into
        several graphs and runs eagerly in between, so results do not change. Saved-tensor hooks (the
        activation counter) stay active under compile. Dropout inside a compiled block draws from
        Inductor's own random stream, so its masks differ from eager mode's (each still reproducible).
        """
        for block in self.blocks.values():
            block.forward = torch.compile(block.forward, dynamic=False, **options)

    @property
    def output_layer(self) -> VocabParallelEmbedding:
        """The last stage's output layer: the token embedding when tied, else ``lm_head``."""
        return self.wte if self.cfg.tied else self.lm_head

    @property
    def padded_vocab_size(self) -> int:
        return (self.wte if self.pre_process else self.output_layer).padded_vocab_size

    def embed(self, ids: torch.Tensor, start: int = 0, tied: TiedGrad | None = None) -> torch.Tensor:
        """Token (+ learned position) embeddings of positions [start, start + S): [B, S] -> [B, S, H]; under CP
        ``ids`` are this rank's two chunks of a sequence of S x cp tokens, at their true positions. ``tied``:
        the pass's meeting point with the LM head's gradient of the same table (:meth:`forward`)."""
        end = start + ids.shape[1] * self.cp_size
        if end > self.cfg.seq_len:
            raise ValueError(f"sequence of {end} tokens exceeds --seq-len {self.cfg.seq_len}")
        tokens = self.wte(ids, tied)  # [B, S, H], or this rank's chunk [B, S/tp, H] with SP
        if not hasattr(self, "wpe"):  # rotary positions are applied inside attention
            return self.drop(tokens)
        if self.cp_size > 1:  # [S/cp] true positions, this TP rank's run of them under SP
            at = local_positions(end, self.cp_rank, self.cp_size, tokens.device)
            if self.sequence_parallel:
                at = at[self.tp_rank * tokens.shape[1]: (self.tp_rank + 1) * tokens.shape[1]]
            return self.drop(tokens + self.wpe.weight[at])
        if self.sequence_parallel:
            start += self.tp_rank * tokens.shape[1]
        pos = self.wpe.weight[start: start + tokens.shape[1]]  # [S, H] (or [S/tp, H])
        return self.drop(tokens + pos)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        if cache is not None:
            return self._decode(x, cache)
        # both uses of a tied table in this pass: backward makes its gradient once (TiedGrad), not three times
        tied = TiedGrad() if (self.pre_process and self.post_process and self.cfg.tied
                              and torch.is_grad_enabled()) else None
        if self.pre_process:
            x = self.embed(x, tied=tied)  # [B, S, H]
        for block in self.blocks.values():
            if self.checkpointing == "full":  # keep only the block input (1/tp of it when partitioned)
                x = checkpoint(block, x, options=self.recompute, partition=(self.partition_block_input,))
            else:
                x = block(x)
        if not self.post_process:
            return x  # hidden states for the next stage
        head = self.output_layer
        if targets is None:
            return head.logits(self.ln_f(x), tied=tied)  # [B, S, V/tp], padded entries at -inf
        logits = head.logits(self.ln_f(x), mask_padding=False, tied=tied)  # the loss skips the padded columns
        # the logits are ours alone: the loss may overwrite them with their gradient in backward. A dry run
        # emulating a GPU allocates what the GPU's Triton kernels do (torch's CUDA wheels ship triton)
        backend = "triton" if logits.is_meta and emulated() == "cuda" else "auto"
        return vocab_parallel_cross_entropy(logits, targets, self.tp_group, head.vocab_start, head.vocab_size,
                                            inplace_backward=True, backend=backend)  # [B, S]

    def _decode(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The forward of the new positions after ``cache``'s: each block appends its keys and values to its
        layer's slot. Positions start at the length of this chunk's first layer's slot, so every pipeline
        chunk agrees without being told. Returns this rank's vocabulary slice of the logits on the last stage,
        else the hidden states. Blocks run eagerly (compiled ones are specialised to the training shape), and
        with the sequence whole on every TP rank: a step's few new positions cannot be split over them."""
        start = cache.layer(self.layers[0]).length
        with torch.compiler.set_stance("force_eager"), self._sequence_parallel_off():
            if self.pre_process:
                x = self.embed(x, start)  # [B, S, H]
            for i, block in self.blocks.items():
                x = block(x, cache.layer(int(i)))
            return self.output_layer.logits(self.ln_f(x)) if self.post_process else x  # [B, S, V/tp] or [B, S, H]

    @contextmanager
    def _sequence_parallel_off(self) -> Iterator[None]:
        """Every layer all-reduces over TP instead of splitting the sequence, on the same weights (restored)."""
        layers = [m for m in self.modules() if getattr(m, "sequence_parallel", False)]
        for m in layers:
            m.sequence_parallel = False
        try:
            yield
        finally:
            for m in layers:
                m.sequence_parallel = True

    @torch.no_grad()
    def full_logits(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Unsharded, unpadded logits [B, S, vocab_size] of the last stage (``x``: token ids, or the previous
        stage's hidden states; ``cache``: decode, as in :meth:`forward`); for generation, evaluation and tests."""
        logits = gather_from_tp_region(self(x, cache=cache), self.tp_group)
        return logits[..., : self.cfg.vocab_size]


@torch.no_grad()
def full_state_dict(model: nn.Module, tp_group: Group | None = None, only=None) -> dict[str, torch.Tensor]:
    """The unsharded, unpadded fp32 parameters (a collective over ``tp_group``; every TP rank gets them); those
    in the set ``only`` when given."""
    out = {}
    for name, p in model.named_parameters():
        if only is not None and p not in only:
            continue
        spec = p.shard_spec
        if spec.partition_dim is None or tp_group is None or tp_group.size == 1:
            shards = [p.detach().float()]
        else:
            shards = tp_group.all_gather_list(p.detach().float().contiguous(), tag="other")
        out[name] = unshard_tensor(shards, spec).clone()
    return out
