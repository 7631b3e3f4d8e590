"""Pipeline schedules as explicit timelines: the ordered forward/backward actions of each pipeline rank.

A schedule is a pure function of (pp size, this rank, micro-batch count m, virtual stages V) returning a list
of :class:`Action`. The executor (:mod:`.executor`) runs it with point-to-point communication; the simulator
here (:func:`simulate`) replays all ranks' timelines with unit costs to count bubbles and in-flight
micro-batches without any wall clock.

* ``gpipe``: all m forwards, then all m backwards. Holds m micro-batches' activations.
* ``1f1b``: ``pp - rank - 1`` warm-up forwards, then one forward / one backward, then cool-down backwards.
  Holds at most ``pp - rank`` micro-batches' activations; same bubble as GPipe, (p - 1) / m.
* ``interleaved``: 1F1B over V model chunks per rank (Megatron-LM); the bubble shrinks to (1/V)(p - 1)/m.
  Needs m divisible by pp.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SCHEDULES", "Action", "ScheduleError", "SimResult", "build_schedule", "simulate", "transfer_units"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class ScheduleError(ValueError):
    """A schedule that cannot run with the given sizes."""


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    micro_batch: int
    chunk: int = 0  # model chunk on this rank (virtual stage chunk * pp + rank)


def _gpipe(pp: int, rank: int, m: int) -> list[Action]:
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def _one_f_one_b(pp: int, rank: int, m: int) -> list[Action]:
    warmup = min(pp - rank - 1, m)
    out = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        out += [Action("F", warmup + i), Action("B", i)]
    out += [Action("B", i) for i in range(m - warmup, m)]
    return out


def _interleaved(pp: int, rank: int, m: int, v: int) -> list[Action]:
    if m % pp:
        raise ScheduleError(
            f"the interleaved schedule needs the number of micro-batches per step ({m}) to be a multiple of --pp"
            f" ({pp}); change --global-batch-size/--micro-batch-size or use --pp-schedule 1f1b")
    total = m * v

    def fwd(k: int) -> Action:  # the k-th forward: groups of pp micro-batches, chunk by chunk
        group, pos = divmod(k, pp * v)
        return Action("F", group * pp + pos % pp, pos // pp)

    def bwd(k: int) -> Action:
        group, pos = divmod(k, pp * v)
        return Action("B", group * pp + pos % pp, v - 1 - pos // pp)

    warmup = _interleaved_warmup(pp, rank, m, v)
    out = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [fwd(warmup + k), bwd(k)]
    out += [bwd(k) for k in range(total - warmup, total)]
    return out


def _interleaved_warmup(pp: int, rank: int, m: int, v: int) -> int:
    return min((pp - rank - 1) * 2 + (v - 1) * pp, m * v)


def transfer_units(name: str, pp: int, rank: int, micro_batches: int, virtual_stages: int = 1) -> list[list[int]]:
    """How rank ``rank``'s timeline (:func:`build_schedule`) groups into units that compute without
    communicating in between (indices into the action list), for :func:`~megazero.pipeline.p2p.transfer_plan`.

    Every action is its own unit, except in the interleaved schedule's steady state, where each forward and
    the backward after it form one unit (Megatron-LM's interleaved communication pattern): the per-action
    pairing deadlocks around the interleaved schedule's ring (last rank -> first) under NCCL's ordering.
    """
    n = len(build_schedule(name, pp, rank, micro_batches, virtual_stages))
    if name != "interleaved" or pp == 1:
        return [[i] for i in range(n)]
    warmup = _interleaved_warmup(pp, rank, micro_batches, virtual_stages)
    steady = micro_batches * virtual_stages - warmup
    return ([[i] for i in range(warmup)] + [[warmup + 2 * k, warmup + 2 * k + 1] for k in range(steady)]
            + [[i] for i in range(warmup + 2 * steady, n)])


def build_schedule(name: str, pp: int, rank: int, micro_batches: int, virtual_stages: int = 1) -> list[Action]:
    """The ordered actions of pipeline rank ``rank``."""
    if micro_batches < 1:
        raise ScheduleError(f"need at least one micro-batch per step, got {micro_batches}")
    if name == "gpipe":
        return _gpipe(pp, rank, micro_batches)
    if name == "1f1b":
        return _one_f_one_b(pp, rank, micro_batches)
    if name == "interleaved":
        if virtual_stages < 2 and pp > 1:
            raise ScheduleError("--pp-schedule interleaved needs --virtual-stages >= 2")
        return _interleaved(pp, rank, micro_batches, virtual_stages)
    raise ScheduleError(f"unknown --pp-schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


@dataclass
class SimResult:
    makespan: float  # time until the last rank finishes, in units of one micro-batch's full-model forward
    busy: float  # time each rank computes (the same on every rank)
    bubble_fraction: float  # idle time / compute time, per rank (the same on every rank)
    peak_in_flight: list[float]  # per rank: most micro-batches whose activations are held at once


def simulate(name: str, pp: int, micro_batches: int, virtual_stages: int = 1, forward_cost: float = 1.0,
             backward_cost: float = 2.0) -> SimResult:
    """Replay every rank's timeline with unit costs and dependencies; count idle time and live activations.

    A micro-batch's forward through one rank's share of the model costs ``forward_cost`` (split evenly over
    its chunks), its backward ``backward_cost``. An action waits for its data dependency on the neighbouring
    virtual stage and for the previous action of its own rank; communication is free.
    """
    v = virtual_stages
    n_virtual = pp * v
    tf, tb = forward_cost / v, backward_cost / v
    timelines = [build_schedule(name, pp, r, micro_batches, v) for r in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, virtual stage) -> finish time
    clock = [0.0] * pp
    pos = [0] * pp
    live = [0.0] * pp
    peak = [0.0] * pp
    remaining = sum(len(t) for t in timelines)
    while remaining:
        progressed = False
        for r in range(pp):
            while pos[r] < len(timelines[r]):
                a = timelines[r][pos[r]]
                vs = a.chunk * pp + r
                if a.kind == "F":
                    dep = ("F", a.micro_batch, vs - 1) if vs > 0 else None
                else:
                    dep = ("B", a.micro_batch, vs + 1) if vs < n_virtual - 1 else ("F", a.micro_batch, vs)
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done[dep] if dep else 0.0)
                clock[r] = start + (tf if a.kind == "F" else tb)
                done[(a.kind, a.micro_batch, vs)] = clock[r]
                live[r] += (1.0 if a.kind == "F" else -1.0) / v
                peak[r] = max(peak[r], live[r])
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError(f"schedule {name!r} deadlocks at pp={pp}, m={micro_batches}, v={v}")
    makespan = max(clock)
    busy = micro_batches * (forward_cost + backward_cost)
    return SimResult(makespan=makespan, busy=busy, bubble_fraction=(makespan - busy) / busy, peak_in_flight=peak)
