"""Process-group start-up and the collective wrappers that every part of megazero goes through.

Two things live here:

* :func:`init_distributed` starts ``torch.distributed`` from torchrun or SLURM environment variables (or as a
  single process when neither is present), picking gloo on CPU and nccl on CUDA, with a timeout that bounds
  every collective so that a missing peer ends the job with an error instead of a hang.
* :class:`Group` wraps one process group together with a :class:`CommLedger`. Leaf code receives a ``Group``
  (``tp_group``, ``dp_group``...) and calls ``group.all_reduce(t)``; the wrapper picks whichever collective the
  installed torch offers (``all_gather_single`` on newer releases, ``all_gather_into_tensor`` on older ones) and
  records the logical volume of the call the way the ZeRO paper counts it: an all-reduce of n elements counts
  2n, a reduce-scatter its full input n, an all-gather its full output n, a broadcast n.

On gloo (CPU ranks) two collectives take a faster road to the same result, measured at 4 ranks on 48M fp32
elements (CPU time summed over ranks): gloo's reduce-scatter copies its input, all-reduces and copies out (760
ms, twice its all-reduce's 380), so an in-place reduce-scatter (the output is this rank's slice of the input,
ZeRO's pattern) all-reduces the input in place, which leaves the rank's shard where it belongs (and the rest of
the input reduced too: ZeRO's inputs are scratch); gloo's all-gather (570 ms) gives way to one broadcast per
rank's shard into the output (165 ms). The ledger still counts the logical reduce-scatter and all-gather (the
bytes gloo moves for the all-reduce are 2n). NCCL always runs the collectives themselves.
"""

from __future__ import annotations

import datetime
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megazero import host

__all__ = [
    "CommLedger",
    "DistEnv",
    "Group",
    "backend_device",
    "destroy_distributed",
    "detect_env",
    "init_distributed",
]

# Tags say what a collective moves; the DP volume of the ZeRO formulas counts "grad" and "param" only.
VOLUME_TAGS = ("grad", "param")


