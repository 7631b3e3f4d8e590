"""The one helper that starts gloo worlds on CPU for distributed tests.

``run_world(fn, world_size, tp=.., pp=.., cp=..)`` starts ``world_size`` processes, gives each a process group over
gloo and its :class:`~megazero.distributed.context.ParallelContext`, calls ``fn(ctx, *args)`` on every rank and
returns the list of per-rank results (they must pickle). A rank that raises makes ``run_world`` raise with
that rank's traceback; a world that does not finish within ``timeout`` is killed and reported.

How ranks start (:func:`choose_start_method`): by fork on a machine without CUDA (cheap: no re-import of torch, and
each rank runs single-threaded, so many small worlds fit on two cores); by forkserver wherever CUDA is available,
for every world, CPU ones too. There, once any backward has run in the pytest process, autograd's device threads
make a forked child die at its first backward ("Unable to handle autograd's threading in combination with
fork-based multiprocessing"), and CUDA itself does not survive a fork. The fork server is started clean (an exec,
torch preloaded, no CUDA), so its children start in about a second. ``MEGAZERO_TEST_START_METHOD`` (fork,
forkserver or spawn) or ``run_world(..., start_method=...)`` picks one by hand, e.g. to check the non-fork path on
a CPU machine. Outside fork, ``fn`` and its arguments must pickle (module-level functions); one that does not falls
back to fork with a warning. Every rank starts from the parent's environment as it is when ``run_world`` is called
(a fork server would otherwise keep the one it started with), so variables a test sets reach it. Ranks end with
``os._exit`` after destroying their group, which sidesteps gloo's shutdown race.

``cuda=True`` runs the world on the one CUDA device (never forked; CUDA does not survive a fork): every
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
import warnings
from collections.abc import Callable
from typing import Any

from megazero.distributed.group import Group, _Done

__all__ = ["START_METHOD_ENV", "HostP2PGroup", "WorldError", "choose_start_method", "run_world"]

START_METHOD_ENV = "MEGAZERO_TEST_START_METHOD"


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


def choose_start_method(cuda: bool = False, requested: str | None = None) -> str:
    """How a world's ranks start: ``requested``, else ``$MEGAZERO_TEST_START_METHOD``, else fork on a machine
    without CUDA and forkserver on one with CUDA (module docstring). A CUDA world is never forked."""
    method = requested or os.environ.get(START_METHOD_ENV) or None
    if method is None:
        import torch

        method = "forkserver" if cuda or torch.cuda.is_available() else "fork"
    if method not in ("fork", "forkserver", "spawn"):
        raise ValueError(f"{START_METHOD_ENV}={method!r}: choose fork, forkserver or spawn")
    if cuda and method == "fork":
        raise ValueError("a cuda=True world cannot fork (CUDA does not survive a fork): use forkserver or spawn")
    return method


def _mp_context(method: str, picklable: tuple) -> mp.context.BaseContext:
    """The multiprocessing context for ``method``; fork where the world's function or arguments do not pickle."""
    if method != "fork":
        try:
            pickle.dumps(picklable)
        except Exception as e:  # noqa: BLE001 - any pickling failure: lambdas, closures, local classes
            if method == "forkserver" and not picklable[-1]:  # picklable[-1]: cuda
                warnings.warn(f"run_world: {e}; forking instead of {method} (a child dies at its first backward if "
                              "a backward already ran here on a machine with CUDA)", RuntimeWarning, stacklevel=3)
                return mp.get_context("fork")
            raise
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([__name__])  # torch and megazero imported once, in the server (no CUDA there)
    return ctx


def _rank_main(rank: int, world_size: int, ports: mp.Queue, over: Any, grid_kwargs: dict, dist_timeout: float,
               fn: Callable, args: tuple, kwargs: dict, results: mp.Queue, cuda: bool = False,
               environ: dict[str, str] | None = None) -> None:
    code, reported = 0, False
    if environ is not None:  # the parent's environment at run_world time (a fork server's is older)
        os.environ.clear()
        os.environ.update(environ)
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
        # flush the result to the parent before the teardown: gloo can abort the process in
        # destroy_process_group (a rare shutdown race), which would lose a result still in the feeder thread
        results.close()
        results.join_thread()
        reported = True
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        if not reported:  # a failure after the result was sent leaves the parent's answer as it is
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
              start_method: str | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` gloo ranks; return results by rank.

    Ranks start as :func:`choose_start_method` says (fork without CUDA). ``cuda=True``: ranks sharing the one
    CUDA device (forkserver or spawn; ``fn`` and its arguments must pickle)."""
    method = choose_start_method(cuda, start_method)
    ctx_mp = _mp_context(method, (fn, args, kwargs, cuda))
    environ = None if ctx_mp.get_start_method() == "fork" else dict(os.environ)
    results: mp.Queue = ctx_mp.Queue()
    ports: mp.Queue = ctx_mp.Queue()  # rank 0's store port, bound to port 0 (no race), for the other ranks
    over = ctx_mp.Event()  # set when every rank has reported: rank 0 may close the store
    grid_kwargs = {"tp_size": tp, "pp_size": pp, "dp_size": dp, "cp_size": cp}
    procs = [
        ctx_mp.Process(target=_rank_main, args=(r, world_size, ports, over, grid_kwargs, dist_timeout, fn, args, kwargs,
                                                results, cuda, environ), daemon=True)
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
