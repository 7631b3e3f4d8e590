"""Observability: rank-aware logging, the FLOPs count, per-rank memory and communication records, the peak
memory tracker, and the sinks (metrics.jsonl, W&B dashboards).

It sits below the runtime: the engine and executor call into it to measure, and it never imports them."""

from megazero.observe.log import get_logger, setup_logging

__all__ = ["get_logger", "setup_logging"]
