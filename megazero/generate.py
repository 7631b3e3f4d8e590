"""Text generation from megazero's GPT: greedy or sampled decoding, any TP/PP topology.

The forward is the model's own (:class:`~megazero.model.gpt.GPT`, or one rank's pipeline chunks) with a
:class:`~megazero.model.cache.KVCache`: per step it feeds only the new tokens, whose keys and values each
attention appends to the cache and whose positions start at the cache's length. The tensor-parallel layers run
their own forward and collectives. Decoding runs in eval mode (no dropout; each chunk's mode is restored
after) and without sequence parallelism, so a model built for training serves as it is. At ZeRO-3 each
decoding step's forward gathers and releases block by block through the stage-3 hooks, in the training
forward's traced order (no order check), never the whole model.

With pipeline stages each rank runs its chunks in global stage order, receives the hidden states of the new
tokens from the previous stage and sends its own to the next; the last stage picks the token and broadcasts
it over ``pp_group``. The token is also broadcast from TP rank 0, so every rank of a replica agrees.

Checkpoints load from a sharded ``--save`` directory of any topology (this rank's TP shard read straight from
the shards, resharded as needed), a merged ``tools/convert_checkpoint.py`` export, or a Hugging Face GPT-2 or
Llama directory (this rank's slices, read as ``--init-from`` reads them) (:func:`load_model`).

Generation runs at cp 1 (:data:`CP_REFUSAL`): decoding feeds a few new tokens per step, with no sequence to split
over a context-parallel group, and checkpoints do not depend on cp, so a model trained at any cp decodes here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from megazero.checkpoint.hf_import import HFCheckpoint, check_tensors, hf_initializer, hf_model_config
from megazero.config.errors import ConfigError
from megazero.config.schema import ModelConfig
from megazero.distributed.group import Group
from megazero.model.cache import KVCache
from megazero.model.gpt import GPT
from megazero.pipeline.p2p import action_transfers, last_stage_rank
from megazero.pipeline.schedules import Action
from megazero.tensor_parallel.layers import shard_full_tensor, tp_size_rank

__all__ = ["CP_REFUSAL", "SamplingConfig", "TextCodec", "generate_ids", "generate_samples", "load_model",
           "load_tokenizer", "read_prompts", "sample_next"]

CP_REFUSAL = ("generation runs at cp 1, got cp {cp}: decoding adds a few tokens per step, there is no sequence to "
              "split over a context-parallel group; drop --cp (checkpoints load at any cp)")


@dataclass(frozen=True)
class SamplingConfig:
    """``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 switch those filters off."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (1 disables it), got {self.top_p}")
        if self.max_new_tokens < 0:
            raise ValueError(f"--max-new-tokens must be >= 0, got {self.max_new_tokens}")


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token [B] from the last position's logits [B, V]: argmax at temperature 0, else a draw after
    temperature scaling and the top-k and top-p (nucleus) filters."""
    if cfg.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / cfg.temperature
    if cfg.top_k > 0:
        kth = torch.topk(logits, min(cfg.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > cfg.top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def _pipeline_forward(chunks: list[GPT], ids: torch.Tensor, cache: KVCache | None,
                      pp_group: Group | None, schedule: str = "") -> torch.Tensor | None:
    """Run the new positions through every stage; the rank holding the last stage returns the full, unpadded
    fp32 logits [B, S, vocab] (gathered over TP), other ranks None.

    Each rank runs its chunks in chunk order, which is the order of its virtual stages under every layout
    (:func:`~megazero.pipeline.p2p.action_transfers`, as training): interleaved chunks hand over to rank + 1, ``zbv``'s
    second chunk to rank - 1, and the V's turn at the last rank stays on the rank. Sends are asynchronous and a
    stage only waits on a lower stage, so no rank waits in a cycle."""
    pp_size, pp_rank = tp_size_rank(pp_group)
    out, sends, handoff = None, [], None
    for c, chunk in enumerate(chunks):  # the training forward's transfers: a peer of this rank is the V's turn
        recv, send = action_transfers(Action("F", 0, c), pp_rank, pp_size, len(chunks), schedule)
        if chunk.pre_process:
            x = ids
        elif recv.peer == pp_rank:
            x = handoff
        else:
            ref = chunk.blocks[next(iter(chunk.blocks))].ln_1.weight if chunk.blocks else chunk.ln_f.weight
            x = torch.empty((*ids.shape, chunk.cfg.hidden_size), dtype=ref.dtype, device=ref.device)
            pp_group.recv(x, src=recv.peer)
        if chunk.post_process:
            out = chunk.full_logits(x, cache).float()
        else:
            y = chunk(x, cache=cache).contiguous()  # [B, S, H]
            if send.peer == pp_rank:
                handoff = y
            else:
                sends.append((pp_group.isend(y, dst=send.peer, tag="other"), y))
    for work, _ in sends:
        work.wait()
    return out


@contextmanager
def _eval_mode(chunks: list[GPT]) -> Iterator[None]:
    """No dropout while decoding; each chunk's training flag is restored after (samples taken during training)."""
    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        yield
    finally:
        for c, mode in zip(chunks, modes):
            c.train(mode)


