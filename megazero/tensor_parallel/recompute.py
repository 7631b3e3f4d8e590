"""Activation checkpointing: run a block without keeping its activations, recompute them in backward.

:func:`checkpoint` runs ``function(*inputs)`` under ``no_grad`` in the forward pass, so autograd saves
nothing inside it, and keeps only the inputs. In backward it restores the inputs, restores the random number
generator states the forward started from, runs ``function`` again with autograd on and backpropagates
through the recomputed graph (Chen et al. 2016; Megatron-LM's and DeepSpeed's ``CheckpointFunction``).

Three things make the saved inputs cheaper, following DeepSpeed's ``activation_checkpointing`` block:

* **RNG restore.** The default generator's state (CPU, and the input's CUDA device) and the
  :class:`~megazero.tensor_parallel.random.RNGTracker`'s TP stream are captured before the forward and set
  again for the recompute, then put back as they were, so dropout draws the same masks twice and the streams
  advance exactly as in a run without recomputation.
* **partition_activations.** An input that is *replicated* over the TP group (the residual stream without
  sequence parallelism) is stored as this rank's 1/tp slice of its flattened elements; backward all-gathers
  the slices over the TP group. Inputs that differ between TP ranks (sequence shards, a rank's own heads)
  cannot be partitioned that way and are passed with ``partition=False``.
* **cpu_checkpointing.** The stored inputs (partitioned or whole) are copied to host memory (pinned when a
  CUDA device exists) and brought back for the recompute. They then live outside the autograd graph, so
  saved-tensor counters do not see them; :class:`CheckpointStats` counts them instead. On a CPU device the
  copy is still made (a new host buffer; the original is released), which exercises the path but of course
  saves nothing: host and "device" are the same memory there.

:class:`CheckpointStats` also records the bytes one recomputation saves for its own backward (the transient
a layer adds to the stash during backward), measured with saved-tensor hooks like
:class:`megazero.observe.memory.ActivationMemoryCounter`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megazero.distributed import device_io
from megazero.distributed.group import Group
from megazero.tensor_parallel.random import RNGTracker
from megazero.tensor_parallel.weight_grad import backward_inside

__all__ = ["CheckpointOptions", "CheckpointStats", "checkpoint", "gather_partition", "partition_tensor"]


@dataclass
class CheckpointStats:
    """What checkpointing holds outside the autograd graph, and what recomputation adds in backward.

    ``host_bytes`` are the bytes of inputs currently kept in host memory by ``cpu_checkpointing`` (released
    when the recomputation has consumed them, or when their graph is dropped); ``host_peak_bytes`` the most
    held at once. ``recompute_peak_bytes`` is the largest number of bytes a single recomputation saved for
    its backward (de-duplicated by storage, parameters excluded); ``recomputes`` counts recomputations.
    """

    host_bytes: int = 0
    host_peak_bytes: int = 0
    recompute_peak_bytes: int = 0
    recomputes: int = 0

    def reset_peaks(self) -> None:
        self.host_peak_bytes = self.host_bytes
        self.recompute_peak_bytes = 0

    def _hold(self, nbytes: int) -> None:
        self.host_bytes += nbytes
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)

    def _release(self, nbytes: int) -> None:
        self.host_bytes -= nbytes


@dataclass
class CheckpointOptions:
    """How :func:`checkpoint` stores the inputs it keeps for the recomputation.

    ``tp_group`` is the group to partition replicated inputs over (``partition_activations``); ``None`` or a
    group of one keeps them whole. ``cpu`` moves them to host memory (``cpu_checkpointing``). ``rng_tracker``
    is the TP RNG stream whose state is restored along with the default generator's.
    """

    tp_group: Group | None = None
    cpu: bool = False
    rng_tracker: RNGTracker | None = None
    stats: CheckpointStats = field(default_factory=CheckpointStats)


def partition_tensor(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's 1/size slice of ``x``'s flattened elements (zero-padded to a multiple of the group size)."""
    flat = x.detach().reshape(-1)
    per_rank = math.ceil(flat.numel() / group.size)
    start = group.rank * per_rank
    part = flat.new_zeros(per_rank)
    n = max(0, min(per_rank, flat.numel() - start))
    part[:n] = flat[start: start + n]
    return part


