"""ZeRO-3's chunk's own units: parked between a forward and its backward (megazero/zero/stage3/slots.py,
"Parking"), carried without a second all-gather only while the parameters have not changed (gather.py,
"Carry"), and a parameter larger than a block in a unit of its own (megazero/zero/stage3/units.py).

One 2-rank world, a tied 2-layer GPT (hidden 64, vocabulary 2048: the token embedding is 2.6 blocks) with every
parameter sharded (persistence 0), fp32. Measured on the storages themselves: the backward gathers the embedding's
unit into the very memory its forward released (one allocation per step, not two), which is held aside meanwhile
and freed by the backward's release; the step's tracked peak is the same with parking on and off; and the
embedding's gradient is reduce-scattered from the tensor autograd made (no staging copy of its size).
"""

from __future__ import annotations

import torch


def _park_world(ctx) -> dict:
    from megazero.config.schema import OptimizerConfig, ZeroConfig, model_preset
    from megazero.model import GPT, init_parameters
    from megazero.observe.memory import PeakMemoryTracker, zero_buffers
    from megazero.zero import ZeroOptimizer

    torch.set_num_threads(1)
    cfg = model_preset("tiny", num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=2048)
    model = GPT(cfg)
    init_parameters(model, 1234)
    opt = ZeroOptimizer(model, ZeroConfig(stage=3, stage3_param_persistence_threshold=0), OptimizerConfig(),
                        ctx.dp_group, precision="fp32")
    store, slots = opt.store, opt.store.slots
    root = next(u for u in store.units if u.is_root and any(p is model.wte.weight for p in u.params))
    g = torch.Generator().manual_seed(7 + ctx.dp_rank)
    x, y = torch.randint(0, 2048, (2, 32), generator=g), torch.randint(0, 2048, (2, 32), generator=g)
    fills: list[tuple[int, int]] = []  # (data pointer, bytes) of the own unit's storage after each fill
    fill = slots.fill

    def recording_fill(storage, nbytes, pooled=True):
        restored = fill(storage, nbytes, pooled)
        if storage._cdata == root.full.untyped_storage()._cdata:
            fills.append((storage.data_ptr(), storage.nbytes()))
        return restored

    slots.fill = recording_fill
    grads, reduced = [], []  # the embedding's gradient as autograd made it; every reduction's input (pointer, bytes)
    model.wte.weight.register_hook(lambda grad: grads.append((grad.data_ptr(), grad.nbytes)))
    group = store.reduce_group
    reduce_scatter = group.reduce_scatter

    def recording_reduce_scatter(out, inp, **kw):
        reduced.append((inp.data_ptr(), inp.nbytes))
        return reduce_scatter(out, inp, **kw)

    group.reduce_scatter = recording_reduce_scatter
    out: dict = {"wte_unit": len(root.params)}

    def step(probe: bool = False):
        opt.zero_grad()
        loss = model(x, y).sum()
        if probe:  # between the forward and its backward
            st = root.full.untyped_storage()
            held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in slots.held()}
            out["between"] = {"storage_bytes": st.nbytes(), "parked": slots.parked(st),
                              "held_at_forward_ptr": held.get(fills[-1][0], 0)}
        opt.backward(loss / 128)
        if probe:
            out["after"] = {"parked": slots.parked(root.full.untyped_storage()),
                            "held": sum(t.untyped_storage().nbytes() for t in slots.held())}
        opt.step(1e-3)
        return loss.detach()

    out["full_bytes"] = root.full_bytes
    step()
    fills.clear()
    out["loss"] = float(step(probe=True))
    out["fills"] = list(fills)
    out["grads"], out["reduced"] = list(grads[-1:]), list(reduced)
    peaks = {}
    for parking in (False, True, False, True):  # alternated: glibc's state is not part of a tracked peak
        slots.parking = parking
        tracker = PeakMemoryTracker("cpu", lambda: zero_buffers(opt), [model])
        with tracker:
            step()
        peaks.setdefault(parking, []).append(tracker.result()["peak_bytes"])
    out["peaks"] = peaks
    return out


