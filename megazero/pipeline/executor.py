"""Runs one rank's schedule timeline: forward and backward of its model chunks, with point-to-point transfers.

The same executor drives every topology: with one pipeline stage the 1F1B timeline is simply
forward/backward per micro-batch. Activations a stage must keep for backward stay in a stash keyed by
(micro-batch, chunk) from its forward until its backward; the executor counts how many micro-batches (and how
many bytes of saved activations) are stashed at once, which is what the schedules' memory claims are about.

A stage's output is freed once it is sent (Megatron-LM's ``deallocate_output_tensor``): the stash keeps only
its autograd edge (:func:`torch.autograd.graph.get_gradient_edge`), and backward starts there from the gradient
the next stage returns, so an output [micro, seq (/tp under SP), hidden] is not held for each micro-batch in
flight (the estimator, :func:`megazero.plan.estimate.peak_bytes`, holds none at the start of backward).

Counting saved activations costs a Python call per saved tensor; ``measure=False`` (the trainer's unlogged
steps) skips it, leaving ``peak_activation_bytes`` None.

**Split backward** (``split=True``, the zero-bubble schedules): a ``B`` action runs the optimizer's
``backward_input`` (the stage input's gradient, sent upstream at the next transfer point; the weight-gradient
work is stashed per (micro-batch, chunk), :mod:`megazero.tensor_parallel.weight_grad`) and a ``W`` action its
``backward_weight`` (gradients accumulated, ZeRO's hooks fire). The W stash's bytes (layer inputs and output
gradients kept for the weight GEMMs, kept gradients of the small parameters) count as activations from B to W.

Under ``zbv`` rank p - 1 runs two consecutive virtual stages (the V's turn): the activation its chunk 0 produces
and the gradient its chunk 1 returns go straight into its inbox, with no transfer.

Received tensors wait in the inbox until their action runs: one at a time under 1F1B, GPipe and zb-h1, two
under interleaved (a unit's call receives for its forward and its backward), up to three under zbv (a tick's
call receives for later actions). ``peak_received`` counts the most at once
(:func:`~megazero.pipeline.p2p.received_waiting` replays it from the plan); they are not in
``peak_activation_bytes``, which counts what autograd saves, and the estimator adds them to its transient.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from megazero.distributed import device_io
from megazero.observe.memory import ActivationMemoryCounter
from megazero.pipeline.p2p import PipelineP2P, action_transfers, forward_actions, transfer_plan
from megazero.pipeline.partition import StageSpec
from megazero.pipeline.schedules import Action
from megazero.tensor_parallel.weight_grad import WeightGradStore, WeightWork

__all__ = ["PipelineExecutor", "RunStats", "SplitBackward"]

MicroBatch = tuple[torch.Tensor, torch.Tensor]
# backward(output, grad): grad None means ``output`` is this micro-batch's (scalar) share of the loss; else
# ``output`` is the gradient edge of a stage output already sent and freed (torch.autograd.backward takes either)
BackwardFn = Callable[[torch.Tensor | GradientEdge, torch.Tensor | None], None]


class SplitBackward(Protocol):
    """The two halves of a split backward (``ZeroOptimizer.backward_input`` / ``backward_weight``)."""

    def backward_input(self, store: WeightGradStore, output: torch.Tensor | GradientEdge, grad: torch.Tensor | None,
                       inp: torch.Tensor | None, params: Sequence[nn.Parameter]
                       ) -> tuple[torch.Tensor | None, WeightWork]: ...

    def backward_weight(self, work: WeightWork, order: Sequence[nn.Parameter]) -> None: ...


@dataclass
class RunStats:
    loss_sum: torch.Tensor  # sum of per-token losses this rank computed (last stage; 0 elsewhere), fp64, on device
    peak_in_flight: float  # most micro-batches stashed at once (chunks count 1/V each)
    peak_activation_bytes: int | None  # most saved-activation bytes stashed at once (None: not measured)


class PipelineExecutor:
    """Executes schedule timelines over this rank's model chunks."""

    def __init__(self, chunks: list[nn.Module], specs: list[StageSpec], p2p: PipelineP2P | None,
                 pp_rank: int, pp_size: int, device: torch.device, split: bool = False, schedule: str = "") -> None:
        self.chunks = chunks
        self.schedule = schedule  # names the placement of virtual stages (schedules.virtual_stage; "zbv": the V)
        # split backward: the chunks' parameters lead their Functions to the store; W accumulates in the order
        # an ordinary backward would (reverse registration: ZeRO's buckets and units)
        self.wgrad = WeightGradStore() if split else None
        self.params = [list(c.parameters()) for c in chunks]
        self.order = [p[::-1] for p in self.params]
        if self.wgrad is not None:
            self.wgrad.attach([p for ps in self.params for p in ps])
        self.specs = specs
        self.p2p = p2p
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.device = device
        self.counters = [ActivationMemoryCounter(c) for c in chunks]
        self.peak_received = 0  # the last run's most received tensors waiting in the inbox at once

    def run(self, actions: list[Action], micro_batches: list[MicroBatch], loss_divisor: torch.Tensor | float,
            backward: BackwardFn | None, units: list[list[int]] | None = None, measure: bool = True,
            split: SplitBackward | None = None, ticks: Mapping[tuple[str, int, int], int] | None = None) -> RunStats:
        """Run ``actions``, communicating between the ``units`` of actions as
        :func:`~megazero.pipeline.p2p.transfer_plan` says (default: between every two actions).

        ``backward`` None runs the forwards only (evaluation, no graph kept), in the schedule's order, each
        forward its own unit. ``measure`` counts the saved activations (module docstring). ``split`` runs the
        B and W actions of a split-backward executor (module docstring). ``ticks`` (zbv) groups the transfers
        by the list scheduler's ticks instead of ``units`` (:func:`~megazero.pipeline.p2p.transfer_plan`), also
        for the forwards only. A transfer to this rank itself (zbv's turn at rank p - 1) goes from the outbox
        straight to the inbox."""
        if backward is not None and (self.wgrad is not None) != (split is not None):
            raise ValueError("a split-backward executor runs B and W through split=, and only it")
        v = len(self.chunks)
        if backward is None:
            actions, units = forward_actions(actions), None
        plan = transfer_plan(actions, self.pp_rank, self.pp_size, v, units=units, schedule=self.schedule,
                             ticks=ticks)
        if isinstance(loss_divisor, torch.Tensor):  # the per-token loss is fp32: divide in fp32, on the device
            loss_divisor = loss_divisor.to(self.device, torch.float32)
        stash: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor | GradientEdge, int]] = {}
        wstash: dict[tuple[int, int], tuple[WeightWork, int]] = {}  # B done, W not yet: its work and bytes
        outbox: dict[tuple[str, int, int], torch.Tensor] = {}  # produced, sent at the next point
        inbox: dict[tuple[str, int, int], torch.Tensor] = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        live = peak = 0.0
        live_bytes = peak_bytes = received = 0
        for a, calls in zip(actions, plan):
            for call in calls:
                inbox.update(self.p2p.exchange(call, outbox))
            received = max(received, len(inbox))
            recv, send = action_transfers(a, self.pp_rank, self.pp_size, v, self.schedule)
            sent = inbox if send is not None and send.peer == self.pp_rank else outbox  # local: handed over
            spec, chunk = self.specs[a.chunk], self.chunks[a.chunk]
            if a.kind == "F":
                x, y = micro_batches[a.micro_batch]
                if recv is None:
                    inp = None
                    arg = device_io.to_device(x, self.device)  # no host sync (safe from pageable memory)
                else:
                    inp = inbox.pop(recv.key)
                    inp.requires_grad_(backward is not None)
                    arg = inp
                target = device_io.to_device(y, self.device) if spec.post_process else None
                counter = self.counters[a.chunk]
                with torch.set_grad_enabled(backward is not None), counter.track() if measure else nullcontext():
                    out = chunk(arg, target)
                nbytes = counter.last if measure else 0
                if spec.post_process:
                    loss_sum += out.detach().double().sum()
                    out = out.sum() / loss_divisor
                else:
                    sent[send.key] = out.detach()  # the only reference to the data once sent
                    if backward is not None:
                        out = get_gradient_edge(out)  # keep the autograd node, drop the tensor
                if backward is not None:
                    stash[(a.micro_batch, a.chunk)] = (inp, out, nbytes)
                    live += 1 / v
                    live_bytes += counter.last
                    peak, peak_bytes = max(peak, live), max(peak_bytes, live_bytes)
            elif a.kind == "B":
                inp, out, nbytes = stash.pop((a.micro_batch, a.chunk))
                grad = None if recv is None else inbox.pop(recv.key)
                if split is not None:
                    grad_in, work = split.backward_input(self.wgrad, out, grad, inp, self.params[a.chunk])
                    wbytes = _stash_bytes(work) if measure else 0
                    wstash[(a.micro_batch, a.chunk)] = (work, wbytes)
                    live_bytes += wbytes
                    peak_bytes = max(peak_bytes, live_bytes - nbytes)
                else:
                    backward(out, grad)
                    grad_in = inp.grad if inp is not None else None
                if send is not None:
                    sent[send.key] = grad_in
                del out, grad, inp
                live -= 1 / v
                live_bytes -= nbytes
            else:
                work, wbytes = wstash.pop((a.micro_batch, a.chunk))
                split.backward_weight(work, self.order[a.chunk])
                live_bytes -= wbytes
        for call in plan[-1]:
            self.p2p.exchange(call, outbox)
        assert not stash, f"schedule left micro-batches without backward: {sorted(stash)}"
        assert not wstash, f"schedule left micro-batches without W: {sorted(wstash)}"
        assert not outbox and not inbox, f"transfers left over: {sorted(outbox)} {sorted(inbox)}"
        self.peak_received = received
        return RunStats(loss_sum=loss_sum, peak_in_flight=peak, peak_activation_bytes=peak_bytes if measure else None)


def _stash_bytes(work: WeightWork) -> int:
    """Bytes of the distinct storages a W stash holds (a tensor saved in forward and kept for W counts here
    too: it stays alive past B for W)."""
    seen: dict[int, int] = {}
    for t in work.stashed_tensors():
        seen.setdefault(device_io.storage_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())
