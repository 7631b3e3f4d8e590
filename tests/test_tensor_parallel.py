"""Tensor parallelism: each layer against its unsharded counterpart, the whole GPT against one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazero.config.schema import ModelConfig
from megazero.model import GPT, init_parameters
from megazero.observe.memory import ActivationMemoryCounter
from megazero.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    scatter_to_tp_region,
    shard_full_tensor,
    vocab_parallel_cross_entropy,
)
from megazero.tensor_parallel.layers import unshard_tensor
from megazero.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from tests.common import assert_matches_reference, train_runs
from tests.dist import run_world

TOL = dict(rtol=1e-6, atol=1e-6)


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


def _load(layer, full: dict[str, torch.Tensor], tp_group) -> None:
    """Give a parallel layer this rank's slices of the given full tensors."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(shard_full_tensor(full[name], p.shard_spec, tp_group.rank, tp_group.size))


def _grad_full(layer, name: str, tp_group) -> torch.Tensor:
    p = dict(layer.named_parameters())[name]
    shards = tp_group.all_gather_list(p.grad.contiguous()) if p.shard_spec.partition_dim is not None else [p.grad]
    return unshard_tensor(shards, p.shard_spec)


def _layer_checks(ctx):
    """Every TP layer's forward output and gradients against nn.Linear / nn.Embedding / F.cross_entropy."""
    tp = ctx.tp_group
    B, S, H, OUT = 2, 8, 16, 24
    x_full = _rand(B, S, H, seed=1)
    g_out = _rand(B, S, OUT, seed=2)
    checks = 0
    for sp in (False, True):
        for stride, gather in ((1, True), (3, False)):
            w, b = _rand(OUT, H, seed=3), _rand(OUT, seed=4)
            ref_x = x_full.clone().requires_grad_()
            ref_y = F.linear(ref_x, w.requires_grad_(), b.requires_grad_())
            (ref_y * g_out).sum().backward()
            col = ColumnParallelLinear(H, OUT, tp, gather_output=gather, stride=stride, sequence_parallel=sp)
            _load(col, {"weight": w.detach(), "bias": b.detach()}, tp)
            assert col.weight.numel() * tp.size == w.numel()  # 1/tp of the parameters on each rank
            x = x_full.clone().requires_grad_()
            x_in = scatter_to_sequence_parallel_region(x, tp) if sp else x
            y = col(x_in)
            out_spec = ShardSpec((B, S, OUT), "zeros", partition_dim=2, stride=stride)  # this rank's outputs
            want = ref_y if gather else shard_full_tensor(ref_y.detach(), out_spec, tp.rank, tp.size)
            torch.testing.assert_close(y, want, **TOL)
            gy = g_out if gather else shard_full_tensor(g_out, out_spec, tp.rank, tp.size)
            (y * gy).sum().backward()
            torch.testing.assert_close(_grad_full(col, "weight", tp), w.grad, **TOL)
            torch.testing.assert_close(_grad_full(col, "bias", tp), b.grad, **TOL)
            # the partial input gradients were summed (all-reduce, or reduce-scatter then all-gather under SP)
            torch.testing.assert_close(x.grad, ref_x.grad, **TOL)
            checks += 1

        # row-parallel: input split along the last dim, output summed (SP: reduce-scattered along sequence)
        w, b = _rand(OUT, H, seed=5).requires_grad_(), _rand(OUT, seed=6).requires_grad_()
        ref_x = x_full.clone().requires_grad_()
        ref_y = F.linear(ref_x, w, b)
        (ref_y * g_out).sum().backward()
        row = RowParallelLinear(H, OUT, tp, sequence_parallel=sp)
        _load(row, {"weight": w.detach(), "bias": b.detach()}, tp)
        assert row.weight.numel() * tp.size == w.numel()
        x = x_full.clone().requires_grad_()
        y = row(scatter_to_tp_region(x, tp))
        want, gy = ref_y, g_out
        if sp:
            want, gy = (t.chunk(tp.size, dim=1)[tp.rank] for t in (ref_y, g_out))
        torch.testing.assert_close(y, want, **TOL)
        (y * gy).sum().backward()
        torch.testing.assert_close(_grad_full(row, "weight", tp), w.grad, **TOL)
        bias_grad = row.bias.grad.clone()
        if sp:  # a replicated bias applied to a sequence shard has a partial gradient: summed over TP by the model
            tp.all_reduce(bias_grad)
        torch.testing.assert_close(bias_grad, b.grad, **TOL)
        torch.testing.assert_close(x.grad, ref_x.grad, **TOL)
        checks += 1

    # vocab-parallel embedding and cross-entropy with a vocabulary tp does not divide (1000 -> 1024 padded)
    V = 1000
    emb_w = _rand(V, H, seed=7).requires_grad_()
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(8))
    ids[0, 0], ids[1, -1] = 0, V - 1
    targets = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(9))
    targets[0, 1] = -100  # ignored
    ref_h = F.embedding(ids, emb_w)
    ref_logits = ref_h @ emb_w.t()
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), reduction="none").view(B, S)
    (ref_loss.sum() + (ref_h * x_full).sum()).backward()
    emb = VocabParallelEmbedding(V, H, tp)
    _load(emb, {"weight": emb_w.detach()}, tp)
    assert emb.padded_vocab_size == 1024 and emb.weight.shape[0] == 1024 // tp.size
    h = emb(ids)
    torch.testing.assert_close(h, ref_h, **TOL)
    loss = vocab_parallel_cross_entropy(emb.logits(h), targets, tp, emb.vocab_start)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    (loss.sum() + (h * x_full).sum()).backward()
    grad = _grad_full(emb, "weight", tp)
    torch.testing.assert_close(grad, emb_w.grad, rtol=1e-5, atol=1e-5)
    padded_rows = emb.weight.grad[max(0, V - emb.vocab_start):]
    assert torch.count_nonzero(padded_rows) == 0  # padding gets no gradient

    # sequence gather into a TP layer: forward all-gathers the shards, backward sums partial gradients
    shard = x_full.chunk(tp.size, dim=1)[tp.rank].clone().requires_grad_()
    full = gather_from_sequence_parallel_region(shard, tp)
    torch.testing.assert_close(full, x_full, **TOL)
    (full * g_out[..., :H] * (tp.rank + 1)).sum().backward()  # each rank's gradient differs (partial sums)
    want = (g_out[..., :H] * sum(r + 1 for r in range(tp.size))).chunk(tp.size, dim=1)[tp.rank]
    torch.testing.assert_close(shard.grad, want, **TOL)
    return checks + 1


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_match_unsharded_counterparts(tp):
    assert run_world(_layer_checks, tp, tp=tp) == [7] * tp