def gather_partition(part: torch.Tensor, group: Group, shape: torch.Size) -> torch.Tensor:
    """Inverse of :func:`partition_tensor`: all-gather every rank's slice and reshape to ``shape``."""
    full = torch.empty(part.numel() * group.size, dtype=part.dtype, device=part.device)
    group.all_gather_into(full, part.contiguous(), tag="act")
    return full[: math.prod(shape)].view(shape)


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` in (pinned, where CUDA exists) host memory; a real copy even when ``x`` is on the CPU."""
    kept = device_io.empty(x.numel(), x.dtype, pin=torch.cuda.is_available()).view(x.shape)
    kept.copy_(x, non_blocking=x.device.type == "cuda")
    return kept


def _rng_state(device: torch.device, tracker: RNGTracker | None) -> tuple[Any, ...]:
    with device_io.on_host():  # RNG states are CPU tensors (host memory on a GPU)
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return torch.get_rng_state(), cuda, None if tracker is None else tracker.state.clone()


def _set_rng_state(state: tuple[Any, ...], device: torch.device, tracker: RNGTracker | None) -> None:
    cpu, cuda, tracked = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
    if tracker is not None:
        tracker.state = tracked


@contextmanager
def _count_saved(stats: CheckpointStats) -> Iterator[None]:
    """Count the bytes autograd saves inside the body (storages once, parameters and their views excluded)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter) and not isinstance(t._base, nn.Parameter):
            storage = t.untyped_storage()
            seen.setdefault(device_io.storage_key(t), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield
    stats.recompute_peak_bytes = max(stats.recompute_peak_bytes, sum(seen.values()))
    stats.recomputes += 1


class _Stored:
    """How one input was kept: its shape, whether it was partitioned, and (offloaded) its host copy."""

    def __init__(self, x: torch.Tensor, partitioned: bool, host: torch.Tensor | None) -> None:
        self.shape, self.device, self.requires_grad = x.shape, x.device, x.requires_grad
        self.partitioned = partitioned
        self.host = host


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, options, partition, *inputs):
        ctx.function, ctx.options = function, options
        device = next((x.device for x in inputs), torch.device("cpu"))
        ctx.device = device
        ctx.rng_state = _rng_state(device, options.rng_tracker)
        with torch.no_grad():
            outputs = function(*inputs)
        group = options.tp_group
        split = group is not None and group.size > 1
        stored, on_device = [], []
        for x, part in zip(inputs, partition):
            keep = partition_tensor(x, group) if part and split else x.detach()
            host_copy = None
            if options.cpu:
                host_copy = _to_host(keep)
                nbytes = host_copy.untyped_storage().nbytes()
                options.stats._hold(nbytes)
                weakref.finalize(host_copy, options.stats._release, nbytes)
            else:
                on_device.append(keep)
            stored.append(_Stored(x, part and split, host_copy))
        ctx.stored = stored
        ctx.save_for_backward(*on_device)  # what stays on the device: seen by saved-tensor hooks
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        options: CheckpointOptions = ctx.options
        kept = iter(ctx.saved_tensors)
        inputs = []
        for s in ctx.stored:
            x = next(kept) if s.host is None else device_io.to_device(s.host, s.device)
            s.host = None  # the host copy is free once it is back on the device
            if s.partitioned:
                x = gather_partition(x, options.tp_group, s.shape)
            inputs.append(x.detach().requires_grad_(s.requires_grad))
        ctx.stored = None
        resume = _rng_state(ctx.device, options.rng_tracker)
        _set_rng_state(ctx.rng_state, ctx.device, options.rng_tracker)
        try:
            with torch.enable_grad(), _count_saved(options.stats):
                outputs = ctx.function(*inputs)
        finally:
            _set_rng_state(resume, ctx.device, options.rng_tracker)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        # a zero-bubble B pass keeps the parameters' gradients for W (weight_grad.backward_inside)
        got = backward_inside([o for o, _ in pairs], [g for _, g in pairs], inputs)
        return (None, None, None, *got)


def checkpoint(function: Callable[..., Any], *inputs: torch.Tensor, options: CheckpointOptions,
               partition: tuple[bool, ...] | None = None) -> Any:
    """``function(*inputs)`` with its activations recomputed in backward instead of kept.

    ``inputs`` are tensors (close over everything else); ``partition[i]`` says input ``i`` is replicated
    over ``options.tp_group`` and may be stored partitioned (default: none is). Returns what ``function``
    returns (a tensor or a tuple of tensors). Without autograd (evaluation) ``function`` just runs. With
    autograd, at least one input must require grad (the recomputation runs from this node's backward).
    """
    if not torch.is_grad_enabled():
        return function(*inputs)
    partition = partition or (False,) * len(inputs)
    if len(partition) != len(inputs):
        raise ValueError(f"partition has {len(partition)} entries for {len(inputs)} inputs")
    if not any(x.requires_grad for x in inputs):
        # the recomputation runs from this function's backward, which autograd only calls for inputs that
        # need a gradient: the parameters inside would silently get none
        raise ValueError("activation checkpointing needs an input that requires grad (a frozen embedding "
                         "feeding checkpointed layers would leave their parameters without gradients)")
    return _CheckpointFunction.apply(function, options, partition, *inputs)
