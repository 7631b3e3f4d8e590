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
* ``zb-h1`` and ``zbv``: zero-bubble schedules (Qi et al., arXiv 2401.10241 and 2405.15362). The backward is
  split: ``B`` computes the input gradient only (sent upstream at once), ``W`` the weight gradients, later, in
  the slots where 1F1B idles. Built by :func:`_zero_bubble`, a unit-cost list scheduler over every rank at
  once (F = B = W): a rank runs a ready ``B`` first, else a forward while it holds fewer than 1F1B's
  ``pp - rank`` micro-batches between F and B and fewer than ``min(pp + 1, pp - rank + 3)`` between F and W,
  else its oldest pending ``W``. A W stash (each linear's input and output gradient) weighs about what a
  micro-batch saves for its backward, so no rank holds more than 1F1B's first stage plus one micro-batch, and
  the last stage (whose micro-batches are the heaviest: the logits) at most three W stashes beyond its own
  1F1B count. ``zb-h1`` keeps 1F1B's stage layout and cuts the bubble to 1/3 to 4/9 of 1F1B's at pp 4.
  ``zbv`` runs two chunks per rank in a V (rank r holds virtual stages r and 2p - 1 - r, so the first and
  the last stage sit on rank 0 and the turn at rank p - 1 needs no transfer) with at most 2p chunk
  activations between F and W per rank, 1F1B's peak, and about 2/9 of 1F1B's bubble at pp 4.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SCHEDULES", "SPLIT_SCHEDULES", "Action", "ScheduleError", "SimResult", "build_schedule", "simulate",
           "transfer_ticks", "transfer_units", "virtual_stage"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
SPLIT_SCHEDULES = ("zb-h1", "zbv")  # their backward is split into B (input gradient) and W (weight gradients)
W_SLACK = 3  # zb-h1: W stashes a rank may hold beyond its 1F1B in-flight micro-batches (and at most p + 1 in all)


class ScheduleError(ValueError):
    """A schedule that cannot run with the given sizes."""


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B" (the whole backward; in SPLIT_SCHEDULES the input gradient only) or "W"
    micro_batch: int
    chunk: int = 0  # model chunk on this rank (virtual stage: :func:`virtual_stage`)


def virtual_stage(name: str, pp: int, rank: int, chunk: int) -> int:
    """The virtual stage that chunk ``chunk`` of rank ``rank`` runs: ``chunk * pp + rank`` (Megatron-LM's
    interleaving), or for ``zbv`` the V: chunk 0 is stage ``rank``, chunk 1 stage ``2 pp - 1 - rank``."""
    if name == "zbv":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def _zero_bubble(name: str, pp: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's timeline of a zero-bubble schedule, placed by a list scheduler in unit time (module
    docstring). Pure and deterministic: every rank computes the same plan and takes its own row."""
    return _zero_bubble_plan(name, pp, m)[0]


def transfer_ticks(name: str, pp: int, micro_batches: int) -> dict[tuple[str, int, int], int] | None:
    """For ``zbv``: the unit-time tick at which the list scheduler starts each action, keyed by (kind,
    micro-batch, virtual stage), for every rank; None for the other schedules.

    zbv's transfers are grouped by tick (:func:`~megazero.pipeline.p2p.transfer_plan`): after tick t every rank
    sends what it produced in t and receives what its neighbours produced in t, in one batched call. Per-action
    pairing (the receive posted just before the action that needs it) fails there under NCCL's order-based
    matching: in the V a link carries forwards of chunk 0 and gradients of chunk 1 both ways, and the receiver
    consumes them in another order than the sender produces them (the replay shows misdelivered messages and a
    deadlock from pp 2, m 3 on). Each link carries at most one message per direction per tick, and every rank's
    calls follow the tick order, so the k-th send always meets the k-th receive and no call waits on a later one.
    """
    if name != "zbv" or pp == 1:
        return None
    return dict(_zero_bubble_plan(name, pp, micro_batches)[1])


@functools.lru_cache(maxsize=256)
def _zero_bubble_plan(name: str, pp: int, m: int
                      ) -> tuple[tuple[tuple[Action, ...], ...], tuple[tuple[tuple[str, int, int], int], ...]]:
    """(every rank's timeline, the start tick of each (kind, micro-batch, virtual stage)): :func:`_zero_bubble`."""
    v = 2 if name == "zbv" else 1
    n = pp * v
    rank_of, chunk_of = {}, {}
    for r in range(pp):
        for c in range(v):
            vs = virtual_stage(name, pp, r, c)
            rank_of[vs], chunk_of[vs] = r, c
    own = [[vs for vs in range(n) if rank_of[vs] == r] for r in range(pp)]
    in_fb, in_fw = ((lambda r: 2 * pp), (lambda r: 2 * pp)) if v == 2 else (
        (lambda r: pp - r), (lambda r: min(pp + 1, pp - r + W_SLACK)))
    done: dict[tuple[str, int, int], int] = {}
    start: dict[tuple[str, int, int], int] = {}
    next_f, next_b = [0] * n, [0] * n
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    held_fb, held_fw = [0] * pp, [0] * pp
    out: list[list[Action]] = [[] for _ in range(pp)]
    left, t = 3 * m * n, 0
    while left:
        for r in range(pp):  # every action takes one tick: each rank starts at most one per tick
            b = [vs for vs in own[r] if next_b[vs] < m and done.get(
                ("B", next_b[vs], vs + 1) if vs < n - 1 else ("F", next_b[vs], vs), t + 1) <= t]
            f = [vs for vs in own[r] if next_f[vs] < m and (vs == 0 or done.get(("F", next_f[vs], vs - 1),
                                                                                  t + 1) <= t)]
            if b:
                vs = max(b)
                kind, mb = "B", next_b[vs]
                next_b[vs] += 1
                held_fb[r] -= 1
                pending_w[r].append((mb, vs))
            elif f and held_fb[r] < in_fb(r) and held_fw[r] < in_fw(r):
                vs = max(f)
                kind, mb = "F", next_f[vs]
                next_f[vs] += 1
                held_fb[r] += 1
                held_fw[r] += 1
            elif pending_w[r]:
                kind, (mb, vs) = "W", pending_w[r].pop(0)
                held_fw[r] -= 1
            else:
                continue
            done[(kind, mb, vs)] = t + 1
            start[(kind, mb, vs)] = t
            out[r].append(Action(kind, mb, chunk_of[vs]))
            left -= 1
        t += 1
        if t > 12 * m * n + 4 * n:
            raise ScheduleError(f"{name}: the list scheduler made no progress at pp={pp}, m={m}")
    return tuple(tuple(row) for row in out), tuple(start.items())


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
    if name in SPLIT_SCHEDULES:
        if virtual_stages != (2 if name == "zbv" else 1):
            raise ScheduleError(f"--pp-schedule {name} runs {2 if name == 'zbv' else 1} model chunk(s) per rank,"
                                f" got --virtual-stages {virtual_stages}")
        return list(_zero_bubble(name, pp, micro_batches)[rank])
    raise ScheduleError(f"unknown --pp-schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


@dataclass
class SimResult:
    makespan: float  # time until the last rank finishes, in units of one micro-batch's full-model forward
    busy: float  # time each rank computes (the same on every rank)
    bubble_fraction: float  # idle time / compute time, per rank (the same on every rank)
    peak_in_flight: list[float]  # per rank: most micro-batches whose activations are held at once (F to B)
    peak_weight_stash: list[float]  # per rank: most micro-batches between B and W at once (split schedules)


def simulate(name: str, pp: int, micro_batches: int, virtual_stages: int = 1, forward_cost: float = 1.0,
             backward_cost: float = 2.0, timelines: Sequence[Sequence[Action]] | None = None) -> SimResult:
    """Replay every rank's timeline with unit costs and dependencies; count idle time and live activations.

    A micro-batch's forward through one rank's share of the model costs ``forward_cost`` (split evenly over
    its chunks), its backward ``backward_cost``, which a split schedule runs as B and W of half each. An action
    waits for its data dependency on the neighbouring virtual stage and for the previous action of its own
    rank; communication is free. ``timelines`` replays given per-rank action lists (e.g. recorded from a real
    run) instead of :func:`build_schedule`'s.
    """
    v = virtual_stages
    n_virtual = pp * v
    split = name in SPLIT_SCHEDULES
    cost = {"F": forward_cost / v, "B": backward_cost / v / (2 if split else 1), "W": backward_cost / v / 2}
    if timelines is None:
        timelines = [build_schedule(name, pp, r, micro_batches, v) for r in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, virtual stage) -> finish time
    clock = [0.0] * pp
    pos = [0] * pp
    live, stash = [0.0] * pp, [0.0] * pp
    peak, peak_stash = [0.0] * pp, [0.0] * pp
    remaining = sum(len(t) for t in timelines)
    while remaining:
        progressed = False
        for r in range(pp):
            while pos[r] < len(timelines[r]):
                a = timelines[r][pos[r]]
                vs = virtual_stage(name, pp, r, a.chunk)
                if a.kind == "F":
                    dep = ("F", a.micro_batch, vs - 1) if vs > 0 else None
                elif a.kind == "B":
                    dep = ("B", a.micro_batch, vs + 1) if vs < n_virtual - 1 else ("F", a.micro_batch, vs)
                else:
                    dep = ("B", a.micro_batch, vs)
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done[dep] if dep else 0.0)
                clock[r] = start + cost[a.kind]
                done[(a.kind, a.micro_batch, vs)] = clock[r]
                live[r] += {"F": 1.0, "B": -1.0, "W": 0.0}[a.kind] / v
                stash[r] += {"F": 0.0, "B": 1.0 if split else 0.0, "W": -1.0}[a.kind] / v
                peak[r] = max(peak[r], live[r])
                peak_stash[r] = max(peak_stash[r], stash[r])
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError(f"schedule {name!r} deadlocks at pp={pp}, m={micro_batches}, v={v}")
    makespan = max(clock)
    busy = micro_batches * (forward_cost + backward_cost)
    return SimResult(makespan=makespan, busy=busy, bubble_fraction=(makespan - busy) / busy, peak_in_flight=peak,
                     peak_weight_stash=peak_stash)
