"""A resumed run keeps the run it resumes: the checkpoint's global batch, unless ``--global-batch-size`` says
otherwise.

Resolution derives the global batch from the micro-batch and the data-parallel size when the flag is not given,
so resuming at another dp would silently train another run (16 -> 32 sequences per step going from dp 1 to 2).
:func:`resolve_for_resume` resolves a run that loads a checkpoint with the checkpoint's global batch instead,
picking the micro-batch when the one in force does not divide it (the loss and the update do not depend on
the micro-batch, only memory and speed do), and says what it kept or that an explicit global batch differs.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from megazero.checkpoint.store import MANIFEST, resume_step_dir
from megazero.config.errors import ConfigError
from megazero.config.schema import Config

__all__ = ["resolve_for_resume"]


def _saved_training(cfg: Config) -> tuple[Any, dict[str, Any]] | None:
    """(step directory, its saved training settings) of the checkpoint ``--load`` names, if there is one."""
    step_dir = resume_step_dir(cfg.training.load, cfg.training.save)
    if step_dir is None:
        return None
    try:
        return step_dir, json.loads((step_dir / MANIFEST).read_text())["config"]["training"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # loading reports what is wrong with it


def resolve_for_resume(cfg: Config, world_size: int, device_type: str = "cpu",
                       micro_given: bool = False) -> tuple[Config, str | None]:
    """``cfg`` resolved for ``world_size``; when it loads a checkpoint and ``--global-batch-size`` was not given
    (``cfg.training.global_batch_size`` is None), with the checkpoint's global batch. Returns the config and a
    line to log: what was kept, or that a given global batch differs from the checkpoint's (else None).

    The micro-batch in force is kept when it divides the global batch over dp; otherwise, unless it was given
    (``micro_given``: ``"training.micro_batch_size" in cfg.explicit``, then :class:`ConfigError`), the largest one
    below it that does.
    """
    resolved = cfg.resolve(world_size, device_type)
    saved = _saved_training(cfg) if cfg.training.load is not None else None
    if saved is None or saved[1].get("global_batch_size") in (None, resolved.training.global_batch_size):
        return resolved, None
    step_dir, g = saved[0], int(saved[1]["global_batch_size"])
    rt = resolved.training
    if cfg.training.global_batch_size is not None:
        return resolved, (f"--global-batch-size {rt.global_batch_size} differs from the checkpoint's global batch "
                          f"{g} ({step_dir}): the resumed run trains on another batch from here on")
    dp, micro = resolved.parallel.dp_size, rt.micro_batch_size
    if g % dp:
        raise ConfigError(f"the checkpoint {step_dir} trained with global batch {g}, which dp {dp} does not divide; "
                          f"resume at a dp that divides {g}, or pass --global-batch-size to train on another batch")
    per_rank = g // dp
    if per_rank % micro:
        if micro_given:
            raise ConfigError(f"--micro-batch-size {micro} x dp {dp} does not divide the checkpoint's global batch "
                              f"{g}; pass a --micro-batch-size that divides {per_rank}, or --global-batch-size to "
                              "train on another batch")
        micro = max(d for d in range(1, micro + 1) if per_rank % d == 0)
    kept = replace(cfg, training=replace(cfg.training, global_batch_size=g, micro_batch_size=micro,
                                         gradient_accumulation_steps=None)).resolve(world_size, device_type)
    kt = kept.training
    return kept, (f"resuming with the checkpoint's global batch {g} = micro {kt.micro_batch_size} x accumulation "
                  f"{kt.gradient_accumulation_steps} x dp {dp} ({rt.global_batch_size} without it); pass "
                  "--global-batch-size to change it")