@torch.no_grad()
def generate_ids(chunks: GPT | list[GPT], prompt: list[int], cfg: SamplingConfig, pp_group: Group | None = None,
                 use_cache: bool = True, eos_id: int | None = None, vocab_size: int | None = None,
                 schedule: str = "") -> list[int]:
    """New token ids after ``prompt`` (one sequence). Collective over this replica's TP and PP groups: every
    rank of the replica calls it with the same arguments and gets the same tokens.

    ``vocab_size``: the tokenizer's entries; logits of the embedding rows beyond them (a checkpoint that pads its
    vocabulary, as Qwen2 and Pythia do) are never sampled, greedy or not. None: every row of the model.

    ``chunks``: this rank's model chunks in order (one :class:`GPT` holding every layer without pipelining);
    ``schedule`` the pipeline schedule they were built for (``zbv`` places them in a V; any other name, or
    none, the interleaved order).
    Without ``use_cache`` every step runs the whole sequence again through the training forward (a reference
    for the cache).
    """
    chunks = [chunks] if isinstance(chunks, GPT) else list(chunks)
    mcfg = chunks[0].cfg
    if chunks[0].cp_size > 1:
        raise ValueError(CP_REFUSAL.format(cp=chunks[0].cp_size))
    if not prompt:
        raise ValueError("the prompt is empty; give at least one token of text")
    if len(prompt) + cfg.max_new_tokens > mcfg.seq_len:
        raise ValueError(f"prompt ({len(prompt)} tokens) + --max-new-tokens ({cfg.max_new_tokens}) exceeds the "
                         f"model's context of {mcfg.seq_len} positions; shorten the prompt or ask for fewer tokens")
    device = next(chunks[0].parameters()).device
    tp_group = chunks[0].tp_group
    # the rank holding the last stage: rank 0 for zbv's V, the last rank otherwise
    pp_last = 0 if pp_group is None else last_stage_rank(schedule, pp_group.size, len(chunks))
    generator = torch.Generator(device).manual_seed(cfg.seed) if cfg.temperature > 0 else None
    cache = KVCache(mcfg.seq_len) if use_cache else None
    tokens, new = list(prompt), []
    with _eval_mode(chunks):
        for _ in range(cfg.max_new_tokens):
            fed = cache.length if cache is not None else 0  # positions the cache holds already
            ids = torch.tensor([tokens[fed:]], dtype=torch.long, device=device)
            logits = _pipeline_forward(chunks, ids, cache, pp_group, schedule)
            token = torch.zeros(1, dtype=torch.long, device=device)
            if logits is not None:
                token = sample_next(logits[:, -1, :vocab_size], cfg, generator)
            if tp_group is not None:
                tp_group.broadcast(token, src=0, tag="other")
            if pp_group is not None:
                pp_group.broadcast(token, src=pp_last, tag="other")
            t = int(token.item())
            tokens.append(t)
            new.append(t)
            if cfg.stop_at_eos and eos_id is not None and t == eos_id:
                break
    return new


def read_prompts(path: str | os.PathLike) -> list[str]:
    """The prompts of a ``--sample-prompts`` file: one per non-empty line (``\\n`` in a line is a newline)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    prompts = [line.replace("\\n", "\n") for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"--sample-prompts {path} holds no prompt (one prompt a line)")
    return prompts


def generate_samples(engine: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int) -> list[dict[str, Any]]:
    """Greedy continuations of ``prompts`` by the model being trained, at any topology: a collective over the
    world (every rank calls it; each DP replica decodes the same tokens). Prompts are cut on the left to leave
    room for ``max_new_tokens`` in the context. Returns ``{"prompt", "text", "ids"}`` per prompt."""
    seq_len = engine.cfg.model.seq_len
    n_new = min(max_new_tokens, seq_len - 1)
    out = []
    for prompt in prompts:  # ZeRO-3: the model's own hooks gather block by block (module docstring)
        ids = tokenizer.encode(prompt)[-(seq_len - n_new):] or [tokenizer.eos_id]
        new = generate_ids(engine.chunks, ids, SamplingConfig(n_new, temperature=0), engine.ctx.pp_group,
                           eos_id=tokenizer.eos_id, vocab_size=tokenizer.vocab_size, schedule=engine.schedule)
        out.append({"prompt": prompt, "text": tokenizer.decode(new), "ids": new})
    return out


# ---- loading ------------------------------------------------------------------------------------------------
class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class _HFTokenizer:
    """A ``transformers`` tokenizer behind megazero's encode/decode (no special tokens added)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.eos_id = self._tok.eos_token_id
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def _model_vocab(path: Path, step_dir: Path | None) -> int | None:
    """The vocabulary size of the model at ``path`` (a checkpoint's manifest, a merged export's or a Hugging
    Face config.json), None when unknown."""
    from megazero.checkpoint import CheckpointReader

    if step_dir is not None:
        return CheckpointReader(step_dir, verify=False).manifest["model"]["vocab_size"]
    if (path / "config.json").is_file():
        meta = json.loads((path / "config.json").read_text())
        return meta.get("megazero_model", meta).get("vocab_size")
    return None


