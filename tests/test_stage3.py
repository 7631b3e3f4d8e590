"""ZeRO stage 3 by blocks: parity and the DP ledger with the interleaved schedule and full recomputation,
gathered and in-flight gradient bytes at the peak (measured on the tensors), the order check's cost,
``gathered_parameters()`` through forwards, and sharded initialisation (meta device, one unit at a time).

Two gloo worlds: pp 2 x dp 2 (interleaved and 1F1B, full recompute, reuse distance) and dp 4 (6 layers:
peaks, order check, holding); the single-process reference runs once.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megazero.config.cli import parse_args
from megazero.model.gpt import GPT, init_parameters
from megazero.train.engine import Engine
from megazero.zero.stage3.slots import SWAP
from tests.common import assert_matches_reference, merge_runs, normwise_error, outside_blocks, train_runs
from tests.dist import run_world

FLAGS = ["--hidden-size", "64", "--num-heads", "4", "--seq-len", "32", "--vocab-size", "512", "--lr", "3e-3",
         "--clip-grad", "0.5", "--warmup-steps", "2", "--train-steps", "3", "--global-batch-size", "8"]
STEPS, VOCAB, SEQ = 3, 512, 32


def _engine(ctx, flags: list[str], cache: str, **zero) -> Engine:
    cfg = parse_args([*FLAGS, *flags, "--cache-dir", cache])
    cfg = replace(cfg, zero=replace(cfg.zero, **zero)).resolve(ctx.world_size)
    return Engine(cfg, ctx)


def _batches(step: int, ctx, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This DP rank's share of the global batch of ``step`` (the same global batch for every topology)."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = (torch.randint(0, VOCAB, (8, SEQ), generator=g) for _ in range(2))
    b = 8 // ctx.dp_size
    x, y = x[ctx.dp_rank * b: (ctx.dp_rank + 1) * b], y[ctx.dp_rank * b: (ctx.dp_rank + 1) * b]
    return list(zip(x.split(micro), y.split(micro)))


def _train(ctx, flags: list[str], cache: str, micro: int, **zero) -> dict:
    engine = _engine(ctx, ["--micro-batch-size", str(micro), *flags], cache, **zero)
    store = engine.optimizer.store
    key = (ctx.dp_group.name, "all_gather", "check")
    losses, volumes, checks = [], [], []
    ctx.ledger.mark_step()  # what earlier runs in this world did after their last step is not this run's
    for step in range(STEPS):
        before = ctx.ledger.calls[key]
        losses.append(engine.train_step(_batches(step, ctx, micro)).loss)
        volumes.append(ctx.ledger.dp_volume_last_step())
        checks.append(ctx.ledger.calls[key] - before)
    state = engine.full_state_dict()
    out = {"losses": losses, "volumes": volumes, "checks": checks, "m": 8 // ctx.dp_size // micro}
    if hasattr(store, "units"):
        out["padded"] = store.padded_numel()
        out["blocks"] = sum(u.numel for u in store.units if not u.is_root)
        # the parameters outside the blocks, counted on the model: the chunks' own units hold them (+ padding)
        out["own_params"] = outside_blocks(engine.chunks)
    out["state"] = state if ctx.dp_rank == 0 and ctx.tp_rank == 0 else None
    return out


def _merge(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for r in per_rank:
        for k, v in (r["state"] or {}).items():
            state.setdefault(k, v)
    return state


PP_RUNS = {  # name: (flags, micro-batch size, zero overrides)
    "interleaved": (["--pp", "2", "--pp-schedule", "interleaved", "--virtual-stages", "2"], 2,
                    {"stage3_param_persistence_threshold": 0}),
    "interleaved-persist": (["--pp", "2", "--pp-schedule", "interleaved", "--virtual-stages", "2"], 2,
                            {"stage3_param_persistence_threshold": 1000, "overlap_comm": True}),
    "recompute": (["--pp", "2", "--activation-checkpointing", "full"], 2, {"stage3_param_persistence_threshold": 0}),
    "recompute-reuse0": (["--pp", "2", "--activation-checkpointing", "full"], 2,
                         {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}),
}


def _pp_world(ctx, cache: str) -> dict:
    return {name: _train(ctx, ["--num-layers", "4", "--zero-stage", "3", *flags], cache, micro, **zero)
            for name, (flags, micro, zero) in PP_RUNS.items()}


@pytest.fixture(scope="module")
def pp_reference(data_cache):
    return run_world(_train, 1, ["--num-layers", "4"], data_cache, 8)[0]


def test_stage3_interleaved_and_recompute_match_one_process_and_the_ledger(pp_reference, data_cache) -> None:
    """pp 2 x dp 2 at stage 3 (2 micro-batches per DP rank): the interleaved schedule (2 chunks per rank) and
    1F1B with full recomputation train the single-process model within 1e-5; the DP ledger per step is
    3mΨ_g (+ (m + 1)Ψ_p for persistent parameters) in both, recomputation included, because a recomputed
    block stays gathered for its backward, less mΨ_own under 1F1B (one chunk per rank): a chunk's own units
    (embeddings, final norm) are gathered once per micro-batch, their parked memory still holding the values.
    With stage3_max_reuse_distance 0 nothing is reused: the own units are gathered twice, a recomputed block
    again (4mΨ for the blocks). Once the first step has traced the order, the order check issues no
    collective."""
    results = run_world(_pp_world, 4, data_cache, pp=2, timeout=600)
    reference = pp_reference
    for name in PP_RUNS:
        got = results[0][name]
        worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], reference["losses"]))
        assert worst < 1e-5, (name, worst, got["losses"], reference["losses"])
        assert normwise_error(_merge([r[name] for r in results]), reference["state"]) < 1e-5, name
        for rank_res in results:
            r = rank_res[name]
            m, g, w = r["m"], r["padded"]["gathered"], r["padded"]["whole"]
            own = g - r["blocks"]
            if name != "interleaved-persist":  # (every parameter gathered: none persistent) each unit padded to dp 2
                assert r["own_params"] <= own < r["own_params"] + 8, (name, own, r["own_params"])
            want = 3 * m * g + ((m + 1) * w if w else 0)
            if name == "recompute" and SWAP:  # one chunk per rank (its own units parked: carried)
                want -= m * own
            if name == "recompute-reuse0":
                want += m * r["blocks"]
            assert r["volumes"] == [want] * STEPS, (name, r["volumes"], want)
            assert r["checks"][0] > 0 and r["checks"][1:] == [0] * (STEPS - 1), (name, r["checks"])


# -- dp 4, 6 layers: peaks measured on the tensors, the order check, gathered_parameters(), construction ---------
class _LiveStorages(TorchDispatchMode):
    """The storages that ops run inside the mode create, sampled after every op (resizes included).

    :meth:`transient` is the most bytes held at once beyond what is still held at the end: a storage that
    survives counts only what it held above its final size (a ZeRO-3 unit buffer resized to 0 counts whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, StorageWeakRef] = {}
        self.samples: list[dict[int, int]] = []

    def live(self) -> dict[int, int]:
        out = {}
        for key, ref in list(self.refs.items()):
            if ref.expired():
                del self.refs[key]
            else:
                out[id(ref)] = torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        return out

    def transient(self) -> int:
        end = self.live()
        return max((sum(max(0, b - end.get(k, 0)) for k, b in snap.items()) for snap in self.samples), default=0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.refs or self.refs[ref.cdata].expired():
                    self.refs[ref.cdata] = ref
        self.samples.append(self.live())
        return out


class _Peaks:
    """Samples, after every DP all-gather and reduce-scatter and every gradient arrival, the bytes of the
    gathered parameter buffers (every all-gather output still alive) and of the gradient buffers beyond the
    owned partition (staging, in flight, pooled), from the storages themselves."""

    def __init__(self, ctx, engine: Engine) -> None:
        self.store, self.outputs = engine.optimizer.store, {}
        self.gathered = self.grads = 0
        # at each gradient arrival of a block's parameter: the own (root) units' gathered bytes, the staging
        # bytes beyond the owned partition; at every sample: the owned partition's live bytes
        self.root_in_blocks, self.staging_in_blocks = 0, set()
        self.owned = []
        in_block = {id(p) for u in self.store.units if not u.is_root for p in u.params}
        group = ctx.dp_group
        gather, scatter = group.all_gather_into, group.reduce_scatter

        def all_gather_into(output, input, tag="other", async_op=False):
            if tag == "param":
                ref = StorageWeakRef(output.untyped_storage())
                self.outputs.setdefault(ref.cdata, ref)
            work = gather(output, input, tag=tag, async_op=async_op)
            self.sample()
            return work

        def reduce_scatter(output, input, op="sum", tag="other", async_op=False):
            work = scatter(output, input, op=op, tag=tag, async_op=async_op)
            self.sample()
            return work

        group.all_gather_into, group.reduce_scatter = all_gather_into, reduce_scatter
        for p in engine.model.parameters():  # registered after the store's own hooks: run after them
            p.register_post_accumulate_grad_hook(lambda q: self.sample(id(q) in in_block))

    def sample(self, block_grad: bool = False) -> None:
        live = 0
        for key, ref in list(self.outputs.items()):
            if ref.expired():
                del self.outputs[key]
            else:
                live += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        owned = {u.grad.untyped_storage().data_ptr() for u in self.store.units}
        grads = [g for g in self.store.held_tensors()["grads"] if g.untyped_storage().data_ptr() not in owned]
        self.gathered = max(self.gathered, live)
        sizes = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}
        self.grads = max(self.grads, sum(sizes.values()))
        self.owned.append(sum(u.grad.untyped_storage().nbytes() for u in self.store.units))
        if block_grad:
            roots = sum(u.full.untyped_storage().nbytes() for u in self.store.units if u.is_root)
            self.root_in_blocks = max(self.root_in_blocks, roots)
            filed = {g.untyped_storage().data_ptr() for u in self.store.units for _, g in u.filed}
            self.staging_in_blocks |= {n for k, n in sizes.items() if k not in filed}  # (not fresh gradients)


