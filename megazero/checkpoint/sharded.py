"""Sharded checkpoints: every rank writes what it owns, a manifest makes them whole, any topology reads them.

Layout of ``--save DIR``::

    DIR/latest                          "step_00000200": the newest complete checkpoint (atomic pointer)
    DIR/step_00000200/rank_00000.safetensors ... rank_{world-1}.safetensors
    DIR/step_00000200/tokenizer.model   the run's SentencePiece model (copied)
    DIR/step_00000200/manifest.json     written last: its presence makes the step directory a checkpoint

**Canonical form.** The training state of a parameter is three fp32 tensors of its *local TP shard* shape
(vocab padding included): the ``master`` weight (the parameter itself in fp32 runs; the 16-bit model copy is
master rounded, so it is not stored), ``exp_avg`` and ``exp_avg_sq``. Each rank owns runs of elements of these
flattened shards (:meth:`~megazero.zero.optimizer.ZeroOptimizer.owned_state`: all of them at stage 0, a DP
slice at stages 1-3). A rank stores the runs it owns *canonically* (the TP-replicated parameters on TP rank 0
only, stage 0's replicas on DP rank 0 only, the tied embedding from the first pipeline stage only) as one flat
fp32 tensor per kind in ``rank_{r:05d}.safetensors`` (keys ``master``, ``exp_avg``, ``exp_avg_sq``), plus its
RNG states (``rng.torch``, ``rng.tp`` and ``rng.cuda`` on GPUs). The manifest lists, for every parameter by its
topology-independent name (``blocks.5.mlp.fc.weight``): full shape, local shape, TP partition dim / stride /
padded size, and its pieces ``{file, tp, dp, pp, offset, numel, at}``: ``numel`` elements starting at
``offset`` of TP shard ``tp``'s flattened tensor, stored at ``at`` in that file. The pieces of each TP shard
tile it exactly (checked when the manifest is written). The manifest also records format version, topology,
ZeRO stage, precision, model and run config, step, optimizer step count, loss-scaler state, sampler state
(consumed samples), the tokenizer's SHA-256 and the SHA-256 and size of every file.

**Save protocol** (all ranks; :func:`save_checkpoint`): rank 0 prepares the step directory (an incomplete one
of the same step is removed, a complete one moved aside to ``step_X.replaced``); every rank writes its shard
file (temp file, fsync, ``os.replace``); the ranks agree that all shards were written; rank 0 gathers the
index, copies the tokenizer, writes ``manifest.json`` and then ``latest`` (each atomically, directory
fsynced), then deletes incomplete step directories and, with ``keep_last``, older checkpoints (manifest
first). A kill at any point leaves the new checkpoint complete or the previous one ``latest``.

**Load** (:func:`load_checkpoint`, any topology, precision or ZeRO stage): each rank reads the manifest,
checks the model configuration and tokenizer, and reads exactly the runs it owns now. When the TP size is
unchanged, a run is read straight from the overlapping saved pieces of the same TP shard; otherwise the full
tensor is assembled from every TP shard's pieces, re-sharded for the new TP rank (vocab padding follows the
new TP size) and sliced. Only the files holding needed pieces are opened, and each file's SHA-256 is checked
on first use. RNG states are restored per rank at an unchanged topology (a resumed run continues bit for
bit); after a reshard from saved rank 0 (TP tracker: the first saved rank of the same TP rank).

**Failure handling.** A step that can fail on some ranks only ends in a collective verdict (:func:`_agree`):
*every* rank raises :class:`CheckpointError` with the lowest failing rank's message (naming the file or
setting at fault). Testing hook: ``MEGAZERO_FAULT=point:rank:step[:stop]`` (``after_shards``,
``after_manifest``, the trainer's ``step``) SIGKILLs (SIGSTOPs) that rank there, on a first attempt only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from megazero.checkpoint.safetensors_io import SafetensorsFile, atomic_write, sha256_file, write_safetensors
from megazero.observe.log import get_logger
from megazero.observe.metrics import gather_rank_records
from megazero.tensor_parallel.layers import ShardSpec, shard_full_tensor

if TYPE_CHECKING:
    from megazero.data import DistributedBatchSampler, Tokenizer
    from megazero.distributed.context import ParallelContext

__all__ = [
    "CheckpointError",
    "TrainState",
    "CheckpointReader",
    "find_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "maybe_inject_fault",
    "save_checkpoint",
]

FORMAT, VERSION = "megazero-checkpoint", 1
MANIFEST, LATEST, TOKENIZER = "manifest.json", "latest", "tokenizer.model"
KINDS = ("master", "exp_avg", "exp_avg_sq")
FAULT_ENV = "MEGAZERO_FAULT"
_STEP_RE = re.compile(r"step_(\d{8})(\.replaced)?$")
_ARCH_FLAGS = {"num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_heads": "--num-heads",
               "seq_len": "--seq-len", "vocab_size": "--vocab-size", "layernorm_eps": "model.layernorm_eps"}
_MSG_BYTES = 4096


class TrainState(Protocol):
    """What a checkpoint saves and restores: the engine's model chunks, optimizer, RNG tracker and step, as
    :class:`megazero.train.engine.Engine` provides them (declared here so checkpointing does not import the
    training package above it)."""

    cfg: Any
    ctx: ParallelContext
    chunks: list[torch.nn.Module]
    optimizer: Any
    rng_tracker: Any
    device: torch.device
    step: int
    schedule: str
    virtual_stages: int


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file or setting at fault."""


