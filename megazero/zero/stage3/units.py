"""ZeRO stage 3's units of gathering: a model's chunks, their transformer blocks and their own parameters.

A *chunk* is a module with its own ``forward`` that a schedule runs as a whole: the model itself, or (for a
container such as the ``nn.ModuleList`` of an interleaved pipeline's model chunks) each child with a forward.
Inside a chunk, each element of a ``nn.ModuleList``/``nn.ModuleDict`` child (GPT's ``blocks``: one transformer
block) is a *block unit*, gathered just before its forward and its backward and released after each. Every
other trainable parameter of the chunk (embeddings, final LayerNorm, the tied LM head) belongs to the chunk's
*root units*, gathered for the chunk's whole forward and whole backward (the tied embedding is read at both
ends of the chunk). A parameter listed in ``isolate`` gets a root unit of its own, so its partition over the
DP group depends on nothing else (the tied embedding's two pipeline copies must be partitioned alike). So does a
chunk's own parameter larger than its largest block (GPT-2 124M's token embedding, 5.5 blocks): alone in its unit
(unpadded where its size divides evenly), its gradient is reduce-scattered straight from its ``.grad``, where a
unit shared with the position table copied it into a staging buffer of the unit's size first (at 124M with
seq 1024, whose position table is sharded, a fresh 157 MB per rank and step, faulted in; at seq 32 the table
stays whole and the embedding was alone already).

Each unit's parameters form one :class:`~megazero.zero.bucketed.FlatLayout` over the DP group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megazero.zero.bucketed import FlatLayout

__all__ = ["PreBackward", "Unit", "UnitSpec", "collect_units", "model_chunks", "saves_storage"]


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def model_chunks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name prefix, chunk)``: ``model`` itself if it has a forward, else its children that have one."""
    if _has_forward(model):
        return [("", model)]
    chunks = [(f"{name}.", child) for name, child in model.named_children() if _has_forward(child)]
    if not chunks:
        raise ValueError("ZeRO-3 needs a model with a forward, or a container of modules with a forward")
    return chunks


@dataclass
class UnitSpec:
    """One unit before sharding: its name, the module whose forward gathers it, its chunk and parameters."""

    name: str
    module: nn.Module
    chunk: int
    params: list[nn.Parameter]
    is_root: bool


def collect_units(model: nn.Module, isolate: Sequence[nn.Parameter] = (), apart_larger: bool = True
                  ) -> list[UnitSpec]:
    """Every chunk's root units (its own parameters; isolated ones apart, and with ``apart_larger`` those larger
    than a block) then its block units, in order.

    Only trainable parameters are listed, each once; units without parameters are left out.
    """
    seen: set[int] = set()
    isolated = {id(p) for p in isolate}
    out: list[UnitSpec] = []

    def fresh(ps) -> list[nn.Parameter]:
        keep = [p for p in ps if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in keep)
        return keep

    for c, (prefix, chunk) in enumerate(model_chunks(model)):
        blocks: list[tuple[str, nn.Module]] = []
        for name, child in chunk.named_children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                blocks += [(f"{prefix}{name}.{key}", block) for key, block in child.named_children()]
        in_blocks = {id(p) for _, b in blocks for p in b.parameters()}
        own = [p for p in chunk.parameters() if id(p) not in in_blocks]
        largest = max((sum(p.numel() for p in b.parameters() if p.requires_grad) for _, b in blocks), default=0)
        if largest and apart_larger:  # own parameters larger than a block: units of their own (module docstring)
            isolated |= {id(p) for p in own if p.numel() > largest}
        rest = fresh([p for p in own if id(p) not in isolated])
        for p in own:
            if id(p) in isolated:
                name = next(n for n, q in chunk.named_parameters() if q is p)
                out += [UnitSpec(f"{prefix}{name}", chunk, c, ps, True) for ps in [fresh([p])] if ps]
        if rest:
            out.append(UnitSpec(f"{prefix}(own parameters)" if prefix else "(own parameters)", chunk, c, rest, True))
        for name, block in blocks:
            ps = fresh(block.parameters())
            if ps:
                out.append(UnitSpec(name, block, c, ps, False))
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(f"ZeRO-3 found trainable parameters outside every model chunk: {missing[:5]}")
    return out