def _named_masters(engine: Engine) -> dict[str, torch.Tensor]:
    """The fp32 master weights under each chunk's own (unsharded) parameter names (a collective)."""
    names = {id(p): n for c in engine.chunks for n, p in c.named_parameters()}
    by_param = dict(engine.model.named_parameters())
    return {names[id(by_param[k])]: v for k, v in engine.optimizer.master_params().items()}


def _dp4_world(ctx, cache: str) -> dict:
    flags = ["--num-layers", "6", "--zero-stage", "3", "--micro-batch-size", "1"]
    zero = {"stage3_param_persistence_threshold": 0, "overlap_comm": True}
    with _LiveStorages() as mode:
        engine = _engine(ctx, flags, cache, **zero)
    construction = mode.transient()
    store = engine.optimizer.store
    initial = _named_masters(engine)
    peaks = _Peaks(ctx, engine)
    key = (ctx.dp_group.name, "all_gather", "check")
    checks = []
    for step in range(STEPS):
        before = ctx.ledger.calls[key]
        engine.train_step(_batches(step, ctx, 1))
        checks.append(ctx.ledger.calls[key] - before)
    gathered_peak, grads_peak = peaks.gathered, peaks.grads  # of the training steps
    owned_full = sum(u.grad.numel() * u.grad.element_size() for u in store.units)
    owned_after_step = sum(u.grad.untyped_storage().nbytes() for u in store.units)
    engine.optimizer.zero_grad()
    owned_after_zero = sum(u.grad.untyped_storage().nbytes() for u in store.units)
    owned = (min(peaks.owned), max(peaks.owned), owned_full, owned_after_step, owned_after_zero)
    in_blocks = (peaks.root_in_blocks, sorted(peaks.staging_in_blocks), dict(store._roots_free))
    # gathered_parameters() holds through forwards run inside it: no gather, nothing released
    x = _batches(0, ctx, 2)[0][0]
    chunk = engine.chunks[0]
    with torch.no_grad():
        outside = chunk(x)
        with engine.optimizer.gathered_parameters():
            gathers = ctx.ledger.calls[(ctx.dp_group.name, "all_gather", "param")]
            inside = [chunk(x), chunk(x)]
            held = all(u.full.untyped_storage().nbytes() == u.full_bytes for u in store.units)
            gathers = ctx.ledger.calls[(ctx.dp_group.name, "all_gather", "param")] - gathers
        released = sum(u.full.untyped_storage().nbytes() for u in store.units)
        # a deviation from the traced order (on every rank alike) brings the check back, without error
        before = ctx.ledger.calls[key]
        chunk.blocks = torch.nn.ModuleDict({k: chunk.blocks[k] for k in reversed(list(chunk.blocks))})
        chunk(x)
        deviation_checks = ctx.ledger.calls[key] - before
    unit_bytes = {u.name: u.numel * u.full.element_size() for u in store.units}
    # a live budget of the own units plus one block: nothing is prefetched beyond it
    budget = sum(u.numel for u in store.units if u.is_root) + max(u.numel for u in store.units if not u.is_root)
    tight = _engine(ctx, flags, cache, stage3_max_live_parameters=budget, **zero)
    limited = _Peaks(ctx, tight)
    tight.train_step(_batches(0, ctx, 1))
    return {"largest_param": 4 * max(p.numel() for p in engine.model.parameters()), "budget_peak": limited.gathered, "budget_bytes": 4 * budget,"construction": construction, "initial": initial, "gathered_peak": gathered_peak,
            "grads_peak": grads_peak, "unit_bytes": unit_bytes, "root": [u.name for u in store.units if u.is_root],
            "checks": checks, "holds": (held, gathers, [torch.equal(t, outside) for t in inside]),
            "released": released, "deviation_checks": deviation_checks, "inflight": store.max_inflight,
            "owned": owned, "in_blocks": in_blocks, "toy": _toy_roots_kept(ctx), "bf16": _toy_bf16_reduction(ctx)}


