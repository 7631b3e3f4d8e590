"""Ring attention: attention over a sequence split across the CP group, with K/V blocks passed around the ring.

Layout as :func:`torch.nn.functional.scaled_dot_product_attention`: ``q`` is ``[B, Hq, S_local, D]``, ``k`` and
``v`` are ``[B, Hkv, S_local, D]``, each holding this rank's two chunks of the sequence (:mod:`.sharding`). The
result is ``[B, Hq, S_local, D]``, equal to the rows of full-sequence attention that this rank's queries own.

Decisions:

* **Work per ring step.** At step ``s`` rank ``i`` holds the K/V of rank ``(i - s) mod cp``. Local queries and
  visiting keys are two chunks each; a pair of chunks ``(qa, kb)`` is computed in full when ``qa > kb``, with
  the causal triangle when ``qa == kb`` (the rank's own block, step 0) and skipped when ``qa < kb``. So every
  rank computes 3 chunk-by-chunk blocks at step 0 and 2 at every later step: the balance the 2·cp chunks buy.
  The mask follows the chunks' true offsets (their ids), never the local index.
* **Merge.** Each block returns its output normalised by its own softmax and each row's log-sum-exp (the row
  maximum is subtracted inside ``logsumexp``). Partial results merge as ``lse = logaddexp(lse_a, lse_b)``,
  ``out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)``: the online softmax with the running maximum folded
  into the running log-sum-exp, exact and stable whatever the range of the scores.
* **Precision.** Scores, softmax, accumulators and the dK/dV that travel are fp32 whatever the input dtype
  (dK/dV are summed cp times on their way round, so bf16 would lose bits at every hop); the output and the
  gradients are cast back. The blocks are plain matmuls holding one chunk-by-chunk score matrix at a time; a
  fused kernel that returns the log-sum-exp could replace :func:`_block_forward`/:func:`_block_backward`.
* **Backward passes dK/dV around the ring** rather than recomputing the forward: the forward saves its merged
  output and log-sum-exp (as flash attention does), from which each block's probabilities are recomputed. At
  step ``s`` a rank posts the K/V exchange for step ``s + 1``, computes its block, adds the partial dK/dV of
  the visiting block that its previous peer accumulated and sends the sum on; the last of the cp dK/dV
  exchanges brings each rank the finished gradient of its own K/V.
* **Point-to-point.** Every exchange is ONE :meth:`~megazero.distributed.group.Group.batch_p2p` call holding
  this rank's send to the next rank and its receive from the previous one, so every rank's calls pair up under
  NCCL's order-based matching (a send issued alone would block until the peer posts its receive, and the peer
  is itself blocked in a send). K/V travel packed in one buffer, dK/dV in another. Message tags name the step
  and the kind, so a replay (:mod:`megazero.pipeline.p2p_replay`) shows a misdelivery that gloo would hide.
  Per call on a CP group of ``n`` with K of ``N`` elements, the ledger counts ``2 N (n - 1)`` sent under
  "kv" in the forward, the same again in the backward, and ``2 N n`` (fp32) under "kv_grad".
* **Grouped-query attention.** Query heads are viewed as ``[B, Hkv, g, S, D]``: query head ``h`` uses K/V head
  ``h // g``, as ``scaled_dot_product_attention(enable_gqa=True)``. K/V are never repeated, so the ring moves
  ``Hkv`` heads.
* A CP group of one runs ``scaled_dot_product_attention`` itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megazero.context_parallel.sharding import chunk_ids
from megazero.distributed.group import Group

__all__ = ["ring_attention"]

_FWD_KV, _BWD_KV, _BWD_DKV = 0, 1, 2  # message tag = 4 * step + kind


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: Group, *, causal: bool = True,
                   scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, K/V passed around ``cp_group`` (module
    docstring). Differentiable in ``q``, ``k`` and ``v``."""
    check_qkv(q, k, v)
    if cp_group.size == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, cp_group, causal, scale)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise unless ``q`` is ``[B, Hq, S, D]`` and ``k``, ``v`` are ``[B, Hkv, S, D]`` with ``Hkv`` dividing
    ``Hq`` and ``S`` even (two chunks)."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"expected q [B, Hq, S, D] and k, v [B, Hkv, S, D]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    (b, hq, s, d), (bk, hkv, sk, dk) = q.shape, k.shape
    if (b, s, d) != (bk, sk, dk) or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} disagree: batch, local sequence and head "
                         "dim must match and the K/V heads must divide the query heads")
    if s % 2:
        raise ValueError(f"local sequence {s} is odd: a CP rank holds two equal chunks (shard_sequence)")


