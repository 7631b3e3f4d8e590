"""Zero-bubble's split backward with K/V heads shared by TP ranks (issue 29): Llama with one K/V head at tp 2.

When tp exceeds the K/V heads, the qkv weight enters its linear through ``mappings.sum_shared_rows_grad`` (a view
whose backward sums the shared rows' gradient over the ranks holding them). That view must still lead the
linear to the W store, so that B neither runs the qkv weight GEMM nor the K/V gradient all-reduce, and W runs
both. One 2-rank world (tp 2): the GEMMs whose output has a weight's shape and the ledger's K/V all-reduces,
counted in B and in W of one split backward, and W's gradients against one ordinary backward of the same
model and batch. End-to-end parity of this layout under zb-h1 (tp2·pp2, one K/V head) is
tests/test_kv_replication.py's ``test_one_kv_head_on_two_tp_ranks_under_the_zero_bubble_schedule``.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megazero.config.schema import ModelConfig
from megazero.model import GPT, init_parameters
from megazero.plan.estimate import weight_stash_bytes
from megazero.tensor_parallel import weight_grad
from megazero.tensor_parallel.random import RNGTracker
from tests.dist import run_world

# 4 query heads on 1 K/V head; seq 24 so that no input-gradient GEMM ([24, n]) has a weight's shape
CFG = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, seq_len=24, vocab_size=512, arch="llama",
                  num_kv_heads=1, ffn_size=96)


class _WeightGemms(TorchDispatchMode):
    """Counts matrix products whose output has the shape of one of ``shapes`` (a weight gradient), by shape."""

    def __init__(self, shapes: dict[tuple[int, ...], str]) -> None:
        super().__init__()
        self.shapes, self.counts = shapes, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and tuple(out.shape) in self.shapes:
            name = self.shapes[tuple(out.shape)]
            self.counts[name] = self.counts.get(name, 0) + 1
        return out


def _kv_elements(ctx) -> int:
    return sum(n for (group, op, tag), n in ctx.ledger.totals.items()
               if group in ("tp_kv", "tp") and op == "all_reduce" and tag == "kv_grad")


def _split_world(ctx):
    torch.set_num_threads(1)
    model = GPT(CFG, ctx.tp_group, rng_tracker=RNGTracker(0, ctx.tp_rank), kv_group=ctx.kv_group(2))
    init_parameters(model, 0, ctx.tp_group)
    params = [p for p in model.parameters() if p.requires_grad]
    store = weight_grad.WeightGradStore()
    store.attach(params)
    gen = torch.Generator().manual_seed(1)
    ids, targets = (torch.randint(0, CFG.vocab_size, (1, CFG.seq_len), generator=gen) for _ in range(2))

    model(ids, targets).mean().backward()  # the ordinary backward: the reference gradients
    want = {id(p): p.grad.clone() for p in params}
    kv_full = _kv_elements(ctx)
    for p in params:
        p.grad = None

    names = {id(p): n for n, p in model.named_parameters()}
    shapes = {tuple(p.shape): n.split(".", 2)[-1] for n, p in model.named_parameters() if p.dim() == 2}
    with _WeightGemms(shapes) as b_gemms:
        _, work = weight_grad.input_gradients(store, model(ids, targets).mean(), None, None, params)
    kv_b = _kv_elements(ctx) - kv_full
    deferred = [names[id(getattr(p, "wgrad_leaf", p))] for ps, _ in work.deferred for p in ps if p is not None]
    stash = sum(t.numel() * t.element_size() for t in {id(t): t for t in work.stashed_tensors()}.values())
    order = params[::-1]
    yielded = []
    with _WeightGemms(shapes) as w_gemms:
        for p, g in weight_grad.weight_gradients(work, order):
            yielded.append(names[id(getattr(p, "wgrad_leaf", p))])
            torch.autograd.backward(p, g)
    in_order = yielded == [names[id(p)] for p in order]  # the qkv views at their weights' places
    kv_w = _kv_elements(ctx) - kv_full - kv_b
    err = max((p.grad - want[id(p)]).abs().max().item() / want[id(p)].abs().max().item() for p in params)
    missing = [names[id(p)] for p in params if p.grad is None]
    return b_gemms.counts, w_gemms.counts, kv_full, kv_b, kv_w, deferred, err, missing, stash, in_order


def test_qkv_gemm_and_kv_sum_run_in_w_at_tp_above_kv_heads():
    """tp 2, one K/V head: B runs no weight GEMM and no K/V all-reduce; W runs every weight GEMM (qkv of both
    layers included) and the K/V all-reduce of both layers, as many elements as the ordinary backward; W's
    gradients equal the ordinary backward's (1e-5), handed over in backward order; the estimator's W stash counts the qkv output gradient
    of this rank's heads (its query heads and the shared K/V head)."""
    for b, w, kv_full, kv_b, kv_w, deferred, err, missing, stash, in_order in run_world(_split_world, 2, tp=2):
        assert b == {}, b  # before the fix: {"attn.qkv.weight": 2}, the qkv GEMMs ran in B
        assert w.get("attn.qkv.weight") == 2 and w.get("attn.proj.weight") == 2, w
        assert sum(n.endswith("attn.qkv.weight") for n in deferred) == 2, deferred
        hd = CFG.hidden_size // CFG.num_heads
        assert kv_full == 2 * (2 * 2 * hd * CFG.hidden_size)  # per layer: K and V rows, an all-reduce counts 2n
        assert (kv_b, kv_w) == (0, kv_full), (kv_b, kv_w)
        assert not missing and err < 1e-5, (missing, err)
        assert in_order  # W hands the gradients over in backward order, a shared-rows view at its leaf's place
        est = weight_stash_bytes(CFG, 1, tp_size=2, precision="fp32", layers=2, first_stage=True, last_stage=True)
        assert abs(est - stash) / stash < 0.015, (est, stash)  # the kept norm gradients (O(h)) left out
