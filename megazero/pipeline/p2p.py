"""Point-to-point transfer of activations (forward) and their gradients (backward) between pipeline stages.

**Order that NCCL accepts.** NCCL matches the k-th send from rank A to rank B with the k-th receive at B from A
(tags are ignored), runs a communicator's operations in issue order, and a large send does not complete before
its receive is posted. Issuing each send and each receive as its own call deadlocks 1F1B: at pp 2, rank 0
issues send F1 and then waits in recv B0 while rank 1 sits in send B0 before its recv F1. So the executor
communicates only at the points *between* two actions of its timeline, and at each point does everything in
ONE batched call (one NCCL group): the sends that the previous action produced and the receives that the
next action needs. In 1F1B's steady state that is Megatron-LM's send_forward_recv_backward after a forward
and send_backward_recv_forward after a backward. The interleaved schedule's ring (the last rank feeds the
first) needs more: in its steady state a forward and the following backward form one unit, and one call
between units sends both results and receives both inputs of the next unit (Megatron-LM's
send_forward_backward_recv_forward_backward); per-action pairing deadlocks there at m >= 2pp. zbv's V (rank r
runs virtual stages r and 2p - 1 - r) sends chunk 0's activations up and chunk 1's down the same links, and a
receiver consumes them in another order than its neighbour produces them, which no unit grouping repairs: its
calls follow the list scheduler's ticks instead (one call per tick:
:func:`~megazero.pipeline.schedules.transfer_ticks`), and the turn at rank p - 1 (chunk 0 to chunk 1, and its
gradient back) stays in the process. :func:`transfer_plan` computes these calls as a pure function of the
timeline, so a test can replay every rank's plan under NCCL's rules
(:mod:`megazero.pipeline.p2p_replay`) without starting a process; ``paired=False`` gives the old one-op-per-
call order as a negative case.

Shapes are known up front ([micro-batch, sequence or its TP shard under SP, hidden]), so a receiver allocates
its buffer without a handshake. Every message also carries a tag made of its direction, micro-batch and the
receiving model chunk: gloo matches by it, and the replay uses it to check that NCCL's order-based matching
would deliver every message where it belongs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from megazero.distributed.group import Group
from megazero.pipeline.schedules import Action, virtual_stage

__all__ = ["PipelineP2P", "Transfer", "action_transfers", "forward_actions", "last_stage_rank", "received_waiting", "stage_holder",
           "transfer_plan"]


@dataclass(frozen=True)
class Transfer:
    """One point-to-point operation of a pipeline rank."""

    op: str  # "send" or "recv"
    direction: str  # "F": an activation travelling to the next stage; "B": a gradient travelling back
    peer: int  # pipeline-group rank of the other side
    micro_batch: int
    chunk: int  # the RECEIVING rank's model chunk: names the message identically on both sides

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.direction, self.micro_batch, self.chunk)


def forward_actions(actions: Sequence[Action]) -> list[Action]:
    """The timeline without its backwards (evaluation): the forwards keep the schedule's order."""
    return [a for a in actions if a.kind == "F"]


def stage_holder(schedule: str, pp_size: int, virtual_stages: int, stage: int) -> tuple[int, int]:
    """(pipeline rank, model chunk) that runs virtual stage ``stage``: the inverse of
    :func:`~megazero.pipeline.schedules.virtual_stage` (in closed form: it runs per action, every step)."""
    if not 0 <= stage < pp_size * virtual_stages:
        raise ValueError(f"no rank runs virtual stage {stage} of {pp_size} x {virtual_stages} under {schedule!r}")
    if schedule == "zbv":
        return (stage, 0) if stage < pp_size else (2 * pp_size - 1 - stage, 1)
    return stage % pp_size, stage // pp_size


def last_stage_rank(schedule: str, pp_size: int, virtual_stages: int) -> int:
    """The pipeline rank holding the last stage (the loss, the logits): ``pp - 1``, or 0 under zbv's V."""
    return stage_holder(schedule, pp_size, virtual_stages, pp_size * virtual_stages - 1)[0]