class _Toy(torch.nn.Module):
    """A chunk whose part before the blocks saves one of its own parameters for backward (``proj_in``'s
    weight, for the gradient of its input): ZeRO-3 must keep its own units gathered through the blocks'
    backward, since the embedding's backward comes after them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 32)
        self.proj_in = torch.nn.Linear(32, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
        self.head = torch.nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj_in(self.emb(ids))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten(), reduction="sum")


def _toy_bf16_reduction(ctx) -> tuple:
    """The toy in bf16 at stage 3, one backward: the dtypes of the staging buffers seen at every gradient
    arrival, and the largest difference of each unit's owned gradient from the fp32 sum over DP (an all-reduce,
    independent of the store) of a plain bf16 copy's local gradients, relative to the largest value."""
    from megazero.config.schema import OptimizerConfig, ZeroConfig
    from megazero.zero import ZeroOptimizer

    g = torch.Generator().manual_seed(8)
    x, y = torch.randint(0, 64, (8, 6), generator=g), torch.randint(0, 64, (8, 6), generator=g)
    b = 8 // ctx.dp_size
    x, y = x[ctx.dp_rank * b: (ctx.dp_rank + 1) * b], y[ctx.dp_rank * b: (ctx.dp_rank + 1) * b]
    ref = _Toy().to(torch.bfloat16)
    (ref(x, y) / 48).backward()
    model = _Toy()
    opt = ZeroOptimizer(model, ZeroConfig(stage=3, stage3_param_persistence_threshold=0), OptimizerConfig(),
                        ctx.dp_group, precision="bf16")
    store, dtypes = opt.store, set()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: dtypes.update(t.dtype for t in store._held_staging()))
    opt.zero_grad()
    opt.backward(model(x, y) / 48)
    names = {id(p): n for n, p in model.named_parameters()}
    grads = dict(ref.named_parameters())
    worst = 0.0
    for unit in store.units:
        full = unit.layout.flatten([grads[names[id(p)]].grad.float() for p in unit.params])
        ctx.dp_group.all_reduce(full, tag="other")
        lo, hi = unit.layout.shard_range(ctx.dp_rank)
        worst = max(worst, ((unit.grad - full[lo:hi]).abs().max() / full.abs().max()).item())
    return sorted(map(str, dtypes)), worst


