"""Ring attention: attention over a sequence split across the CP group, with K/V blocks passed around the ring.

Layout as :func:`torch.nn.functional.scaled_dot_product_attention`: ``q`` is ``[B, Hq, S_local, D]``, ``k`` and
``v`` are ``[B, Hkv, S_local, D]``, each holding this rank's two chunks of the sequence (:mod:`.sharding`). The
result is ``[B, Hq, S_local, D]``, equal to the rows of full-sequence attention that this rank's queries own.

Decisions:

* **Work per ring step.** At step ``s`` rank ``i`` holds the K/V of rank ``(i - s) mod cp``. Local queries and
  visiting keys are two chunks each; a pair of chunks ``(qa, kb)`` is computed in full when ``qa > kb``, with
  the causal triangle when ``qa == kb`` (the rank's own block, step 0) and skipped when ``qa < kb``. So every
  rank computes 3 chunk-by-chunk blocks at step 0 and 2 at every later step: the balance the 2·cp chunks buy.
  Which blocks are full, causal or skipped follows the chunks' true offsets (their ids), never the local index;
  a diagonal block is square, so the fused kernels take ``is_causal`` for its triangle (no mask tensor).
* **Blocks through fused kernels** (:func:`block_kernel`). Each block runs SDPA's fused kernel that returns the
  log-sum-exp of its rows: on CUDA FlashAttention-2 (``aten._scaled_dot_product_flash_attention``, fp16/bf16,
  head dim a multiple of 8 up to 256) or the memory-efficient kernel (fp32, larger heads), on the CPU (and the
  meta device of the dry run) ``aten._scaled_dot_product_flash_attention_for_cpu``; their backward ops take the
  *merged* output and log-sum-exp, so each block's gradient is exact without its own softmax. Where none of
  them exists (an older torch, another dtype) the block is plain matmuls holding one fp32 chunk-by-chunk score
  matrix and one chunk-by-chunk causal mask for a diagonal block (``kernel="matmul"``, also selectable to check
  one path against the other). Either way no ``[S, S]`` tensor is built, so what a rank holds falls as 1/cp.
* **Layout.** The queries are re-laid once as ``[2 chunks, B, Hkv, g, c, D]`` (``g = Hq / Hkv``) and K/V as
  ``[2 (k, v), 2 chunks, B, Hkv, c, D]`` (the buffer that travels), so every block's operands are contiguous.
  **Grouped-query attention** never repeats K/V for the full blocks: the ``g`` query heads of one K/V head are
  folded into the query rows (``[B, Hkv, g·c, D]``; rows of a full block are independent). The diagonal block
  needs the causal triangle per head, so there K/V are expanded to the ``g`` heads (one chunk, the size of the
  query chunk) and their gradient summed back. The ring moves ``Hkv`` heads.
* **Merge.** Each block returns its output normalised by its own softmax and each row's log-sum-exp. Partial
  results merge as ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)``
  in fp32 whatever the input dtype: the online softmax with the running maximum folded into the running
  log-sum-exp, exact and stable whatever the range of the scores.
* **Precision.** The merge, the dQ accumulator and the dK/dV that travel are fp32 (dK/dV are summed cp times on
  their way round, so bf16 would lose bits at every hop); the fused kernels compute in the input dtype as a
  single SDPA call does; the output and the gradients are cast back.
* **Backward passes dK/dV around the ring** rather than recomputing the forward: the forward saves its merged
  output and log-sum-exp (as flash attention does). At step ``s`` a rank posts the K/V exchange for step
  ``s + 1``, computes its blocks, adds the partial dK/dV of the visiting block that its previous peer
  accumulated and sends the sum on; the last of the cp dK/dV exchanges brings each rank the finished gradient
  of its own K/V.
* **Point-to-point.** Every exchange is ONE :meth:`~megazero.distributed.group.Group.batch_p2p` call holding
  this rank's send to the next rank and its receive from the previous one, so every rank's calls pair up under
  NCCL's order-based matching (a send issued alone would block until the peer posts its receive, and the peer
  is itself blocked in a send). K/V travel packed in one buffer, dK/dV in another. Message tags name the step
  and the kind, so a replay (:mod:`megazero.pipeline.p2p_replay`) shows a misdelivery that gloo would hide.
  Per call on a CP group of ``n`` with K of ``N`` elements, the ledger counts ``2 N (n - 1)`` sent under
  "kv" in the forward, the same again in the backward, and ``2 N n`` (fp32) under "kv_grad".
* A CP group of one runs ``scaled_dot_product_attention`` itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megazero.context_parallel.sharding import chunk_ids
from megazero.distributed.group import Group

__all__ = ["RING_KERNELS", "block_kernel", "ring_attention"]

_FWD_KV, _BWD_KV, _BWD_DKV = 0, 1, 2  # message tag = 4 * step + kind
RING_KERNELS = ("auto", "fused", "matmul")
_FLASH_MAX_HEAD_DIM = 256  # FlashAttention-2's largest head dimension


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: Group, *, causal: bool = True,
                   scale: float | None = None, kernel: str = "auto") -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, K/V passed around ``cp_group`` (module
    docstring). ``kernel``: "auto" (a fused kernel where one exists, :func:`block_kernel`), "fused" (refuse
    if none exists) or "matmul" (the plain fp32 blocks). Differentiable in ``q``, ``k`` and ``v``."""
    check_qkv(q, k, v)
    if kernel not in RING_KERNELS:
        raise ValueError(f"unknown ring attention kernel {kernel!r}; expected one of {RING_KERNELS}")
    if cp_group.size == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    fused = None if kernel == "matmul" else block_kernel(q)
    if kernel == "fused" and fused is None:
        raise ValueError(f"no fused attention kernel with log-sum-exp for {q.dtype} on {q.device.type} in torch "
                         f"{torch.__version__}; use kernel='matmul'")
    return _RingAttention.apply(q, k, v, cp_group, causal, scale, fused)


