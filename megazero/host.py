"""The one seam through which megazero reads device values back to the host, asks where a tensor's storage is, and
allocates host memory for offloaded states.

A training step reads from the device once (the loss, the gradient norm, the token count) plus what logging and
the checks ask for, and a few places de-duplicate tensors by their storage. Both go through this module:

* :func:`read` returns a tensor's values as a flat list of Python floats (a host synchronisation on CUDA);
* :func:`storage_key` returns a key that is equal for two tensors exactly when they share a storage
  (:func:`same_data` and :func:`adjacent` compare positions in storages with it).

A real run uses :class:`DeviceHost` (``tolist()`` and the storage's ``data_ptr()``). The dry run
(:mod:`megazero.dryrun`), whose tensors live on the meta device and hold no values, installs a
:class:`PlaceholderHost` with :func:`use` for the duration of its step: reads return a placeholder value
(counted). Every meta storage reports ``data_ptr() == 0``, so :func:`storage_key` tells those apart by the
storage object itself, in any mode.

Host memory (ZeRO-Offload's master weights, Adam moments, gradient copy and parameter shards) is allocated with
:func:`empty`/:func:`zeros` and moved to the device with :func:`to_device`; :func:`is_host` says whether a tensor
lives there. A real run puts it on the CPU (pinned on request) and tells it apart by the tensor's device. Where
host and device are one torch device, an :class:`EmulatedHost` stands in for the split a GPU run has: it
allocates host memory on that device (the dry run's meta, or the CPU of a gloo run measured as a GPU run would
be), out of sight of any :class:`~megazero.memory.PeakMemoryTracker`, and marks its storage (:func:`emulated`),
so the tracker leaves it out of the device peak and ``model_state_bytes()`` counts it as offloaded; and
:func:`to_device` copies it, as a host-to-device transfer does on a GPU. :class:`PlaceholderHost` is the dry
run's emulated host on meta.
The host in force is kept in a :class:`contextvars.ContextVar`, so it is scoped to the ``with`` block (and
thread) that installed it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["DeviceHost", "EmulatedHost", "PlaceholderHost", "adjacent", "current", "emulated", "empty", "is_host",
           "on_host", "read", "same_data", "storage_key", "to_device", "use", "zeros"]

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


class PlaceholderHost(EmulatedHost):
    """For tensors without values (meta): every read returns ``value`` per element and is counted; host memory
    is emulated on meta."""

    def __init__(self, value: float = 1.0) -> None:
        super().__init__("meta")
        self.value = float(value)
        self.reads = 0  # host reads (synchronisations a real device would make)
        self.read_elements = 0

    def read(self, tensor: torch.Tensor) -> list[float]:
        self.reads += 1
        self.read_elements += tensor.numel()
        if tensor.device.type != "meta":
            return super().read(tensor)
        return [self.value] * tensor.numel()


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


@contextmanager
def use(host: DeviceHost) -> Iterator[DeviceHost]:
    """Install ``host`` for the body of the ``with`` block."""
    token = _HOST.set(host)
    try:
        yield host
    finally:
        _HOST.reset(token)
