"""The one helper that starts gloo worlds on CPU for distributed tests.

``run_world(fn, world_size, tp=.., pp=.., cp=..)`` forks ``world_size`` processes, gives each a process group over
gloo and its :class:`~megazero.distributed.context.ParallelContext`, calls ``fn(ctx, *args)`` on every rank and
returns the list of per-rank results (they must pickle). A rank that raises makes ``run_world`` raise with
that rank's traceback; a world that does not finish within ``timeout`` is killed and reported.

Forking is cheap (no re-import of torch) and each rank runs single-threaded, so many small worlds fit on
two cores. Ranks end with ``os._exit`` after destroying their group, which sidesteps gloo's shutdown race.

``cuda=True`` runs the world on the one CUDA device (spawned ranks; CUDA does not survive a fork): every
group's device is that GPU, so model, activations and collective buffers live there and the device rule is
enforced as under NCCL. The collectives still run over gloo (NCCL refuses two ranks on one GPU), which
carries CUDA tensors for all-reduce, broadcast and all-gather/reduce-scatter; its send/receive do not, so
:class:`HostP2PGroup` routes point-to-point transfers through host copies after the device check.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from megazero.distributed.group import Group, _Done

__all__ = ["HostP2PGroup", "WorldError", "run_world"]


class WorldError(RuntimeError):
    """A rank of a test world failed or the world timed out."""


class HostP2PGroup(Group):
    """A test-only Group on a CUDA device whose point-to-point transfers go through host copies (gloo cannot
    send CUDA tensors). The device check and the ledger run first, exactly as for any Group."""

    def _issue_p2p(self, ops):
        import torch

        host = [(kind, t.detach().cpu() if kind == "send" else torch.empty(t.shape, dtype=t.dtype), peer, tag)
                for kind, t, peer, tag in ops]
        for work in super()._issue_p2p(host):
            work.wait()
        for (kind, t, _, _), (_, h, _, _) in zip(ops, host):
            if kind == "recv":
                t.copy_(h)
        return [_Done() for _ in ops]


def _rank_main(rank: int, world_size: int, ports: mp.Queue, over: Any, grid_kwargs: dict, dist_timeout: float,
               fn: Callable, args: tuple, kwargs: dict, results: mp.Queue, cuda: bool = False) -> None:
    code = 0
    try:
        import datetime

        import torch
        import torch.distributed as dist

        from megazero.distributed.context import ParallelContext, RankGrid

        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=dist_timeout)
        # rank 0 hosts the store on a port the OS picks, hands it on, and keeps it until the world is over; a
        # store thread in the parent at fork time left a forked client hanging in TCPStore's constructor
        # (about 1 world in 10)
        if rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                                  timeout=timeout)
            for _ in range(world_size - 1):
                ports.put(store.port)
        else:
            store = dist.TCPStore("127.0.0.1", ports.get(timeout=dist_timeout), world_size, is_master=False,
                                  timeout=timeout)
        if cuda:
            torch.cuda.set_device(0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        grid = RankGrid.from_world(world_size, **grid_kwargs)
        if cuda:
            ctx = ParallelContext.from_grid(grid, timeout_s=dist_timeout, device=torch.device("cuda", 0),
                                            group_cls=HostP2PGroup)
        else:
            ctx = ParallelContext.from_grid(grid, timeout_s=dist_timeout)
        out = fn(ctx, *args, **kwargs)
        # pickle by value: multiprocessing would share tensors through file descriptors of a dying process
        results.put((rank, "ok", pickle.dumps(out)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))
        code = 1
    finally:
        results.close()
        results.join_thread()  # flush the queue's feeder thread before the hard exit
        if rank == 0:
            over.wait(dist_timeout)  # the store lives here: peers may still be using it
        os._exit(code)


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, tp: int = 1, pp: int = 1,
              dp: int | None = None, cp: int = 1, timeout: float = 180.0, dist_timeout: float = 120.0, cuda: bool = False,
              **kwargs: Any) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` forked gloo ranks; return results by rank.

    ``cuda=True``: spawned ranks sharing the one CUDA device (``fn`` and its arguments must pickle)."""
    ctx_mp = mp.get_context("spawn" if cuda else "fork")
    results: mp.Queue = ctx_mp.Queue()
    ports: mp.Queue = ctx_mp.Queue()  # rank 0's store port, bound to port 0 (no race), for the other ranks
    over = ctx_mp.Event()  # set when every rank has reported: rank 0 may close the store
    grid_kwargs = {"tp_size": tp, "pp_size": pp, "dp_size": dp, "cp_size": cp}
    procs = [
        ctx_mp.Process(target=_rank_main, args=(r, world_size, ports, over, grid_kwargs, dist_timeout, fn, args, kwargs,
                                                results, cuda), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(out) - set(errors))
                raise WorldError(f"world of {world_size} timed out after {timeout:.0f}s; ranks {missing} unfinished"
                                 + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in errors.items()))
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in out and r not in errors]
                if dead and not errors:
                    # a rank died without reporting (e.g. a signal); give peers a moment, then fail
                    errors.update({r: f"exited with code {procs[r].exitcode} without a result" for r in dead})
                continue
            if status == "ok":
                out[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
            if errors:
                # one failure: the rest would wait on a dead peer; stop them now
                break
        if errors:
            raise WorldError("".join(f"\n--- rank {r} failed ---\n{tb}" for r, tb in sorted(errors.items())))
    finally:
        over.set()
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
    return [out[r] for r in range(world_size)]
