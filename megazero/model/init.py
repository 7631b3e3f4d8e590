"""Initial values: every parameter drawn in full from ``(seed, its unsharded name)``, then sliced for its TP rank
and zero-padded, so any topology starts from the same model (DESIGN.md's conventions).

A model built on the meta device is materialised by ZeRO one parameter (or one stage-3 unit) at a time through
:func:`parameter_initializer`. Its :meth:`ParameterInit.into` writes a value straight into the memory that keeps
it (a view of a flat buffer) on the CPU: where this rank's slice is the whole tensor (tp 1, or a replicated
parameter) the generator fills the view in place, with the same stream and bit for bit the same values as
:func:`initial_value`; a TP shard is cut from the stream replayed piece by piece through one small scratch
(:func:`_draw_shard`), never drawn in full. Why: drawing into fresh tensors (the draw, ``* std``, the padding,
the TP slice) leaves tens of MB of freed heap per large parameter, which glibc keeps resident once a small live
allocation lands above it (bench/README.md, "ZeRO's process peak": 100-230 MB on some ranks of the 49M GPT at
ZeRO-3). Into another dtype or device (a GPU) the value is written so into host memory mapped for it alone
(``device_io.mapped``: unmapped when it dies), then copied.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
from torch import nn

from megazero.distributed import device_io
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


def _runs(spec: ShardSpec, tp_rank: int, tp_size: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """Where this TP rank's shard comes from in the full, unpadded value, both flattened: ``(start, end, at)``
    runs of full elements copied to the shard's flat ``at`` (increasing, disjoint), and ``(at, count)`` runs of
    padding (zeros)."""
    dim, shape = spec.partition_dim, spec.full_shape
    outer, inner, size = math.prod(shape[:dim]), math.prod(shape[dim + 1:]), shape[dim]
    rows = spec.rank_rows(tp_rank, tp_size)  # along the padded dim
    local = sum(hi - lo for lo, hi in rows)
    runs, pads = [], []
    for o in range(outer):
        at = o * local
        for lo, hi in rows:
            real = min(hi, size)
            if lo < real:
                runs.append(((o * size + lo) * inner, (o * size + real) * inner, at * inner))
            if hi > max(lo, size):
                pads.append(((at + max(lo, size) - lo) * inner, (hi - max(lo, size)) * inner))
            at += hi - lo
    return runs, pads


def _draw_shard(spec: ShardSpec, out: torch.Tensor, generator: torch.Generator, tp_rank: int, tp_size: int,
                chunk: int = 1 << 14) -> None:
    """:func:`initial_value`'s TP shard written into ``out`` (contiguous fp32 on the CPU) without the full value:
    the generator's stream is replayed in pieces of ``chunk`` elements through one scratch in mapped memory, and
    this rank's elements copied out of each piece (the outer indices whose whole row of the full value lies in
    a piece through 2-D views, one copy per run), then scaled by ``std`` at once (the padding is zero).

    Bit for bit the full draw's values, by how the CPU's ``normal_`` fills a float tensor of n >= 16 elements:
    one 32-bit draw per element in order, turned into normals 16 elements at a time (pairs ``j``, ``j + 8``),
    then 16 more draws recompute the last 16 elements where n is no multiple of 16. So a piece that starts at
    a multiple of 16 of the stream and ends at least 16 elements before its end holds the full draw's values,
    and the last piece, running to the end, holds them with that tail (tests/test_zero_rss.py checks it against
    the full draw at every cut)."""
    flat = out.view(-1)
    runs, pads = _runs(spec, tp_rank, tp_size)
    for at, n in pads:
        flat[at: at + n].zero_()
    if spec.init != "normal":
        for a, b, at in runs:
            flat[at: at + b - a].fill_(1.0 if spec.init == "ones" else 0.0)
        return
    size, chunk = math.prod(spec.full_shape), max(16, chunk // 16 * 16)
    outer = math.prod(spec.full_shape[: spec.partition_dim])
    per, row, local = len(runs) // outer, size // outer, flat.numel() // outer  # runs, elements per outer index
    rows = flat.view(outer, local)
    scratch = device_io.mapped(min(chunk + 16, size), torch.float32)  # off the heap, unmapped when it dies
    c, i, end = 0, 0, max((b for _, b, _ in runs), default=0)
    while c < end:
        e = size if size - c < chunk + 16 else c + chunk  # the last piece runs to the end (16 to chunk + 15)
        piece = scratch[: e - c].normal_(0.0, 1.0, generator=generator)
        while i < len(runs) and runs[i][0] < e:
            o = i // per
            n = min(e // row, outer) - o  # outer indices whose whole row lies in this piece (from run i's)
            if i % per == 0 and o * row >= c and n > 0:  # their runs: one copy per run, through 2-D views
                whole = piece[o * row - c: (o + n) * row - c].view(n, row)
                for a, b, at in runs[i: i + per]:
                    rows[o: o + n, at - o * local: at - o * local + b - a].copy_(whole[:, a - o * row: b - o * row])
                i += n * per
                continue
            a, b, at = runs[i]
            lo, hi = max(a, c), min(b, e)
            flat[at + lo - a: at + hi - a].copy_(piece[lo - c: hi - c])
            if b > e:
                break
            i += 1
        c = e
    flat.mul_(spec.std)  # (the padding is zero)


@torch.no_grad()
def write_initial_value(out: torch.Tensor, p: nn.Parameter, name: str, seed: int,
                        tp_group: Group | None = None) -> None:
    """Write :func:`initial_value` into ``out`` (``p``'s shape, any dtype and device; rounded to its dtype).

    In place, without a temporary, where ``out`` is contiguous fp32 on the CPU: where this rank's slice is the
    whole (padded) tensor the draw fills the real rows and the padding rows (after them along ``partition_dim``
    0) are zeroed; a TP shard is drawn without the full value (:func:`_draw_shard`). Into another dtype or
    device the value is written so into mapped host memory (off the heap), then copied (rounded) into ``out``."""
    spec = p.shard_spec
    tp_size, tp_rank = tp_size_rank(tp_group)
    dim = spec.partition_dim
    body = out
    if dim is not None and tp_size == 1 and out.shape[dim] > spec.full_shape[dim]:  # vocab padding at the end
        body = out.narrow(dim, 0, spec.full_shape[dim])
    host32 = out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous()
    if host32 and (dim is None or tp_size == 1) and body.is_contiguous():
        _draw(spec, body, _generator(seed, name))
        if body is not out:
            out.narrow(dim, body.shape[dim], out.shape[dim] - body.shape[dim]).zero_()
        return
    if host32 and dim is not None:
        _draw_shard(spec, out, _generator(seed, name), tp_rank, tp_size)
        return
    value = device_io.mapped(out.numel(), torch.float32).view(out.shape)  # another dtype or device: drawn off
    write_initial_value(value, p, name, seed, tp_group)  # the heap as above, then copied (rounded) into ``out``
    out.copy_(value)


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