def block_kernel(q: torch.Tensor) -> str | None:
    """The fused kernel a ring block of queries like ``q`` runs: "flash" or "efficient" on CUDA (as SDPA's own
    dispatch picks them on sm80+), "cpu" where torch has the CPU flash op (on CPU and meta tensors); None where
    none applies (the plain matmul blocks then run)."""
    d, dtype = q.shape[-1], q.dtype
    if q.device.type == "cuda":
        if d % 8:
            return None
        if dtype in (torch.float16, torch.bfloat16) and d <= _FLASH_MAX_HEAD_DIM:
            return "flash"
        return "efficient" if dtype in (torch.float16, torch.bfloat16, torch.float32) else None
    if dtype in (torch.float32, torch.bfloat16, torch.float16) and hasattr(
            torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return "cpu"
    return None


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


# -- layouts ------------------------------------------------------------------------------------------------------
def _to_chunks(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, H, S, D]`` -> ``[2, B, H / groups, groups, S / 2, D]``, contiguous (one copy)."""
    b, h, s, d = t.shape
    return t.reshape(b, h // groups, groups, 2, s // 2, d).permute(3, 0, 1, 2, 4, 5).contiguous()


def _from_chunks(t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_to_chunks`."""
    _, b, h, g, c, d = t.shape
    return t.permute(1, 2, 3, 0, 4, 5).reshape(b, h * g, 2 * c, d)


def _pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``k``, ``v`` ``[B, Hkv, S, D]`` -> ``[2 (k, v), 2 chunks, B, Hkv, S / 2, D]``, the buffer that travels."""
    b, h, s, d = k.shape
    return torch.stack([k, v]).reshape(2, b, h, 2, s // 2, d).permute(0, 3, 1, 2, 4, 5).contiguous()


def _unpack_kv(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _from_chunks(kv[0].unsqueeze(3)), _from_chunks(kv[1].unsqueeze(3))


# -- one block: fused kernels ---------------------------------------------------------------------------------
def _fused_forward(kind: str, q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, L, D]`` queries over ``[B, H, M, D]`` keys: the output and each row's fp32 log-sum-exp [B, H, L]."""
    ops = torch.ops.aten
    if kind == "flash":
        res = ops._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]
    if kind == "efficient":
        out, lse = ops._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out, lse[..., : q.shape[2]]  # the kernel pads the rows of its log-sum-exp to a multiple of 32
    return ops._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _fused_backward(kind: str, dout, q, k, v, out, lse, causal: bool, scale: float):
    """The block's dq, dk, dv given the MERGED rows' ``out`` and ``lse``: the kernels form
    ``p = exp(s - lse)`` and ``rowsum(dout * out)`` from them, which is this block's share of the whole."""
    ops = torch.ops.aten
    if kind == "flash":
        seed = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: the RNG state is not read
        offset = torch.zeros((), dtype=torch.uint64, device=q.device)
        return ops._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, None, None, q.shape[2],
                                                                k.shape[2], 0.0, causal, seed, offset, scale=scale)
    if kind == "efficient":
        rows = -(-q.shape[2] // 32) * 32
        lse = F.pad(lse, (0, rows - q.shape[2]))
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        grads = ops._scaled_dot_product_efficient_attention_backward(dout, q, k, v, None, out, lse, seed, seed, 0.0,
                                                                     [True, True, True, False], causal, scale=scale)
        return grads[:3]
    return ops._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                    scale=scale)


