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
                                               scatter gradients every backward: 3mΨ, less mΨ_own for a
                                               chunk's own units on a rank of one chunk (persistent parameters
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
once; it resolves to on with CUDA and off on the CPU (``--overlap-comm``). Stages 0-1 reduce during the last
micro-batch's backward when :meth:`ZeroOptimizer.zero_grad` is told the number of micro-batches, else at the
step.
``contiguous_gradients`` is always in effect: owned gradients live in one contiguous buffer.

The step works on flat buckets, never a parameter at a time (what a GPU launches grows with the buckets): fresh
gradients are moved into their bucket by one foreach copy or add per bucket and micro-batch (cast to fp32 on the
way), the norm is one ``_foreach_norm``, Adam(W) one fused call per flat run list with one persistent step tensor,
the fp32 master is written into the parameters by one foreach copy, and sequence parallelism's partial
gradients travel in one flat all-reduce (``tests/test_step_ops.py`` counts the dispatched ops).

The optimizer owns the step; the rest is delegated by role: where parameters and gradients live and the hooks
that reduce them (:mod:`.store`), the fp32 master and Adam moments and their checkpoint form (:mod:`.state`),
ZeRO-Offload's host side (:mod:`.offload`) and the memory accounting (:mod:`.accounting`).

fp16 scales the loss (:mod:`.loss_scaler`): an overflow anywhere, agreed over the DP and model-parallel groups
through the gradient norm, skips the step and leaves the master weights untouched. Clipping by the global norm of
the unpartitioned gradient, and which parameters each rank counts in it: :mod:`.norm`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

from megazero.config.precision import PRECISION_DTYPES
from megazero.config.schema import LossScaleConfig, OptimizerConfig, ZeroConfig
from megazero.distributed import device_io
from megazero.distributed.group import Group
from megazero.tensor_parallel import weight_grad
from megazero.tensor_parallel.finalize import all_reduce_coalesced, sequence_parallel_grads
from megazero.zero import accounting
from megazero.zero.adam import ADAM_CHUNK, adam_update
from megazero.zero.bucketed import BucketedParams, sharded_state
from megazero.zero.grads import OwnedGrads, grad_dtype_for
from megazero.zero.loss_scaler import make_loss_scaler
from megazero.zero.norm import StepStats, skipped_steps_error
from megazero.zero.offload import host_offload
from megazero.zero.stage3.split import input_backward
from megazero.zero.state import OwnedRun, OwnedState
from megazero.zero.store import build_store, claim, gathered, local_tied_pairs, walk

