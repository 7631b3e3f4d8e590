"""When a rank fails, say which: a failed rank posts its reason in the job's store, and a rank whose collective
broke names the peer instead of repeating gloo's or NCCL's text.

A collective whose peer died (gloo: "Connection closed by peer", "Connection reset by peer"; NCCL: the
communicator aborted) or hangs ("Timed out waiting ...") raises a ``RuntimeError`` that names an address, not a
rank. So every rank that fails calls :func:`announce_failure` before it exits (``megazero/failed/RANK`` in the
store of the default process group: its one-line reason), and a rank that sees :func:`is_peer_failure` calls
:func:`explain_peer_failure`, which posts that it lost a peer, waits up to three seconds for the others to post,
and reads back who did what: a rank that posted a reason failed first (its line is quoted), a rank that posted
nothing stopped responding (killed, crashed or hung; its own log says more). A store that cannot be reached is
said too: it is hosted by rank 0 under SLURM and by the agent under torchrun.
"""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from megazero.config.errors import UserError

__all__ = ["PeerError", "announce_failure", "explain_peer_failure", "is_peer_failure"]

_KEY, _COUNT = "megazero/failed/{}", "megazero/failed_ranks"
_LOST = "lost a peer"  # what a rank that only lost its peer posts
_CLOSED = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
           "communicator was aborted", "remote process exited", "socket closed")
_TIMED_OUT = ("timed out", "timeout", "watchdog")


class PeerError(UserError):
    """Another rank failed or stopped responding; the message names it and where to look."""


def is_peer_failure(e: BaseException) -> bool:
    """Whether ``e`` (or an exception it was raised from) is a collective that lost its peer."""
    while e is not None:
        if isinstance(e, PeerError):
            return False
        text = str(e).lower()
        if isinstance(e, (RuntimeError, ConnectionError)) and any(p in text for p in _CLOSED + _TIMED_OUT):
            return True
        e = e.__cause__ or e.__context__
    return False


def _store(timeout_s: float) -> dist.Store | None:
    """The default process group's store with a short timeout, or None without one."""
    if not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        return store
    except Exception:  # noqa: BLE001 - no store, no report
        return None


def announce_failure(rank: int, message: str) -> None:
    """Post this rank's one-line reason for failing, for peers whose collectives break when it exits."""
    store = _store(2.0)
    if store is not None:
        try:
            store.set(_KEY.format(rank), message.encode()[:2000])
            store.add(_COUNT, 1)
        except Exception:  # noqa: BLE001 - best effort: the store may be gone with its host
            pass


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def explain_peer_failure(e: BaseException, rank: int, world_size: int, timeout_s: float,
                         grace_s: float = 3.0) -> PeerError:
    """The one line for a collective of ``rank`` that broke with ``e``: which rank failed first (with its
    reason) or stopped responding. Posts this rank's state, then waits up to ``grace_s`` for the others'."""
    text = str(e).lower()
    how = (f"did not answer within --dist-timeout {timeout_s:g} s (hung, or still busy elsewhere)"
           if any(p in text for p in _TIMED_OUT) and not any(p in text for p in _CLOSED)
           else "closed its connection (the process exited, crashed or was killed)")
    store, grace_s = _store(2.0), min(grace_s, timeout_s)
    reasons: dict[int, str] = {}
    if store is not None:
        try:
            store.set(_KEY.format(rank), _LOST.encode())
            store.add(_COUNT, 1)
            deadline, seen = time.monotonic() + grace_s, 0
            while True:  # until every rank posted, one posted a reason, or the grace is over
                count = store.add(_COUNT, 0)
                if count != seen:
                    seen = count
                    for q in range(world_size):
                        if q not in reasons and store.check([_KEY.format(q)]):
                            reasons[q] = store.get(_KEY.format(q)).decode(errors="replace")
                if count >= world_size or time.monotonic() > deadline or set(reasons.values()) - {_LOST}:
                    break
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - the store went with its host
            return PeerError(f"lost contact with the other ranks and with the job's store (a peer {how}; under "
                             "SLURM rank 0 hosts the store, so rank 0 has likely stopped): look at rank 0's log")
    failed = sorted(q for q, r in reasons.items() if r != _LOST and q != rank)
    silent = [q for q in range(world_size) if q not in reasons]
    if failed:
        first = reasons[failed[0]]
        return PeerError(f"{_ranks(failed)} failed first ({first}); this rank lost its connection to it")
    if silent:
        return PeerError(f"{_ranks(silent)} stopped responding: {'it' if len(silent) == 1 else 'one of them'} "
                         f"{how}; look at {_ranks(silent[:1])}'s log and exit status")
    return PeerError(f"a peer {how}; every rank reported losing a peer, look at the launcher's log")
