"""The peak of a step by category from the device allocator, where :class:`~megazero.observe.memory.PeakMemoryTracker`
cannot run: under ``--compile`` its dispatch mode would make Dynamo fall back to eager for good.

Around the step the allocator's peak is reset and read (CUDA's ``max_memory_allocated``); the categories that
need no interception are filled in by walking tensors: the model states (``params``, ``grads``,
``master_params``, ``optimizer_states``, ``comm_buffers``) from the buffers megazero owns, each storage once,
as the step leaves them; ``activations`` from the saved-tensor counter, which compiled graphs feed as eager ones
do (the most bytes the step stashed). ``other`` is the rest of the peak: gradients in flight, recomputation,
temporaries. A bound rather than a split at one moment: on stages 2-3 the gradient partition may fill only as
activations are freed, so ``other`` can come out smaller than at the true moment of the peak.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megazero.distributed import device_io
from megazero.observe.memory import CATEGORIES, Buffers, StepPeak

__all__ = ["DevicePeak"]

_STATES = ("params", "grads", "master_params", "optimizer_states", "comm_buffers")


class DevicePeak:
    """Use once per step like the tracker::

        with DevicePeak(device, lambda: zero_buffers(opt), lambda: engine.activation_peak_bytes) as peak:
            engine.train_step(batch)
        peak.result()  # StepPeak

    ``read_peak``/``reset_peak`` default to CUDA's allocator statistics on ``device`` (tests pass others).
    """

    def __init__(self, device: torch.device | str, buffers: Buffers, activations: Callable[[], int | None],
                 read_peak: Callable[[], int] | None = None, reset_peak: Callable[[], None] | None = None) -> None:
        self.device = torch.device(device)
        self.buffers, self.activations = buffers, activations
        self.read_peak = read_peak or (lambda: torch.cuda.max_memory_allocated(self.device))
        self.reset_peak = reset_peak or (lambda: torch.cuda.reset_peak_memory_stats(self.device))
        self.run_peak: int | None = None
        self._result: StepPeak | None = None

    def __enter__(self) -> DevicePeak:
        self.run_peak = max(self.run_peak or 0, self.read_peak())  # the run's peak survives the reset
        self.reset_peak()
        return self

    def __exit__(self, *exc: object) -> None:
        peak = self.read_peak()
        self.run_peak = max(self.run_peak or 0, peak)
        seen: set[int] = set()
        by_cat = dict.fromkeys(CATEGORIES, 0)
        keys = {"master": "master_params", "states": "optimizer_states", "comm": "comm_buffers"}
        for cat, tensors in self.buffers().items():
            cat = keys.get(cat, cat)
            if cat not in _STATES:
                continue
            for t in tensors:
                if not isinstance(t, torch.Tensor) or t.device.type != self.device.type:
                    continue
                key = device_io.storage_key(t)
                if key not in seen:  # a storage counts once, however many views share it
                    seen.add(key)
                    by_cat[cat] += t.untyped_storage().nbytes()
        by_cat["activations"] = min(int(self.activations() or 0), max(0, peak - sum(by_cat.values())))
        by_cat["other"] = max(0, peak - sum(by_cat.values()))
        self._result = StepPeak(peak_bytes=peak, peak_by_category=by_cat, device_step_peak_bytes=peak,
                                device_run_peak_bytes=self.run_peak)

    def result(self) -> StepPeak:
        if self._result is None:
            raise RuntimeError("DevicePeak.result() before a step was measured")
        return self._result
