"""Group: one process group with checked collectives, and the one place that counts their volume.

Leaf code receives a ``Group`` (``tp_group``, ``dp_group``...) and calls ``group.all_reduce(t)``. The wrapper
checks every tensor against the backend's device (NCCL serves CUDA tensors only), picks whichever collective the
installed torch offers (``all_gather_single`` on newer releases, ``all_gather_into_tensor`` on older ones) and
records the logical volume of each call in a :class:`~megazero.distributed.ledger.CommLedger`.

On gloo two collectives take a faster road to the same result (figures in bench/README.md, "ZeRO 0-2 at the
peak with the default buckets"): an in-place reduce-scatter runs as one reduce per shard to its owner (about 30%
less CPU than gloo's all-reduce, which it replaced, and a third of gloo's own reduce-scatter: bench/README.md,
"ZeRO speed"), which leaves this rank's shard where it belongs and the rest of the input as gloo's reductions
left it, so callers read only their own shard (NCCL would leave the rest untouched); an all-gather runs as one
broadcast per shard. The ledger still counts the logical reduce-scatter and all-gather. NCCL always runs the
collectives themselves.

Two switches keep the shortcuts honest (DESIGN.md, "gloo's shortcuts stay invisible"), read from the environment
when a group is made and kept as attributes a harness may set: ``MEGAZERO_GLOO_FAST_PATHS=0`` (``fast_paths``)
runs gloo's own reduce-scatter and all-gather, with NCCL's semantics; ``MEGAZERO_POISON_REDUCE_SCATTER=1``
(``poison``, set by the test suite) fills the part of an in-place reduce-scatter's input that this rank does not
own with NaN once the collective is waited on, so code that reads it (what gloo reduced and NCCL left local)
fails in every test world instead of passing on gloo alone.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from typing import NamedTuple

import torch
import torch.distributed as dist

from megazero.distributed import device_io
from megazero.distributed.ledger import CommLedger

__all__ = ["Group", "P2PCall", "backend_device"]

class P2PCall(NamedTuple):
    """One point-to-point operation as issued: ``kind`` "send"/"recv", ``peer`` global rank, ``nbytes``, ``tag``
    (recorded by :meth:`Group.batch_p2p` when ``p2p_log`` is set; replayed by :mod:`megazero.pipeline.p2p_replay`)."""

    kind: str
    peer: int
    nbytes: int
    tag: Hashable = None


class Group:
    """One process group plus the ledger that counts its traffic.

    ``Group`` is what leaf code receives: it knows its ``size``, this process's ``rank`` in it and the
    ``device`` its backend works on, and offers the handful of collectives megazero needs. A group of size 1
    short-circuits every collective (no call, no ledger entry), so single-process runs pay nothing.

    Device discipline: NCCL serves CUDA tensors only, gloo forgives anything. Every call checks, at every
    group size including 1 (before the short-circuit), that each tensor it is handed lives on ``device``, and
    raises naming the call, its tag and both devices, so a one-GPU run catches what a multi-GPU run would hit.
    ``device`` defaults to the current CUDA device under NCCL and the CPU otherwise.
    """

    def __init__(
        self,
        name: str,
        ranks: list[int],
        process_group: dist.ProcessGroup | None,
        ledger: CommLedger | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.name = name
        self.ranks = list(ranks)
        self.process_group = process_group
        self.ledger = ledger if ledger is not None else CommLedger()
        self.size = len(self.ranks)
        global_rank = dist.get_rank() if dist.is_initialized() else self.ranks[0]
        self.rank = self.ranks.index(global_rank) if global_rank in self.ranks else -1
        self.device = _normalise_device(device if device is not None else backend_device())
        self.nodes = None  # the ZeRO group's node subgroups (ParallelContext.configure_nodes), else None
        self.p2p_log: list | None = None  # when a list: every batched p2p call is appended (p2p_replay)
        self._gloo = self.size > 1 and dist.is_initialized() and dist.get_backend(process_group) == "gloo"
        self.fast_paths = os.environ.get("MEGAZERO_GLOO_FAST_PATHS", "1") != "0"  # gloo's shortcuts (docstring)
        self.poison = os.environ.get("MEGAZERO_POISON_REDUCE_SCATTER", "0") == "1"  # NaN where NCCL leaves local

    def __repr__(self) -> str:
        return f"Group({self.name!r}, ranks={self.ranks}, rank={self.rank}, device={self.device})"

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def check_device(self, call: str, tag: str, *tensors: torch.Tensor) -> None:
        """Raise if a tensor handed to ``call`` does not live on this group's device."""
        for t in tensors:
            if t.device != self.device:
                raise RuntimeError(
                    f"{call} on the {self.name!r} group (tag {tag!r}) was handed a tensor on {t.device}, but the "
                    f"group's backend works on {self.device}: create the tensor on the group's device "
                    f"(group.device) or move it there with .to(group.device)")

    # -- collectives -------------------------------------------------------------------------------------
    def _record(self, op: str, tag: str, tensor: torch.Tensor, elements: int) -> None:
        """Count a call in the ledger: ``elements`` of ``tensor``'s dtype, over this group's ranks (its link)."""
        self.ledger.record(self.name, op, tag, elements, elements * tensor.element_size(), self.ranks)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", tag: str = "other", async_op: bool = False):
        """In-place all-reduce; counts 2n."""
        self.check_device("all_reduce", tag, tensor)
        if self.size == 1:
            return _Done() if async_op else None
        self._record("all_reduce", tag, tensor, 2 * tensor.numel())
        return dist.all_reduce(tensor, op=_reduce_op(op), group=self.process_group, async_op=async_op)

    def all_gather_into(
        self, output: torch.Tensor, input: torch.Tensor, tag: str = "other", async_op: bool = False
    ):
        """Gather equal shards ``input`` of every rank into the flat ``output`` (rank order); counts the output n."""
        self.check_device("all_gather_into", tag, output, input)
        if self.size == 1:
            if not device_io.same_data(output, input):
                output.copy_(input.view_as(output))
            return _Done() if async_op else None
        self._record("all_gather", tag, output, output.numel())
        if self._gloo and self.fast_paths:  # one broadcast per shard (module docstring)
            n = input.numel()
            mine = output.view(-1)[self.rank * n: (self.rank + 1) * n]
            if not device_io.same_data(mine, input):
                mine.copy_(input.reshape(-1))
            works = [dist.broadcast(output.view(-1)[r * n: (r + 1) * n], src=self.ranks[r],
                                    group=self.process_group, async_op=True) for r in range(self.size)]
            done = _Works(works)
            return done if async_op else done.wait()
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return fn(output, input, group=self.process_group, async_op=async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: str = "sum",
        tag: str = "other",
        async_op: bool = False,
    ):
        """Reduce the flat ``input`` over ranks and leave shard ``rank`` in ``output``; counts the input n."""
        self.check_device("reduce_scatter", tag, output, input)
        if self.size == 1:
            if not device_io.same_data(output, input):
                output.copy_(input.view_as(output))
            return _Done() if async_op else None
        self._record("reduce_scatter", tag, input, input.numel())
        n = output.numel()
        in_place = input.is_contiguous() and device_io.same_data(output, input.view(-1)[self.rank * n:])
        if self._gloo and self.fast_paths and in_place:
            # one reduce per shard to its owner, in place: this rank's shard is then where the output is
            flat = input.view(-1)
            works = [dist.reduce(flat[r * n: (r + 1) * n], dst=self.ranks[r], op=_reduce_op(op),
                                 group=self.process_group, async_op=True) for r in range(self.size)]
            work = _Works(works) if async_op else _Works(works).wait()
        else:
            fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            work = fn(output, input, op=_reduce_op(op), group=self.process_group, async_op=async_op)
        if not (self.poison and in_place and input.is_floating_point()):
            return work
        poisoned = _Poisoned(work, input.view(-1), self.rank * n, n)
        return poisoned if async_op else poisoned.wait()

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, tag: str = "other") -> None:
        """Send the ``r``-th of ``size`` equal row-blocks of ``input`` to group rank ``r``; block ``r`` of
        ``output`` is what rank ``r`` sent here (blocking). Counts the input n (in its bytes)."""
        self.check_device("all_to_all", tag, output, input)
        if self.size == 1:
            if not device_io.same_data(output, input):
                output.copy_(input.view_as(output))
            return
        self._record("all_to_all", tag, input, input.numel())
        dist.all_to_all_single(output, input, group=self.process_group)

    def all_gather_list(self, tensor: torch.Tensor, tag: str = "other") -> list[torch.Tensor]:
        """All-gather into a list of tensors (for small, possibly unequal payloads); counts the output n."""
        self.check_device("all_gather_list", tag, tensor)
        if self.size == 1:
            return [tensor]
        outs = [torch.empty_like(tensor) for _ in range(self.size)]
        self._record("all_gather", tag, tensor, tensor.numel() * self.size)
        dist.all_gather(outs, tensor, group=self.process_group)
        return outs

    def broadcast(self, tensor: torch.Tensor, src: int = 0, tag: str = "other") -> None:
        """Broadcast from group rank ``src``; counts n."""
        self.check_device("broadcast", tag, tensor)
        if self.size == 1:
            return
        self._record("broadcast", tag, tensor, tensor.numel())
        dist.broadcast(tensor, src=self.ranks[src], group=self.process_group)

    def batch_p2p(self, ops: list[P2P], tag: str = "act") -> list:
        """Issue point-to-point operations as ONE batched call (one NCCL group) and return their work handles.

        ``ops`` are ``(kind, tensor, peer, msg_tag)`` with ``kind`` "send" or "recv" and ``peer`` a group
        rank. NCCL matches the k-th send from A to B with the k-th receive at B from A and ignores
        ``msg_tag``; gloo matches by ``msg_tag``. Sends count n each in the ledger.
        """
        for kind, tensor, _peer, _msg_tag in ops:
            self.check_device(kind, tag, tensor)
        if not ops:
            return []
        if self.p2p_log is not None:
            self.p2p_log.append([P2PCall(kind, self.ranks[peer], t.numel() * t.element_size(), msg_tag)
                                 for kind, t, peer, msg_tag in ops])
        if self.size == 1:
            raise RuntimeError(f"point-to-point {ops[0][0]} on the {self.name!r} group of size 1 has no peer")
        for kind, tensor, _peer, _msg_tag in ops:
            if kind == "send":
                self._record("send", tag, tensor, tensor.numel())
        return self._issue_p2p(ops)

    def _issue_p2p(self, ops: list[P2P]) -> list:
        """Issue checked operations as one ``batch_isend_irecv`` (a test group may route them elsewhere)."""
        fns = {"send": dist.isend, "recv": dist.irecv}
        return dist.batch_isend_irecv([dist.P2POp(fns[kind], tensor, self.ranks[peer], self.process_group, msg_tag)
                                       for kind, tensor, peer, msg_tag in ops])

    def isend(self, tensor: torch.Tensor, dst: int, msg_tag: int = 0, tag: str = "act"):
        """Non-blocking send to group rank ``dst``; returns the work handle. Counts n (sends only)."""
        return self.batch_p2p([("send", tensor, dst, msg_tag)], tag=tag)[0]

    def recv(self, tensor: torch.Tensor, src: int, msg_tag: int = 0, tag: str = "act") -> None:
        """Blocking receive from group rank ``src`` into ``tensor``."""
        self.batch_p2p([("recv", tensor, src, msg_tag)], tag=tag)[0].wait()

    def warm_up(self) -> None:
        """Initialise the communicator eagerly with a one-element all-reduce (not counted in the ledger).

        NCCL creates a communicator on its first call; when that call is a batched point-to-point operation,
        every rank of the group must take part in it. Warming up at construction lifts that constraint."""
        if self.size > 1:
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.process_group)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.process_group)


# (kind "send" | "recv", tensor, peer group rank, message tag)
P2P = tuple[str, torch.Tensor, int, int]


def backend_device(process_group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a group's collectives work on: the current CUDA device under NCCL, the CPU otherwise."""
    if dist.is_initialized():
        backend = str(dist.get_backend(process_group) if process_group is not None else dist.get_backend())
        if "nccl" in backend.lower() and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _normalise_device(device: torch.device | str) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


class _Done:
    """Stand-in work handle for collectives that a group of one skips."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class _Works:
    """One handle for several asynchronous collectives."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class _Poisoned:
    """A reduce-scatter's handle that, once waited on, fills its input outside this rank's part ``[lo, lo + n)``
    with NaN (``Group.poison``)."""

    def __init__(self, work, flat: torch.Tensor, lo: int, n: int) -> None:
        self.work, self.flat, self.lo, self.n = work, flat, lo, n

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.flat is not None:
            self.flat[: self.lo].fill_(float("nan"))
            self.flat[self.lo + self.n:].fill_(float("nan"))
            self.flat = None

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


def _reduce_op(op: str) -> dist.ReduceOp:
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {sorted(ops)}")
    return ops[op]
