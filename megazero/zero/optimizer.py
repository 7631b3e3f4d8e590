"""The ZeRO optimizer every training step goes through: gradient reduction over DP, clipping, loss scaling,
Adam(W) on this rank's partition, and re-assembly of the updated parameters.

One integer, ``zero_cfg.stage``, decides what is partitioned across the ``dp_group`` ranks
(:func:`~megazero.zero.bucketed.sharded_state`):

======  =====================================  =================================================================
stage   partitioned                            gradient policy with m micro-batches per step (DP volume / step)
======  =====================================  =================================================================
0       nothing (plain data parallelism)       accumulate locally, all-reduce each bucket during the last
                                               micro-batch's backward: 2Ψ for any m
1       optimizer states (+ fp32 master)       accumulate locally, reduce-scatter each bucket during the last
                                               backward, all-gather the updated parameters: 2Ψ for any m
2       + gradients                            reduce-scatter buckets during every backward, all-gather after
                                               the step: (m + 1)Ψ
3       + parameters (:mod:`.stage3`)          gather per block in every forward and backward, reduce-
                                               scatter gradients every backward: 3mΨ (persistent parameters
                                               below ``stage3_param_persistence_threshold``: (m + 1)Ψ_p)
======  =====================================  =================================================================

Ψ is this rank's parameter count (its TP shard of its pipeline stage), up to padding to equal aligned slices.
With ``reduce_scatter`` False, each reduce-scatter above becomes an all-reduce (2Ψ instead of Ψ).
Buckets hold :meth:`ZeroConfig.bucket_numel <megazero.config.schema.ZeroConfig.bucket_numel>` elements (stages 0-2
and stage 3's persistent parameters): ``min(reduce_bucket_size, allgather_bucket_size)`` when set, else derived
from this rank's Ψ (stage 2: a staging pool of at most Ψ/16 elements; agreed over ``tied_group``, so both
copies of a tied embedding are cut alike).
``overlap_comm`` makes the in-backward reductions asynchronous (stages 2-3: waited on at the end of each
backward, at most ``max_inflight_buckets`` in flight; stages 0-1: at the step); without it each completes at
once. Stages 0-1 reduce during the last micro-batch's backward when :meth:`ZeroOptimizer.zero_grad` is told the
number of micro-batches, else at the step.
``contiguous_gradients`` is always in effect: owned gradients live in one contiguous buffer.

Precision: ``fp32`` trains the parameters directly (a parameter is its own master copy, so
``master_params_bytes`` is 0 and the optimizer keeps 8 bytes of Adam moments per owned element); ``bf16`` and
``fp16`` keep the model's parameters and gradients in 16 bits and an fp32 master copy plus the two fp32
moments of this rank's partition only (K = 12 bytes per owned element; stage 0 owns everything). fp16 scales
the loss (:mod:`.loss_scaler`): an overflow anywhere, agreed over the DP and model-parallel groups through the
gradient norm, skips the step and leaves the master weights untouched.

Offload (ZeRO-Offload, ``offload_optimizer: {device: cpu}``, stages 1-3): the fp32 master partition and the
Adam moments live in host memory (pinned with ``pin_memory`` when a GPU is present); each step copies this
rank's reduced gradient partition to the host, runs Adam there in chunks, and copies each updated chunk back to
the device parameters while the next chunk is computed (the copies are asynchronous from pinned memory). In
fp32 the device parameters then need a separate host master copy. ``offload_param: {device: cpu}`` (stage 3)
keeps the parameter shards in host memory too; :mod:`.stage3` moves a shard to the device just before its
all-gather. ``model_state_bytes()["offloaded_bytes"]`` says how much of the model states lives on the host.

Clipping uses the global norm of the unpartitioned gradient: squares are summed over this rank's partition,
then over ``dp_group`` (stages 1-3; stage 0 holds the full reduced gradient) and over ``norm_group`` (the
model-parallel group), counting TP-replicated parameters once (``norm_counted``). The coefficient is
``torch.nn.utils.clip_grad_norm_``'s: ``min(1, clip / (norm + 1e-6))``. The Adam/AdamW update is torch's fused
kernel (``torch.optim.AdamW(fused=True)``'s arithmetic) over the flat partition; weight decay applies to
parameters with ``ndim >= 2``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from megazero.config.schema import LossScaleConfig, OptimizerConfig, ZeroConfig
from megazero.distributed import device_io
from megazero.distributed.group import Group
from megazero.zero.adam import adam_update
from megazero.zero.bucketed import BucketedParams, sharded_state, storage_bytes
from megazero.zero.grads import OwnedGrads, grad_dtype_for
from megazero.zero.loss_scaler import make_loss_scaler

__all__ = ["PRECISION_DTYPES", "NonFiniteGradientError", "StepStats", "ZeroOptimizer", "grad_norm_weights"]

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class NonFiniteGradientError(FloatingPointError):
    """Too many consecutive steps had a non-finite gradient norm (see :meth:`ZeroOptimizer.check_skipped_steps`)."""


@dataclass
class StepStats:
    """What one optimizer step did: the (unscaled, pre-clipping) global gradient norm (``inf`` when an fp16
    step overflowed), whether the step was skipped, and the fp16 loss scale for the next step (None otherwise)."""

    grad_norm: float
    skipped: bool = False
    loss_scale: float | None = None


def grad_norm_weights(model: nn.Module, tp_rank: int) -> dict[nn.Parameter, bool]:
    """Which parameters this rank counts in the global gradient norm.

    TP-sharded parameters count on every TP rank (each holds a different slice); parameters replicated across
    TP (LayerNorms, row-parallel biases, position embeddings) count on TP rank 0 only. A summed all-reduce of
    the squares over the model-parallel group then gives exactly the unsharded model's norm.
    """
    return {p: p.shard_spec.partition_dim is not None or tp_rank == 0 for p in model.parameters()}


def _runs(segments, starts: list[int], keep) -> list[tuple[int, int]]:
    """Merged ``[start, end)`` runs (in owned coordinates) of the pieces whose parameter satisfies ``keep``."""
    runs: list[list[int]] = []
    for seg, base in zip(segments, starts):
        for p, a, b in seg.pieces:
            if not keep(p):
                continue
            if runs and runs[-1][1] == base + a and a > 0:  # within one segment
                runs[-1][1] = base + b
            else:
                runs.append([base + a, base + b])
    return [(a, b) for a, b in runs]


class ZeroOptimizer:
    """Adam/AdamW over the model's parameters with ZeRO stage ``zero_cfg.stage`` over ``dp_group``.

    The model must be built in fp32 at its local (TP-shard) shape and initialised identically on every DP
    rank; the optimizer converts it to ``precision`` and, at stage 3, shards its parameters. Call
    :meth:`zero_grad`, then :meth:`backward` once per micro-batch with that micro-batch's share of the global
    mean loss (gradients are summed over DP ranks), then :meth:`step`. ``norm_group`` is the group over which
    squared gradient norms are summed (the model-parallel group: tp x pp); ``norm_counted`` says which
    parameters this rank counts. ``loss_scale_cfg`` configures fp16 loss scaling; ``align`` is the element
    multiple every rank's slice is padded to. The model may be built on the meta device: then ``param_init``
    gives each parameter's full fp32 value and ``device`` where the buffers live; the store materialises one
    parameter (stages 0-2) or one gather unit (stage 3, sharded) at a time, so no full copy of the replica
    exists beyond the buffers the formula counts.
    """

    def __init__(
        self,
        model: nn.Module,
        zero_cfg: ZeroConfig,
        opt_cfg: OptimizerConfig,
        dp_group: Group,
        norm_group: Group | None = None,
        norm_counted: dict[nn.Parameter, bool] | None = None,
        precision: str = "fp32",
        loss_scale_cfg: LossScaleConfig | None = None,
        align: int = 16,
        tied_params: Sequence[nn.Parameter] = (),
        tied_group: Group | None = None,
        param_init: Callable[[nn.Parameter], torch.Tensor] | None = None,
        device: torch.device | None = None,
    ) -> None:
        if precision not in PRECISION_DTYPES:
            raise ValueError(f"--precision must be one of {sorted(PRECISION_DTYPES)}, got {precision!r}")
        self.sharded = sharded_state(zero_cfg.stage)
        self.model = model
        self.cfg = zero_cfg
        self.opt_cfg = opt_cfg
        self.dp_group = dp_group
        self.norm_group = norm_group
        self.precision = precision
        self.dtype = PRECISION_DTYPES[precision]
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        if any(getattr(p, "_zero_wrapped", False) for p in self.params):
            raise ValueError("this model is already wrapped by a ZeroOptimizer (its gradient hooks and flat "
                             "buffers belong to it); build a fresh model for a new optimizer")
        for p in self.params:
            p._zero_wrapped = True
        self.norm_counted = norm_counted or {p: True for p in self.params}
        self.grad_dtype = grad_dtype_for(precision, zero_cfg.grad_dtype)
        # the model chunks of an interleaved pipeline: a backward reduces only the chunk that ran
        chunks = [[p for p in c.parameters() if p.requires_grad] for c in model] \
            if isinstance(model, nn.ModuleList) else None
        bucket = zero_cfg.bucket_numel(sum(p.numel() for p in self.params), dp_group.size)
        if (zero_cfg.reduce_bucket_size is None and tied_group is not None and tied_group.size > 1
                and tied_group.device.type != "meta"):  # the dry run (meta) keeps its own: nothing to read back
            agreed = torch.tensor([bucket], dtype=torch.int64, device=tied_group.device)
            tied_group.all_reduce(agreed, op="min", tag="other")  # the tied copies' stages hold different Ψ
            bucket = int(device_io.read(agreed)[0])
        if zero_cfg.stage == 3:
            from megazero.zero.stage3.params import Stage3Params

            self.store = Stage3Params(model, self.dtype, dp_group, replace(zero_cfg, reduce_bucket_size=bucket),
                                      align=align, isolate=tied_params,
                                      offload_param=zero_cfg.offload_param == "cpu", param_init=param_init,
                                      device=device, grad_dtype=self.grad_dtype)
        else:
            self.store = BucketedParams(
                self.params, self.dtype, dp_group, shard_optimizer=self.sharded.optimizer_states,
                shard_gradients=self.sharded.gradients, bucket_numel=bucket, align=align,
                overlap_comm=zero_cfg.overlap_comm, reduce_scatter=zero_cfg.reduce_scatter, isolate=tied_params,
                grad_dtype=self.grad_dtype, max_inflight=zero_cfg.max_inflight_buckets, groups=chunks,
                param_init=param_init, device=device)
        # Segments of a parameter with a copy elsewhere (the tied embedding on the first and last pipeline
        # stage). Each copy is partitioned on its own, so both hold the same elements here and their reduced
        # gradients can be summed over ``tied_group`` before the update.
        self.tied_group = tied_group
        self._tied_segments = [seg for seg in self.store.segments
                               if any(any(p is t for t in tied_params) for p, _, _ in seg.pieces)]
        for p in model.parameters():  # frozen parameters just follow the compute dtype
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(self.dtype)
        self._comm_device = dp_group.device  # where the norm collectives run (the device even under offload)
        self._grads: OwnedGrads | None = None  # this step's owned gradients, prepare_step -> finish_step
        self._host_grads: torch.Tensor | None = None  # offload: the fp32 host copy, allocated once
        self._init_partition()
        self.scaler = make_loss_scaler(precision, loss_scale_cfg)
        self.step_count = 0
        self.skipped_steps = 0  # steps skipped for a non-finite gradient norm (fp16 overflows included)
        self.consecutive_skips = 0  # of them, in a row up to the last step (non-finite norm without scaler)

    # -- this rank's partition ---------------------------------------------------------------------------
    def _init_partition(self) -> None:
        segs = self.store.segments
        self._starts = [0]
        for s in segs:
            self._starts.append(self._starts[-1] + s.param.numel())
        self.owned_numel = self._starts[-1]
        self.offload = self.cfg.offload_optimizer == "cpu"
        self._pin = self.offload and self.cfg.offload_optimizer_pin_memory and torch.cuda.is_available()
        device = segs[0].param.device

        def fp32(zero: bool) -> torch.Tensor:  # an owned-size fp32 state, in host memory under offload
            if self.offload:
                return (device_io.zeros if zero else device_io.empty)(self.owned_numel, torch.float32, self._pin)
            return (torch.zeros if zero else torch.empty)(self.owned_numel, dtype=torch.float32, device=device)

        self.mixed = self.dtype != torch.float32
        if self.mixed or self.offload:  # an fp32 master copy of the owned partition (from the fp32 model)
            self.master = fp32(zero=False)
            for s, a in zip(segs, self._starts):
                self.master[a: a + s.param.numel()].copy_(s.init if s.init is not None else s.param)
                s.init = None
            self._pieces = [(0, self.owned_numel, self.master)]
        else:  # the parameters are their own master; merge segments that are adjacent in memory
            self.master = None
            self._pieces = []
            for s, a in zip(segs, self._starts):
                prev = self._pieces[-1] if self._pieces else None
                if prev is not None and prev[1] == a and device_io.adjacent(prev[2], s.param):
                    self._pieces[-1] = (prev[0], a + s.param.numel(),
                                        _extend(prev[2], s.param.numel()))
                else:
                    self._pieces.append((a, a + s.param.numel(), s.param))
        self.exp_avg = fp32(zero=True)
        self.exp_avg_sq = fp32(zero=True)
        self._decay_runs = _runs(segs, self._starts, lambda p: p.ndim >= 2)  # runs never span two segments
        self._norm_runs = _runs(segs, self._starts, lambda p: self.norm_counted.get(p, True))

    # -- the training-step interface -----------------------------------------------------------------------
    def zero_grad(self, micro_batches: int | None = None) -> None:
        """Clear this step's gradients; ``micro_batches`` is the number of :meth:`backward` calls per model
        chunk this step (lets stages 0-1 reduce each bucket during the last one; None: at the step)."""
        if isinstance(self.store, BucketedParams):
            self.store.zero_grad(micro_batches)
        else:
            self.store.zero_grad()

    def backward(self, loss: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        """Backward of one micro-batch's share of the global loss (scaled by the fp16 loss scale).

        On a pipeline stage before the last, ``loss`` is the stage's output and ``grad`` the gradient the
        next stage sent back (already carrying the loss scale).
        """
        self.store.start_backward()
        if grad is not None:
            torch.autograd.backward(loss, grad)
        else:
            (loss * self.scaler.scale if self.scaler is not None else loss).backward()
        self.store.finish_backward()

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (None without loss scaling)."""
        return self.scaler.scale if self.scaler is not None else None

    def _owned_grads(self) -> OwnedGrads:
        """The reduced owned gradients: the store's segment buffers in place (no copy), or under optimizer
        offload their fp32 copy in a host buffer allocated once."""
        segs = self.store.segments
        if not self.offload:
            return OwnedGrads([(a, s.grad) for s, a in zip(segs, self._starts)])
        if self._host_grads is None:
            self._host_grads = device_io.empty(self.owned_numel, torch.float32, self._pin)
        g = self._host_grads
        for s, a in zip(segs, self._starts):
            g[a: a + s.grad.numel()].copy_(s.grad, non_blocking=True)
        if self._pin:
            torch.cuda.current_stream().synchronize()  # device-to-host copies done before Adam reads them
        return OwnedGrads([(0, g)])

    def _global_sq_norm(self, g: OwnedGrads) -> torch.Tensor:
        """The squared global gradient norm as a 0-dim fp64 tensor on the gradients' device (no host read).

        Squares are summed on the device over this rank's counted runs, then over DP (partitioned gradients)
        and the model-parallel group. Under optimizer offload ``g`` lives in host memory: the local sum is
        moved to the device so the collectives get a tensor on their group's device.
        """
        norms = [torch.linalg.vector_norm(g.slice(a, b), dtype=torch.float32) for a, b in self._norm_runs]
        local = (torch.stack(norms).double().square().sum() if norms
                 else torch.zeros((), dtype=torch.float64, device=g.parts[0].device))
        sq = local.reshape(1).to(self._comm_device, non_blocking=True)
        if self.sharded.optimizer_states:  # partitioned gradients: sum the partitions over DP
            self.dp_group.all_reduce(sq, tag="norm")
        if self.norm_group is not None:
            self.norm_group.all_reduce(sq, tag="norm")
        return sq[0]

    def prepare_step(self) -> torch.Tensor:
        """First half of :meth:`step`: reduce the gradients (and sum the tied embedding's two copies) and
        return the global squared gradient norm (still loss-scaled under fp16) as a 0-dim fp64 device tensor.

        Nothing is read back to the host: the caller fetches this value together with anything else it needs
        (the loss) in one read, then calls :meth:`finish_step`.
        """
        self.store.reduce_gradients()
        if self.tied_group is not None:
            for seg in self._tied_segments:
                self.tied_group.all_reduce(seg.grad, tag="tied")
        self._grads = self._owned_grads()
        return self._global_sq_norm(self._grads)

    def finish_step(self, lr: float, sq_norm: float) -> StepStats:
        """Second half of :meth:`step`, given the host value of :meth:`prepare_step`'s squared norm.

        A non-finite norm (every rank sees the same sum) skips the step on every rank, leaving weights and
        moments untouched: under fp16 loss scaling it is an overflow and lowers the scale; without a scaler it
        is counted in :attr:`skipped_steps` and :attr:`consecutive_skips` (see
        :meth:`check_skipped_steps`). Otherwise clip by the global norm and update with learning rate ``lr``."""
        g = self._grads
        if g is None:
            raise RuntimeError("ZeroOptimizer.finish_step called without prepare_step for this step")
        self._grads = None
        sq = float(sq_norm)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if not math.isfinite(sq):  # every rank saw the same non-finite sum: all skip
            self.skipped_steps += 1
            if self.scaler is not None:
                self.scaler.update(overflow=True)
                return StepStats(grad_norm=math.inf, skipped=True, loss_scale=self.scaler.scale)
            self.consecutive_skips += 1
            return StepStats(grad_norm=sq, skipped=True, loss_scale=None)
        self.consecutive_skips = 0
        norm = math.sqrt(sq) / scale
        coef = 1.0
        if self.opt_cfg.clip_grad > 0:
            coef = min(1.0, self.opt_cfg.clip_grad / (norm + 1e-6))
        g.scale_(coef / scale)
        if self.offload:
            self._adam_offloaded(g, lr)
        else:
            self._adam(g, lr)
            if self.mixed:
                for s, a in zip(self.store.segments, self._starts):
                    s.param.copy_(self.master[a: a + s.param.numel()])
        del g
        self.store.after_step()
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        return StepStats(grad_norm=norm, skipped=False, loss_scale=self.loss_scale)

    def step(self, lr: float) -> StepStats:
        """Reduce gradients, check for fp16 overflow, clip by the global norm, update with learning rate ``lr``
        (:meth:`prepare_step` then :meth:`finish_step`, reading the norm back in between)."""
        return self.finish_step(lr, device_io.read(self.prepare_step())[0])

    def check_skipped_steps(self, step: int) -> None:
        """Raise :class:`NonFiniteGradientError` once ``OptimizerConfig.max_skipped_steps`` steps in a row (0:
        never) were skipped for a non-finite gradient norm without a loss scaler. Every rank skipped the same
        steps, so every rank raises; ``step`` (the last step run) goes into the message."""
        limit = self.opt_cfg.max_skipped_steps
        if limit and self.consecutive_skips >= limit:
            raise NonFiniteGradientError(
                f"the gradient norm was not finite in {self.consecutive_skips} consecutive steps (the last at step "
                f"{step}), so each was skipped; the run is diverging: lower the learning rate (--lr, now "
                f"{self.opt_cfg.lr:g}), lengthen --warmup-steps, keep --clip-grad on, or raise "
                f"--max-skipped-steps ({limit}) to tolerate more")

    @torch.no_grad()
    def _adam_offloaded(self, g: OwnedGrads, lr: float, chunk: int = 1 << 23) -> None:
        """Adam on the host in chunks; each updated chunk is copied to the device parameters (asynchronously
        from pinned memory) while the next chunk is computed."""
        self.step_count += 1
        for lo in range(0, self.owned_numel, chunk):
            hi = min(lo + chunk, self.owned_numel)
            self._adam_update(self.master[lo:hi], g, lr, lo, hi)
            for s, a in zip(self.store.segments, self._starts):
                a_lo, a_hi = max(a, lo), min(a + s.param.numel(), hi)
                if a_lo < a_hi:
                    s.param[a_lo - a: a_hi - a].copy_(self.master[a_lo:a_hi], non_blocking=True)

    @torch.no_grad()
    def _adam(self, g: OwnedGrads, lr: float, chunk: int = 1 << 23) -> None:
        """``torch.optim.Adam``/``AdamW`` (single-tensor arithmetic) on the owned partition; a separate fp32
        master is updated in chunks, so 16-bit gradients are converted to fp32 one chunk at a time."""
        self.step_count += 1
        if self.master is not None:
            for lo in range(0, self.owned_numel, chunk):
                hi = min(lo + chunk, self.owned_numel)
                self._adam_update(self.master[lo:hi], g, lr, lo, hi)
            return
        for a, b, p in self._pieces:
            self._adam_update(p, g, lr, a, b)

    def _adam_update(self, p: torch.Tensor, g: OwnedGrads, lr: float, lo: int, hi: int) -> None:
        """One Adam/AdamW update of owned elements [lo, hi), held in ``p`` (:func:`~megazero.zero.adam.adam_update`)."""
        adam_update(p, g, lr, lo, hi, cfg=self.opt_cfg, step=self.step_count, decay_runs=self._decay_runs,
                    exp_avg=self.exp_avg, exp_avg_sq=self.exp_avg_sq)

    # -- inspection ----------------------------------------------------------------------------------------
    def master_params(self) -> dict[str, torch.Tensor]:
        """The full fp32 master value of every trainable parameter, by name (a collective over ``dp_group``)."""
        if self.master is not None:
            values = [self.master[a: a + s.param.numel()] for s, a in zip(self.store.segments, self._starts)]
        else:
            values = [s.param for s in self.store.segments]
        full = self.store.consolidate([v.to(self._comm_device) for v in values])  # host master under offload
        return {n: full[p] for n, p in self.model.named_parameters() if p in full}

    @contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Inside the block every model parameter holds its whole (model-dtype) value, e.g. to export or
        evaluate outside the training step; a collective over ``dp_group`` at stage 3, free otherwise."""
        gather = getattr(self.store, "gather_all", None)
        if gather is None:
            yield
            return
        gather()
        try:
            yield
        finally:
            self.store.release_all()

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of the model states this rank holds now, measured on the live tensors (storages counted once).

        ``params_bytes``: the model's parameter storages plus parameter shards/buffers the optimizer keeps;
        ``grads_bytes``: the accumulated gradient (full at stages 0-1, the owned partition at 2-3, in
        ``grad_dtype``), the fp32 host copy under optimizer offload, and stray ``.grad``;
        ``master_params_bytes``: the fp32 master partition (0 in fp32, where parameters are their own master);
        ``optimizer_states_bytes``: the Adam moments; ``offloaded_bytes``: how much of all the above lives in
        host memory while the rest is on an accelerator, read from each tensor's device (0 when everything is
        on the CPU), so the device holds the sum of the four minus this; ``comm_buffers_bytes``: buffers
        allocated once for communication (stage 2's staging pool of ``max_inflight_buckets`` buckets), not a
        model state.
        """
        seen: set[int] = set()
        held = self.store.held_tensors()
        host_grads = getattr(self, "_host_grads", None)  # optimizer offload: the fp32 copy Adam reads
        kinds = {"params_bytes": [p for p in self.model.parameters()] + held["params"],
                 "grads_bytes": [p.grad for p in self.model.parameters()] + held["grads"] + [host_grads],
                 "master_params_bytes": [self.master] if self.master is not None else [],
                 "optimizer_states_bytes": [self.exp_avg, self.exp_avg_sq]}
        out = {k: storage_bytes(ts, seen) for k, ts in kinds.items()}
        tensors = [t for ts in kinds.values() for t in ts if t is not None and t.untyped_storage().nbytes()]
        on_accelerator = any(not device_io.is_host(t) for t in tensors)
        out["offloaded_bytes"] = storage_bytes([t for t in tensors if device_io.is_host(t)]) if on_accelerator else 0
        out["comm_buffers_bytes"] = storage_bytes(held.get("comm", []), seen)
        return out

    def padded_numel(self) -> dict[str, int]:
        """Elements of the flat buffers as laid out (Ψ plus padding): what each collective moves."""
        return self.store.padded_numel()

    # -- checkpointing (canonical, topology-independent form; see megazero/checkpoint/sharded.py) --------------------
    def owned_state(self) -> list[tuple[nn.Parameter, int, dict[str, torch.Tensor]]]:
        """The runs of parameter elements this rank updates, in owned order: ``(param, offset, views)``.

        ``offset`` is where the run starts in the flattened parameter as this rank holds it (its TP shard,
        vocab padding included); ``views`` are live 1-D views of the run's fp32 ``master`` value (the
        parameter itself in fp32 runs), ``exp_avg`` and ``exp_avg_sq``. A parameter has one run per bucket it
        spans (buckets may cut parameters). Stage 0 owns every element on every DP rank.
        """
        store = self.store
        if hasattr(store, "layouts"):  # stage 3: persistent buckets first, then one layout per gather unit
            layouts = store.layouts()
        else:
            layouts = [(ps, lay, store.rank) for _, ps, lay in store.buckets]
        assert len(layouts) == len(store.segments), "owned segments and flat layouts out of step"
        out = []
        for seg, base, (ps, layout, rank) in zip(store.segments, self._starts, layouts):
            lo, hi = layout.shard_range(rank)
            for pc in layout.pieces(lo, hi):
                a, b = base + pc.offset, base + pc.offset + pc.numel
                master = self.master[a:b] if self.master is not None else seg.param[pc.offset: pc.offset + pc.numel]
                out.append((ps[pc.index], pc.param_offset,
                            {"master": master, "exp_avg": self.exp_avg[a:b], "exp_avg_sq": self.exp_avg_sq[a:b]}))
        return out

    def state_dict(self) -> dict[str, object]:
        """``step_count``, the fp16 ``loss_scaler`` state (None without one) and ``owned``: :meth:`owned_state`
        (live views: copy them to keep a snapshot). Keyed by parameter, not by rank or flat position, so a
        checkpoint writer can name each run and reload it at any topology."""
        return {"step_count": self.step_count,
                "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "owned": self.owned_state()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore the optimizer from ``state``: ``owned`` aligned with :meth:`owned_state` (a dict of
        ``master``/``exp_avg``/``exp_avg_sq`` values per run, or the triples :meth:`state_dict` returns).

        The model's parameters become the master values rounded to the model dtype, and sharded parameters
        are all-gathered: a collective over ``dp_group`` that every rank must join.
        """
        owned = self.owned_state()
        values = state["owned"]
        if len(values) != len(owned):
            raise ValueError(f"optimizer state has {len(values)} owned runs, this rank owns {len(owned)}")
        for (p, offset, views), item in zip(owned, values):
            item = item[2] if isinstance(item, tuple) else item
            for kind, view in views.items():
                src = item[kind].reshape(-1)
                if src.numel() != view.numel():
                    raise ValueError(f"optimizer state {kind} at offset {offset} of a {tuple(p.shape)} parameter has "
                                     f"{src.numel()} elements, expected {view.numel()}")
                view.copy_(src)
        self.step_count = int(state["step_count"])
        if self.scaler is not None and state.get("loss_scaler") is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        if self.master is not None:  # a separate fp32 master: the model's parameters follow it
            for s, a in zip(self.store.segments, self._starts):
                s.param.copy_(self.master[a: a + s.param.numel()])
        self.store.after_step()


def _extend(a: torch.Tensor, n: int) -> torch.Tensor:
    return a.as_strided((a.numel() + n,), (1,), a.storage_offset())
