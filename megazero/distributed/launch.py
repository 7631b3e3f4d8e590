"""Start-up: ``torch.distributed`` from torchrun or SLURM environment variables (or one process when neither is
present), gloo on CPU and nccl on CUDA, with a timeout that bounds every collective so that a missing peer ends
the job with an error instead of a hang."""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistEnv", "default_backend", "destroy_distributed", "detect_env", "init_distributed"]


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