__all__ = ["ZeroOptimizer"]


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
    exists beyond the buffers the formula counts. ``reduce_group`` is a second communicator over the ranks of
    ``dp_group`` for stage 3's gradient reductions (:func:`~megazero.zero.store.build_store`).
    """

    def __init__(
        self,
        model: nn.Module,
        zero_cfg: ZeroConfig,
        opt_cfg: OptimizerConfig,
        dp_group: Group,
        norm_group: Group | None = None,
        norm_counted: dict[nn.Parameter, bool | int] | None = None,
        precision: str = "fp32",
        loss_scale_cfg: LossScaleConfig | None = None,
        align: int = 16,
        tied_params: Sequence[nn.Parameter] = (),
        tied_group: Group | None = None,
        param_init: Callable[[nn.Parameter], torch.Tensor] | None = None,
        device: torch.device | None = None,
        reduce_group: Group | None = None,
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
        if reduce_group is not None and reduce_group.ranks != dp_group.ranks:
            raise ValueError(f"reduce_group {reduce_group} must hold the ranks of dp_group {dp_group}")
        claim(self.params)
        self.norm_counted = norm_counted or {p: True for p in self.params}
        self.grad_dtype = grad_dtype_for(precision, zero_cfg.grad_dtype)
        self.store = build_store(model, self.params, zero_cfg, self.dtype, self.grad_dtype, dp_group, align=align,
                                 tied_params=tied_params, tied_group=tied_group, param_init=param_init,
                                 device=device, reduce_group=reduce_group)
        # Segments of a parameter with a copy elsewhere (the tied embedding on the first and last pipeline
        # stage). Each copy is partitioned on its own, so both hold the same elements here and their reduced
        # gradients can be summed over ``tied_group`` before the update.
        self.tied_group = tied_group
        self._tied_segments = [seg for seg in self.store.segments
                               if any(any(p is t for t in tied_params) for p, _, _ in seg.pieces)]
        # Both copies on this rank (zbv: the first and the last stage on pipeline rank 0) and no group: the two
        # copies' segments pair up in order (each copy is partitioned alone, alike) and are summed here, so the
        # pipeline's embedding group is not used (the second copy is left out of the norm by norm_counted).
        self.tied_pairs = local_tied_pairs(self._tied_segments, tied_params) if tied_group is None else []
        self._comm_device = dp_group.device  # where the norm collectives run (the device even under offload)
        self._grads: OwnedGrads | None = None  # this step's owned gradients, prepare_step -> finish/launch_step
        self.offload = zero_cfg.offload_optimizer == "cpu"
        self.host = host_offload(zero_cfg, dp_group, norm_group)  # (the delayed update: stages 1-3, else ValueError)
        self.mixed = self.dtype != torch.float32
        # parameter shards in host memory without optimizer offload: the fp32 master and the moments stay on the
        # device with the gradients (one device in the Adam call), the master apart from the host shards even in
        # fp32, written into them after each update (megazero/zero/offload.py)
        self.offload_param = zero_cfg.offload_param == "cpu" and zero_cfg.stage == 3
        # this rank's partition: a separate fp32 master under mixed precision, and under offload (on the host)
        self.state = OwnedState(self.store, separate_master=self.mixed or self.offload or self.offload_param,
                                host=self.host, device=self._comm_device)
        self._decay_runs = self.state.runs(lambda p: p.ndim >= 2)  # runs never span two segments
        self._norm_runs = self.state.runs(lambda p: self.norm_counted.get(p, True))
        # sequence parallelism's partial gradients: summed over TP in prepare_step, one call (tensor_parallel.finalize)
        self._sp_group, sp_params = sequence_parallel_grads(model)
        self._sp_runs = self.state.runs(set(sp_params).__contains__)
        self._sp_buffer: torch.Tensor | None = None
        self.scaler = make_loss_scaler(precision, loss_scale_cfg)
        self.step_count = 0
        self._step_tensor: torch.Tensor | None = None  # step_count on the moments' device (adam_update)
        self.skipped_steps = 0  # steps skipped for a non-finite gradient norm (fp16 overflows included)
        self.consecutive_skips = 0  # of them, in a row up to the last step (non-finite norm without scaler)

    # -- the state's buffers, read by the memory tracker, benchmarks and tests -----------------------------------
    @property
    def master(self) -> torch.Tensor | None:
        """The fp32 master partition (None where the parameters are their own master)."""
        return self.state.master

    @property
    def exp_avg(self) -> torch.Tensor:
        return self.state.exp_avg

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        return self.state.exp_avg_sq

    @property
    def owned_numel(self) -> int:
        """Elements this rank updates."""
        return self.state.numel

    @property
    def _host_grads(self) -> torch.Tensor | None:
        """Optimizer offload: the fp32 host copy of the owned gradients (None before the first step)."""
        return self.host.grads if self.host is not None else None

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

    def backward_input(self, store: weight_grad.WeightGradStore, output: torch.Tensor | GradientEdge,
                       grad: torch.Tensor | None, inp: torch.Tensor | None,
                       params: Sequence[nn.Parameter]) -> tuple[torch.Tensor | None, weight_grad.WeightWork]:
        """B of a split backward (zero-bubble pipeline schedules): the gradient of the stage input ``inp`` and
        the work left for :meth:`backward_weight` (:func:`~megazero.tensor_parallel.weight_grad.input_gradients`;
        ``output`` a loss share, scaled here, when ``grad`` is None). No gradient reaches the store's hooks, so
        nothing is reduced; stage 3 gathers the blocks for it as in a backward (:mod:`.stage3.split`)."""
        if grad is None and self.scaler is not None:
            output = output * self.scaler.scale
        with input_backward(self.store):
            return weight_grad.input_gradients(store, output, grad, inp, params)

    def backward_weight(self, work: weight_grad.WeightWork, order: Sequence[nn.Parameter]) -> None:
        """W of a split backward: each parameter's weight gradient, accumulated through autograd on the leaf, so
        the store's hooks run as in :meth:`backward`: a bucket or unit is reduced when its last W ends."""
        self.store.start_backward()
        for p, g in weight_grad.weight_gradients(work, order):
            torch.autograd.backward(p, g)
        self.store.finish_backward()

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (None without loss scaling)."""
        return self.scaler.scale if self.scaler is not None else None

    def _owned_grads(self) -> OwnedGrads:
        """The reduced owned gradients: the store's segment buffers in place (no copy); under optimizer offload
        the same device gradients, staged to the fp32 host buffer sub-group by sub-group by the host Adam
        (:meth:`megazero.zero.offload.HostOffload.owned_grads`)."""
        if self.host is not None:
            return self.host.owned_grads(self.store.segments, self.state.starts)
        return OwnedGrads([(a, s.grad) for s, a in zip(self.store.segments, self.state.starts)])

    def _global_sq_norm(self, g: OwnedGrads) -> torch.Tensor:
        """The squared global gradient norm as a 0-dim fp64 tensor on the gradients' device (no host read).

        Squares are summed on the device over this rank's counted runs, then over DP (partitioned gradients)
        and the model-parallel group. Under optimizer offload ``g`` is still on the device (its host copy is
        made during Adam); the sum is moved to the communication device in case the two differ.
        """
        runs = [g.slice(a, b) for a, b in self._norm_runs]  # one kernel launch for all runs (not one per run)
        norms = torch._foreach_norm(runs, 2, dtype=torch.float32) if runs else []
        local = (torch.stack(norms).double().square().sum() if norms
                 else torch.zeros((), dtype=torch.float64, device=g.parts[0].device))
        sq = local.reshape(1).to(self._comm_device, non_blocking=True)
        dpu = self.host is not None and self.host.delayed_after is not None
        if dpu:  # the pending delayed update's failure flags ride along: every rank learns of any failure (offload.py)
            sq = self.host.with_flags(sq)
        if self.sharded.optimizer_states:  # partitioned gradients: sum the partitions over DP
            self.dp_group.all_reduce(sq, tag="norm")
        if self.norm_group is not None:
            self.norm_group.all_reduce(sq, tag="norm")
        return self.host.fold_flags(sq) if dpu else sq[0]  # (a failure: negative, finish_step raises)

    def prepare_step(self) -> torch.Tensor:
        """First half of :meth:`step`: reduce the gradients (sum the tied embedding's two copies, and under
        sequence parallelism the partial gradients of TP-replicated parameters over TP, in one call) and
        return the global squared gradient norm (still loss-scaled under fp16) as a 0-dim fp64 device tensor.

        Nothing is read back to the host: the caller fetches this value together with anything else it needs
        (the loss) in one read, then calls :meth:`finish_step` (or, where :attr:`steps_on_device`, calls
        :meth:`launch_step` before the read and :meth:`settle_step` after it).
        """
        self.store.reduce_gradients()
        if self.tied_group is not None:
            for seg in self._tied_segments:
                self.tied_group.all_reduce(seg.grad, tag="tied")
        for a, b in self.tied_pairs:
            a.grad.add_(b.grad)
            b.grad.copy_(a.grad)
        self._grads = self._owned_grads()
        if self._sp_runs:
            self._sp_buffer = all_reduce_coalesced([self._grads.slice(a, b) for a, b in self._sp_runs],
                                                   self._sp_group, buffer=self._sp_buffer)
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
        if sq < 0:  # the delayed update failed on some rank: every rank raises here (_global_sq_norm)
            self.host.raise_failure(self.step_count)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if not math.isfinite(sq):  # every rank saw the same non-finite sum: all skip
            self._land()  # (the delayed update: the previous step's lands; this norm carried its flags, unset)
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
        if self.host is not None:  # the delayed update: the previous one ends (then lands in host.adam, below)
            self.host.begin_step(self.step_count)
        self._adam(g, lr)
        if self.state.master is not None and not self.offload:  # (offload copies each chunk back as it goes)
            self.state.write_params()
        del g
        self.store.after_step()
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        return StepStats(grad_norm=norm, skipped=False, loss_scale=self.loss_scale)

    @property
    def steps_on_device(self) -> bool:
        """Whether the step's decisions can be taken on the device, so that its one host read may come after the
        update is launched (:meth:`launch_step`, then :meth:`settle_step` with the value read): no loss scaler
        (its scale is decided on the host), Adam on the device (not the host's under offload) and torch's fused
        kernel (its ``found_inf`` skips a non-finite step). Otherwise :meth:`finish_step` takes the norm read
        first, and the device idles while the update is issued."""
        fused = getattr(torch, "_fused_adamw_" if self.opt_cfg.decoupled_weight_decay else "_fused_adam_", None)
        return self.scaler is None and self.host is None and not self.offload_param and fused is not None

    def launch_step(self, lr: float, sq_norm: torch.Tensor) -> None:
        """:meth:`finish_step`'s update with no host read: given :meth:`prepare_step`'s squared norm as a device
        tensor, clip by the global norm on the device (``torch.nn.utils.clip_grad_norm_``'s coefficient) and update,
        the fused Adam told by ``found_inf`` to leave weights and moments untouched when the norm is not finite
        (every rank sees the same sum, so all skip). :meth:`settle_step` then does the host's bookkeeping."""
        g = self._grads
        if g is None:
            raise RuntimeError("ZeroOptimizer.launch_step called without prepare_step for this step")
        if not self.steps_on_device:
            raise RuntimeError("ZeroOptimizer.launch_step needs steps_on_device (no loss scaler, no offload)")
        self._grads = None
        sq = sq_norm.to(self.state.exp_avg.device, non_blocking=True)
        finite = torch.isfinite(sq)
        if self.opt_cfg.clip_grad > 0:
            coef = torch.clamp(self.opt_cfg.clip_grad / (sq.sqrt() + 1e-6), max=1.0)
            g.scale_(torch.where(finite, coef, torch.ones_like(coef)))  # (a skipped step's gradients go unused)
        self._adam(g, lr, found_inf=(~finite).float())
        if self.state.master is not None:
            self.state.write_params()
        del g
        self.store.after_step()

    def settle_step(self, sq_norm: float) -> StepStats:
        """The host's side of a step launched by :meth:`launch_step`, given the squared norm read back: count a
        skipped step (its update did nothing on the device) and report the norm."""
        sq = float(sq_norm)
        if not math.isfinite(sq):
            self.step_count -= 1  # the fused kernel left this step out
            self.skipped_steps += 1
            self.consecutive_skips += 1
            return StepStats(grad_norm=sq, skipped=True, loss_scale=None)
        self.consecutive_skips = 0
        return StepStats(grad_norm=math.sqrt(sq), skipped=False, loss_scale=None)

    def step(self, lr: float) -> StepStats:
        """Reduce gradients, check for fp16 overflow, clip by the global norm, update with learning rate ``lr``
        (:meth:`prepare_step`, then the update and one read of the norm: the update first where
        :attr:`steps_on_device`, else :meth:`finish_step` after the read)."""
        sq = self.prepare_step()
        if self.steps_on_device:
            self.launch_step(lr, sq)
            return self.settle_step(device_io.read(sq)[0])
        return self.finish_step(lr, device_io.read(sq)[0])

    def flush(self) -> bool:
        """Land offload's pending delayed update, if any, once the ranks agreed it succeeded (:meth:`HostOffload.agree
        <megazero.zero.offload.HostOffload.agree>`, a collective over ``dp_group`` and ``norm_group``; then
        :meth:`_land`; every rank has the same pending state). Returns whether one was pending. The loop calls it
        before an evaluation, samples, a checkpoint and at the end; the state reads below call it too."""
        if self.host is None or not self.host.pending:
            return False
        self.host.agree(self._comm_device, (self.dp_group, self.norm_group), self.step_count)
        self._land()
        return True

    def _land(self) -> None:
        """Land a pending delayed update already agreed on (a skipped step's norm carried the flags), all-gather."""
        if self.host is not None and self.host.land(self.state.master, self.store.segments, self.state.starts):
            self.store.after_step()

    def check_skipped_steps(self, step: int) -> None:
        """Raise :class:`NonFiniteGradientError` once ``OptimizerConfig.max_skipped_steps`` steps in a row (0:
        never) were skipped for a non-finite gradient norm without a loss scaler. Every rank skipped the same
        steps, so every rank raises; ``step`` (the last step run) goes into the message."""
        if self.opt_cfg.max_skipped_steps and self.consecutive_skips >= self.opt_cfg.max_skipped_steps:
            raise skipped_steps_error(self.consecutive_skips, step, self.opt_cfg)

    @torch.no_grad()
    def _adam(self, g: OwnedGrads, lr: float, found_inf: torch.Tensor | None = None) -> None:
        """``torch.optim.Adam``/``AdamW`` (single-tensor arithmetic) on the owned partition: on the host under
        offload; a separate fp32 master is updated in chunks, so 16-bit gradients are converted to fp32 one
        chunk at a time. A nonzero ``found_inf`` (a device tensor) makes the fused kernel skip the update."""
        self.step_count += 1
        if self._step_tensor is None:  # Adam's step for the fused kernel: one tensor beside the moments, kept
            self._step_tensor = torch.zeros((), dtype=torch.float32, device=self.state.exp_avg.device)
        self._step_tensor.fill_(float(self.step_count))  # one fill per step (no host copy), whatever the runs
        step, step_tensor = self.step_count, self._step_tensor  # bound now: offload's delayed update runs later

        def update(p: torch.Tensor, lo: int, hi: int) -> None:  # owned elements [lo, hi), held in ``p``
            adam_update(p, g, lr, lo, hi, cfg=self.opt_cfg, step=step, decay_runs=self._decay_runs,
                        exp_avg=self.state.exp_avg, exp_avg_sq=self.state.exp_avg_sq, step_tensor=step_tensor,
                        found_inf=found_inf)

        master = self.state.master
        if self.host is not None:  # each updated chunk is copied back to the device parameters
            self.host.adam(master, self.store.segments, self.state.starts, update)
        elif master is not None:
            for lo in range(0, self.state.numel, ADAM_CHUNK):
                hi = min(lo + ADAM_CHUNK, self.state.numel)
                update(master[lo:hi], lo, hi)
        else:
            for a, b, p in self.state.pieces:
                update(p, a, b)

    # -- inspection ----------------------------------------------------------------------------------------
    def master_params(self) -> dict[str, torch.Tensor]:
        """The full fp32 master value of every trainable parameter, by name (a collective over ``dp_group``; a
        pending delayed update's :meth:`flush` also over ``norm_group``)."""
        self.flush()
        return self.state.master_params(self.model, self._comm_device)

    def gathered_parameters(self) -> Iterator[None]:
        """A context manager: inside the block every model parameter holds its whole (model-dtype) value; a
        collective over ``dp_group`` at stage 3, free otherwise (:func:`~megazero.zero.store.gathered`; a pending
        delayed update's :meth:`flush`: over ``norm_group`` too). At stage 3 that is the whole replica at once: the
        engine's evaluation, export and checks never use it (forwards gather block by block through the hooks,
        :meth:`gathered_units` walks units); tests and small models do."""
        self.flush()
        return gathered(self.store)

    def gathered_units(self, params: Sequence[nn.Parameter] | None = None) -> Iterator[list[nn.Parameter]]:
        """Lists of trainable parameters (only ``params``, when given), each holding its whole value until the
        loop moves on: the whole model at once at stages 0-2, one gather unit at a time at stage 3 (a collective
        over ``dp_group``; :func:`~megazero.zero.store.walk`; with a pending delayed update, :meth:`flush` is one
        over ``dp_group`` and ``norm_group``). What export and the tied-embedding check use: it
        never holds more than two units, where :meth:`gathered_parameters` holds the whole replica."""
        self.flush()
        return walk(self.store, params)

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of the model states this rank holds now (:func:`megazero.zero.accounting.model_state_bytes`)."""
        # read through the attributes (a stand-in with model, store, master and moments is measured alike)
        return accounting.model_state_bytes(self.model, self.store, self.master, (self.exp_avg, self.exp_avg_sq),
                                            getattr(self, "_host_grads", None))

    def padded_numel(self) -> dict[str, int]:
        """Elements of the flat buffers as laid out (Ψ plus padding): what each collective moves."""
        return self.store.padded_numel()

    # -- checkpointing (canonical, topology-independent form; see megazero/checkpoint/canonical.py) --------------
    def owned_state(self) -> list[OwnedRun]:
        """The runs of parameter elements this rank updates, ``(param, offset, views)``
        (:meth:`OwnedState.owned <megazero.zero.state.OwnedState.owned>`); a pending delayed update lands first."""
        self.flush()
        return self.state.owned()

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
        are all-gathered: a collective over ``dp_group`` that every rank must join (and over ``norm_group`` too
        where a delayed update is pending: :meth:`flush` agrees on it first).
        """
        self.flush()  # (a pending delayed update would write the master while it is loaded)
        self.state.load(state["owned"])
        self.step_count = int(state["step_count"])
        if self.scaler is not None and state.get("loss_scaler") is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        if self.state.master is not None:  # a separate fp32 master: the model's parameters follow it
            self.state.write_params()
        self.store.after_step()

