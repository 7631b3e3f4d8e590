"""Saving a checkpoint: what each rank writes, the manifest that makes the shards whole, and the protocol.

A rank stores the runs of the canonical state it owns (:mod:`megazero.checkpoint.canonical`) *canonically*
(the TP-replicated parameters on TP rank 0 only, stage 0's replicas on DP rank 0 and CP rank 0 only, the tied
embedding from the first pipeline stage only; ZeRO partitions over DP x CP, so what a rank owns is a run of a
parameter and the format does not depend on cp) as one flat fp32 tensor per kind in
``rank_{r:05d}.safetensors`` (keys ``master``, ``exp_avg``, ``exp_avg_sq``), plus its RNG states
(``rng.torch``, ``rng.tp`` and ``rng.cuda`` on GPUs). The manifest lists, for every parameter by its
topology-independent name: full shape, local shape, TP partition dim / stride / padded size, and its pieces
``{file, tp, dp, pp, offset, numel, at}``: ``numel`` elements starting at ``offset`` of TP shard ``tp``'s
flattened tensor, stored at ``at`` in that file. The pieces of each TP shard tile it exactly (checked when the
manifest is written). The manifest also records format version, topology, ZeRO stage, precision, model and run
config, step, optimizer step count, loss-scaler state, sampler state (consumed samples), the tokenizer (its
file, SHA-256 and vocabulary size) and the SHA-256 and size of every file. The tokenizer is copied beside the
shards under its own kind's names: a SentencePiece model as ``tokenizer.model``, a Hugging Face one as
``tokenizer.json`` (plus the ``tokenizer_config.json`` beside it, which names eos and bos), so the step
directory opens as a tokenizer directory for :func:`megazero.data.open_tokenizer` and ``transformers`` alike.

**Save protocol** (all ranks; :func:`save_checkpoint`): rank 0 prepares the step directory (an incomplete one
of the same step is removed, a complete one moved aside to ``step_X.replaced``); every rank writes its shard
file (temp file, fsync, ``os.replace``); the ranks agree that all shards were written; rank 0 gathers the
index, copies the tokenizer, writes ``manifest.json`` and then ``latest`` (each atomically, directory
fsynced), then deletes incomplete step directories and, with ``keep_last``, older checkpoints (manifest
first). A kill at any point leaves the new checkpoint complete or the previous one ``latest``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megazero.checkpoint import faults
from megazero.checkpoint.canonical import FORMAT, KINDS, VERSION, TrainState, named_params
from megazero.checkpoint.safetensors_io import atomic_write, write_safetensors
from megazero.checkpoint.store import (
    LATEST,
    MANIFEST,
    TOKENIZER,
    CheckpointError,
    agree,
    describe,
    prepare_step_dir,
    prune,
    step_dir_name,
)
from megazero.data import HFTokenizer
from megazero.data.hf_tokenizer import HF_TOKENIZER_FILE
from megazero.observe.log import get_logger
from megazero.observe.metrics import gather_rank_records

if TYPE_CHECKING:
    from megazero.data import DistributedBatchSampler, Tokenizer

__all__ = ["save_checkpoint"]


def _write_rank_file(engine: TrainState, step_dir: Path) -> dict[str, Any]:
    ctx, opt = engine.ctx, engine.optimizer
    info = {p: (n, chunk) for n, p, chunk in named_params(engine)}
    pieces, runs, at = [], [], 0
    for p, offset, views in opt.owned_state():
        name, chunk = info[p]
        canonical = ((p.shard_spec.partition_dim is not None or ctx.tp_rank == 0)
                     and (opt.sharded.optimizer_states or ctx.dp_rank == ctx.cp_rank == 0)
                     and (name != "wte.weight" or chunk.pre_process))
        if canonical:
            n = views["master"].numel()
            pieces.append({"name": name, "tp": ctx.tp_rank, "dp": ctx.dp_rank, "pp": ctx.pp_rank,
                           "offset": offset, "numel": n, "at": at})
            runs.append(views)
            at += n
    rng = {"rng.torch": torch.get_rng_state(), "rng.tp": engine.rng_tracker.state.cpu()}
    if engine.device.type == "cuda":
        rng["rng.cuda"] = torch.cuda.get_rng_state(engine.device)
    entries = [(k, torch.float32, (at,)) for k in KINDS] + [(k, torch.uint8, tuple(v.shape)) for k, v in rng.items()]

    def produce(key: str) -> torch.Tensor:
        if key in rng:
            return rng[key]
        return torch.cat([r[key].float() for r in runs]) if runs else torch.zeros(0)

    fname = f"rank_{ctx.rank:05d}.safetensors"
    written = write_safetensors(step_dir / fname, entries, produce,
                                {"format": FORMAT, "rank": str(ctx.rank), "step": str(engine.step)})
    specs = {n: {"shape": list(p.shard_spec.full_shape), "local_shape": list(p.shape), "pp_rank": ctx.pp_rank,
                 **{k: getattr(p.shard_spec, k) for k in ("partition_dim", "stride", "padded_dim_size")},
                 **({"blocks": list(p.shard_spec.blocks)} if p.shard_spec.blocks else {}),
                 **({"replicas": list(p.shard_spec.replicas)} if p.shard_spec.replicas else {})}
             for n, p, _ in named_params(engine)}
    return {"file": fname, "coords": ctx.coords(), "pieces": pieces, "specs": specs, **written}


def _tokenizer_files(tokenizer: Tokenizer | HFTokenizer) -> dict[str, Path]:
    """The files that store ``tokenizer`` in a step directory, {name there: source}; the first is the one the
    manifest names and checksums."""
    if isinstance(tokenizer, HFTokenizer):
        files = {HF_TOKENIZER_FILE: Path(tokenizer.model_path)}
        if tokenizer.config_path is not None:
            files[tokenizer.config_path.name] = Path(tokenizer.config_path)
        return files
    return {TOKENIZER: Path(tokenizer.model_path)}


def _build_manifest(engine: TrainState, sampler: DistributedBatchSampler | None, entries: list[dict],
                    tokenizer: Tokenizer | None) -> dict[str, Any]:
    cfg, ctx, opt = engine.cfg, engine.ctx, engine.optimizer
    tensors: dict[str, dict[str, Any]] = {}
    for e in entries:
        for name, spec in e["specs"].items():
            rec = tensors.setdefault(name, {**spec, "pp_ranks": [], "pieces": []})
            rec["pp_ranks"] = sorted(set(rec["pp_ranks"]) | {spec["pp_rank"]})
            rec.pop("pp_rank", None)
        for pc in e["pieces"]:
            tensors[pc["name"]]["pieces"].append({"file": e["file"], **{k: v for k, v in pc.items() if k != "name"}})
    for name, rec in tensors.items():  # every TP shard must be tiled exactly by its pieces
        for tp in range(ctx.tp_size if rec["partition_dim"] is not None else 1):
            runs = sorted((q["offset"], q["offset"] + q["numel"]) for q in rec["pieces"] if q["tp"] == tp)
            ends = [0] + [b for _, b in runs]
            if [a for a, _ in runs] != ends[:-1] or ends[-1] != int(torch.Size(rec["local_shape"]).numel()):
                raise CheckpointError(f"internal error: the saved pieces of {name} do not tile TP shard {tp}")
    return {
        "format": FORMAT, "version": VERSION, "step": engine.step, "optimizer_step": opt.step_count,
        "consumed_samples": sampler.consumed_samples if sampler is not None else None,
        "sampler": sampler.state_dict() if sampler is not None else None,
        "topology": {"world_size": ctx.world_size, "tp": ctx.tp_size, "pp": ctx.pp_size, "dp": ctx.dp_size,
                     "cp": ctx.cp_size,
                     "pp_schedule": engine.schedule, "virtual_stages": engine.virtual_stages},
        "zero_stage": cfg.zero.stage, "precision": cfg.training.precision,
        "model": dataclasses.asdict(cfg.model), "model_preset": cfg.model_preset,
        "num_parameters": sum(int(torch.Size(r["shape"]).numel()) for r in tensors.values()),
        "loss_scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
        "tokenizer": {"file": next(iter(_tokenizer_files(tokenizer))), "sha256": tokenizer.fingerprint,
                      "vocab_size": tokenizer.vocab_size} if tokenizer is not None else None,
        "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),
        "files": {e["file"]: {"sha256": e["sha256"], "bytes": e["bytes"], **e["coords"]} for e in entries},
        "tensors": tensors, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def save_checkpoint(engine: TrainState, sampler: DistributedBatchSampler | None, root: str | os.PathLike,
                    tokenizer: Tokenizer | None = None, keep_last: int | None = None) -> Path:
    """Save ``engine`` (model, optimizer, RNG, step) and ``sampler``'s position under ``root/step_XXXXXXXX``.

    A collective over the world: every rank must call it. Returns the step directory; raises
    :class:`CheckpointError` on every rank if any rank fails (the previous checkpoint stays ``latest``).
    """
    ctx, start = engine.ctx, time.perf_counter()
    root = Path(root)
    step_dir = root / step_dir_name(engine.step)
    error: BaseException | None = None
    if ctx.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            prepare_step_dir(step_dir)
        except Exception as e:  # noqa: BLE001 - turned into a verdict every rank raises
            error = CheckpointError(f"cannot create checkpoint directory {step_dir}: {describe(e)}")
    agree(ctx, error)
    entry = None
    try:
        entry = _write_rank_file(engine, step_dir)
    except Exception as e:  # noqa: BLE001 - turned into a verdict every rank raises
        error = CheckpointError(f"cannot write {step_dir}/rank_{ctx.rank:05d}.safetensors: {describe(e)}")
    agree(ctx, error)
    faults.maybe_inject_fault("after_shards", ctx.rank, engine.step)
    entries = gather_rank_records(entry)
    if ctx.rank == 0:
        try:
            manifest = _build_manifest(engine, sampler, entries, tokenizer)
            for name, source in (_tokenizer_files(tokenizer) if tokenizer is not None else {}).items():
                data = source.read_bytes()
                atomic_write(step_dir / name, lambda f, data=data: f.write(data))
            text = json.dumps(manifest, indent=1).encode()
            atomic_write(step_dir / MANIFEST, lambda f: f.write(text))
            faults.maybe_inject_fault("after_manifest", ctx.rank, engine.step)
            atomic_write(root / LATEST, lambda f: f.write(f"{step_dir.name}\n".encode()))
            prune(root, step_dir, keep_last)
        except Exception as e:  # noqa: BLE001
            error = e if isinstance(e, CheckpointError) else CheckpointError(
                f"cannot write the manifest of {step_dir}: {describe(e)}")
    agree(ctx, error)
    size = sum(e["bytes"] for e in entries) if entries else 0
    get_logger().info("saved checkpoint %s (%.1f MB of shards) in %.2fs", step_dir, size / 1e6,
                      time.perf_counter() - start)
    return step_dir
