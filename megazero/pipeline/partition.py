"""Split the GPT's layers into pipeline stages (and virtual stages for the interleaved schedule).

With ``pp`` ranks and ``V`` model chunks per rank there are ``pp * V`` virtual stages; chunk ``c`` of pipeline
rank ``r`` is virtual stage ``c * pp + r`` (Megatron-LM's interleaving), so consecutive virtual stages sit
on consecutive ranks and activations always travel to rank ``(r + 1) % pp``. The ``zbv`` schedule places its
two chunks per rank in a V instead (chunk 0 is stage ``r``, chunk 1 stage ``2 pp - 1 - r``:
:func:`~megazero.pipeline.schedules.virtual_stage`), so rank 0 holds both the first and the last stage. The
first virtual stage also holds the embeddings, the last the final LayerNorm and the (tied) LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

from megazero.pipeline.schedules import virtual_stage

__all__ = ["StageSpec", "PipelineLayoutError", "partition_layers", "stage_specs"]


class PipelineLayoutError(ValueError):
    """Layers that cannot be split as asked."""


@dataclass(frozen=True)
class StageSpec:
    """What one model chunk of one pipeline rank holds."""

    virtual_stage: int
    layers: range
    pre_process: bool  # token and position embeddings
    post_process: bool  # final LayerNorm, LM head and loss


def partition_layers(num_layers: int, num_stages: int, layout: list[int] | None = None) -> list[range]:
    """Contiguous layer ranges for ``num_stages`` (virtual) stages.

    Balanced by default (sizes differ by at most one; later stages take the extra layers, since the first
    stage also runs the embedding and the last the LM head, which is costlier); ``layout`` gives the number
    of layers of each stage explicitly.
    """
    if num_stages < 1:
        raise PipelineLayoutError(f"need at least one pipeline stage, got {num_stages}")
    if layout is not None:
        if len(layout) != num_stages:
            raise PipelineLayoutError(
                f"--pp-layout has {len(layout)} entries but there are {num_stages} (virtual) pipeline stages;"
                " give one layer count per stage")
        if sum(layout) != num_layers or min(layout) < 1:
            raise PipelineLayoutError(
                f"--pp-layout {','.join(map(str, layout))} must give every stage at least one layer and sum to"
                f" --num-layers {num_layers}")
        sizes = list(layout)
    else:
        if num_layers < num_stages:
            raise PipelineLayoutError(
                f"--num-layers {num_layers} is fewer than the {num_stages} (virtual) pipeline stages; every stage"
                " needs at least one layer: lower --pp/--virtual-stages or add layers")
        base, extra = divmod(num_layers, num_stages)
        sizes = [base + (1 if s >= num_stages - extra else 0) for s in range(num_stages)]
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def stage_specs(num_layers: int, pp_size: int, pp_rank: int, virtual_stages: int = 1,
                layout: list[int] | None = None, schedule: str = "") -> list[StageSpec]:
    """The model chunks pipeline rank ``pp_rank`` holds, in chunk order (``schedule`` "zbv": the V layout)."""
    total = pp_size * virtual_stages
    ranges = partition_layers(num_layers, total, layout)
    return [
        StageSpec(virtual_stage=v, layers=ranges[v], pre_process=v == 0, post_process=v == total - 1)
        for v in (virtual_stage(schedule, pp_size, pp_rank, c) for c in range(virtual_stages))
    ]
