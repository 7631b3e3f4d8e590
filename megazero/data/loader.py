"""A loader that prepares the next step's batch on a background thread, in pinned memory on a CUDA machine.

The training step reads this rank's micro-batches of step k while a thread collates (and pins) those of
step k + 1, so the host never builds a batch between two steps and host-to-device copies can be
asynchronous (``x.to(device, non_blocking=True)`` from pinned memory). The order is the sampler's, exactly
as :func:`~megazero.data.sampler.collate` over ``sampler.next_global_batch()`` gives it: the thread reads
the stream from its own position and the sampler's ``consumed_samples`` advances only when a batch is handed
out, so a checkpoint taken between steps records the position of the batches actually trained on.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from megazero.data.sampler import DistributedBatchSampler, collate

__all__ = ["PrefetchLoader"]

MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]


class PrefetchLoader:
    """This rank's micro-batches, one global batch per call of :meth:`next_global_batch`, ``depth`` ahead.

    ``pin_memory`` None pins when CUDA is available. Use as a context manager or call :meth:`close`.
    """

    def __init__(self, dataset: Any, sampler: DistributedBatchSampler, depth: int = 1,
                 pin_memory: bool | None = None) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.dataset = dataset
        self.sampler = sampler
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._position = sampler.consumed_samples  # where the thread reads next (ahead of the sampler)
        self._thread = threading.Thread(target=self._work, name="megazero-prefetch", daemon=True)
        self._thread.start()

    def _prepare(self, position: int) -> MicroBatches:
        s = self.sampler
        batches = [collate(self.dataset, idx) for idx in s.rank_micro_batches(s.global_batch_indices(position))]
        if self.pin_memory:
            batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]
        return batches

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                item: Any = (self._position, self._prepare(self._position))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            self._position += self.sampler.global_batch_size

    def next_global_batch(self) -> MicroBatches:
        """The next step's micro-batches (prepared ahead); advances the sampler by one global batch."""
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        position, batches = item
        if position != self.sampler.consumed_samples:
            raise RuntimeError(f"prefetch loader out of step: prepared position {position}, sampler at "
                               f"{self.sampler.consumed_samples} (the sampler was moved while the loader ran; "
                               "build a new loader after loading a checkpoint)")
        self.sampler.consumed_samples += self.sampler.global_batch_size
        return batches

    @property
    def ready(self) -> int:
        """Batches prepared and waiting."""
        return self._queue.qsize()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self) -> PrefetchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