def _toy_roots_kept(ctx) -> tuple:
    """The toy at stage 3 over DP (3 steps, AdamW) against plain torch AdamW on the whole batch, one process."""
    from megazero.config.schema import OptimizerConfig, ZeroConfig
    from megazero.zero import ZeroOptimizer

    opt_cfg = OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0)
    g = torch.Generator().manual_seed(7)
    data = [(torch.randint(0, 64, (8, 6), generator=g), torch.randint(0, 64, (8, 6), generator=g)) for _ in range(3)]
    ref = _Toy()
    adam = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=opt_cfg.betas, eps=opt_cfg.eps, weight_decay=0.0)
    for x, y in data:
        adam.zero_grad()
        (ref(x, y) / y.numel()).backward()
        adam.step()
    model = _Toy()
    opt = ZeroOptimizer(model, ZeroConfig(stage=3, stage3_param_persistence_threshold=0), opt_cfg, ctx.dp_group)
    b = 8 // ctx.dp_size
    for x, y in data:
        opt.zero_grad()
        xs, ys = (t[ctx.dp_rank * b: (ctx.dp_rank + 1) * b] for t in (x, y))
        opt.backward(model(xs, ys) / y.numel())
        opt.step(opt_cfg.lr)
    with opt.gathered_parameters():
        err = normwise_error({n: p.detach().clone() for n, p in model.named_parameters()},
                             dict(ref.named_parameters()))
    return dict(opt.store._roots_free), err