# ---- directories ------------------------------------------------------------------------------------------
def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints (step directories with a manifest) under ``root``, oldest first."""
    root = Path(root)
    out = []
    for d in root.glob("step_*") if root.is_dir() else []:
        m = _STEP_RE.fullmatch(d.name)
        if m and (d / MANIFEST).is_file():
            out.append((int(m.group(1)), 0 if m.group(2) else 1, d))
    return [(s, d) for s, _, d in sorted(out)]


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """The step directory to load for ``path``: itself if it holds a manifest, else the one ``latest`` names
    under it, else (``latest`` missing or naming an incomplete step) the newest complete one; None if none."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if _STEP_RE.fullmatch(path.name) and path.is_dir():
        raise CheckpointError(f"{path} has no {MANIFEST}: it is an incomplete checkpoint (its save was interrupted)"
                              f"; load another step or the directory above it")
    latest = path / LATEST
    if latest.is_file():
        target = path / latest.read_text().strip()
        if (target / MANIFEST).is_file():
            return target
        get_logger().warning("%s names %s, which is not a complete checkpoint; using the newest complete one",
                             latest, target.name)
    found = list_checkpoints(path)
    return found[-1][1] if found else None


def _remove(d: Path) -> None:
    (d / MANIFEST).unlink(missing_ok=True)  # first: a half-deleted directory must not look complete
    shutil.rmtree(d, ignore_errors=True)


def _prepare_step_dir(step_dir: Path) -> None:
    if step_dir.exists():
        if (step_dir / MANIFEST).is_file():
            aside = step_dir.with_name(step_dir.name + ".replaced")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(step_dir, aside)  # still loadable until the new one is complete
        else:
            shutil.rmtree(step_dir)
    step_dir.mkdir(parents=True)


def _prune(root: Path, current: Path, keep_last: int | None) -> None:
    """Remove incomplete or replaced step directories and, with ``keep_last``, all but the newest complete."""
    for d in root.glob("step_*"):
        m = _STEP_RE.fullmatch(d.name)
        if d != current and d.is_dir() and (not m or m.group(2) or not (d / MANIFEST).is_file()):
            _remove(d)
    for f in root.glob(f".{LATEST}.tmp-*"):  # left by a kill while the pointer was written
        f.unlink(missing_ok=True)
    if keep_last:
        for _, d in list_checkpoints(root)[:-keep_last]:
            if d != current:
                _remove(d)


# ---- collective verdicts ----------------------------------------------------------------------------------
def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def _agree(ctx: ParallelContext, error: BaseException | None) -> None:
    """Collective: if any rank failed, every rank raises :class:`CheckpointError` with the lowest failing
    rank's message (a world all-reduce plus, on failure, a broadcast of the message)."""
    world = ctx.world_group
    if world.size == 1:
        if error is not None:
            raise CheckpointError(_describe(error)) from error
        return
    first = torch.tensor([ctx.rank if error is not None else world.size], dtype=torch.int64, device=world.device)
    world.all_reduce(first, op="min", tag="checkpoint")
    src = int(first.item())
    if src == world.size:
        return
    buf = torch.zeros(_MSG_BYTES, dtype=torch.uint8)
    if ctx.rank == src:
        data = _describe(error).encode()[:_MSG_BYTES]
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(world.device)
    world.broadcast(buf, src=src, tag="checkpoint")
    msg = bytes(buf.tolist()).rstrip(b"\0").decode(errors="replace")
    raise CheckpointError(f"{msg} (rank {src})") from error