def _expand_heads(t: torch.Tensor, g: int) -> torch.Tensor:
    """K or V ``[B, Hkv, c, D]`` repeated for the ``g`` query heads of each: ``[B, Hkv·g, c, D]``."""
    b, h, c, d = t.shape
    return t.unsqueeze(2).expand(b, h, g, c, d).reshape(b, h * g, c, d)


def _block_forward_fused(kind, qa, kb, vb, scale, diagonal):
    """Grouped queries ``[B, Hkv, g, c, D]`` over ``[B, Hkv, c, D]``: output ``[B, Hkv, g, c, D]``, lse fp32."""
    b, h, g, c, d = qa.shape
    if diagonal:  # the causal triangle per head: K/V expanded to the query heads
        o, lse = _fused_forward(kind, qa.view(b, h * g, c, d), _expand_heads(kb, g), _expand_heads(vb, g),
                                True, scale)
    else:  # every row sees every key: the g query heads of a K/V head are rows of one call
        o, lse = _fused_forward(kind, qa.view(b, h, g * c, d), kb, vb, False, scale)
    return o.reshape(b, h, g, c, d), lse.reshape(b, h, g, c)


def _block_backward_fused(kind, qa, kb, vb, dout, out, lse, scale, diagonal):
    b, h, g, c, d = qa.shape
    if diagonal:
        rows = (b, h * g, c, d)
        dq, dk, dv = _fused_backward(kind, dout.view(rows), qa.view(rows), _expand_heads(kb, g), _expand_heads(vb, g),
                                     out.view(rows), lse.view(b, h * g, c), True, scale)
        # the g query heads' K/V gradients summed in fp32, as the ring accumulates them
        return (dq.reshape(b, h, g, c, d), dk.reshape(b, h, g, c, d).sum(2, dtype=torch.float32),
                dv.reshape(b, h, g, c, d).sum(2, dtype=torch.float32))
    rows = (b, h, g * c, d)
    dq, dk, dv = _fused_backward(kind, dout.view(rows), qa.view(rows), kb, vb, out.view(rows),
                                 lse.view(b, h, g * c), False, scale)
    return dq.reshape(b, h, g, c, d), dk, dv