def test_own_units_are_parked_and_the_embedding_is_reduced_from_its_grad():
    """The backward's gather of the tied embedding's unit lands in the memory its forward used, held aside in
    between (the storage itself empty, as released) and freed once backward releases it; the step's tracked
    peak does not change with parking; the embedding, larger than a block, is a unit of its own whose reduction
    reads its gradient where autograd left it."""
    from tests.dist import run_world

    for r in run_world(_park_world, 2, timeout=300):
        (f_ptr, f_bytes), (b_ptr, b_bytes) = r["fills"]  # the forward's gather, the backward's
        assert f_bytes == b_bytes == r["full_bytes"] > 0, r
        assert b_ptr == f_ptr, r["fills"]
        assert r["between"] == {"storage_bytes": 0, "parked": True, "held_at_forward_ptr": r["full_bytes"]}, r
        assert r["after"]["parked"] is False, r
        assert r["after"]["held"] < r["full_bytes"], r  # its memory is not held once backward released it
        assert r["wte_unit"] == 1, r  # the token embedding apart from the position table and final norm
        assert r["grads"][0] in r["reduced"], (r["grads"], r["reduced"])  # reduced from autograd's own tensor
        on, off = r["peaks"][True], r["peaks"][False]
        assert on[0] == on[1] and off[0] == off[1], r["peaks"]
        assert on[0] == off[0], r["peaks"]


def _carry_world(ctx) -> dict:
    """Three steps of a tied GPT at ZeRO-3, plain and with two detours that leave the own unit parked or written:
    ``"orphan"``, a forward with a graph that no backward follows, just before each optimizer step (its parked,
    carried values must not outlive the step); ``"written"``, after each step a forward without a graph and then
    ``gathered_parameters()`` whose body writes the gathered table (released, not parked: the next forward must
    gather the shards again). Each run's losses, final shards and all-gathers per step."""
    from megazero.config.schema import OptimizerConfig, ZeroConfig, model_preset
    from megazero.model import GPT, init_parameters
    from megazero.zero import ZeroOptimizer

    torch.set_num_threads(1)
    cfg = model_preset("tiny", num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=2048)
    out = {}
    for run in ("plain", "orphan", "written"):
        model = GPT(cfg)
        init_parameters(model, 1234)
        opt = ZeroOptimizer(model, ZeroConfig(stage=3, stage3_param_persistence_threshold=0), OptimizerConfig(),
                            ctx.dp_group, precision="fp32")
        g = torch.Generator().manual_seed(7 + ctx.dp_rank)
        losses, gathers = [], []
        key = (ctx.dp_group.name, "all_gather", "param")
        for _ in range(3):
            x, y = torch.randint(0, 2048, (2, 32), generator=g), torch.randint(0, 2048, (2, 32), generator=g)
            before = ctx.ledger.calls[key]
            opt.zero_grad()
            loss = model(x, y).sum()
            opt.backward(loss / 128)
            losses.append(float(loss))
            if run == "orphan":
                model(x, y).sum()  # a graph no backward follows: the own unit stays parked over the step
            opt.step(1e-2)
            if run == "written":
                with torch.no_grad():
                    model(x, y)
                with opt.gathered_parameters():
                    model.wte.weight.data.mul_(0)  # gathered values only: the shards keep theirs
            gathers.append(ctx.ledger.calls[key] - before)
        out[run] = {"losses": losses, "shards": opt.store.shard_flat.clone(), "gathers": gathers,
                    "units": [u.is_root for u in opt.store.units]}
    return out


def test_a_carried_unit_never_outlives_a_change_of_its_values():
    """The carry skips the backward's all-gather of the own unit (one gather fewer per step than without it), and
    values parked by a forward whose backward never came, or written inside ``gathered_parameters()``, are never
    used again after the optimizer step or the release: the losses and shards equal the plain run's bit for bit."""
    from tests.dist import run_world

    for r in run_world(_carry_world, 2, timeout=300):
        plain = r["plain"]
        for run in ("orphan", "written"):
            assert r[run]["losses"] == plain["losses"], (run, r[run]["losses"], plain["losses"])
            assert torch.equal(r[run]["shards"], plain["shards"]), run
        # own units: the token table alone, the position table with the final norm; then two blocks
        assert plain["units"] == [True, True, False, False], plain["units"]
        assert plain["gathers"] == [2 * 4 - 2] * 3, plain["gathers"]