def maybe_inject_fault(point: str, rank: int, step: int) -> None:
    """Testing hook: SIGKILL (or with a ``:stop`` suffix SIGSTOP, a hung rank) this process if
    ``MEGAZERO_FAULT`` is ``point:rank:step`` (on a torchrun job's first attempt only)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    want_point, want_rank, want_step, *action = spec.split(":")
    if point == want_point and rank == int(want_rank) and step == int(want_step):
        os.kill(os.getpid(), signal.SIGSTOP if action == ["stop"] else signal.SIGKILL)


# ---- save -------------------------------------------------------------------------------------------------
def _named_params(engine: TrainState) -> list[tuple[str, torch.nn.Parameter, Any]]:
    return [(n, p, chunk) for chunk in engine.chunks for n, p in chunk.named_parameters()]


def _write_rank_file(engine: TrainState, step_dir: Path) -> dict[str, Any]:
    ctx, opt = engine.ctx, engine.optimizer
    info = {p: (n, chunk) for n, p, chunk in _named_params(engine)}
    pieces, runs, at = [], [], 0
    for p, offset, views in opt.owned_state():
        name, chunk = info[p]
        canonical = ((p.shard_spec.partition_dim is not None or ctx.tp_rank == 0)
                     and (opt.sharded.optimizer_states or ctx.dp_rank == 0)
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
                 **{k: getattr(p.shard_spec, k) for k in ("partition_dim", "stride", "padded_dim_size")}}
             for n, p, _ in _named_params(engine)}
    return {"file": fname, "coords": ctx.coords(), "pieces": pieces, "specs": specs, **written}


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
                     "pp_schedule": engine.schedule, "virtual_stages": engine.virtual_stages},
        "zero_stage": cfg.zero.stage, "precision": cfg.training.precision,
        "model": dataclasses.asdict(cfg.model), "model_preset": cfg.model_preset,
        "num_parameters": sum(int(torch.Size(r["shape"]).numel()) for r in tensors.values()),
        "loss_scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
        "tokenizer": {"file": TOKENIZER, "sha256": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size}
        if tokenizer is not None else None,
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
    step_dir = root / f"step_{engine.step:08d}"
    error: BaseException | None = None
    if ctx.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _prepare_step_dir(step_dir)
        except Exception as e:  # noqa: BLE001 - turned into a verdict every rank raises
            error = CheckpointError(f"cannot create checkpoint directory {step_dir}: {_describe(e)}")
    _agree(ctx, error)
    entry = None
    try:
        entry = _write_rank_file(engine, step_dir)
    except Exception as e:  # noqa: BLE001 - turned into a verdict every rank raises
        error = CheckpointError(f"cannot write {step_dir}/rank_{ctx.rank:05d}.safetensors: {_describe(e)}")
    _agree(ctx, error)
    maybe_inject_fault("after_shards", ctx.rank, engine.step)
    entries = gather_rank_records(entry)
    if ctx.rank == 0:
        try:
            manifest = _build_manifest(engine, sampler, entries, tokenizer)
            if tokenizer is not None:
                data = Path(tokenizer.model_path).read_bytes()
                atomic_write(step_dir / TOKENIZER, lambda f: f.write(data))
            text = json.dumps(manifest, indent=1).encode()
            atomic_write(step_dir / MANIFEST, lambda f: f.write(text))
            maybe_inject_fault("after_manifest", ctx.rank, engine.step)
            atomic_write(root / LATEST, lambda f: f.write(f"{step_dir.name}\n".encode()))
            _prune(root, step_dir, keep_last)
        except Exception as e:  # noqa: BLE001
            error = e if isinstance(e, CheckpointError) else CheckpointError(
                f"cannot write the manifest of {step_dir}: {_describe(e)}")
    _agree(ctx, error)
    size = sum(e["bytes"] for e in entries) if entries else 0
    get_logger().info("saved checkpoint %s (%.1f MB of shards) in %.2fs", step_dir, size / 1e6,
                      time.perf_counter() - start)
    return step_dir


# ---- load -------------------------------------------------------------------------------------------------
class CheckpointReader:
    """Read access to one complete step directory: its manifest and any range of any saved tensor.

    Files are opened (and their SHA-256 checked against the manifest) on first use only, so a reader touches
    just the files that hold the pieces asked for. Used by :func:`load_checkpoint` and
    ``tools/convert_checkpoint.py``.
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
        read into one reused buffer and copied to its blocks (peak: the tensor plus one shard)."""
        rec = self.tensors[name]
        local, dim = rec["local_shape"], rec["partition_dim"]
        numel = int(torch.Size(local).numel())
        if dim is None:
            return self.read_range(name, kind, 0, 0, numel).view(local)
        size, n = local[dim] * self.tp_size, local[dim] // rec["stride"]  # padded dim; rows per block per rank
        full = torch.empty([size if d == dim else x for d, x in enumerate(local)])
        shard = torch.empty(local)
        for r in range(self.tp_size):  # the inverse of shard_full_tensor: block b of rank r's shard
            self.read_range(name, kind, r, 0, numel, out=shard.view(-1))
            for b in range(rec["stride"]):
                full.narrow(dim, b * size // rec["stride"] + r * n, n).copy_(shard.narrow(dim, b * n, n))
        return full.narrow(dim, 0, rec["shape"][dim]).contiguous()

    def values_for(self, name: str, spec: ShardSpec, tp_rank: int, tp_size: int, start: int, numel: int,
                   kind: str) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of ``name``'s flattened TP shard ``tp_rank`` of ``tp_size`` as
        this run lays it out (``spec``: the live parameter's spec, whose padding may differ from the saved)."""
        if tuple(self.tensors[name]["shape"]) != tuple(spec.full_shape):
            raise CheckpointError(f"{self.dir}: {name} has shape {tuple(self.tensors[name]['shape'])} in the "
                                  f"checkpoint but {tuple(spec.full_shape)} in this model")
        rec = self.tensors[name]
        same = (spec.partition_dim, spec.stride, spec.padded_dim_size) == (
            rec["partition_dim"], rec["stride"], rec["padded_dim_size"])
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
    saved = reader.manifest["model"]
    wrong = [f"{flag} {getattr(cfg.model, f)} != checkpoint's {saved.get(f)}"
             for f, flag in _ARCH_FLAGS.items() if saved.get(f) != getattr(cfg.model, f)]
    if wrong:
        raise CheckpointError(f"checkpoint {reader.dir} has a different model configuration: {'; '.join(wrong)}. "
                              "Pass the checkpoint's model settings (manifest.json, \"model\") to resume from it")
    tok = reader.manifest.get("tokenizer")
    if tokenizer is not None and tok is not None and tok["sha256"] != tokenizer.fingerprint:
        raise CheckpointError(f"checkpoint {reader.dir} was trained with another tokenizer (SHA-256 "
                              f"{tok['sha256'][:12]}..., this run's {tokenizer.fingerprint[:12]}...); pass "
                              f"--tokenizer {reader.dir / TOKENIZER}")