@dataclass
class CommLedger:
    """Counts the logical volume (in elements) of every collective this rank joins.

    Entries are keyed by (group name, op, tag). :meth:`mark_step` closes an optimizer step so that per-step
    figures can be read with :meth:`last_step`.
    """

    totals: dict[tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    _at_step_start: dict[tuple[str, str, str], int] = field(default_factory=dict)
    _last_step: dict[tuple[str, str, str], int] = field(default_factory=dict)
    steps: int = 0

    def record(self, group: str, op: str, tag: str, elements: int) -> None:
        key = (group, op, tag)
        self.totals[key] += int(elements)
        self.calls[key] += 1

    def mark_step(self) -> None:
        """Close one optimizer step: what was recorded since the previous mark becomes :meth:`last_step`."""
        self._last_step = {k: v - self._at_step_start.get(k, 0) for k, v in self.totals.items()}
        self._last_step = {k: v for k, v in self._last_step.items() if v}
        self._at_step_start = dict(self.totals)
        self.steps += 1

    def last_step(self) -> dict[tuple[str, str, str], int]:
        """Elements per (group, op, tag) moved during the last closed step."""
        return dict(self._last_step)

    def dp_volume_last_step(self) -> int:
        """DP-group elements of gradients and parameters in the last step: the figure ZeRO's formulas predict."""
        return sum(v for (g, _op, tag), v in self._last_step.items() if g == "dp" and tag in VOLUME_TAGS)

    def breakdown_last_step(self) -> dict[str, int]:
        """The last step as ``{"group/op/tag": elements}``, for metrics.jsonl."""
        return {f"{g}/{op}/{tag}": v for (g, op, tag), v in sorted(self._last_step.items())}


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
        self.p2p_log: list | None = None  # when a list: every batched p2p call is appended (p2p_replay)
        self._gloo = self.size > 1 and dist.is_initialized() and dist.get_backend(process_group) == "gloo"

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
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", tag: str = "other", async_op: bool = False):
        """In-place all-reduce; counts 2n."""
        self.check_device("all_reduce", tag, tensor)
        if self.size == 1:
            return _Done() if async_op else None
        self.ledger.record(self.name, "all_reduce", tag, 2 * tensor.numel())
        return dist.all_reduce(tensor, op=_reduce_op(op), group=self.process_group, async_op=async_op)

    def all_gather_into(
        self, output: torch.Tensor, input: torch.Tensor, tag: str = "other", async_op: bool = False
    ):
        """Gather equal shards ``input`` of every rank into the flat ``output`` (rank order); counts the output n."""
        self.check_device("all_gather_into", tag, output, input)
        if self.size == 1:
            if not host.same_data(output, input):
                output.copy_(input.view_as(output))
            return _Done() if async_op else None
        self.ledger.record(self.name, "all_gather", tag, output.numel())
        if self._gloo:  # one broadcast per shard (module docstring)
            n = input.numel()
            mine = output.view(-1)[self.rank * n: (self.rank + 1) * n]
            if not host.same_data(mine, input):
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
            if not host.same_data(output, input):
                output.copy_(input.view_as(output))
            return _Done() if async_op else None
        self.ledger.record(self.name, "reduce_scatter", tag, input.numel())
        n = output.numel()
        if self._gloo and input.is_contiguous() and host.same_data(output, input.view(-1)[self.rank * n:]):
            # in place: all-reduce the input, this rank's shard is then where the output is (module docstring)
            return dist.all_reduce(input, op=_reduce_op(op), group=self.process_group, async_op=async_op)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return fn(output, input, op=_reduce_op(op), group=self.process_group, async_op=async_op)

    def all_gather_list(self, tensor: torch.Tensor, tag: str = "other") -> list[torch.Tensor]:
        """All-gather into a list of tensors (for small, possibly unequal payloads); counts the output n."""
        self.check_device("all_gather_list", tag, tensor)
        if self.size == 1:
            return [tensor]
        outs = [torch.empty_like(tensor) for _ in range(self.size)]
        self.ledger.record(self.name, "all_gather", tag, tensor.numel() * self.size)
        dist.all_gather(outs, tensor, group=self.process_group)
        return outs

    def broadcast(self, tensor: torch.Tensor, src: int = 0, tag: str = "other") -> None:
        """Broadcast from group rank ``src``; counts n."""
        self.check_device("broadcast", tag, tensor)
        if self.size == 1:
            return
        self.ledger.record(self.name, "broadcast", tag, tensor.numel())
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
            from megazero.pipeline.p2p_replay import P2PCall

            self.p2p_log.append([P2PCall(kind, self.ranks[peer], t.numel() * t.element_size(), msg_tag)
                                 for kind, t, peer, msg_tag in ops])
        if self.size == 1:
            raise RuntimeError(f"point-to-point {ops[0][0]} on the {self.name!r} group of size 1 has no peer")
        for kind, tensor, _peer, _msg_tag in ops:
            if kind == "send":
                self.ledger.record(self.name, "send", tag, tensor.numel())
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


def _reduce_op(op: str) -> dist.ReduceOp:
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {sorted(ops)}")
    return ops[op]


# ---------------------------------------------------------------------------------------------------------
# Start-up
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DistEnv:
    """Where this process sits, as read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist such as ``node[003-005,010],gpu7`` -> ``node003``."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        return nodelist
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def detect_env(environ: dict[str, str] | None = None) -> DistEnv:
    """Read rank and world size from torchrun (``RANK``/``WORLD_SIZE``) or SLURM (``SLURM_PROCID``...)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_NODELIST", "127.0.0.1")),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="slurm",
        )
    return DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0, launcher="single")


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str | None = None, timeout_s: float = 300.0) -> DistEnv:
    """Start the default process group (once) and return where this process sits.

    ``timeout_s`` bounds every collective: a rank whose peer has died fails with an error after at most that
    long. A single process without launcher variables gets a world of one over an in-memory store.
    """
    env = detect_env()
    if dist.is_initialized():
        return env
    backend = backend or default_backend()
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    if env.launcher == "single":
        store: dist.Store = dist.HashStore()
    elif env.launcher == "slurm":
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=env.rank == 0,
                              timeout=timeout, wait_for_workers=False)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent store outlives a restart and workers use it without a per-attempt prefix, so a
        # restarted worker can read a dead worker's address from the previous attempt (pytorch#135712):
        # give every attempt (--max-restarts) its own keys.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"megazero/attempt_{attempt}", dist.TCPStore(
            env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout))
    else:
        store = None
    if store is None:
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
    return env


def destroy_distributed() -> None:
    """Tear the default group down, tolerating a peer that already left (gloo's shutdown race)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - nothing useful to do at shutdown
            pass