def _stage0_initial(ctx, cache: str) -> dict[str, torch.Tensor]:
    engine = _engine(ctx, ["--num-layers", "6", "--micro-batch-size", "8"], cache)
    return {n: p.detach().clone() for n, p in engine.chunks[0].named_parameters()}


def test_stage3_peaks_order_check_holding_and_sharded_init_at_dp4(data_cache) -> None:
    """dp 4, 6 layers, fp32, one micro-batch at a time (2 per step), measured on the tensors:

    * gathered parameter bytes at the peak (every all-gather receive buffer alive) are at most the chunk's own
      units plus two blocks (the one in use and the one prefetched), far below the whole model;
    * gradient bytes beyond the owned partition (staging, in flight, pooled) are at most the own units plus
      (max_inflight_buckets + 1) blocks: each block is reduce-scattered as its backward ends;
    * the order check issues collectives in the first (tracing) step only, and again on a deviation;
    * with ``stage3_max_live_parameters`` at the own units plus one block, the gathered bytes stay within it;
    * ``gathered_parameters()`` holds through forwards inside it and releases everything after;
    * construction on the meta device holds at most one unit's full values at a time (transient bytes at
      construction <= the largest unit's flat fp32 buffer + twice the largest parameter in fp32, its random
      draw and scaled copy), and the initial weights are bit-identical to a stage-0 build."""
    results = run_world(_dp4_world, 4, data_cache, timeout=600)
    ref = run_world(_stage0_initial, 1, data_cache)[0]
    for r in results:
        sizes = r["unit_bytes"]
        root = sum(sizes[n] for n in r["root"])
        block = max(v for n, v in sizes.items() if n not in r["root"])
        whole = sum(sizes.values())
        assert 0 < r["gathered_peak"] <= root + 2 * block < 0.6 * whole, (r["gathered_peak"], root, block, whole)
        assert 0 < r["grads_peak"] <= root + (r["inflight"] + 1) * block, (r["grads_peak"], root, block)
        assert r["checks"][0] > 0 and r["checks"][1:] == [0] * (STEPS - 1), r["checks"]
        assert r["deviation_checks"] > 0
        assert 0 < r["budget_peak"] <= r["budget_bytes"], (r["budget_peak"], r["budget_bytes"])
        assert r["holds"] == (True, 0, [True, True]) and r["released"] == 0, (r["holds"], r["released"])
        transient = r["construction"]
        bound = max(sizes.values()) + 2 * r["largest_param"]  # one unit's fp32 buffer + one parameter's draw
        assert transient <= bound < 0.6 * whole, (transient, bound, whole)
        assert r["initial"].keys() == ref.keys()
        assert all(torch.equal(r["initial"][k], ref[k]) for k in ref), "sharded init differs from a stage-0 build"
        # the own units (embeddings, head, final LayerNorm; persistence 0) are released once backward reaches
        # the blocks (GPT's embedding saves only the token ids), and their gradients are staged only at the
        # end: during the blocks' backward no own unit is gathered and every staging buffer is a block's
        root_in_blocks, staging_in_blocks, roots_free = r["in_blocks"]
        assert roots_free == {0: True} and root_in_blocks == 0, r["in_blocks"]
        blocks = {v for n, v in sizes.items() if n not in r["root"]}
        assert staging_in_blocks and set(staging_in_blocks) <= blocks, (staging_in_blocks, blocks, root)
        # the owned gradient partition is allocated unit by unit by the step's reductions, freed by zero_grad
        low, high, full, after_step, after_zero = r["owned"]
        assert low == 0 and high == full == after_step and after_zero == 0, r["owned"]
        # a chunk whose part before the blocks saved an own parameter keeps its own units: still exact
        toy_free, toy_err = r["toy"]
        assert toy_free == {0: False} and toy_err < 1e-5, r["toy"]
        # bf16: gradients staged in bf16 (exact), converted and reduce-scattered in fp32 chunks: the owned
        # gradient equals an fp32 sum over DP of the local bf16 gradients (up to the order of the sum)
        dtypes, worst = r["bf16"]
        assert dtypes == ["torch.bfloat16"] and worst < 1e-6, r["bf16"]


