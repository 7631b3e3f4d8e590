"""The one seam through which megazero reads device values back to the host or asks where a tensor's storage is.

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
The host in force is kept in a :class:`contextvars.ContextVar`, so it is scoped to the ``with`` block (and
thread) that installed it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

__all__ = ["DeviceHost", "PlaceholderHost", "adjacent", "current", "read", "same_data", "storage_key", "use"]


class DeviceHost:
    """Reads real values (the default)."""

    def read(self, tensor: torch.Tensor) -> list[float]:
        return [float(x) for x in tensor.detach().reshape(-1).tolist()]

    def storage_key(self, tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        # meta (and empty) storages all report address 0: tell them apart by the storage object itself
        return storage.data_ptr() or storage._cdata


class PlaceholderHost(DeviceHost):
    """For tensors without values (meta): every read returns ``value`` per element and is counted."""

    def __init__(self, value: float = 1.0) -> None:
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