def _rng_source(manifest: dict[str, Any], ctx: ParallelContext) -> tuple[int, int]:
    """Saved ranks whose (default, TP-tracker) RNG states this rank takes."""
    topo = manifest["topology"]
    if (topo["tp"], topo["pp"], topo["dp"]) == (ctx.tp_size, ctx.pp_size, ctx.dp_size):
        return ctx.rank, ctx.rank
    same_tp = [m["rank"] for m in manifest["files"].values() if m["tp_rank"] == ctx.tp_rank]
    return 0, min(same_tp) if same_tp else -1


def load_checkpoint(engine: TrainState, sampler: DistributedBatchSampler | None, path: str | os.PathLike,
                    tokenizer: Tokenizer | None = None, missing_ok: bool = False) -> dict[str, Any] | None:
    """Restore ``engine`` and ``sampler`` from the checkpoint at ``path`` (a step directory, or a ``--save``
    directory: its ``latest``), at this run's topology, precision and ZeRO stage.

    A collective over the world. Returns the manifest, or None when ``missing_ok`` and there is no checkpoint
    (``--load auto`` on a first start). Raises :class:`CheckpointError` on every rank if any rank fails.
    """
    ctx, opt, start = engine.ctx, engine.optimizer, time.perf_counter()
    error: BaseException | None = None
    manifest = values = rng = None
    try:
        step_dir = find_checkpoint(path)
        if step_dir is None and not missing_ok:
            raise CheckpointError(f"no checkpoint in {path}: no {LATEST} file and no complete step_* directory")
    except Exception as e:  # noqa: BLE001
        error, step_dir = e, None
    _agree(ctx, error)
    found = torch.tensor([int(step_dir is not None)], dtype=torch.int64, device=ctx.world_group.device)
    ctx.world_group.all_reduce(found, tag="checkpoint")
    if 0 < found.item() < ctx.world_size:
        raise CheckpointError(f"ranks disagree on whether {path} holds a checkpoint; it must be on a shared filesystem")
    if step_dir is None:
        return None
    try:
        reader = CheckpointReader(step_dir)
        manifest = reader.manifest
        _check_compatible(reader, engine.cfg, tokenizer)
        if sampler is not None and manifest["sampler"] is not None:
            sampler.load_state_dict(manifest["sampler"])
        names = {p: n for n, p, _ in _named_params(engine)}
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
    _agree(ctx, error)
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
