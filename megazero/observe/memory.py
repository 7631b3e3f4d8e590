"""The peak of a training step, measured at the level of tensor allocation, by category.

:class:`PeakMemoryTracker` is a ``TorchDispatchMode``: it sees every tensor an operator (factory functions
included) allocates, every storage that is freed (a weak reference to the storage, called back when the
storage dies) and every storage resize (``Tensor.resize_``/``set_`` through the dispatcher, and
``UntypedStorage.resize_`` and ``_swap_data_ptr_``, which ZeRO-3 uses to free and re-gather parameters (its
buffer slots move between storages by a swap) and which the dispatcher does not see, so the tracker patches
them while it is active). It keeps the bytes of the live storages (a storage
counts once however many views share it) and the largest total reached, with that moment's breakdown:

=====================  ====================================================================================
category               what it holds
=====================  ====================================================================================
``params``             the model's parameters and the parameter buffers the ZeRO store keeps (flat
                       buffers, shards, gathered ZeRO-3 units)
``grads``              gradient buffers (flat, owned partition) and ``.grad`` of parameters
``master_params``      the fp32 master partition (mixed precision, offload)
``optimizer_states``   Adam's moments
``comm_buffers``       what the store lists as communication staging (buckets, receive buffers)
``activations``        storages allocated inside a model chunk's forward (and the chunk's inputs) that are
                       alive at the peak: what autograd saved for backward, plus, at a peak inside a forward,
                       its live temporaries
``other``              everything else allocated during the step: autograd's gradients in flight,
                       recomputation, optimizer and loss temporaries
=====================  ====================================================================================

The category of a storage is decided at the moment of a new peak, from the buffers megazero owns (a
callable returning ``{category: tensors}``, e.g. :func:`zero_buffers`), then from where it was allocated.
The tracker counts storages that exist when it starts only if they are listed there (the model states);
everything allocated while it runs is counted. Only tensors on ``device`` count (on a GPU run, host-side
pinned buffers of offload are left out, and so is the host memory a :class:`~megazero.distributed.device_io.EmulatedHost`
stands in on the device); meta tensors count only on a meta tracker (the dry run).

Unlike ``torch.distributed._tools.mem_tracker.MemTracker`` it does not track per module, so a module may run
several forwards in one step (gradient accumulation, pipelining, recomputation). Cost: one Python call per
operator and a classification per new peak; the trainer runs it on logged steps only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megazero.distributed import device_io

__all__ = ["CATEGORIES", "ActivationMemoryCounter", "PeakMemoryTracker", "StepPeak", "zero_buffers"]

CATEGORIES = ("params", "grads", "master_params", "optimizer_states", "activations", "comm_buffers", "other")
_FORWARD = "activations"  # allocation-time label of storages created inside a chunk's forward
_STORE_KEYS = {"params": "params", "grads": "grads", "comm": "comm_buffers", "master": "master_params",
               "master_params": "master_params", "optimizer_states": "optimizer_states", "states": "optimizer_states"}

Buffers = Callable[[], dict[str, Iterable[torch.Tensor | None]]]


def zero_buffers(optimizer: Any) -> dict[str, list[torch.Tensor | None]]:
    """The buffers a :class:`~megazero.zero.optimizer.ZeroOptimizer` owns now, by category.

    The model's parameters and their ``.grad``, the store's ``held_tensors()`` (keys ``params``, ``grads``
    and, where the store lists them, ``comm``), the fp32 master partition and the Adam moments.
    """
    out: dict[str, list[torch.Tensor | None]] = {c: [] for c in CATEGORIES}
    params = list(optimizer.model.parameters())
    out["params"] += params
    out["grads"] += [p.grad for p in params]
    for key, tensors in optimizer.store.held_tensors().items():
        if key in _STORE_KEYS:
            out[_STORE_KEYS[key]] += list(tensors)
    master = getattr(optimizer, "master", None)
    if master is not None:
        out["master_params"].append(master)
    out["optimizer_states"] += [getattr(optimizer, "exp_avg", None), getattr(optimizer, "exp_avg_sq", None)]
    return out


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):  # meta counts on a meta tracker
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return None


class StepPeak(dict):
    """What :class:`PeakMemoryTracker` measured: ``peak_bytes`` (int), ``peak_by_category`` ({category:
    bytes}), ``device_step_peak_bytes`` (CUDA's ``max_memory_allocated`` over the same step, else None) and
    ``device_run_peak_bytes`` (the largest ``max_memory_allocated`` seen over all tracked steps and before them,
    since the tracker resets CUDA's peak statistics at each step)."""


class PeakMemoryTracker(TorchDispatchMode):
    """Peak bytes of live tensors on ``device`` while the context is active, by category (module docstring).

    ``buffers`` returns the buffers megazero owns by category (called at entry and at each new peak);
    ``forward_modules`` are the model chunks whose forwards allocate activations; ``baseline`` returns further
    tensors from before the step to count (as ``other`` unless ``buffers`` lists them). Use once per step::

        tracker = PeakMemoryTracker(device, lambda: zero_buffers(opt), engine.chunks)
        with tracker:
            engine.train_step(batch)
        tracker.result()  # StepPeak
    """

    def __init__(self, device: torch.device | str = "cpu", buffers: Buffers | None = None,
                 forward_modules: Sequence[nn.Module] = (),
                 baseline: Callable[[], Iterable[torch.Tensor]] | None = None) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.buffers = buffers
        self.forward_modules = list(forward_modules)
        self.baseline = baseline
        self._reset()

    def _reset(self) -> None:
        self._live: dict[int, list] = {}  # id(storage) -> [weakref, nbytes, label]
        self._total = 0
        self.peak_bytes = 0
        self.peak_by_category: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._dirty = False
        self._frozen: list | None = None  # the live storages at a peak, awaiting classification
        self._forward_depth = 0
        self._hooks: list[Any] = []
        self._orig_resize = None
        self._orig_swap = None
        self._cuda_step_peak: int | None = None
        self.device_run_peak_bytes: int | None = getattr(self, "device_run_peak_bytes", None)

    # -- bookkeeping ---------------------------------------------------------------------------------------
    def _counts(self, st: torch.UntypedStorage) -> bool:
        dev = st.device
        if device_io.emulated(st):  # host memory standing in on this device (megazero.distributed.device_io.EmulatedHost)
            return False
        return dev.type == self.device.type and (dev.index is None or self.device.index is None
                                                  or dev.index == self.device.index)

    def _add(self, st: torch.UntypedStorage, label: str) -> None:
        key = id(st)
        if key in self._live or not self._counts(st):
            return
        ref = weakref.ref(st, lambda _r, k=key: self._on_free(k))
        self._live[key] = [ref, 0, label]
        self._set_size(key, st.nbytes())

    def _set_size(self, key: int, nbytes: int) -> None:
        """A storage's size changed, seen from a safe point (an operator, a resize): classify a peak now."""
        entry = self._live[key]
        delta = nbytes - entry[1]
        if delta < 0 and self._dirty:
            self._freeze()
            self._classify()
        entry[1] = nbytes
        self._total += delta
        if self._total > self.peak_bytes:
            self.peak_bytes = self._total
            self._dirty = True

    def _on_free(self, key: int) -> None:
        """A storage died. This runs inside its destructor (possibly while a ``.grad`` is being replaced, or on
        another thread), so it reads no tensor: it freezes the peak just passed, classified at the next safe
        point."""
        entry = self._live.get(key)
        if entry is None:
            return
        if self._dirty and entry[1] > 0:
            self._freeze()
        del self._live[key]
        self._total -= entry[1]

    def _freeze(self) -> None:
        self._dirty = False
        self._frozen = [(key, entry[1], entry[2], entry) for key, entry in list(self._live.items())]

    def _classify(self) -> None:
        """Break the frozen peak down by category: owned buffers by identity, the rest by where they were
        allocated. A storage once seen owned keeps that category (for peaks frozen just before it dies)."""
        frozen, self._frozen = self._frozen, None
        if frozen is None:
            return
        owned = self._owned()
        cats = dict.fromkeys(CATEGORIES, 0)
        for key, nbytes, label, entry in frozen:
            cat = owned.get(key) if self._live.get(key) is entry else None
            if cat is not None:
                entry[2] = cat
            cats[cat or label] += nbytes
        self.peak_by_category = cats

    def _owned(self) -> dict[int, str]:
        owned: dict[int, str] = {}
        if self.buffers is None:
            return owned
        for cat, tensors in self.buffers().items():
            for t in tensors:
                st = _storage(t) if isinstance(t, torch.Tensor) else None
                if st is not None:
                    owned.setdefault(id(st), cat)
        return owned

    # -- the dispatch mode ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not torch.Tensor and t is not nn.Parameter for t in types):
            return NotImplemented  # tensor subclasses (DTensor) desugar to plain tensors first
        if self._frozen is not None:
            self._classify()
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs:
            return out
        inputs = {id(s) for s in (_storage(t) for t in tree_flatten((args, kwargs))[0]
                                  if isinstance(t, torch.Tensor)) if s is not None}
        label = _FORWARD if self._forward_depth else "other"
        for t in outs:
            st = _storage(t)
            if st is None:
                continue
            key = id(st)
            if key in self._live:  # in place, a view, a resize or set_: follow its size
                if st.nbytes() != self._live[key][1]:
                    self._set_size(key, st.nbytes())
            elif key not in inputs:  # a new storage (views of storages from before the step are not new)
                self._add(st, label)
        return out

    def _resize(self, st: torch.UntypedStorage, size: int):
        if self._frozen is not None:
            self._classify()
        old = st.nbytes()
        result = self._orig_resize(st, size)
        key = id(st)
        if key in self._live:
            self._set_size(key, st.nbytes())
        elif old == 0 and st.nbytes() > 0:
            self._add(st, _FORWARD if self._forward_depth else "other")
        return result

    def _swap(self, st: torch.UntypedStorage, other: torch.UntypedStorage):
        """Two storages exchange their memory (a ZeRO-3 slot lent or taken back): follow both sizes, the one
        that shrinks first, so the total never counts the memory twice."""
        if self._frozen is not None:
            self._classify()
        result = self._orig_swap(st, other)
        label = _FORWARD if self._forward_depth else "other"
        for s in sorted((st, other), key=lambda x: x.nbytes()):
            if id(s) in self._live:
                self._set_size(id(s), s.nbytes())
            elif s.nbytes() > 0:
                self._add(s, label)
        return result

    def _pre_forward(self, module, args) -> None:
        self._forward_depth += 1
        for t in tree_flatten(args)[0]:  # the chunk's inputs are held for its backward
            st = _storage(t) if isinstance(t, torch.Tensor) else None
            if st is not None and id(st) in self._live and self._live[id(st)][2] == "other":
                self._live[id(st)][2] = _FORWARD

    def _post_forward(self, module, args, out) -> None:
        self._forward_depth -= 1

    def __enter__(self) -> PeakMemoryTracker:
        self._reset()
        for cat, tensors in (self.buffers() if self.buffers is not None else {}).items():
            for t in tensors:
                st = _storage(t) if isinstance(t, torch.Tensor) else None
                if st is not None:
                    self._add(st, cat)
        for t in self.baseline() if self.baseline is not None else ():
            st = _storage(t)
            if st is not None:
                self._add(st, "other")
        for m in self.forward_modules:
            self._hooks.append(m.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(m.register_forward_hook(self._post_forward))
        self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):
            return tracker._resize(st, size)

        torch.UntypedStorage.resize_ = resize_
        self._orig_swap = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)
        if self._orig_swap is not None:
            def swap(st, other):
                return tracker._swap(st, other)

            torch.UntypedStorage._swap_data_ptr_ = swap
        if self.device.type == "cuda":  # the run's peak so far survives the reset (device_peak_bytes)
            self.device_run_peak_bytes = max(self.device_run_peak_bytes or 0,
                                             torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            torch.UntypedStorage.resize_ = self._orig_resize
            if self._orig_swap is not None:
                torch.UntypedStorage._swap_data_ptr_ = self._orig_swap
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            if self._dirty:
                self._freeze()
            self._classify()
            if self.device.type == "cuda":
                self._cuda_step_peak = torch.cuda.max_memory_allocated(self.device)
                self.device_run_peak_bytes = max(self.device_run_peak_bytes or 0, self._cuda_step_peak)
            # stop following storages that outlive the step (their callbacks become no-ops)
            self._live = {}

    def result(self) -> StepPeak:
        """What the last tracked step measured."""
        return StepPeak(peak_bytes=self.peak_bytes, peak_by_category=dict(self.peak_by_category),
                        device_step_peak_bytes=self._cuda_step_peak,
                        device_run_peak_bytes=self.device_run_peak_bytes)


class ActivationMemoryCounter:
    """Measures activation memory as the bytes autograd saves for backward, through saved-tensor hooks.

    Saved tensors are de-duplicated by storage (a view counts its whole storage once, since that is what stays
    alive) and parameters and their views are left out (they are model states). ``last`` is what one tracked forward saved;
    ``peak`` the largest of all tracked forwards since :meth:`reset_peak`.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.last = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = 0

    @contextmanager
    def track(self) -> Iterator[None]:
        params = {device_io.storage_key(p) for p in self.model.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            # a parameter, or a view of one (``weight.t()`` inside linear); the view test also covers ZeRO-3,
            # whose parameters live in storages gathered during the forward, unknown when tracking starts
            if not isinstance(t, nn.Parameter) and not isinstance(t._base, nn.Parameter):
                storage = t.untyped_storage()
                ptr = device_io.storage_key(t)
                if ptr not in params and ptr not in seen:
                    seen[ptr] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.last = sum(seen.values())
        self.peak = max(self.peak, self.last)