class Unit:
    """One gather unit: parameters viewed into ``full`` (storage freed while released), sharded over DP.

    ``shard`` is this rank's slice of the flat parameters (model dtype; in host memory with ``offload_param``),
    ``grad`` its slice of the reduced gradient (the reduction dtype); ``filed`` holds this backward's fresh
    local gradients until they reach ``flush_numel`` elements (the largest parameter's) or the unit is complete,
    when one foreach copy moves them into ``staging``, which is reduce-scattered.
    """

    def __init__(self, uid: int, spec: UnitSpec, layout: FlatLayout, shard: torch.Tensor, grad: torch.Tensor,
                 full: torch.Tensor) -> None:
        self.uid, self.name, self.module, self.chunk = uid, spec.name, spec.module, spec.chunk
        self.params, self.is_root, self.layout = spec.params, spec.is_root, layout
        self.shard, self.grad, self.full = shard, grad, full
        self.grad_live = False  # ``grad`` holds this step's reduced gradient (else its storage is freed)
        self.numel = layout.padded_numel
        self.full_bytes = full.numel() * full.element_size()
        self.views = layout.views(full, [p.shape for p in self.params])
        self.index = {p: i for i, p in enumerate(self.params)}
        self.gathered = False
        self.work = None  # the all-gather in flight into ``full``
        self.kept: int | None = None  # gathered elements since a recomputation finished with it (reuse)
        self.arrived = [False] * len(self.params)
        self.remaining = len(self.params)
        self.reduced = False
        self.staging: torch.Tensor | None = None
        self.filed: list[tuple[int, torch.Tensor]] = []  # (parameter index, fresh gradient) not yet staged
        self.filed_numel = 0
        self.flush_numel = max(p.numel() for p in self.params)  # filed gradients are staged from this size on
        self.staged: set[int] = set()  # parameters staged in this backward
        self.staging_slot: torch.Tensor | None = None  # the pool's slot ``staging`` views (None: its own memory)
        self.staged_in_full = False  # ``staging`` is ``full`` itself (gradients written over used parameters)

    def reset_backward(self) -> None:
        self.arrived = [False] * len(self.params)
        self.filed, self.filed_numel, self.staged = [], 0, set()
        self.remaining, self.reduced = len(self.params), False

    def __repr__(self) -> str:
        return f"Unit({self.uid}, {self.name!r}, {self.numel} elements, gathered={self.gathered})"


class PreBackward(torch.autograd.Function):
    """Identity whose backward first calls ``callback`` (gathers a unit before its backward runs)."""

    @staticmethod
    def forward(ctx, callback, x):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return None, grad


def saves_storage(tensors, storages: set[int], names: dict[type, list[str]], limit: int = 256) -> bool:
    """Whether the autograd graph behind ``tensors`` saved, for its backward, a tensor on one of ``storages``
    (``UntypedStorage._cdata`` keys): each node's ``_saved_*`` values, and a custom Function's saved tensors
    and tensor attributes. Leaves (``AccumulateGrad``) are not entered. True too when it cannot tell (a node
    whose saved values cannot be read, or more than ``limit`` nodes): the safe answer. ``names`` caches each
    node type's saved-value attribute names (the caller keeps it).

    ZeRO-3 asks it of the part of a chunk's forward before its first block: if nothing there saved a root
    unit's parameters (GPT's embeddings save only the token ids), that unit is not needed once backward has
    reached the blocks, and is released for the rest of backward.
    """
    nodes = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[int] = set()
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in seen or type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(id(node))
        if len(seen) > limit:
            return True
        try:
            values = _saved_values(node, names)
        except Exception:  # noqa: BLE001 - freed or unreadable saved values: assume the worst
            return True
        for v in values:
            if isinstance(v, torch.Tensor) and v.untyped_storage()._cdata in storages:
                return True
        nodes += [f for f, _ in node.next_functions]
    return False


def _saved_values(node, cache: dict[type, list[str]]) -> list:
    if isinstance(node, torch.autograd.function.BackwardCFunction):  # a custom Function: its ctx
        return list(node.saved_tensors) + list(vars(node).values())
    names = cache.get(type(node))
    if names is None:
        names = cache[type(node)] = [n for n in dir(node) if n.startswith("_saved_")]
    out = []
    for n in names:
        v = getattr(node, n)
        out += list(v) if isinstance(v, (tuple, list)) else [v]
    return out
