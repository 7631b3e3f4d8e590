"""Context parallelism's building block: load-balanced sharding, true positions, and attention over a split
sequence (ring and all-gather modes) against plain ``scaled_dot_product_attention`` on the full sequence, plus
the ring's recorded point-to-point calls replayed under NCCL's rules.

One gloo world per topology (cp 2, cp 4, tp2·cp2) runs every check; the reference is torch's own attention
(independent of megazero), computed on each rank from the same seed. Negative controls: a wrong chunk offset
and a merge that skips the softmax rescaling must break the match, and the ring's calls issued one by one
(send, then receive) must deadlock in the replay.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megazero.context_parallel import (
    CP_ATTENTION_MODES,
    chunk_ids,
    context_parallel_attention,
    gather_sequence,
    local_positions,
    shard_sequence,
    unshard_sequence,
)
from megazero.distributed.context import RankGrid
from megazero.distributed.group import Group
from megazero.pipeline.p2p_replay import record_p2p, replay
from tests.dist import run_world

BATCH, HEADS, HEAD_DIM, CHUNK = 2, 4, 8, 3  # chunks of 3 tokens: odd, so an off-by-one offset shows
TOL = 1e-5
# (mode, kv heads, causal, ring kernel): multi-head and grouped-query (2 query heads per K/V head), one non-causal;
# the ring's blocks through the fused kernel and through the plain matmul path
CASES = ([("allgather", hkv, True, "auto") for hkv in (HEADS, HEADS // 2)]
         + [("ring", hkv, causal, kernel) for kernel in ("fused", "matmul") for hkv, causal in
            ((HEADS, True), (HEADS // 2, True), (HEADS // 2, False))])


# -- sharding and positions, no processes ---------------------------------------------------------------------
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_sharding_round_trips_and_positions_are_true_offsets(cp):
    seq = 2 * cp * CHUNK
    x = torch.randn(2, seq, 5)
    shards = [shard_sequence(x, r, cp) for r in range(cp)]
    assert torch.equal(unshard_sequence(shards), x)
    assert torch.equal(unshard_sequence([shard_sequence(x, r, cp, seq_dim=-2) for r in range(cp)], seq_dim=-2), x)
    work = set()
    for r in range(cp):
        first, second = chunk_ids(r, cp)
        expect = list(range(first * CHUNK, (first + 1) * CHUNK)) + list(range(second * CHUNK, (second + 1) * CHUNK))
        pos = local_positions(seq, r, cp)
        assert pos.tolist() == expect and torch.equal(shards[r], x[:, pos])
        work.add(int((pos + 1).sum()))  # causal query-key pairs this rank's queries own
    assert work == {CHUNK * CHUNK * (2 * cp - 1) + CHUNK * (CHUNK + 1)}  # balanced: the same on every rank
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 2 x cp = 4.*--seq-len"):
        shard_sequence(torch.zeros(1, 10), 0, 2)


def test_a_cp_group_of_one_is_plain_attention_and_bad_inputs_fail_clearly():
    group = Group("cp", [0], None, device="cpu")
    q, k, v, _ = _inputs(2 * CHUNK, HEADS // 2)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for mode in CP_ATTENTION_MODES:
        assert torch.equal(context_parallel_attention(q, k, v, group, mode=mode), ref)
    with pytest.raises(ValueError, match="unknown context-parallel attention mode 'ulysses'"):
        context_parallel_attention(q, k, v, group, mode="ulysses")
    with pytest.raises(ValueError, match="K/V heads must divide the query heads"):
        context_parallel_attention(q, k[:, :, :-2], v[:, :, :-2], group)


# -- attention over a split sequence, one world per topology -------------------------------------------------
def _inputs(seq: int, hkv: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seq * 10 + hkv)
    shapes = [(BATCH, HEADS, seq, HEAD_DIM)] + [(BATCH, hkv, seq, HEAD_DIM)] * 2 + [(BATCH, HEADS, seq, HEAD_DIM)]
    return tuple(torch.randn(s, generator=gen) for s in shapes)


def _errors(ctx, mode: str, hkv: int, causal: bool, kernel: str = "auto") -> float:
    """Largest difference of this rank's output and q/k/v gradients from full-sequence attention."""
    n, r = ctx.cp_size, ctx.cp_rank
    q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(_inputs(2 * n * CHUNK, hkv)))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != HEADS)
    ref.backward(dout)
    # TP splits the heads (query heads in blocks that keep their K/V head), CP the sequence
    tq, tkv = HEADS // ctx.tp_size, hkv // ctx.tp_size

    def mine(t, h):
        return shard_sequence(t[:, ctx.tp_rank * h: (ctx.tp_rank + 1) * h], r, n, seq_dim=2).detach()

    local = [mine(t, h).requires_grad_() for t, h in ((q, tq), (k, tkv), (v, tkv))]
    out = context_parallel_attention(*local, ctx.cp_group, mode=mode, causal=causal, kernel=kernel)
    out.backward(mine(dout, tq))
    pairs = [(out, mine(ref, tq))] + [(a.grad, mine(t.grad, h)) for a, t, h in zip(local, (q, k, v), (tq, tkv, tkv))]
    return max((a - b).abs().max().item() for a, b in pairs)


