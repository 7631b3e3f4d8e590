"""Launching the checkout under test in subprocesses without port races or leaked workers.

* :func:`torchrun` runs ``python -m torch.distributed.run --standalone`` (c10d rendezvous on
  ``localhost:0``: the agent binds a port the OS picks and holds it while its workers use it).
* :func:`held_store` is the same for ranks launched by hand: a TCPStore on port 0 held by the test, which the
  ranks join as torchrun workers join their agent's store (``TORCHELASTIC_USE_AGENT_STORE``).
* :func:`run` starts each command in its own session; on a timeout it kills the whole process group
  (torchrun and its workers), and after any run it kills what is left of the group.

The environment comes from the ``subprocess_env`` fixture, which puts the repository root first on
``PYTHONPATH``, so ``pretrain/gpt.py`` and ``tools/`` import this checkout's megazero.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "held_store", "kill_group", "run", "torchrun"]

ROOT = Path(__file__).resolve().parents[1]


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL every process left in ``proc``'s process group (it leads its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run(cmd: list[str], env: dict[str, str], timeout: float, cwd: Path | str = ROOT) -> subprocess.CompletedProcess:
    """Run ``cmd`` to completion in a new session; on ``timeout`` kill its whole process group and fail."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd[:6])} ... timed out after {timeout:.0f}s; killed its process group\n"
                             f"{out[-3000:]}\n{err[-3000:]}") from None
    finally:
        kill_group(proc)  # workers a dead agent left behind
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(nproc: int, script_args: list[str], env: dict[str, str], timeout: float,
             launcher_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nproc [launcher_args] pretrain/gpt.py script_args``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           *launcher_args, str(ROOT / "pretrain" / "gpt.py"), *script_args]
    return run(cmd, env, timeout)


def held_store(timeout_s: float = 60.0):
    """A TCPStore listening on a port the OS chose, held by the caller: returns ``(store, env)`` where ``env``
    makes ranks started by hand join it as their rendezvous (keep ``store`` alive while they run)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=timeout_s))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    return store, env