def action_transfers(a: Action, pp_rank: int, pp_size: int, virtual_stages: int,
                     schedule: str = "") -> tuple[Transfer | None, Transfer | None]:
    """(the receive action ``a`` needs before it runs, the send it produces) on rank ``pp_rank``; a W
    (the weight-gradient half of a split backward) has neither. A transfer whose ``peer`` is ``pp_rank`` itself
    is local: two consecutive virtual stages on one rank (zbv's turn at rank p - 1, chunk 0 -> chunk 1, and its
    gradient back), handed over in process by the executor and left out of :func:`transfer_plan`."""
    if a.kind == "W":
        return None, None
    vs, last = virtual_stage(schedule, pp_size, pp_rank, a.chunk), pp_size * virtual_stages - 1
    nxt = stage_holder(schedule, pp_size, virtual_stages, vs + 1) if vs < last else None
    prv = stage_holder(schedule, pp_size, virtual_stages, vs - 1) if vs > 0 else None
    if a.kind == "F":
        recv = Transfer("recv", "F", prv[0], a.micro_batch, a.chunk) if prv else None
        send = Transfer("send", "F", nxt[0], a.micro_batch, nxt[1]) if nxt else None
    else:
        recv = Transfer("recv", "B", nxt[0], a.micro_batch, a.chunk) if nxt else None
        send = Transfer("send", "B", prv[0], a.micro_batch, prv[1]) if prv else None
    return recv, send


def transfer_plan(actions: Sequence[Action], pp_rank: int, pp_size: int, virtual_stages: int = 1,
                  units: Sequence[Sequence[int]] | None = None, paired: bool = True,
                  schedule: str = "", ticks: Mapping[tuple[str, int, int], int] | None = None
                  ) -> list[list[list[Transfer]]]:
    """The batched point-to-point calls of one rank's timeline.

    ``units`` splits the action indices into consecutive runs that compute without communicating in between
    (default: every action alone; :func:`~megazero.pipeline.schedules.transfer_units` gives the
    interleaved schedule's steady-state forward/backward pairs). Returns ``len(actions) + 1`` slots: slot
    ``i`` lists the calls made just before action ``i`` (the last slot: after the final action), each call a
    list of transfers issued together. With ``paired`` (the default) there is one call before each unit: the
    sends the previous unit produced together with the receives this unit needs. ``paired=False``
    reproduces the old order (every send its own call right after its action, every receive its own call
    right before), which deadlocks under NCCL; it is kept for the replay tests' negative case. ``schedule``
    names the placement of virtual stages (:func:`~megazero.pipeline.schedules.virtual_stage`: "zbv" for the
    V); local transfers (:func:`action_transfers`) are left out. ``ticks`` (zbv:
    :func:`~megazero.pipeline.schedules.transfer_ticks`, every rank's start tick per (kind, micro-batch, virtual
    stage)) replaces ``units``: one call per tick in which this rank sends or receives, holding the sends of its
    action of that tick and the receives of what its neighbours produced in it, made before this rank's first
    action of a later tick.
    """
    slots: list[list[list[Transfer]]] = [[] for _ in range(len(actions) + 1)]
    if pp_size == 1:
        return slots
    io = [tuple(t if t is not None and t.peer != pp_rank else None  # local hand-overs: no call
                for t in action_transfers(a, pp_rank, pp_size, virtual_stages, schedule)) for a in actions]
    if not paired:
        for i, (recv, send) in enumerate(io):
            slots[i] += [[recv]] if recv is not None else []
            slots[i + 1] += [[send]] if send is not None else []
        return slots
    if ticks is not None:
        return _tick_plan(actions, io, pp_rank, pp_size, schedule, ticks, slots)
    units = [[i] for i in range(len(actions))] if units is None else units
    if [i for u in units for i in u] != list(range(len(actions))):
        raise ValueError(f"transfer units {units} do not cover the {len(actions)} actions in order")
    pending: list[Transfer] = []
    for unit in units:
        ops = pending + [io[i][0] for i in unit if io[i][0] is not None]
        if ops:
            slots[unit[0]].append(ops)
        pending = [io[i][1] for i in unit if io[i][1] is not None]
    if pending:
        slots[-1].append(pending)
    return slots


