"""The one seam through which megazero reads device values back to the host, tells storages apart, and allocates
host memory for offloaded states.

Why one seam: a training step may read from the device once (a host synchronisation on CUDA), and the dry run,
whose meta tensors hold no values, must be able to stand in for every read. The host in force is a
:class:`contextvars.ContextVar`, scoped to the ``with use(...)`` block that installed it:

* :class:`DeviceHost` (the default) reads real values with ``tolist()`` and keys storages by ``data_ptr()``;
  host memory is CPU memory (pinned on request).
* :class:`EmulatedHost` keeps "host" memory on the device itself (a gloo run measured as a GPU run would be,
  or the dry run's meta), marked so the peak tracker leaves it out of the device peak and ``model_state_bytes()``
  counts it as offloaded; :func:`to_device` copies it, as a host-to-device transfer does on a GPU.

Meta storages all report ``data_ptr() == 0``, so :func:`storage_key` tells those apart by the storage object.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["DeviceHost", "EmulatedHost", "adjacent", "current", "emulated", "empty", "is_host", "mapped",
           "on_host", "read", "release_free_memory", "same_data", "storage_key", "to_device", "use", "zeros"]

_MARK = "_megazero_host_memory"  # attribute set on an emulated host storage (storages keep their Python object)


class DeviceHost:
    """Reads real values (the default)."""

    def read(self, tensor: torch.Tensor) -> list[float]:
        return [float(x) for x in tensor.detach().reshape(-1).tolist()]

    def storage_key(self, tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        # meta (and empty) storages all report address 0: tell them apart by the storage object itself
        return storage.data_ptr() or storage._cdata

    def empty(self, numel: int, dtype: torch.dtype, pin: bool = False, zero: bool = False) -> torch.Tensor:
        """``numel`` elements of host memory (the CPU; page-locked with ``pin``)."""
        make = torch.zeros if zero else torch.empty
        return make(numel, dtype=dtype, device="cpu", pin_memory=pin)

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` on ``device`` (asynchronous from pinned memory; ``t`` itself when it is there already)."""
        return t.to(device, non_blocking=True)

    def is_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in host memory: on the CPU, or emulated host memory."""
        return t.device.type == "cpu" or emulated(t)

    @contextmanager
    def on_host(self) -> Iterator[None]:
        """The body makes host-side tensors (CPU tensors on a GPU run): nothing to do here."""
        yield


class EmulatedHost(DeviceHost):
    """Host memory apart from the device, emulated on one torch ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def empty(self, numel: int, dtype: torch.dtype, pin: bool = False, zero: bool = False) -> torch.Tensor:
        with self.on_host():
            t = (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=self.device)
        setattr(t.untyped_storage(), _MARK, True)
        return t

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t.to(device, copy=True) if emulated(t) else super().to_device(t, device)

    @contextmanager
    def on_host(self) -> Iterator[None]:
        with _disable_current_modes():  # not allocations on the device: no tracker sees them
            yield

    def is_host(self, t: torch.Tensor) -> bool:
        return emulated(t)


_DEVICE_HOST = DeviceHost()  # stateless
_HOST: ContextVar[DeviceHost | None] = ContextVar("megazero_host", default=None)


def current() -> DeviceHost:
    """The host in force."""
    return _HOST.get() or _DEVICE_HOST


def read(tensor: torch.Tensor) -> list[float]:
    """``tensor``'s values as a flat list of floats, read back to the host (one synchronisation)."""
    return current().read(tensor)


def empty(numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """``numel`` uninitialised elements of host memory (offloaded states), pinned with ``pin``."""
    return current().empty(numel, dtype, pin)


def zeros(numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """``numel`` zeros in host memory (offloaded states), pinned with ``pin``."""
    return current().empty(numel, dtype, pin, zero=True)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's values on ``device`` (a host-to-device copy; free when it is on ``device`` already)."""
    return current().to_device(tensor, device)


def on_host() -> contextlib.AbstractContextManager[None]:
    """A block that makes host-side tensors a GPU run keeps on the CPU (RNG snapshots): under an
    :class:`EmulatedHost` no memory tracker sees them, as a GPU's tracker does not see CPU tensors."""
    return current().on_host()


def is_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives in host memory (apart from the device, where the host in force tells them apart)."""
    return current().is_host(tensor)


def emulated(x: torch.Tensor | torch.UntypedStorage) -> bool:
    """Whether ``x`` (a tensor or storage) is host memory an :class:`EmulatedHost` allocated on the device."""
    storage = x.untyped_storage() if isinstance(x, torch.Tensor) else x
    return getattr(storage, _MARK, False)


def storage_key(tensor: torch.Tensor) -> int:
    """A key equal for two tensors exactly when they share a storage (live storages; meta ones included)."""
    return current().storage_key(tensor)


def same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` start at the same byte of the same storage (``a.data_ptr() == b.data_ptr()`` on
    real tensors; also right on meta tensors, whose pointers are all offsets from 0)."""
    return (storage_key(a) == storage_key(b)
            and a.storage_offset() * a.element_size() == b.storage_offset() * b.element_size())


def adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` starts in ``a``'s storage exactly where ``a`` ends (both contiguous)."""
    return (storage_key(a) == storage_key(b)
            and (a.storage_offset() + a.numel()) * a.element_size() == b.storage_offset() * b.element_size())


def mapped(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` uninitialised CPU elements in an anonymous memory mapping of their own, unmapped (returned to
    the system) when the tensor dies, whatever glibc's thresholds: for a large temporary made once, such as
    construction's fp32 copy of a ZeRO-3 unit too large for a slot. The heap would keep such a block resident
    under whatever is allocated after it, and glibc heap-allocates blocks up to 32 MiB once its dynamic mmap
    threshold has risen."""
    if numel == 0:  # (frombuffer refuses a count of 0)
        return torch.empty(0, dtype=dtype)
    buf = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype, count=numel)  # holds the mapping until the storage dies


def release_free_memory(device: torch.device) -> None:
    """Hand CUDA's cached blocks back once, after construction (``empty_cache``; nothing on other devices).

    On the host nothing is trimmed: at stages 0-3, in fp32 and in 16 bits, construction writes each parameter's
    initial value straight into the buffer that keeps it (:mod:`megazero.model.init`; a TP shard cut from the
    stream through a small mapped scratch, a 16-bit model's fp32 starting values laid out as the master), so it
    leaves no freed heap behind live allocations with glibc's defaults (bench/README.md, "ZeRO's process peak";
    tests/test_zero_rss.py counts the bytes construction frees, on the CPU: on CUDA a blocking copy from host fp32
    into a 16-bit device buffer may convert through a host temporary, unchecked). Not yet so: under optimizer
    offload (stages 1-3) in a 16-bit dtype the fp32 starting values (4Ψ/N_d) are copied into the host master and
    freed. Buffers used again and again are allocated once (ZeRO-3's slots), so nothing is needed per step."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextmanager
def use(host: DeviceHost) -> Iterator[DeviceHost]:
    """Install ``host`` for the body of the ``with`` block."""
    token = _HOST.set(host)
    try:
        yield host
    finally:
        _HOST.reset(token)