def _pairs(q_ids: tuple[int, int], kv_ids: tuple[int, int], causal: bool) -> list[tuple[int, int, bool]]:
    """The (local query chunk, local key chunk, diagonal?) blocks to compute, by the chunks' true ids."""
    return [(a, b, causal and qa == kb) for a, qa in enumerate(q_ids) for b, kb in enumerate(kv_ids)
            if not causal or qa >= kb]


def _scores(qg: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    """``[B, Hkv, g, cq, ck]`` scaled scores of grouped queries ``[B, Hkv, g, cq, D]`` against ``[B, Hkv, ck, D]``;
    the causal triangle masked when the two chunks are the same one."""
    s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scale
    if diagonal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _block_forward(qg, k, v, scale: float, diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: its softmax-normalised output ``[B, Hkv, g, cq, D]`` and its rows' log-sum-exp."""
    s = _scores(qg, k, scale, diagonal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.unsqueeze(2)), lse


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's result into the running ``out``/``lse`` (views, updated in place)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


def _block_backward(qg, k, v, dout, lse, delta, scale: float, diagonal: bool):
    """Gradients of one block given the merged rows' ``lse`` and ``delta = rowsum(dout * out)``."""
    p = torch.exp(_scores(qg, k, scale, diagonal) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(2)
    ds = p * (torch.matmul(dout, v.unsqueeze(2).transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2) * scale
    return dq, dk, dv


def _exchange(group: Group, send: torch.Tensor, recv: torch.Tensor, msg_tag: int, tag: str) -> list:
    """One ring hop as ONE batched call: ``send`` to the next rank, ``recv`` from the previous one."""
    nxt, prev = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    return group.batch_p2p([("send", send, nxt, msg_tag), ("recv", recv, prev, msg_tag)], tag=tag)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group: Group, causal: bool, scale: float):
        b, hq, s, d = q.shape
        hkv, c, n, i = k.shape[1], s // 2, group.size, group.rank
        qg = q.float().reshape(b, hkv, hq // hkv, s, d)
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k.detach(), v.detach()])
        for step in range(n):
            if step < n - 1:  # post the next hop before computing on the block in hand
                nxt = torch.empty_like(kv)
                works = _exchange(group, kv, nxt, 4 * step + _FWD_KV, "kv")
            kb, vb = kv.float()
            for a, bb, diagonal in _pairs(chunk_ids(i, n), chunk_ids((i - step) % n, n), causal):
                qa, kvs = slice(a * c, (a + 1) * c), slice(bb * c, (bb + 1) * c)
                o, lse_b = _block_forward(qg[..., qa, :], kb[..., kvs, :], vb[..., kvs, :], scale, diagonal)
                _merge(out[..., qa, :], lse[..., qa], o, lse_b)
            if step < n - 1:
                _wait(works)
                kv = nxt
        result = out.reshape(b, hq, s, d).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        b, hq, s, d = q.shape
        hkv, c, n, i = k.shape[1], s // 2, group.size, group.rank
        shape = (b, hkv, hq // hkv, s, d)
        qg, dog = q.float().reshape(shape), dout.float().reshape(shape)
        delta = (dog * out.float().reshape(shape)).sum(-1)
        dq = torch.zeros_like(qg)
        kv = torch.stack([k, v])
        partial, dkv_works = None, []
        for step in range(n):
            if step < n - 1:
                nxt = torch.empty_like(kv)
                kv_works = _exchange(group, kv, nxt, 4 * step + _BWD_KV, "kv")
            kb, vb = kv.float()
            dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
            for a, bb, diagonal in _pairs(chunk_ids(i, n), chunk_ids((i - step) % n, n), causal):
                qa, kvs = slice(a * c, (a + 1) * c), slice(bb * c, (bb + 1) * c)
                dq_b, dk_b, dv_b = _block_backward(qg[..., qa, :], kb[..., kvs, :], vb[..., kvs, :], dog[..., qa, :],
                                                   lse[..., qa], delta[..., qa], scale, diagonal)
                dq[..., qa, :] += dq_b
                dkv[0, ..., kvs, :] += dk_b
                dkv[1, ..., kvs, :] += dv_b
            if partial is not None:  # what the ranks before accumulated for this block
                _wait(dkv_works)
                dkv += partial
            partial = torch.empty_like(dkv)
            dkv_works = _exchange(group, dkv, partial, 4 * step + _BWD_DKV, "kv_grad")
            if step < n - 1:
                _wait(kv_works)
                kv = nxt
        _wait(dkv_works)  # the last hop returns this rank's own K/V gradient, complete
        return dq.reshape(q.shape).to(q.dtype), partial[0].to(k.dtype), partial[1].to(v.dtype), None, None, None