def _tick_plan(actions: Sequence[Action], io: Sequence[tuple[Transfer | None, Transfer | None]], pp_rank: int,
               pp_size: int, schedule: str, ticks: Mapping[tuple[str, int, int], int],
               slots: list[list[list[Transfer]]]) -> list[list[list[Transfer]]]:
    """:func:`transfer_plan` by ticks: every transfer in the call of its producer's tick."""
    vs = [virtual_stage(schedule, pp_size, pp_rank, a.chunk) for a in actions]
    at = [ticks[(a.kind, a.micro_batch, s)] for a, s in zip(actions, vs)]
    calls: dict[int, list[Transfer]] = {}
    for a, s, t, (recv, send) in zip(actions, vs, at, io):
        if send is not None:
            calls.setdefault(t, []).append(send)
        if recv is not None:  # produced by the neighbouring virtual stage's F (forward) or B (backward)
            calls.setdefault(ticks[(a.kind, a.micro_batch, s - 1 if a.kind == "F" else s + 1)], []).append(recv)
    for t in sorted(calls):
        slot = next((i for i, u in enumerate(at) if u > t), len(actions))
        slots[slot].append(calls[t])
    return slots


def received_waiting(actions: Sequence[Action], plan: Sequence[Sequence[Sequence[Transfer]]], pp_rank: int,
                     pp_size: int, virtual_stages: int = 1, schedule: str = "") -> list[int]:
    """How many received boundary tensors ([micro, seq, hidden]) wait in a rank's inbox just before each of its
    ``actions`` runs, after the calls ``plan`` (:func:`transfer_plan`) makes there and the local hand-overs of
    the actions before it (zbv's turn). An action takes its one input out. 1F1B and zb-h1 hold one at a time;
    a call that receives for several later actions (interleaved's units, zbv's ticks) holds more: memory that
    neither the saved activations nor the W stashes include (:func:`megazero.plan.estimate.peak_bytes` counts it)."""
    held, out = 0, []
    for a, calls in zip(actions, plan):
        held += sum(t.op == "recv" for call in calls for t in call)
        out.append(held)
        recv, send = action_transfers(a, pp_rank, pp_size, virtual_stages, schedule)
        held += (send is not None and send.peer == pp_rank) - (recv is not None)
    return out


class PipelineP2P:
    """Exchanges activations and gradients with the neighbouring pipeline ranks, one batched call at a time.

    The pipeline group's communicator is initialised eagerly at construction (a one-element all-reduce),
    so its first batched point-to-point call need not include every rank of the group (NCCL's rule).
    """

    def __init__(self, pp_group: Group, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 virtual_stages: int = 1) -> None:
        self.group = pp_group
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.virtual_stages = virtual_stages
        pp_group.warm_up()

    def _tag(self, t: Transfer) -> int:
        return (t.micro_batch * self.virtual_stages + t.chunk) * 2 + int(t.direction == "B")

    def exchange(self, call: list[Transfer], outbox: dict[tuple[str, int, int], torch.Tensor]
                 ) -> dict[tuple[str, int, int], torch.Tensor]:
        """Issue ``call`` as one batched operation and wait for it; returns the received tensors by message.

        Each send's tensor is taken out of ``outbox`` (keyed like :attr:`Transfer.key`)."""
        ops, received = [], {}
        for t in call:
            if t.op == "send":
                ops.append(("send", outbox.pop(t.key).detach().contiguous(), t.peer, self._tag(t)))
            else:
                buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                received[t.key] = buf
                ops.append(("recv", buf, t.peer, self._tag(t)))
        for work in self.group.batch_p2p(ops, tag="act"):
            work.wait()
        return received
