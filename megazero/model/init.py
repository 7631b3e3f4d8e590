"""Initial values: every parameter drawn in full from ``(seed, its unsharded name)``, then sliced for its TP rank
and zero-padded, so any topology starts from the same model (DESIGN.md's conventions).

A model built on the meta device is materialised by ZeRO one parameter (or one stage-3 unit) at a time through
:func:`parameter_initializer`. Its :meth:`ParameterInit.into` writes a value straight into the memory that keeps
it (a view of a flat buffer) wherever this rank's slice is the whole tensor on the CPU (tp 1, or a replicated
parameter): the generator fills the view in place, with the same stream and bit for bit the same values as
:func:`initial_value`, and no temporary is made. Why: drawing into fresh tensors (the draw, ``* std``, the
padding, the TP slice) leaves tens of MB of freed heap per large parameter, which glibc keeps resident once a
small live allocation lands above it (bench/README.md, "ZeRO's process peak": 100-230 MB on some ranks of the
49M GPT at ZeRO-3). Elsewhere (a TP slice, a GPU) the full value is drawn on the host and copied.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn

from megazero.distributed.group import Group
from megazero.tensor_parallel.layers import ShardSpec, shard_full_tensor, tp_size_rank

__all__ = ["ParameterInit", "init_parameters", "initial_value", "parameter_initializer", "write_initial_value"]


def _name_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(_name_seed(seed, name))


def initial_value(p: nn.Parameter, name: str, seed: int, tp_group: Group | None = None) -> torch.Tensor:
    """The fp32 initial value of parameter ``p`` at this rank's (TP-shard) shape: drawn in full at its
    unsharded shape from ``(seed, name)``, then sliced for this TP rank (``name`` is the unsharded name)."""
    tp_size, tp_rank = tp_size_rank(tp_group)
    spec = p.shard_spec
    return shard_full_tensor(spec.make_full(_generator(seed, name)), spec, tp_rank, tp_size)


def _draw(spec: ShardSpec, out: torch.Tensor, generator: torch.Generator) -> None:
    """:meth:`ShardSpec.make_full` into ``out`` (contiguous fp32 on the CPU, the full shape's element count):
    ``randn`` is ``normal_(0, 1)`` on a fresh tensor, so the values are the same bit for bit."""
    if spec.init == "normal":
        out.normal_(0.0, 1.0, generator=generator).mul_(spec.std)
    elif spec.init == "zeros":
        out.zero_()
    elif spec.init == "ones":
        out.fill_(1.0)
    else:
        raise ValueError(f"unknown init {spec.init!r}")


@torch.no_grad()
def write_initial_value(out: torch.Tensor, p: nn.Parameter, name: str, seed: int,
                        tp_group: Group | None = None) -> None:
    """Write :func:`initial_value` into ``out`` (``p``'s shape, any dtype and device; rounded to its dtype).

    In place, without a temporary, where ``out`` is contiguous fp32 on the CPU and this rank's slice is the
    whole (padded) tensor: the draw fills the real rows, the padding rows (after them along ``partition_dim``
    0) are zeroed. Otherwise the value is drawn and sliced as :func:`initial_value` does, then copied."""
    spec = p.shard_spec
    tp_size, _ = tp_size_rank(tp_group)
    dim = spec.partition_dim
    body = out
    if dim is not None and tp_size == 1 and out.shape[dim] > spec.full_shape[dim]:  # vocab padding at the end
        body = out.narrow(dim, 0, spec.full_shape[dim])
    if ((dim is None or tp_size == 1) and out.device.type == "cpu" and out.dtype == torch.float32
            and out.is_contiguous() and body.is_contiguous()):
        _draw(spec, body, _generator(seed, name))
        if body is not out:
            out.narrow(dim, body.shape[dim], out.shape[dim] - body.shape[dim]).zero_()
        return
    out.copy_(initial_value(p, name, seed, tp_group))


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, tp_group: Group | None = None) -> None:
    """Initialise every parameter from ``(seed, its unsharded name)`` at full shape, then keep this rank's slice.

    Any topology (tp, pp) therefore starts from the same model.
    """
    for name, p in model.named_parameters():
        if p.is_meta:  # no storage to fill (the dry run)
            continue
        write_initial_value(p.data, p, name, seed, tp_group)


class ParameterInit:
    """One meta-built parameter's initial value, from ``(seed, its name in chunks)``: ``init(p)`` a new fp32
    tensor on ``device``, ``init.into(p, out)`` written into ``out`` (in place where it can: module docstring)."""

    def __init__(self, chunks: list[nn.Module], seed: int, tp_group: Group | None, device: torch.device) -> None:
        self.names = {p: n for chunk in chunks for n, p in chunk.named_parameters()}
        self.seed, self.tp_group, self.device = seed, tp_group, device

    def name(self, p: nn.Parameter) -> str:
        """The unsharded name ``p`` is seeded from."""
        return self.names[p]

    def __call__(self, p: nn.Parameter) -> torch.Tensor:
        return initial_value(p, self.name(p), self.seed, self.tp_group).to(self.device)

    def into(self, p: nn.Parameter, out: torch.Tensor) -> None:
        write_initial_value(out, p, self.name(p), self.seed, self.tp_group)


def parameter_initializer(chunks: list[nn.Module], seed: int, tp_group: Group | None,
                          device: torch.device) -> Callable[[nn.Parameter], torch.Tensor]:
    """For a model built on the meta device: a function giving one parameter's initial fp32 value on
    ``device``, bit-identical to :func:`init_parameters` on each of ``chunks`` (ZeRO's sharded initialisation
    materialises one gather unit at a time with it, in place through :meth:`ParameterInit.into`)."""
    if torch.device(device).type == "meta":  # the dry run: shapes only, nothing to compute
        return lambda p: torch.empty(p.shape, dtype=torch.float32, device=device)
    return ParameterInit(chunks, seed, tp_group, device)