# -- stages 0-2: materialised one parameter at a time, no second fp32 copy of the replica ------------------------
def _low_stage_init(ctx, cache: str) -> dict:
    out = {}
    for stage, precision in ((0, "fp32"), (1, "bf16"), (2, "bf16"), (2, "fp32")):
        flags = ["--num-layers", "4", "--zero-stage", str(stage), "--precision", precision, "--micro-batch-size", "4"]
        with _LiveStorages() as mode:
            engine = _engine(ctx, flags, cache)
        transient = mode.transient()
        largest = max(p.numel() for p in engine.model.parameters())
        psi = sum(p.numel() for p in engine.model.parameters())
        masters = _named_masters(engine)  # a collective: every rank
        out[(stage, precision)] = (transient, largest, psi, masters if ctx.dp_rank == 0 else None)
    return out


def _reference_init(ctx, cache: str) -> dict[str, torch.Tensor]:
    cfg = parse_args([*FLAGS, "--num-layers", "4", "--micro-batch-size", "8", "--cache-dir", cache]).resolve(1)
    model = GPT(cfg.model)
    init_parameters(model, cfg.training.seed)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_stages_0_to_2_build_without_a_second_fp32_copy(data_cache) -> None:
    """dp 2: the Engine builds the model on the meta device at every stage and the store materialises it one
    parameter at a time, so construction's transient bytes (peak minus what stays) are at most one fp32 copy
    of this rank's master partition (bf16: the starting values handed to the optimizer) plus two of the
    largest parameter; the weights equal a plain GPT initialised by init_parameters, bit for bit."""
    results = run_world(_low_stage_init, 2, data_cache, timeout=600)
    ref = run_world(_reference_init, 1, data_cache)[0]
    for r in results:
        for (stage, precision), (transient, largest, psi, masters) in r.items():
            master = 4 * psi / (2 if stage else 1) if precision == "bf16" else 0
            assert transient <= master + 2 * 4 * largest, (stage, precision, transient, master, largest)
            if masters is not None:
                assert masters.keys() == ref.keys()
                assert all(torch.equal(masters[k], ref[k]) for k in ref), (stage, precision)


def test_stage3_with_sequence_parallelism_built_on_meta(reference, data_cache, tmp_path) -> None:
    """tp 2 x dp 2 with sequence parallelism at ZeRO-3 through the Engine (built on the meta device): the TP
    all-reduce hooks of replicated parameters' gradients survive materialisation; parity with one process."""
    runs = [["--tp", "2", "--zero-stage", "3", "--sequence-parallel", "--micro-batch-size", "2",
             "--global-batch-size", "8"]]
    for losses, state in merge_runs(run_world(train_runs, 4, runs, data_cache, str(tmp_path), tp=2)):
        assert_matches_reference(losses, state, reference)
