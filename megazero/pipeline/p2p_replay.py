"""Record point-to-point calls and replay them under NCCL's matching rules, to find deadlocks without a GPU.

gloo buffers sends and matches messages by tag, so an order that deadlocks on GPUs runs fine on the CPU.
This module makes NCCL's rules checkable on the CPU:

* :func:`record_p2p` turns on recording for a :class:`~megazero.distributed.group.Group`: every batched call
  (:meth:`~megazero.distributed.group.Group.batch_p2p`) is appended, in issue order, as one *group* of
  :class:`P2PCall` (peer as a global rank, bytes, message tag).
* :func:`plan_calls` turns :func:`~megazero.pipeline.p2p.transfer_plan` slots into the same form, so the
  executor's plan for every rank can be replayed without starting a process.
* :func:`replay` runs every rank's groups under NCCL's rules: the k-th send from A to B matches the k-th
  receive at B from A (tags ignored); a rank's groups run one after another; an operation completes when its
  match is in the peer's current group; a group completes when all its operations have. The replay either
  completes or reports the ranks that are stuck and what each waits for. It also reports where order-based
  matching would deliver a message into the wrong buffer (different tag or size): gloo would not notice.

The replay is event-driven and linear in the number of operations, for plans of hundreds of ranks.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from megazero.distributed.group import Group, P2PCall
from megazero.pipeline.p2p import Transfer

__all__ = ["P2PCall", "ReplayResult", "plan_calls", "record_p2p", "replay"]


def record_p2p(group: Group) -> list[list[P2PCall]]:
    """Start recording ``group``'s batched point-to-point calls; returns the (live) list they are appended to."""
    log: list[list[P2PCall]] = []
    group.p2p_log = log
    return log


def plan_calls(slots: Sequence[Sequence[Sequence[Transfer]]], peer_ranks: Sequence[int],
               nbytes: int = 1) -> list[list[P2PCall]]:
    """The calls of one rank's :func:`~megazero.pipeline.p2p.transfer_plan`, with pipeline ranks mapped to
    global ranks through ``peer_ranks`` and the message (direction, micro-batch, chunk) as tag."""
    return [[P2PCall(t.op, peer_ranks[t.peer], nbytes, t.key) for t in call] for slot in slots for call in slot]


@dataclass
class ReplayResult:
    """What the replay found. ``completed``: every rank ran all its groups; ``stuck``: rank -> description of
    the group it cannot finish; ``mismatches``: messages order-based matching would misdeliver or leave
    unmatched; ``groups_done``: per rank, how many of its groups completed."""

    completed: bool
    groups_done: dict[int, int]
    stuck: dict[int, str] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.completed and not self.mismatches

    def __str__(self) -> str:
        if self.ok:
            return "replay completed"
        lines = ["replay " + ("completed with mismatches" if self.completed else "deadlocked")]
        lines += [f"  rank {r}: {d}" for r, d in sorted(self.stuck.items())[:8]]
        lines += [f"  {m}" for m in self.mismatches[:8]]
        return "\n".join(lines)


def replay(calls: Mapping[int, Sequence[Sequence[P2PCall]]]) -> ReplayResult:
    """Replay every rank's recorded groups (``rank -> [group, ...]``) under NCCL's point-to-point rules."""
    ranks = sorted(calls)
    # where each operation sits: (rank, group index, index in group); matching by channel and position k
    sends: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)  # (src, dst) -> k-th send
    recvs: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)  # (src, dst) -> k-th recv
    for r in ranks:
        for g, group in enumerate(calls[r]):
            for i, op in enumerate(group):
                if op.kind == "send":
                    sends[(r, op.peer)].append((r, g, i))
                elif op.kind == "recv":
                    recvs[(op.peer, r)].append((r, g, i))
                else:
                    raise ValueError(f"rank {r} group {g}: unknown operation kind {op.kind!r}")
    match: dict[tuple[int, int, int], tuple[int, int, int]] = {}
    mismatches: list[str] = []
    for chan in sorted(set(sends) | set(recvs)):
        ss, rs = sends.get(chan, []), recvs.get(chan, [])
        for k, (s, rv) in enumerate(zip(ss, rs)):
            match[s], match[rv] = rv, s
            so, ro = calls[s[0]][s[1]][s[2]], calls[rv[0]][rv[1]][rv[2]]
            if so.nbytes != ro.nbytes or so.tag != ro.tag:
                mismatches.append(f"send #{k} {chan[0]}->{chan[1]} ({so.tag}, {so.nbytes} B) is matched by receive "
                                  f"({ro.tag}, {ro.nbytes} B)")
        if len(ss) != len(rs):
            mismatches.append(f"{chan[0]}->{chan[1]}: {len(ss)} sends but {len(rs)} receives")

    cur = {r: 0 for r in ranks}
    left = {r: 0 for r in ranks}  # operations of the current group not yet matched
    done: set[tuple[int, int, int]] = set()
    ready: deque[int] = deque()

    def enter(r: int) -> None:
        """Rank ``r`` starts its current group: match every operation whose peer is in the right group."""
        g = cur[r]
        if g >= len(calls[r]):
            return
        left[r] = sum((r, g, i) not in done for i in range(len(calls[r][g])))
        for i in range(len(calls[r][g])):
            op = (r, g, i)
            other = match.get(op)
            if other is None or op in done or cur[other[0]] != other[1]:
                continue
            done.add(op)
            done.add(other)
            left[r] -= 1
            left[other[0]] -= 1
            if left[other[0]] == 0:
                ready.append(other[0])
        if left[r] == 0:
            ready.append(r)

    for r in ranks:
        enter(r)
    while ready:
        r = ready.popleft()
        if cur[r] < len(calls[r]) and left[r] == 0:
            cur[r] += 1
            enter(r)
    stuck = {}
    for r in ranks:
        if cur[r] < len(calls[r]):
            g = cur[r]
            waits = [f"{op.kind} {'to' if op.kind == 'send' else 'from'} {op.peer} {op.tag}"
                     for i, op in enumerate(calls[r][g]) if (r, g, i) not in done]
            stuck[r] = f"group {g} of {len(calls[r])} waits on " + ", ".join(waits)
    return ReplayResult(completed=not stuck, groups_done=dict(cur), stuck=stuck, mismatches=mismatches)
