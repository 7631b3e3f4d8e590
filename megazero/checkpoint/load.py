"""Loading a checkpoint at any topology, precision or ZeRO stage: the reader of a step directory and the
reshard on load.

Each rank (:func:`load_checkpoint`) reads the manifest, checks the model configuration and tokenizer, and
reads exactly the runs of the canonical state (:mod:`megazero.checkpoint.canonical`) it owns now. When the TP
size is unchanged, a run is read straight from the overlapping saved pieces of the same TP shard; otherwise
the full tensor is assembled from every TP shard's pieces, re-sharded for the new TP rank (vocab padding
follows the new TP size) and sliced. Only the files holding needed pieces are opened, and each file's SHA-256
is checked on first use. RNG states are restored per rank at an unchanged topology (a resumed run continues
bit for bit); after a reshard from saved rank 0 (TP tracker: the first saved rank of the same TP rank). Nothing
read depends on the saved cp: the canonical runs are keyed by parameter and offset, so a run saved at cp 2 resumes
at cp 1 or 4 like any other change of topology.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megazero.checkpoint.canonical import FORMAT, KINDS, VERSION, TrainState, named_params
from megazero.checkpoint.safetensors_io import SafetensorsFile, sha256_file
from megazero.checkpoint.store import (
    LATEST,
    MANIFEST,
    TOKENIZER,
    CheckpointError,
    agree,
    find_checkpoint,
    first_failure,
    list_checkpoints,
)
from megazero.config.schema import ModelConfig
from megazero.observe.log import get_logger
from megazero.tensor_parallel.layers import ShardSpec, shard_full_tensor

if TYPE_CHECKING:
    from megazero.data import DistributedBatchSampler, Tokenizer
    from megazero.distributed.context import ParallelContext

__all__ = ["CheckpointReader", "load_checkpoint", "verify_checkpoint"]

# the resolved architecture (ModelConfig fields and properties) a checkpoint must share with the run
_ARCH_FLAGS = {"arch": "--arch", "num_layers": "--num-layers", "hidden_size": "--hidden-size",
               "num_heads": "--num-heads", "kv_heads": "--num-kv-heads", "ffn_hidden_size": "--ffn-hidden-size",
               "seq_len": "--seq-len", "vocab_size": "--vocab-size", "layernorm_eps": "--norm-eps",
               "rope_theta": "--rope-theta", "tied": "--tie-embeddings",
               "rope_scaling": "rope scaling (--model or --init-from)"}


def _saved_spec(rec: dict[str, Any]) -> ShardSpec:
    """The split of a saved tensor as its manifest record describes it (init fields unused)."""
    blocks = tuple(rec["blocks"]) if rec.get("blocks") else None
    replicas = tuple(rec["replicas"]) if rec.get("replicas") else None  # K/V heads shared by TP ranks
    return ShardSpec(tuple(rec["shape"]), "zeros", partition_dim=rec["partition_dim"], stride=rec["stride"],
                     padded_dim_size=rec["padded_dim_size"], blocks=blocks, replicas=replicas)


class CheckpointReader:
    """Read access to one complete step directory: its manifest and any range of any saved tensor.

    Files are opened (and their SHA-256 checked against the manifest) on first use only, so a reader touches
    just the files that hold the pieces asked for. Used by :func:`load_checkpoint`, generation
    (:mod:`megazero.generate`) and ``tools/convert_checkpoint.py``.
    """

    def __init__(self, step_dir: str | os.PathLike, verify: bool = True) -> None:
        self.dir = Path(step_dir)
        self.verify = verify
        path = self.dir / MANIFEST
        try:
            self.manifest: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {path}: {e}") from e
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != VERSION:
            raise CheckpointError(f"{path} is not a {FORMAT} version {VERSION} manifest")
        self.tensors: dict[str, dict[str, Any]] = self.manifest["tensors"]
        self.tp_size: int = self.manifest["topology"]["tp"]
        self._files: dict[str, SafetensorsFile] = {}

    def file(self, name: str) -> SafetensorsFile:
        """The shard file ``name``, checked against the manifest's size and checksum on first use."""
        if name not in self._files:
            path, meta = self.dir / name, self.manifest["files"].get(name)
            if meta is None:
                raise CheckpointError(f"{path} is not listed in {self.dir / MANIFEST}")
            if not path.is_file():
                raise CheckpointError(f"checkpoint file {path} is missing (listed in its manifest); restore it or "
                                      "load another checkpoint")
            if self.verify and (path.stat().st_size != meta["bytes"] or sha256_file(path) != meta["sha256"]):
                raise CheckpointError(f"checkpoint file {path} is corrupt (size or SHA-256 differs from the "
                                      "manifest); restore it or load another checkpoint")
            self._files[name] = SafetensorsFile(path)
        return self._files[name]

    def tokenizer_path(self) -> Path | None:
        """The run's tokenizer model copied into the checkpoint, checksum-verified (None if it had none)."""
        tok = self.manifest.get("tokenizer")
        path = self.dir / tok["file"] if tok else None
        if path is not None and (not path.is_file() or (self.verify and sha256_file(path) != tok["sha256"])):
            raise CheckpointError(f"checkpoint file {path} is missing or corrupt (SHA-256 differs from the manifest)")
        return path

    def read_range(self, name: str, kind: str, tp_rank: int, start: int, numel: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of saved TP shard ``tp_rank`` of ``name`` (flattened, fp32),
        read into ``out`` if given."""
        rec = self.tensors[name]
        tp = tp_rank if rec["partition_dim"] is not None else 0
        out = torch.empty(numel, dtype=torch.float32) if out is None else out
        filled = 0
        for pc in rec["pieces"]:
            lo, hi = max(start, pc["offset"]), min(start + numel, pc["offset"] + pc["numel"])
            if pc["tp"] != tp or lo >= hi:
                continue
            self.file(pc["file"]).read_into(kind, pc["at"] + lo - pc["offset"], out[lo - start: hi - start])
            filled += hi - lo
        if filled != numel:
            raise CheckpointError(f"{self.dir / MANIFEST}: the pieces of {name} do not cover [{start}, "
                                  f"{start + numel}) of TP shard {tp}")
        return out

    def full_tensor(self, name: str, kind: str = "master") -> torch.Tensor:
        """The full, unpadded fp32 tensor ``name`` assembled from every saved TP shard, in place: each shard is
        read into one reused buffer and copied to its blocks (peak: the tensor plus one shard). A block shared by
        several TP ranks (K/V heads when tp exceeded them) is taken once, from the first of them."""
        rec = self.tensors[name]
        local, dim = rec["local_shape"], rec["partition_dim"]
        numel = int(torch.Size(local).numel())
        if dim is None:
            return self.read_range(name, kind, 0, 0, numel).view(local)
        spec = _saved_spec(rec)
        size = sum(n * self.tp_size // r for n, r in zip(spec.block_sizes(local[dim], local=True),
                                                         spec.block_replicas()))  # the padded dim
        full = torch.empty([size if d == dim else x for d, x in enumerate(local)])
        shard = torch.empty(local)
        for r in range(self.tp_size):  # the inverse of shard_full_tensor: rank r's rows of each block
            self.read_range(name, kind, r, 0, numel, out=shard.view(-1))
            at = 0
            for (lo, hi), rep in zip(spec.rank_rows(r, self.tp_size, size), spec.block_replicas()):
                if r % rep == 0:
                    full.narrow(dim, lo, hi - lo).copy_(shard.narrow(dim, at, hi - lo))
                at += hi - lo
        return full.narrow(dim, 0, rec["shape"][dim]).contiguous()

    def values_for(self, name: str, spec: ShardSpec, tp_rank: int, tp_size: int, start: int, numel: int,
                   kind: str) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of ``name``'s flattened TP shard ``tp_rank`` of ``tp_size`` as
        this run lays it out (``spec``: the live parameter's spec, whose padding may differ from the saved)."""
        if tuple(self.tensors[name]["shape"]) != tuple(spec.full_shape):
            raise CheckpointError(f"{self.dir}: {name} has shape {tuple(self.tensors[name]['shape'])} in the "
                                  f"checkpoint but {tuple(spec.full_shape)} in this model")
        rec = self.tensors[name]
        saved = _saved_spec(rec)
        same = (spec.partition_dim, spec.stride, spec.padded_dim_size, spec.blocks, spec.replicas) == (
            saved.partition_dim, saved.stride, saved.padded_dim_size, saved.blocks, saved.replicas)
        if spec.partition_dim is None or (tp_size == self.tp_size and same):
            return self.read_range(name, kind, tp_rank, start, numel)
        full = self.full_tensor(name, kind)
        return shard_full_tensor(full, spec, tp_rank, tp_size).reshape(-1)[start: start + numel].clone()

    def rng_state(self, rank: int) -> dict[str, torch.Tensor]:
        """The RNG tensors saved by global rank ``rank``."""
        name = f"rank_{rank:05d}.safetensors"
        f = self.file(name)
        return {k: f.read(k).clone() for k in f.header if k.startswith("rng.")}


def _check_compatible(reader: CheckpointReader, cfg: Any, tokenizer: Tokenizer | None) -> None:
    tok = reader.manifest.get("tokenizer")
    hint = f"pass --tokenizer {reader.dir / tok.get('file', TOKENIZER)}" if tok else ""
    if tokenizer is not None and tok is not None and tok["vocab_size"] != tokenizer.vocab_size:
        raise CheckpointError(f"tokenizer {tokenizer.model_path} has {tokenizer.vocab_size} tokens, but checkpoint "
                              f"{reader.dir} was trained with a tokenizer of {tok['vocab_size']}; {hint}")
    saved = ModelConfig(**reader.manifest["model"])  # fields a checkpoint predates take their defaults
    wrong = [f"{flag} {getattr(cfg.model, f)} != checkpoint's {getattr(saved, f)}"
             for f, flag in _ARCH_FLAGS.items() if getattr(saved, f) != getattr(cfg.model, f)]
    if wrong:
        raise CheckpointError(f"checkpoint {reader.dir} has a different model configuration: {'; '.join(wrong)}. "
                              "Pass the checkpoint's model settings (manifest.json, \"model\") to resume from it")
    if tokenizer is not None and tok is not None and tok["sha256"] != tokenizer.fingerprint:
        raise CheckpointError(f"checkpoint {reader.dir} was trained with another tokenizer (SHA-256 "
                              f"{tok['sha256'][:12]}..., this run's {tokenizer.fingerprint[:12]}...); {hint}")


def _rng_source(manifest: dict[str, Any], ctx: ParallelContext) -> tuple[int, int]:
    """Saved ranks whose (default, TP-tracker) RNG states this rank takes."""
    topo = manifest["topology"]
    if (topo["tp"], topo["pp"], topo["dp"], topo.get("cp", 1)) == (ctx.tp_size, ctx.pp_size, ctx.dp_size,
                                                                    ctx.cp_size):
        return ctx.rank, ctx.rank
    same_tp = [m["rank"] for m in manifest["files"].values() if m["tp_rank"] == ctx.tp_rank]
    return 0, min(same_tp) if same_tp else -1


def verify_checkpoint(ctx: ParallelContext, step_dir: Path) -> str | None:
    """Collective: why ``step_dir`` is damaged (its manifest unreadable, a file missing, truncated or not matching
    its SHA-256), or None when every file matches the manifest. Each rank hashes every world_size-th file."""
    error: BaseException | None = None
    try:
        reader = CheckpointReader(step_dir)
        for name in sorted(reader.manifest["files"])[ctx.rank::ctx.world_size]:
            reader.file(name)
        if ctx.rank == 0:
            reader.tokenizer_path()
    except Exception as e:  # noqa: BLE001 - a verdict every rank reads
        error = e
    return first_failure(ctx, error)


def _candidates(path: str | os.PathLike, fallback: bool, missing_ok: bool) -> list[Path]:
    """The step directories to try for ``path``: the one it names, then (``fallback``) the older complete ones."""
    first = find_checkpoint(path)
    if first is None:
        if missing_ok:
            return []
        if not Path(path).exists():
            raise CheckpointError(f"--load {path}: no such directory; pass a --save directory or one of its "
                                  "step_N directories")
        raise CheckpointError(f"no checkpoint in {path}: no {LATEST} file and no complete step_* directory")
    older = [d for _, d in reversed(list_checkpoints(path)) if d != first] if fallback else []
    return [first, *older]


def load_checkpoint(engine: TrainState, sampler: DistributedBatchSampler | None, path: str | os.PathLike,
                    tokenizer: Tokenizer | None = None, missing_ok: bool = False,
                    fallback: bool = False) -> dict[str, Any] | None:
    """Restore ``engine`` and ``sampler`` from the checkpoint at ``path`` (a step directory, or a ``--save``
    directory: its ``latest``), at this run's topology, precision and ZeRO stage.

    A collective over the world. Returns the manifest, or None when ``missing_ok`` and there is no checkpoint
    (``--load auto`` on a first start). With ``fallback`` (``--load auto``) every file of the checkpoint is
    verified first, and a damaged one (a file missing, truncated or corrupt) is skipped with a warning for the
    newest older one that verifies. Raises :class:`CheckpointError` on every rank if any rank fails.
    """
    ctx, opt, start = engine.ctx, engine.optimizer, time.perf_counter()
    error: BaseException | None = None
    manifest = values = rng = None
    candidates: list[Path] = []
    try:
        candidates = _candidates(path, fallback, missing_ok)
    except Exception as e:  # noqa: BLE001
        error = e
    agree(ctx, error)
    counts = torch.tensor([len(candidates), -len(candidates)], dtype=torch.int64, device=ctx.world_group.device)
    ctx.world_group.all_reduce(counts, op="max", tag="checkpoint")
    if int(counts[0]) != -int(counts[1]):
        raise CheckpointError(f"ranks see different checkpoints under {path}; it must be on a shared filesystem")
    step_dir, verified = (candidates[0] if candidates else None), False
    if fallback and candidates:
        skipped = []
        for step_dir in candidates:
            why = verify_checkpoint(ctx, step_dir)
            if why is None:
                verified = True
                break
            skipped.append(f"{step_dir.name}: {why}")
            get_logger().warning("--load auto: skipping damaged checkpoint %s: %s", step_dir, why)
        if not verified:
            raise CheckpointError(f"--load auto: every checkpoint under {path} is damaged ({'; '.join(skipped)}); "
                                  "restore a file or start afresh with another --save directory")
    if step_dir is None:
        return None
    try:
        reader = CheckpointReader(step_dir, verify=not verified)
        manifest = reader.manifest
        _check_compatible(reader, engine.cfg, tokenizer)
        if sampler is not None and manifest["sampler"] is not None:
            sampler.load_state_dict(manifest["sampler"])
        names = {p: n for n, p, _ in named_params(engine)}
        values = []
        for p, offset, views in opt.owned_state():
            name, n = names[p], views["master"].numel()
            if name not in reader.tensors:
                raise CheckpointError(f"checkpoint {step_dir} has no tensor {name}")
            values.append({k: reader.values_for(name, p.shard_spec, ctx.tp_rank, ctx.tp_size, offset, n, k)
                           for k in KINDS})
        default_src, tp_src = _rng_source(manifest, ctx)
        rng = {**(reader.rng_state(tp_src) if tp_src >= 0 else {}),
               "rng.torch": reader.rng_state(default_src)["rng.torch"]}
    except Exception as e:  # noqa: BLE001
        error = e
    agree(ctx, error)
    opt.load_state_dict({"step_count": manifest["optimizer_step"], "loss_scaler": manifest["loss_scaler"],
                         "owned": values})
    engine.step = manifest["step"]
    torch.set_rng_state(rng["rng.torch"])
    if "rng.tp" in rng:
        engine.rng_tracker.state = rng["rng.tp"].to(engine.rng_tracker.state.device)
    if "rng.cuda" in rng and engine.device.type == "cuda":
        torch.cuda.set_rng_state(rng["rng.cuda"], engine.device)
    topo = manifest["topology"]
    get_logger().info("loaded checkpoint %s (step %d, saved at tp=%d pp=%d dp=%d ZeRO %d %s) in %.2fs",
                      step_dir, engine.step, topo["tp"], topo["pp"], topo["dp"], manifest["zero_stage"],
                      manifest["precision"], time.perf_counter() - start)
    return manifest
