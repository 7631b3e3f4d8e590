"""A disk cache of dry runs, so that planning again does not repeat identical dry runs.

``tools/plan.py --confirm N`` dry-runs the N fastest layouts (:func:`megazero.plan.dryrun.dry_run`: one training step
per rank role on the meta device). A dry run is deterministic given

* the resolved configuration (model, topology, ZeRO, schedule, batch, precision, recomputation, ...; the
  logging section, which only says where files go, is left out),
* the cluster it is judged against (GPU figures, GPUs per node, efficiency: the roofline and the verdict),
* the device type whose defaults and kernels it plans for,
* the code that runs it: a hash of every ``.py`` file of the ``megazero`` package, and torch's version
  (its meta kernels decide the saved tensors),

so :func:`cache_key` hashes exactly these and :class:`DryRunCache` keeps one JSON file per key (the report of
every rank role, as :func:`megazero.plan.dryrun.dry_run` writes it), written atomically. Changing any of them -- a
flag, a GPU figure, a line of megazero, the torch build -- misses the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from megazero.checkpoint.safetensors_io import atomic_write
from megazero.config.schema import Config
from megazero.plan.roofline import Cluster

__all__ = ["DryRunCache", "cache_key", "code_fingerprint", "default_cache_dir", "report_from_dict"]

_PACKAGE = Path(__file__).resolve().parent


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/megazero/plan`` (``~/.cache/megazero/plan`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megazero", "plan")


def code_fingerprint(package: Path = _PACKAGE) -> str:
    """SHA-256 of every ``.py`` file under the megazero package (relative path and bytes) and torch's version."""
    h = hashlib.sha256(f"torch {torch.__version__}\n".encode())
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def cache_key(cfg: Config, c: Cluster, device_type: str, code: str | None = None) -> str:
    """The hash of everything that determines a dry run's report (module docstring)."""
    config = dataclasses.asdict(cfg)
    config.pop("logging", None)
    config.pop("explicit", None)  # which settings were typed, not what they are: the same run either way
    blob = json.dumps({"config": config, "cluster": dataclasses.asdict(c), "device_type": device_type,
                       "code": code or code_fingerprint()}, sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()


def _build(cls: type, d: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


def report_from_dict(d: dict[str, Any]) -> Any:
    """A :class:`~megazero.plan.dryrun.DryRunReport` from its ``as_dict()`` (its JSON)."""
    from megazero.plan.dryrun import DryRunReport, RoleResult

    return _build(DryRunReport, {**d, "roles": [_build(RoleResult, r) for r in d["roles"]]})


class DryRunCache:
    """Dry-run reports on disk, one ``<key>.json`` per :func:`cache_key` under ``directory``."""

    def __init__(self, directory: str | os.PathLike, code: str | None = None) -> None:
        self.directory = Path(directory)
        self.code = code or code_fingerprint()  # hashed once: the code does not change while planning
        self.hits = 0
        self.misses = 0

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def get(self, key: str) -> Any | None:
        """The cached report of ``key``, or None (a missing or unreadable entry is a miss)."""
        try:
            with open(self.path(key)) as f:
                report = report_from_dict(json.load(f))
        except (OSError, ValueError, KeyError, TypeError):
            self.misses += 1
            return None
        self.hits += 1
        return report

    def put(self, key: str, report: Any) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        data = json.dumps(report.as_dict(), indent=1).encode()
        atomic_write(self.path(key), lambda f: f.write(data))

    def dry_run(self, cfg: Config, c: Cluster, device_type: str = "cuda") -> tuple[Any, bool]:
        """The report of ``dry_run(cfg, c, device_type=device_type)``, from the cache when present (then
        ``True``), else run and stored."""
        from megazero.plan import dryrun

        key = cache_key(cfg, c, device_type, self.code)
        report = self.get(key)
        if report is not None:
            return report, True
        report = dryrun.dry_run(cfg, c, device_type=device_type)
        self.put(key, report)
        return report, False