def load_tokenizer(path: str | os.PathLike, override: str | None = None) -> Any:
    """The tokenizer of a checkpoint or export directory: ``override``, the checkpoint's copy, else the one saved
    beside an export (each through :func:`megazero.data.open_tokenizer`: SentencePiece or a Hugging Face
    ``tokenizer.json``; a directory with only ``transformers``' own files through ``AutoTokenizer``). Has
    ``encode``, ``decode``, ``eos_id`` and ``vocab_size``. A tokenizer with more entries than the model has
    embedding rows is refused, naming both; one with fewer is the padded vocabulary of a published checkpoint
    (Qwen2, Pythia), whose extra rows :func:`generate_ids` never samples."""
    from megazero.checkpoint import CheckpointReader, find_checkpoint
    from megazero.data import open_tokenizer

    path = Path(path)
    step_dir = find_checkpoint(path) if path.is_dir() and not (path / "config.json").is_file() else None
    tok: Any = None
    if override:
        tok = open_tokenizer(override)
    elif step_dir is not None:
        found = CheckpointReader(step_dir, verify=False).tokenizer_path()
        tok = open_tokenizer(found) if found is not None else None
    elif (path / "tokenizer.model").is_file():  # a SentencePiece run's export (its tokenizer.json is a copy)
        tok = open_tokenizer(path / "tokenizer.model")
    elif (path / "tokenizer.json").is_file():
        tok = open_tokenizer(path / "tokenizer.json")
    elif (path / "tokenizer_config.json").is_file():
        tok = _HFTokenizer(path)
    if tok is None:
        raise ValueError(f"{path} holds no tokenizer (tokenizer.model or tokenizer.json); pass --tokenizer PATH")
    vocab = _model_vocab(path, step_dir)
    if vocab is not None and tok.vocab_size > vocab:
        raise ValueError(f"tokenizer {getattr(tok, 'model_path', override or path)} has {tok.vocab_size} tokens, "
                         f"but the model in {path} has a vocabulary of {vocab}; pass the model's own tokenizer")
    return tok


@torch.no_grad()
def load_model(path: str | os.PathLike, tp_group: Group | None = None, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, step: int | None = None) -> GPT:
    """A whole :class:`GPT` (every layer) for this TP rank, from ``path``: a ``--save`` directory or step
    directory (sharded, any topology), a merged export (``config.json`` with ``megazero_model``) or a Hugging
    Face directory (``config.json`` with ``model_type`` gpt2 or llama; safetensors or ``pytorch_model.bin``)."""
    from megazero.checkpoint import CheckpointError, CheckpointReader, find_checkpoint

    path = Path(path)
    tp_size, tp_rank = tp_size_rank(tp_group)
    config_file = path / "config.json"
    if config_file.is_file():
        meta = json.loads(config_file.read_text())
        if "megazero_model" in meta:  # a merged export: megazero's names, full tensors
            from safetensors.torch import load_file

            cfg = ModelConfig(**meta["megazero_model"])
            state = load_file(str(path / "model.safetensors"))
            model = GPT(cfg, tp_group)
            for name, p in model.named_parameters():
                p.copy_(shard_full_tensor(state[name].float(), p.shard_spec, tp_rank, tp_size))
        elif meta.get("model_type") in ("gpt2", "llama"):  # this rank's slices, read as --init-from reads them
            try:
                cfg, _ = hf_model_config(meta, str(config_file))
                check_tensors(HFCheckpoint(path), cfg)
            except ConfigError as e:
                raise ValueError(f"{path}: {e}") from e
            model = GPT(cfg, tp_group)
            value = hf_initializer([model], cfg, path, tp_group, torch.device("cpu"))
            for p in model.parameters():
                p.copy_(value(p))
        else:
            raise ValueError(f"{config_file} is neither a megazero export nor a Hugging Face GPT-2 or Llama config")
    else:
        step_dir = path / f"step_{step:08d}" if step is not None else find_checkpoint(path)
        if step_dir is None:
            raise CheckpointError(f"no checkpoint in {path}: no latest file, no step_* directory, no config.json")
        reader = CheckpointReader(step_dir)
        model = GPT(ModelConfig(**reader.manifest["model"]), tp_group)
        for name, p in model.named_parameters():
            if name not in reader.tensors:
                raise CheckpointError(f"checkpoint {step_dir} has no tensor {name}")
            p.copy_(reader.values_for(name, p.shard_spec, tp_rank, tp_size, 0, p.numel(), "master").view(p.shape))
    return model.to(device=device, dtype=dtype).eval()