def test_whole_gpt_matches_single_process_at_tp_2(reference, data_cache, tmp_path):
    runs = [["--tp", "2", "--micro-batch-size", "8"],
            ["--tp", "2", "--sequence-parallel", "--micro-batch-size", "4", "--global-batch-size", "8"]]
    results = run_world(train_runs, 2, runs, data_cache, str(tmp_path), tp=2)
    for losses, state in results[0]:
        assert_matches_reference(losses, state, reference)
    assert results[1][0][0] == results[0][0][0]


def test_whole_gpt_matches_single_process_at_tp_4(reference, data_cache, tmp_path):
    runs = [["--tp", "4", "--micro-batch-size", "8"], ["--tp", "4", "--sequence-parallel", "--micro-batch-size", "8"]]
    for losses, state in run_world(train_runs, 4, runs, data_cache, str(tmp_path), tp=4)[0]:
        assert_matches_reference(losses, state, reference)


def test_tp_with_data_parallel_matches_single_process(reference, data_cache, tmp_path):
    runs = [["--tp", "2", "--dp", "2", "--micro-batch-size", "4", "--sequence-parallel"]]
    for losses, state in run_world(train_runs, 4, runs, data_cache, str(tmp_path), tp=2)[0]:
        assert_matches_reference(losses, state, reference)


def test_dropout_is_deterministic_across_reruns(data_cache, tmp_path):
    flags = ["--tp", "2", "--dropout", "0.1", "--micro-batch-size", "8"]
    runs = [flags, flags, [*flags, "--sequence-parallel"], [*flags, "--sequence-parallel"], ["--tp", "2"]]
    (a, _), (b, _), (c, _), (d, _), (no_dropout, _) = run_world(train_runs, 2, runs, data_cache, str(tmp_path),
                                                                tp=2)[0]
    assert a == b and c == d
    assert a != no_dropout  # dropout is really on


def _activation_bytes(ctx, sp: bool):
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, seq_len=64, vocab_size=512)
    model = GPT(cfg, ctx.tp_group, sequence_parallel=sp)
    init_parameters(model, 0, ctx.tp_group)
    counter = ActivationMemoryCounter(model)
    ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with counter.track():
        loss = model(ids, ids).mean()
    loss.backward()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return counter.last, params


def test_measured_parameter_and_activation_memory_per_rank():
    (act1, params1), = run_world(_activation_bytes, 1, False)
    tp2 = run_world(_activation_bytes, 2, False, tp=2)
    tp2_sp = run_world(_activation_bytes, 2, True, tp=2)
    assert tp2[0] == tp2[1] and tp2_sp[0] == tp2_sp[1]
    (act_tp, params_tp), (act_sp, params_sp) = tp2[0], tp2_sp[0]
    assert params_sp == params_tp
    # sharded layers hold 1/tp of their weights; LayerNorms, positions and row biases stay whole
    # per layer: two LayerNorms (2 x 2H) and two row-parallel biases (2 x H); then ln_f (2H) and positions (S x H)
    H, S, L = 64, 64, 2
    replicated = 4 * (L * 6 * H + 2 * H + S * H)  # fp32 bytes
    assert params_tp == (params1 - replicated) // 2 + replicated
    # TP shards attention and MLP activations; SP also shards LayerNorm/dropout/residual activations
    assert act_sp < act_tp < act1
