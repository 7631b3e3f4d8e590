"""A rank role's dry run at two small micro-batch counts, extrapolated exactly to the step's count.

Under the 1F1B and interleaved schedules a pipeline rank holds at most a bounded number of micro-batches in
flight, so its peak is reached once the steady state is entered and stays the same for any larger count; every
per-step volume (point-to-point transfers, TP collectives, ZeRO's per-micro-batch reductions or gathers) is
affine in the micro-batch count m. :func:`run_role_steady` therefore runs the real step of a role (the same
:func:`~megazero.plan.dryrun.run_role`) at two counts ``m1 < m2`` at or past the steady state (:func:`steady_counts`)
and

* checks that the two runs measured the same peak, peak by category, states at rest, host reads and steps;
  if any differs, it runs the role at the full count instead (the figures are then measured directly);
* extrapolates every ledger entry linearly to m, ``n(m) = n1 + (n2 - n1)(m - m1)/(m2 - m1)``, in integers (an
  entry that would not extrapolate to a whole non-negative number also falls back to the full run).

GPipe keeps every micro-batch in flight (its peak grows with m): it always runs at the full count. The
point-to-point calls kept for the NCCL-order replay are those of the ``m1`` run of every role (a common count,
so the stages' calls pair up). tests/test_dryrun_steady.py checks the extrapolated figures against full runs.
"""

from __future__ import annotations

import time
from dataclasses import replace

from megazero.config.schema import Config
from megazero.distributed.context import RankGrid
from megazero.plan.role import RoleResult, roofline_seconds, run_role, volumes
from megazero.plan.roofline import Cluster

__all__ = ["extrapolate", "run_role_steady", "steady_counts"]


def steady_counts(schedule: str, pp: int, micro_batches: int) -> tuple[int, int] | None:
    """The two micro-batch counts ``(m1, m2)`` a role runs at instead of ``micro_batches``, or None when the
    full count is needed (GPipe) or no cheaper (``m1 + m2 >= micro_batches``).

    1F1B (and no pipeline): the first stage runs ``pp - 1`` warm-up forwards; at ``pp + 1`` micro-batches every
    stage has run a forward after a backward with its most micro-batches in flight. Interleaved: counts are
    multiples of ``pp``; ``2 pp`` exceeds every stage's warm-up (at most ``(v + 1) pp - 2`` chunk forwards of
    ``m v``) by a full steady group. The zero-bubble schedules run at the full count."""
    if pp > 1 and schedule in ("gpipe", "zb-h1", "zbv"):  # zero-bubble: the list scheduler's whole timeline
        return None
    if pp > 1 and schedule == "interleaved":
        m1, m2 = 2 * pp, 3 * pp
    else:
        m1, m2 = pp + 1, pp + 2
    return (m1, m2) if m1 + m2 < micro_batches else None


def _with_micro_batches(cfg: Config, m: int, dp: int) -> Config:
    t = cfg.training
    return replace(cfg, training=replace(t, gradient_accumulation_steps=m,
                                         global_batch_size=t.micro_batch_size * m * dp))


def extrapolate(n1: dict[str, int], n2: dict[str, int], m1: int, m2: int, m: int) -> dict[str, int] | None:
    """Each entry affine through ``(m1, n1[k])`` and ``(m2, n2[k])`` evaluated at ``m`` (a missing entry is 0);
    entries that come out 0 are left out, as the ledger does. None when one would not be a whole number >= 0."""
    out = {}
    for k in sorted(set(n1) | set(n2)):
        a, b = n1.get(k, 0), n2.get(k, 0)
        num = (b - a) * (m - m1)
        if num % (m2 - m1):
            return None
        v = a + num // (m2 - m1)
        if v < 0:
            return None
        if v:
            out[k] = v
    return out


def _agree(a: RoleResult, b: RoleResult) -> bool:
    return (a.peak_bytes == b.peak_bytes and a.peak_by_category == b.peak_by_category and a.states == b.states
            and a.host_reads == b.host_reads and a.steps == b.steps and a.eval_peak_bytes == b.eval_peak_bytes)


def run_role_steady(cfg: Config, grid: RankGrid, rank: int, c: Cluster | None = None) -> RoleResult:
    """:func:`~megazero.plan.dryrun.run_role`'s result for the full micro-batch count, from runs at two small counts
    where the schedule allows and they agree (module docstring), else from a run at the full count.
    ``micro_batches_run`` says which counts ran."""
    p, t = cfg.parallel, cfg.training
    m = t.gradient_accumulation_steps
    counts = steady_counts(p.pp_schedule if grid.pp_size > 1 else "1f1b", grid.pp_size, m)
    if counts is None:
        res = run_role(cfg, grid, rank, c)
        res.micro_batches_run = [m]
        return res
    start = time.perf_counter()
    m1, m2 = counts
    a = run_role(_with_micro_batches(cfg, m1, grid.dp_size), grid, rank)
    b = run_role(_with_micro_batches(cfg, m2, grid.dp_size), grid, rank)
    breakdown = None
    if _agree(a, b):
        breakdown = extrapolate(a.breakdown, b.breakdown, m1, m2, m)
    if breakdown is None:  # not in the steady state yet, or not affine: measure the full count
        res = run_role(cfg, grid, rank, c)
        res.micro_batches_run = [m1, m2, m]
        res.p2p_calls = a.p2p_calls  # every role's m1 calls pair up in the replay
        res.wall_seconds = time.perf_counter() - start
        return res
    keyed = {tuple(k.split("/", 2)): v for k, v in breakdown.items()}
    res = replace(a, volumes=volumes(keyed), breakdown=breakdown, micro_batches_run=[m1, m2])
    if c is not None:
        res.step_seconds = roofline_seconds(cfg, grid, rank, keyed, c)
    res.wall_seconds = time.perf_counter() - start
    return res