# -- one block: plain fp32 matmuls (where no fused kernel exists) ---------------------------------------------
def _scores(qg: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    """``[B, Hkv, g, cq, ck]`` scaled scores of grouped queries ``[B, Hkv, g, cq, D]`` against ``[B, Hkv, ck, D]``;
    the causal triangle set to -inf when the two chunks are the same one."""
    s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scale
    if diagonal:
        s = s.masked_fill(torch.ones(s.shape[-1], s.shape[-1], dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    return s


def _block_forward(qg, k, v, scale: float, diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: its softmax-normalised output ``[B, Hkv, g, cq, D]`` and its rows' log-sum-exp."""
    s = _scores(qg, k, scale, diagonal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.unsqueeze(2)), lse


def _block_backward(qg, k, v, dout, lse, delta, scale: float, diagonal: bool):
    """Gradients of one block given the merged rows' ``lse`` and ``delta = rowsum(dout * out)``."""
    p = torch.exp(_scores(qg, k, scale, diagonal) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(2)
    ds = p * (torch.matmul(dout, v.unsqueeze(2).transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2) * scale
    return dq, dk, dv


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's result into the running fp32 ``out``/``lse`` (views, updated in place)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out.float() * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


# -- the ring -------------------------------------------------------------------------------------------------
def _exchange(group: Group, send: torch.Tensor, recv: torch.Tensor, msg_tag: int, tag: str) -> list:
    """One ring hop as ONE batched call: ``send`` to the next rank, ``recv`` from the previous one."""
    nxt, prev = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    return group.batch_p2p([("send", send, nxt, msg_tag), ("recv", recv, prev, msg_tag)], tag=tag)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group: Group, causal: bool, scale: float, fused: str | None):
        hkv, n, i = k.shape[1], group.size, group.rank
        g = q.shape[1] // hkv
        qc = _to_chunks(q.detach() if fused else q.detach().float(), g)  # [2, B, Hkv, g, c, D]
        out = torch.zeros(qc.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(qc.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = _pack_kv(k.detach(), v.detach())  # [2, 2, B, Hkv, c, D]
        for step in range(n):
            if step < n - 1:  # post the next hop before computing on the block in hand
                nxt = torch.empty_like(kv)
                works = _exchange(group, kv, nxt, 4 * step + _FWD_KV, "kv")
            kb = kv if fused else kv.float()
            for a, bb, diagonal in _pairs(chunk_ids(i, n), chunk_ids((i - step) % n, n), causal):
                if fused:
                    o, lse_b = _block_forward_fused(fused, qc[a], kb[0, bb], kb[1, bb], scale, diagonal)
                else:
                    o, lse_b = _block_forward(qc[a], kb[0, bb], kb[1, bb], scale, diagonal)
                _merge(out[a], lse[a], o, lse_b)
            if step < n - 1:
                _wait(works)
                kv = nxt
        result = _from_chunks(out).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.fused = group, causal, scale, fused
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, fused = ctx.group, ctx.causal, ctx.scale, ctx.fused
        hkv, n, i = k.shape[1], group.size, group.rank
        g = q.shape[1] // hkv
        dtype = q.dtype if fused else torch.float32
        qc, doc, oc = (_to_chunks(t.to(dtype), g) for t in (q, dout, out))  # [2, B, Hkv, g, c, D]
        delta = None if fused else (doc * oc).sum(-1)
        dq = torch.zeros(qc.shape, dtype=torch.float32, device=q.device)
        kv = _pack_kv(k, v)
        partial, dkv_works = None, []
        for step in range(n):
            if step < n - 1:
                nxt = torch.empty_like(kv)
                kv_works = _exchange(group, kv, nxt, 4 * step + _BWD_KV, "kv")
            kb = kv.to(dtype)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=k.device)
            for a, bb, diagonal in _pairs(chunk_ids(i, n), chunk_ids((i - step) % n, n), causal):
                if fused:
                    dq_b, dk_b, dv_b = _block_backward_fused(fused, qc[a], kb[0, bb], kb[1, bb], doc[a], oc[a],
                                                             lse[a], scale, diagonal)
                else:
                    dq_b, dk_b, dv_b = _block_backward(qc[a], kb[0, bb], kb[1, bb], doc[a], lse[a], delta[a], scale,
                                                       diagonal)
                dq[a] += dq_b
                dkv[0, bb] += dk_b
                dkv[1, bb] += dv_b
            if partial is not None:  # what the ranks before accumulated for this block
                _wait(dkv_works)
                dkv += partial
            partial = torch.empty_like(dkv)
            dkv_works = _exchange(group, dkv, partial, 4 * step + _BWD_DKV, "kv_grad")
            if step < n - 1:
                _wait(kv_works)
                kv = nxt
        _wait(dkv_works)  # the last hop returns this rank's own K/V gradient, complete
        dk, dv = _unpack_kv(partial)
        return _from_chunks(dq).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