def _broken_merge(out, lse, block_out, block_lse):
    out.add_(block_out)  # no rescaling by exp(lse - new): each block weighted as if it held the whole softmax
    lse.copy_(torch.logaddexp(lse, block_lse))


class _OpLog(TorchDispatchMode):
    """Every aten op run inside, with its tensor outputs' shapes and dtypes (what the block kernels create)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[tuple[tuple[int, ...], torch.dtype]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else [out]
        self.ops.append((str(func.overloadpacket), [(tuple(t.shape), t.dtype) for t in flat
                                                    if isinstance(t, torch.Tensor)]))
        return out


def _kernel_trace(ctx, kernel: str) -> dict:
    """What one GQA ring forward + backward creates: fused-kernel calls, boolean tensors, chunk x chunk blocks."""
    with _OpLog() as log:
        err = _errors(ctx, "ring", HEADS // 2, True, kernel)
    outputs = [o for _, outs in log.ops for o in outs]
    return {"error": err, "fused_calls": sum("_scaled_dot_product_flash_attention_for_cpu" in n for n, _ in log.ops),
            "bool_tensors": sum(dtype == torch.bool for _, dtype in outputs),
            "score_blocks": sum(len(shape) >= 2 and shape[-2:] == (CHUNK, CHUNK) for shape, _ in outputs)}


def _world(ctx):
    from megazero.context_parallel import ring

    res = {"cp_ranks": ctx.cp_group.ranks, "errors": {c: _errors(ctx, *c) for c in CASES}}
    res["traces"] = {kernel: _kernel_trace(ctx, kernel) for kernel in ("auto", "matmul")}
    res["auto_kernel"] = ring.block_kernel(torch.zeros(1, 1, 2, HEAD_DIM))
    n, r, seq = ctx.cp_size, ctx.cp_rank, 2 * ctx.cp_size * CHUNK
    x = torch.arange(2.0 * seq).view(2, seq) + 100 * ctx.tp_rank
    res["gathered"] = torch.equal(gather_sequence(shard_sequence(x, r, n), ctx.cp_group), x)
    res["positions"] = local_positions(seq, r, n).tolist()

    # the ring's calls, forward and backward, and what the ledger counted for them
    before = dict(ctx.ledger.totals)
    res["log"] = record_p2p(ctx.cp_group)
    res["ring_error"] = _errors(ctx, "ring", HEADS // 2, True)
    ctx.cp_group.p2p_log = None
    res["sent"] = {tag: ctx.ledger.totals[("cp", "send", tag)] - before.get(("cp", "send", tag), 0)
                   for tag in ("kv", "kv_grad")}

    # negative controls: a wrong chunk offset (the contiguous layout's ids), a merge without rescaling
    for name, attr, bad in (("offset", "chunk_ids", lambda rank, size: (2 * rank, 2 * rank + 1)),
                            ("merge", "_merge", _broken_merge)):
        good, _ = getattr(ring, attr), setattr(ring, attr, bad)
        try:
            for kernel in ("fused", "matmul"):
                res[f"broken_{name}_{kernel}"] = _errors(ctx, "ring", HEADS // 2, True, kernel)
        finally:
            setattr(ring, attr, good)
    return res


TOPOLOGIES = {"cp2": (2, 1), "cp4": (4, 1), "tp2_cp2": (2, 2)}


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_attention_over_a_split_sequence_equals_full_attention(name):
    cp, tp = TOPOLOGIES[name]
    world = cp * tp
    results = run_world(_world, world, cp=cp, tp=tp, timeout=120)
    grid = RankGrid(world, tp_size=tp, cp_size=cp)
    for rank, res in enumerate(results):
        assert res["cp_ranks"] == grid.group_of("cp", rank)  # groups compose: the ring runs within one tp rank
        for case, err in res["errors"].items():
            assert err < TOL, (name, rank, case, err)
        assert res["ring_error"] < TOL and res["gathered"]
        cp_rank = grid.position(rank).cp_rank
        assert res["positions"] == local_positions(2 * cp * CHUNK, cp_rank, cp).tolist()
        # the broken ring must miss by far more than the tolerance, on either kernel
        broken = {key: val for key, val in res.items() if key.startswith("broken_")}
        assert len(broken) == 4 and min(broken.values()) > 1e-2, broken
        # torch 2.13's CPU has the fused op with log-sum-exp: the default ring calls it for every block and builds
        # neither a boolean mask nor a chunk x chunk score block; the matmul path (the negative control) builds both
        fused, plain = res["traces"]["auto"], res["traces"]["matmul"]
        assert res["auto_kernel"] == "cpu" and fused["error"] < TOL and plain["error"] < TOL
        blocks = 3 + 2 * (cp - 1)  # per rank: 3 blocks at step 0, 2 at each later step, forward and backward
        reference = 2  # the reference's own SDPA forward and backward (torch's CPU dispatch picks the same op)
        assert fused["fused_calls"] == 2 * blocks + reference and fused["bool_tensors"] == fused["score_blocks"] == 0, fused
        assert plain["fused_calls"] == reference and plain["bool_tensors"] > 0 and plain["score_blocks"] > 0, plain
        # ledger: K/V (BATCH x 2 heads x 2 chunks x HEAD_DIM each) go round cp - 1 hops forward and again
        # backward; dK/dV take cp hops in the backward
        kv = 2 * BATCH * (HEADS // 2 // tp) * 2 * CHUNK * HEAD_DIM
        assert res["sent"] == {"kv": 2 * (cp - 1) * kv, "kv_grad": cp * kv}, res["sent"]
    logs = {rank: res["log"] for rank, res in enumerate(results)}
    assert all(len(call) == 2 for log in logs.values() for call in log)  # a send and a receive per hop
    result = replay(logs)
    assert result.ok, str(result)
    # the same calls issued one operation at a time (send first) deadlock under NCCL's rules
    one_by_one = {rank: [[op] for call in log for op in call] for rank, log in logs.items()}
    assert not replay(one_by_one).completed


# -- the CUDA kernels' calls: shapes on meta here, values on a GPU ----------------------------------------------
def _block_operands(device: str, dtype: torch.dtype, g: int = 2, c: int = 16, d: int = 64):
    gen = torch.Generator().manual_seed(7)
    qa, dout = (torch.randn(1, 2, g, c, d, generator=gen).to(device, dtype) for _ in range(2))
    kb, vb = (torch.randn(1, 2, c, d, generator=gen).to(device, dtype) for _ in range(2))
    return qa, kb, vb, dout


@pytest.mark.parametrize("kind, dtype", [("flash", torch.bfloat16), ("efficient", torch.float32)])
def test_cuda_block_kernels_take_and_return_the_ring_layouts_on_meta(kind, dtype):
    """The flash and memory-efficient calls (their argument order, the efficient kernel's padded log-sum-exp, the
    backward's RNG placeholders) run through torch's meta kernels: every block shape the ring hands them."""
    from megazero.context_parallel import ring

    qa, kb, vb, dout = _block_operands("meta", dtype)
    for diagonal in (True, False):
        o, lse = ring._block_forward_fused(kind, qa, kb, vb, 0.125, diagonal)
        assert o.shape == qa.shape and lse.shape == qa.shape[:-1] and lse.dtype == torch.float32
        dq, dk, dv = ring._block_backward_fused(kind, qa, kb, vb, dout, o, lse, 0.125, diagonal)
        assert dq.shape == qa.shape and dk.shape == dv.shape == kb.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind, dtype, tol", [("flash", torch.bfloat16, 2e-2), ("efficient", torch.float32, 1e-4)])
def test_cuda_block_kernels_equal_the_matmul_blocks(kind, dtype, tol):
    """One block alone (its own output and log-sum-exp are then the merged ones): the fused CUDA kernel's output,
    log-sum-exp and gradients equal the fp32 matmul block's, diagonal and full, grouped queries."""
    from megazero.context_parallel import ring

    qa, kb, vb, dout = _block_operands("cuda", dtype)
    for diagonal in (True, False):
        o, lse = ring._block_forward_fused(kind, qa, kb, vb, 0.125, diagonal)
        # fresh fp32 leaves each pass: for fp32 operands .float() is the operand itself, whose .grad would then
        # carry the first pass's gradients into the second (seen on an H200 as a 93.8% dq mismatch)
        q32, k32, v32 = (t.detach().float().clone().requires_grad_() for t in (qa, kb, vb))
        o_ref, lse_ref = ring._block_forward(q32, k32, v32, 0.125, diagonal)
        o_ref.backward(dout.float())
        grads = ring._block_backward_fused(kind, qa, kb, vb, dout, o, lse, 0.125, diagonal)
        torch.testing.assert_close(o.float(), o_ref.detach(), atol=tol, rtol=tol)
        torch.testing.assert_close(lse, lse_ref.detach(), atol=tol, rtol=tol)
        for got, want in zip(grads, (q32.grad, k32.grad, v32.grad)):
            torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
