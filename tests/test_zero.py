"""ZeRO stages 0-3 on gloo ranks: parity with one process, communication volume, memory, overflow, stage-3 hooks.

One world per DP size runs every variant (stage x accumulation x precision x bucketing/overlap/prefetch
settings) and returns what each rank saw; the tests below assert on those results. The single-process
reference (plain ``torch.optim.AdamW`` + ``clip_grad_norm_`` on the whole global batch) runs once.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field, replace

import pytest
import torch
from torch import nn

from megazero.config.schema import LossScaleConfig, ModelConfig, OptimizerConfig, ZeroConfig
from megazero.distributed.group import Group
from megazero.model.gpt import GPT, full_state_dict, init_parameters
from megazero.zero import ZeroOptimizer, grad_norm_weights
from megazero.zero.bucketed import storage_bytes
from megazero.zero.norm import NonFiniteGradientError
from megazero.zero.stage3.params import GatherOrderError
from megazero.zero.stage3.slots import SWAP
from tests import launch
from tests.common import outside_blocks
from tests.dist import run_world

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16, vocab_size=96)  # ~30K parameters
BIG = ModelConfig(num_layers=2, hidden_size=192, num_heads=4, seq_len=64, vocab_size=1024)  # ~1.1M parameters
OPT = OptimizerConfig(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip_grad=0.5)
GLOBAL_BATCH, STEPS, SEED = 8, 10, 1234
NO_PERSIST = {"stage3_param_persistence_threshold": 0}


@dataclass(frozen=True)
class Run:
    name: str
    stage: int
    m: int = 1  # micro-batches per step
    precision: str = "fp32"
    zero: dict = field(default_factory=dict)
    steps: int = STEPS
    model: ModelConfig = MODEL


FP32_RUNS = [
    Run("s0", 0), Run("s0-acc", 0, m=2),
    Run("s1", 1, zero={"reduce_bucket_size": 3000}), Run("s1-acc", 1, m=2),
    Run("s2", 2, zero={"reduce_bucket_size": 3000, "overlap_comm": True}),
    Run("s2-acc", 2, m=2, zero={"reduce_bucket_size": 5000}),
    Run("s2-allreduce", 2, m=2, zero={"reduce_scatter": False, "reduce_bucket_size": 4000}),
    Run("s3", 3, zero=NO_PERSIST),
    Run("s3-acc", 3, m=2, zero={**NO_PERSIST, "stage3_prefetch_bucket_size": 3000, "overlap_comm": True,
                                "reduce_bucket_size": 4000}),
    Run("s3-persist", 3, zero={"stage3_param_persistence_threshold": 1000, "overlap_comm": True}),
]
BF16_RUNS = [Run("bf16-s0", 0, precision="bf16"), Run("bf16-s1", 1, precision="bf16"),
             Run("bf16-s2", 2, m=2, precision="bf16", zero={"reduce_bucket_size": 3000}),
             Run("bf16-s3", 3, precision="bf16", zero=NO_PERSIST)]
MEMORY_RUNS = [Run(f"mem-bf16-s{s}", s, precision="bf16", zero=NO_PERSIST, steps=1, model=BIG) for s in range(4)] + [
    Run("mem-bf16-s3-default", 3, precision="bf16", steps=1, model=BIG),
    Run("mem-fp32-s1", 1, steps=1, model=BIG), Run("mem-fp32-s3", 3, zero=NO_PERSIST, steps=1, model=BIG),
    Run("mem-bf16-s0-model", 0, precision="bf16", zero={"grad_dtype": "model"}, steps=1, model=BIG),
    Run("mem-bf16-s1-model", 1, precision="bf16", zero={"grad_dtype": "model"}, steps=1, model=BIG),
    Run("mem-bf16-s2-model", 2, precision="bf16", zero={"grad_dtype": "model"}, steps=1, model=BIG),
    Run("mem-fp16-s2", 2, precision="fp16", steps=1, model=BIG),
    Run("mem-fp16-s1-fp32", 1, precision="fp16", zero={"grad_dtype": "fp32"}, steps=1, model=BIG)]
OVERFLOW_STEPS = [False, True, True, False, False, False]  # rank 1 injects an inf gradient at steps 1 and 2
STUCK_STEPS = [False, True, True, True, False]  # three non-finite steps in a row: stops at the 2nd or 3rd
FP16_SCALING = LossScaleConfig(initial_scale_power=10, loss_scale_window=2, hysteresis=2, min_loss_scale=1.0)


def global_batch(step: int, model: ModelConfig = MODEL) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    shape = (GLOBAL_BATCH, model.seq_len)
    return torch.randint(0, model.vocab_size, shape, generator=g), torch.randint(0, model.vocab_size, shape, generator=g)


def lr_at(step: int) -> float:
    return OPT.lr * min(1.0, (step + 1) / 3)


def normwise(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert state.keys() == ref.keys()
    diff = torch.cat([(state[k].float() - ref[k].float()).flatten() for k in ref])
    return (diff.norm() / torch.cat([ref[k].float().flatten() for k in ref]).norm()).item()


def expected_volume(run: Run, padded: dict[str, int], dp: int) -> int:
    """Each stage's stated DP volume per step in m, on the padded buffers (whole W, gathered G)."""
    w, g, m = padded["whole"], padded["gathered"], run.m
    r = 1 if run.zero.get("reduce_scatter", True) else 2  # an all-reduce instead of a reduce-scatter: 2x
    # one chunk: its own units (embeddings, final norm) are gathered once per micro-batch, not twice
    g_own = padded["own"] if SWAP and run.zero.get("stage3_max_reuse_distance", 1) > 0 else 0  # (SWAP: parking)
    if run.stage == 0:
        return 2 * w
    if run.stage == 1:
        return r * w + w
    if run.stage == 2:
        return m * r * w + w
    return m * (2 + r) * g - m * g_own + (m * r * w + w if w else 0)


def _model() -> GPT:
    model = GPT(MODEL)
    init_parameters(model, SEED)
    return model


def reference_run(ctx) -> dict:
    """Single process: torch.optim.AdamW (decay on ndim >= 2) + clip_grad_norm_ on the whole global batch."""
    model = _model()
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": OPT.weight_decay},
              {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=OPT.lr, betas=OPT.betas, eps=OPT.eps)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = global_batch(step)
        opt.zero_grad()
        loss = model(x, y).sum() / y.numel()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), OPT.clip_grad).item())
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "initial": initial,
            "weights": {k: v.detach().clone() for k, v in model.named_parameters()}}


def train(ctx, run: Run, dp_group: Group | None = None, inject: list[bool] | None = None,
          loss_scale: LossScaleConfig | None = None, inject_value: float = float("inf"),
          opt_cfg: OptimizerConfig = OPT) -> dict:
    """Train ``run`` on this rank's share of each global batch, recording what the tests check.

    ``inject``: per step, whether rank 1 writes ``inject_value`` into one gradient row; the run stops at a
    :class:`NonFiniteGradientError` (after ``opt_cfg.max_skipped_steps`` skips in a row), recording it."""
    model = GPT(run.model)
    init_parameters(model, SEED)
    psi = sum(p.numel() for p in model.parameters())
    threshold = run.zero.get("stage3_param_persistence_threshold", ZeroConfig().stage3_param_persistence_threshold)
    persistent = sum(p.numel() for p in model.parameters() if p.numel() <= threshold) if run.stage == 3 else 0
    opt = ZeroOptimizer(model, ZeroConfig(stage=run.stage, **run.zero), opt_cfg, dp_group or ctx.dp_group,
                        norm_group=ctx.mp_group, norm_counted=grad_norm_weights(model, ctx.tp_rank),
                        precision=run.precision, loss_scale_cfg=loss_scale)
    injecting = [False]
    if inject is not None and ctx.dp_rank == 1:
        target = dict(model.named_parameters())["blocks.0.mlp.fc.weight"]
        target.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), inject_value) if injecting[0] else g)
    r, b = ctx.dp_rank, GLOBAL_BATCH // ctx.dp_size
    rec: dict = defaultdict(list)
    for step in range(run.steps):
        x, y = global_batch(step, run.model)
        x, y = x[r * b: (r + 1) * b], y[r * b: (r + 1) * b]
        if inject is not None:
            injecting[0] = inject[step]
            before = _snapshot(opt, model)
        opt.zero_grad(micro_batches=run.m)
        total = torch.zeros((), dtype=torch.float64)
        for xm, ym in zip(x.chunk(run.m), y.chunk(run.m)):
            loss = model(xm, ym).sum()
            opt.backward(loss / (GLOBAL_BATCH * run.model.seq_len))
            total += loss.detach().double()
        ctx.dp_group.all_reduce(total, tag="loss")
        stats = opt.step(lr_at(step))
        ctx.ledger.mark_step()
        rec["losses"].append(total.item() / (GLOBAL_BATCH * run.model.seq_len))
        rec["norms"].append(stats.grad_norm)
        rec["skipped"].append(stats.skipped)
        rec["scales"].append(stats.loss_scale)
        rec["volumes"].append(ctx.ledger.dp_volume_last_step())
        if inject is not None:
            after = _snapshot(opt, model)
            rec["unchanged"].append(all(torch.equal(before[k], after[k]) for k in before))
            try:
                opt.check_skipped_steps(step + 1)
            except NonFiniteGradientError as e:
                rec["error"].append(str(e))
                break
    weights = opt.master_params() if run.model is MODEL else None
    return {**rec, "weights": weights if ctx.rank == 0 else None, "memory": opt.model_state_bytes(),
            "padded": opt.padded_numel(), "psi": psi, "persistent": persistent, "adam_steps": opt.step_count,
            "psi_own": outside_blocks([model]),
            "skipped_steps": opt.skipped_steps}


def _snapshot(opt: ZeroOptimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    """fp32 master and model-dtype parameter values (a collective)."""
    out = {f"master.{k}": v for k, v in opt.master_params().items()}
    with opt.gathered_parameters():
        out.update({f"model.{k}": p.detach().clone() for k, p in model.named_parameters()})
    return out


def stage3_release_check(ctx) -> dict:
    """Stage 3 without prefetch: count gathers per step and gathered units during and after the step."""
    model = _model()
    opt = ZeroOptimizer(model, ZeroConfig(stage=3, stage3_prefetch_bucket_size=0, **NO_PERSIST), OPT, ctx.dp_group)
    units = opt.store.units
    live: list[int] = []
    for u in units:
        u.module.register_forward_pre_hook(lambda *_: live.append(sum(v.gathered for v in units)))
    key = ("dp", "all_gather", "param")
    gathers = []
    for step in range(STEPS):
        x, y = global_batch(step)
        b = GLOBAL_BATCH // ctx.dp_size
        before = ctx.ledger.calls[key]
        opt.zero_grad()
        opt.backward(model(x[:b], y[:b]).sum() / y.numel())
        opt.step(lr_at(step))
        ctx.ledger.mark_step()
        gathers.append(ctx.ledger.calls[key] - before)
    weight = model.blocks["0"].mlp.fc.weight
    master = opt.master_params()
    with opt.gathered_parameters():
        inside = all(torch.equal(p, master[k]) for k, p in model.named_parameters())
    return {"units": len(units), "own_units": sum(u.is_root for u in units), "gathers_per_step": gathers,
            "max_gathered_in_forward": max(live),
            "gathered_after_step": sum(u.gathered for u in units), "inside_matches_master": inside,
            "outside_is_nan": bool(torch.isnan(weight).all()) and weight.shape == (4 * 32, 32)}


def order_mismatch(ctx) -> str:
    """Rank 1 runs the blocks in the opposite order: every rank must stop with an error naming the modules."""
    model = _model()
    ZeroOptimizer(model, ZeroConfig(stage=3, **NO_PERSIST), OPT, ctx.dp_group)
    if ctx.dp_rank == 1:
        model.blocks = nn.ModuleDict({k: model.blocks[k] for k in reversed(list(model.blocks))})
    x, y = global_batch(0)
    try:
        model(x[:2], y[:2])
    except GatherOrderError as e:
        return str(e)
    return "no error"


def tp_world(ctx) -> dict:
    """tp 2 x dp 2 (sequence parallelism for stages 2 and 3): losses and full (TP-unsharded) final weights."""
    out = {}
    for stage, sp in [(1, False), (2, True), (3, False), (3, True)]:
        model = GPT(MODEL, ctx.tp_group, sequence_parallel=sp)
        init_parameters(model, SEED, ctx.tp_group)
        opt = ZeroOptimizer(model, ZeroConfig(stage=stage, **NO_PERSIST), OPT, ctx.dp_group,
                            norm_group=ctx.mp_group, norm_counted=grad_norm_weights(model, ctx.tp_rank))
        r, b = ctx.dp_rank, GLOBAL_BATCH // ctx.dp_size
        losses = []
        for step in range(STEPS):
            x, y = global_batch(step)
            opt.zero_grad()
            loss = model(x[r * b: (r + 1) * b], y[r * b: (r + 1) * b]).sum()
            opt.backward(loss / y.numel())
            total = loss.detach().double()
            ctx.dp_group.all_reduce(total, tag="loss")
            opt.step(lr_at(step))
            losses.append(total.item() / y.numel())
        with opt.gathered_parameters():
            out[(stage, sp)] = losses, full_state_dict(model, ctx.tp_group)
    return out


def _watch_grad_collectives(group: Group) -> tuple[dict, object]:
    """Wrap ``group``'s reduce-scatter and all-reduce: count gradient collectives issued and the elements handed
    to those issued but not yet waited on (``live``, and its ``peak``). Returns the counters and an undo."""
    state = {"live": 0, "peak": 0, "issued": 0}
    names = ("reduce_scatter", "all_reduce")
    orig = {name: getattr(group, name) for name in names}

    class Watched:
        def __init__(self, work, n: int) -> None:
            self.work, self.n = work, n

        def wait(self) -> None:
            self.work.wait()
            state["live"] -= self.n
            self.n = 0

    def wrap(name: str):
        def call(*args, tag: str = "other", async_op: bool = False, **kw):
            if tag != "grad":
                return orig[name](*args, tag=tag, async_op=async_op, **kw)
            n = (args[1] if name == "reduce_scatter" else args[0]).numel()
            state["issued"] += 1
            state["live"] += n
            state["peak"] = max(state["peak"], state["live"])
            work = orig[name](*args, tag=tag, async_op=async_op, **kw)
            if not async_op:
                state["live"] -= n
                return work
            return Watched(work, n)
        return call

    for name in names:
        setattr(group, name, wrap(name))
    return state, lambda: [delattr(group, name) for name in names]


GRAD_FLOW_RUNS = [Run("flow-s0", 0), Run("flow-s1", 1), Run("flow-bf16-s1", 1, precision="bf16"),
                  Run("flow-s2", 2), Run("flow-bf16-s2", 2, precision="bf16")]


def grad_flow_check(ctx) -> dict:
    """Stages 0-2, 2 micro-batches, buckets of 1500 elements, overlap on, at most 2 buckets in flight: per
    backward pass, the gradient collectives issued before its last gradient arrived; the peak of elements
    handed to gradient collectives not yet waited on; the peak bytes of live gradient storage (every
    ``p.grad``, the store's gradient buffers and staging pool) measured in a hook after each gradient; the
    addresses of the staging pool and of the gradients the step reads, per step."""
    out = {}
    for run in GRAD_FLOW_RUNS:
        model = _model()
        zero = ZeroConfig(stage=run.stage, reduce_bucket_size=1500, overlap_comm=True, max_inflight_buckets=2)
        opt = ZeroOptimizer(model, zero, OPT, ctx.dp_group, precision=run.precision)
        params = list(model.parameters())
        watch, undo = _watch_grad_collectives(ctx.dp_group)
        live_peak, last_seen = [0], [0]

        def measure(_p, opt=opt, params=params, watch=watch, live_peak=live_peak, last_seen=last_seen):
            held = opt.store.held_tensors()
            live = storage_bytes([q.grad for q in params] + held["grads"] + held.get("comm", []))
            live_peak[0] = max(live_peak[0], live)
            last_seen[0] = watch["issued"]

        for p in params:
            p.register_post_accumulate_grad_hook(measure)
        step_grads: list[list[tuple[int, int, str]]] = []
        owned_grads = opt._owned_grads

        def spy(owned_grads=owned_grads, step_grads=step_grads):
            g = owned_grads()
            step_grads.append([(t.data_ptr(), t.untyped_storage().data_ptr(), str(t.dtype)) for t in g.parts])
            return g

        opt._owned_grads = spy
        issued_in_pass, pool = [], []
        r, b = ctx.dp_rank, GLOBAL_BATCH // ctx.dp_size
        for step in range(3):
            x, y = global_batch(step)
            opt.zero_grad(micro_batches=2)
            for xm, ym in zip(x[r * b: (r + 1) * b].chunk(2), y[r * b: (r + 1) * b].chunk(2)):
                before = last_seen[0] = watch["issued"]
                opt.backward(model(xm, ym).sum() / y.numel())
                issued_in_pass.append(last_seen[0] - before)
            opt.step(lr_at(step))
            pool.append([t.data_ptr() for t in opt.store.held_tensors().get("comm", [])])
        undo()
        held = opt.store.held_tensors()
        out[run.name] = {
            "issued_in_pass": issued_in_pass, "inflight_peak": watch["peak"], "live_grad_peak": live_peak[0],
            "pool": pool, "step_grads": step_grads, "psi": sum(p.numel() for p in params),
            "grad_storages": sorted(t.untyped_storage().data_ptr() for t in held["grads"]),
            "grad_bytes": storage_bytes(held["grads"]), "grad_elem": held["grads"][0].element_size(),
            "largest_bucket": max(lay.padded_numel for _, _, lay in opt.store.buckets),
            "buckets": len(opt.store.buckets), "largest_param": max(p.numel() for p in params)}
    return out


def unused_grad_check(ctx) -> dict:
    """Stages 0-2 (fp32, bf16; 1 and 2 micro-batches), buckets of 64 elements mixing two layers: step 1 uses
    both layers, step 2 only ``a``. Per setting, whether after step 2's reduction ``b``'s owned gradient is
    exactly zero (no stale gradient of step 1, no leftover staging) and ``a``'s is not."""
    out = {}
    for stage in (0, 1, 2):
        for precision in ("fp32", "bf16"):
            for m in (1, 2):
                torch.manual_seed(0)
                model = nn.ModuleDict({"a": nn.Linear(8, 40), "b": nn.Linear(8, 40)})
                zero = ZeroConfig(stage=stage, reduce_bucket_size=64, overlap_comm=stage == 2)
                opt = ZeroOptimizer(model, zero, OPT, ctx.dp_group, precision=precision)
                x = torch.randn(4, 8, dtype=opt.dtype)
                for layers in (("a", "b"), ("a",)):
                    opt.zero_grad(micro_batches=m)
                    for xm in x.chunk(m):
                        opt.backward(sum(model[k](xm).float().square().sum() for k in layers))
                    sq = opt.prepare_step()
                    unused = {id(p) for p in model["b"].parameters()} if layers == ("a",) else set()
                    zeros = [bool((seg.grad[a:b] == 0).all()) for seg in opt.store.segments
                             for p, a, b in seg.pieces if id(p) in unused]
                    used = [bool((seg.grad[a:b] != 0).any()) for seg in opt.store.segments
                            for p, a, b in seg.pieces if id(p) not in unused]
                    opt.finish_step(1e-3, float(sq))
                out[(stage, precision, m)] = (len(zeros) > 0 and all(zeros), all(used))
    return out


def zero_world(ctx, extras: bool = False, memory: bool = False) -> dict:
    out = {run.name: train(ctx, run) for run in FP32_RUNS + BF16_RUNS}
    if extras:
        solo = Group("solo", [ctx.rank], None)
        out["no-dp-reduction"] = train(ctx, Run("no-dp-reduction", 1), dp_group=solo)
        for stage in range(4):
            run = Run(f"fp16-overflow-s{stage}", stage, precision="fp16", zero=NO_PERSIST, steps=len(OVERFLOW_STEPS))
            out[run.name] = train(ctx, run, inject=OVERFLOW_STEPS, loss_scale=FP16_SCALING)
        for stage, precision in ((1, "fp32"), (2, "bf16")):
            run = Run(f"nan-skip-s{stage}", stage, precision=precision, steps=len(OVERFLOW_STEPS))
            out[run.name] = train(ctx, run, inject=OVERFLOW_STEPS, inject_value=float("nan"))
        out["nan-stuck"] = train(ctx, Run("nan-stuck", 2, steps=len(STUCK_STEPS)), inject=STUCK_STEPS,
                                 inject_value=float("nan"), opt_cfg=replace(OPT, max_skipped_steps=3))
        out.update(grad_flow_check(ctx))
        out["unused-grads"] = unused_grad_check(ctx)
        out["s3-release"] = stage3_release_check(ctx)
        out["order-error"] = order_mismatch(ctx)  # last: the ranks' stage-3 state is abandoned after it
    if memory:
        out.update({run.name: train(ctx, run) for run in MEMORY_RUNS})
    return out


@pytest.fixture(scope="module")
def reference():
    """Losses, grad norms and final fp32 weights of the single-process AdamW run."""
    return run_world(reference_run, 1)[0]


@pytest.fixture(scope="module")
def world2():
    return run_world(zero_world, 2, extras=True, timeout=300)


@pytest.fixture(scope="module")
def world4():
    return run_world(zero_world, 4, memory=True, timeout=300)


@pytest.mark.parametrize("dp", [2, 4])
def test_fp32_parity_with_single_process_adamw(dp, reference, world2, world4) -> None:
    """Issue 3, must-show 1: stages 0-3, with and without accumulation, clipping on: losses of 10 steps and the
    final weights match torch.optim.AdamW within 1e-5 relative."""
    results = {2: world2, 4: world4}[dp]
    ref = reference
    assert ref["norms"][0] > 0.5, "clipping must be active (clip 0.5)"
    assert normwise(ref["weights"], ref["initial"]) > 1e-2, "the reference must move its weights"
    for run in FP32_RUNS:
        got = results[0][run.name]
        assert len(got["losses"]) == STEPS
        worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
        assert worst < 1e-5, f"{run.name} dp={dp}: loss rel err {worst:.2e}"
        err = normwise(got["weights"], ref["weights"])
        assert err < 1e-5, f"{run.name} dp={dp}: weights normwise err {err:.2e}"
        norm_err = max(abs(a - b) / b for a, b in zip(got["norms"], ref["norms"]))
        assert norm_err < 1e-5, f"{run.name} dp={dp}: grad norm rel err {norm_err:.2e}"


def test_parity_detects_a_missing_gradient_reduction(reference, world2) -> None:
    """The control run reduces nothing over DP (each rank trains on its own half): parity must fail clearly."""
    got = world2[0]["no-dp-reduction"]
    assert normwise(got["weights"], reference["weights"]) > 1e-3


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_volume_matches_stage_formula(dp, world2, world4) -> None:
    """Issue 3, must-show 3: the ledger's DP volume per step is 2Ψ (stages 0-2) and 3Ψ (stage 3) with one
    micro-batch, within padding, and follows each stage's formula in m with accumulation (exactly, counting
    the padded buffers): stage 0/1 2Ψ, stage 2 (m+1)Ψ, stage 3 3mΨ - mΨ_own + (m+1)Ψ_persistent (the model's
    own units, outside the blocks, are gathered once per micro-batch)."""
    for rank_res in {2: world2, 4: world4}[dp]:
        for run in FP32_RUNS + BF16_RUNS:
            got = rank_res[run.name]
            want = expected_volume(run, got["padded"], dp)
            assert got["volumes"] == [want] * STEPS, (run.name, got["volumes"], want)
            paper_case = run.m == 1 and (run.stage < 3 or run.zero == NO_PERSIST)
            if paper_case:  # the paper's figures on the unpadded parameter count
                paper = 3 * got["psi"] - SWAP * got["psi_own"] if run.stage == 3 else 2 * got["psi"]
                assert abs(want - paper) / paper < 0.01, (run.name, want, paper)


STATE_KEYS = ("params_bytes", "grads_bytes", "master_params_bytes", "optimizer_states_bytes")


def grad_bytes(run: Run) -> int:
    """Bytes per gradient element the run's setting asks for: fp32 in bf16 by default (Megatron-LM, DeepSpeed's
    bf16 optimizer), the model dtype in fp16 by default (the ZeRO paper's 2Ψ) and with grad_dtype "model"."""
    setting = run.zero.get("grad_dtype", "auto")
    if run.precision == "fp32" or setting == "fp32" or (setting == "auto" and run.precision == "bf16"):
        return 4
    return 2


def test_memory_matches_zero_formula_at_dp4(world4) -> None:
    """Issue 3, must-show 2, and issue 11 item 5: measured model-state bytes per rank equal DESIGN.md's formula
    (16-bit params, g-byte gradients, K = 12) within 1% on a >1M-parameter model at dp = 4, persistence
    threshold 0: bf16 with fp32 gradients (the default) 18Ψ at stage 0, 6Ψ + 12Ψ/Nd at stage 1 and
    2Ψ + 16Ψ/Nd at stage 2; 16-bit gradients (bf16 with grad_dtype model, fp16's default) 16Ψ, 4Ψ + 12Ψ/Nd,
    2Ψ + 14Ψ/Nd. The default threshold shows the persisted parameters whole; fp32 follows its own formula."""
    n = 4
    for rank_res in world4:
        totals = {}
        for run in MEMORY_RUNS:
            got = rank_res[run.name]
            psi, persist = got["psi"], got["persistent"]
            assert psi > 1_000_000
            b = 4 if run.precision == "fp32" else 2
            g = grad_bytes(run)
            sharded = [run.stage >= 1, run.stage >= 2, run.stage >= 3]
            want = {
                "params_bytes": b * (persist + (psi - persist) / n) if sharded[2] else b * psi,
                "grads_bytes": g * psi / n if sharded[1] else g * psi,
                "master_params_bytes": (4 * psi / n if sharded[0] else 4 * psi) if b == 2 else 0,
                "optimizer_states_bytes": 8 * psi / n if sharded[0] else 8 * psi,
            }
            for key, value in want.items():
                measured = got["memory"][key]
                assert abs(measured - value) <= 0.01 * max(value, 1) + 16, (run.name, key, measured, value)
            totals[run.name] = sum(got["memory"][k] for k in STATE_KEYS)
            formula = {0: (2 + g + 12) * psi, 1: (2 + g) * psi + 12 * psi / n, 2: 2 * psi + (g + 12) * psi / n,
                       3: (2 + g + 12) * psi / n}[run.stage]
            if b == 2 and persist == 0:
                assert abs(totals[run.name] - formula) / formula < 0.01, (run.name, totals[run.name], formula)
        assert totals["mem-bf16-s0"] == pytest.approx(18 * psi, rel=0.01)  # the figures, spelled out
        assert totals["mem-bf16-s2"] == pytest.approx(2 * psi + 16 * psi / n, rel=0.01)
        assert totals["mem-bf16-s0-model"] == pytest.approx(16 * psi, rel=0.01)
        assert totals["mem-fp16-s2"] == pytest.approx(2 * psi + 14 * psi / n, rel=0.01)
        assert totals["mem-bf16-s0"] > totals["mem-bf16-s1"] > totals["mem-bf16-s2"] > totals["mem-bf16-s3"]
        assert rank_res["mem-bf16-s3-default"]["persistent"] > 0


def test_fp16_overflow_on_one_rank_skips_everywhere(world2) -> None:
    """Issue 3, must-show 4: an inf gradient injected on rank 1 makes every rank skip the step with master and
    model weights untouched, and the scale drops after `hysteresis` overflows, then grows after the window."""
    for stage in range(4):
        per_rank = [res[f"fp16-overflow-s{stage}"] for res in world2]
        for got in per_rank:
            assert got["skipped"] == [False, True, True, False, False, False], (stage, got["skipped"])
            assert got["scales"] == [1024.0, 1024.0, 512.0, 512.0, 1024.0, 1024.0], (stage, got["scales"])
            assert got["unchanged"] == [False, True, True, False, False, False], (stage, got["unchanged"])
            assert got["adam_steps"] == 4
            assert got["norms"][1] == float("inf") and got["norms"][0] < 10


def test_nonfinite_gradient_without_scaler_skips_on_every_rank(world2) -> None:
    """Issue 11 item 5: without a loss scaler (fp32 stage 1, bf16 stage 2) a NaN written into one gradient on
    rank 1 only makes every rank skip that step with master and model weights bit-identical, counted in
    ``skipped_steps``; training goes on after it."""
    for name in ("nan-skip-s1", "nan-skip-s2"):
        per_rank = [res[name] for res in world2]
        for got in per_rank:
            assert got["skipped"] == OVERFLOW_STEPS, (name, got["skipped"])
            assert got["unchanged"] == OVERFLOW_STEPS, (name, got["unchanged"])
            assert got["adam_steps"] == 4 and got["skipped_steps"] == 2, name
            assert all(n != n for n in got["norms"][1:3]) and all(n < 10 for n in got["norms"][3:]), got["norms"]
            assert got["scales"] == [None] * len(OVERFLOW_STEPS) and not got.get("error")
        assert per_rank[0]["losses"] == per_rank[1]["losses"]


def test_consecutive_nonfinite_steps_stop_every_rank(world2) -> None:
    """With max_skipped_steps 3, three NaN steps in a row (steps 2-4) stop the run on every rank (no rank waits
    for a peer) with an error naming the step and suggesting a lower learning rate."""
    for res in world2:
        got = res["nan-stuck"]
        assert len(got["losses"]) == 4 and got["skipped"] == [False, True, True, True]
        assert len(got["error"]) == 1
        msg = got["error"][0]
        assert "3 consecutive steps" in msg and "at step 4" in msg and "lower the learning rate" in msg, msg


def test_stage2_bounds_gradients_in_flight_and_reuses_its_buffers(world2) -> None:
    """Issue 13 item 1, measured at dp 2 with buckets of 1500 elements and max_inflight_buckets 2: no bucket is
    larger, even where a parameter is (buckets cut it), stage 2 reduces during every backward pass before its
    last gradient arrives, the elements handed to gradient
    collectives not yet waited on never exceed 2 buckets (not Ψ), live gradient storage during backward stays
    below the owned partition + 2 staging buckets + two parameters' gradients (the full unreduced gradient
    never exists), and the staging pool and the gradients the step reads keep their addresses across steps."""
    for res in world2:
        for name in ("flow-s2", "flow-bf16-s2"):
            got = res[name]
            psi, bucket, e = got["psi"], got["largest_bucket"], got["grad_elem"]
            assert got["buckets"] >= 10 and e == 4
            assert got["largest_bucket"] <= 1500 < got["largest_param"]  # buckets cut the parameters they bound
            assert all(n > 0 for n in got["issued_in_pass"]), got["issued_in_pass"]
            assert 0 < got["inflight_peak"] <= 2 * bucket < psi / 3, (got["inflight_peak"], bucket, psi)
            bound = got["grad_bytes"] + e * 2 * bucket + 2 * 4 * got["largest_param"]
            assert got["live_grad_peak"] <= bound < got["grad_bytes"] + e * psi, (got["live_grad_peak"], bound)
            assert len(got["pool"][0]) == 2 and got["pool"] == [got["pool"][0]] * 3
            assert got["step_grads"] == [got["step_grads"][0]] * 3
            assert {s for _, s, dt in got["step_grads"][0]} == set(got["grad_storages"])  # the store's own buffer
            assert {dt for _, _, dt in got["step_grads"][0]} == {"torch.float32"}


def test_a_parameter_without_gradient_reduces_zeros_not_last_steps(world2) -> None:
    """Gradient buffers are overwritten by each step's first gradient rather than zeroed: a parameter that gets
    no gradient in a step (and a bucket reduced before all its gradients arrived) must still reduce zeros."""
    for res in world2:
        for key, (unused_zero, used_set) in res["unused-grads"].items():
            assert unused_zero and used_set, key


def test_stages_0_1_reduce_during_the_last_micro_batch_into_persistent_buffers(world2) -> None:
    """Issue 13 item 1, stages 0-1 (full gradient by definition): no gradient collective during the first of two
    micro-batches, some before the last gradient of the last one arrives (DDP-style overlap); the step reads
    the accumulated fp32 gradient buffer itself (in bf16 too: fp32 accumulation) at the same address every
    step, with no separate fp32 copy."""
    for res in world2:
        for name in ("flow-s0", "flow-s1", "flow-bf16-s1"):
            got = res[name]
            assert got["issued_in_pass"][0::2] == [0, 0, 0], (name, got["issued_in_pass"])
            assert all(n > 0 for n in got["issued_in_pass"][1::2]), (name, got["issued_in_pass"])
            assert got["step_grads"] == [got["step_grads"][0]] * 3 and got["pool"] == [[]] * 3
            assert {s for _, s, _ in got["step_grads"][0]} == set(got["grad_storages"])
            assert {dt for _, _, dt in got["step_grads"][0]} == {"torch.float32"}
            assert 4 * got["psi"] <= got["grad_bytes"] < 1.1 * 4 * got["psi"]  # the full gradient in fp32, padded


def test_stage3_gathers_each_unit_once_per_pass_and_releases(world2) -> None:
    """Without prefetch, each block's unit is all-gathered exactly once per forward and once per backward, the
    model's own unit (the tied embedding, the position table and the final norm) once per step: its backward
    finds it parked with the forward's values (zero/stage3/gather.py, "Carry"); during a submodule's forward
    only it, the embedding and the root's own parameters are gathered; after each step nothing is; reads
    outside the step see NaN placeholders of the right shape and real values inside ``gathered_parameters()``."""
    for res in world2:
        got = res["s3-release"]
        assert got["own_units"] == 1 and got["gathers_per_step"] == [2 * got["units"] - SWAP] * STEPS
        assert got["max_gathered_in_forward"] <= 3
        assert got["gathered_after_step"] == 0
        assert got["outside_is_nan"] and got["inside_matches_master"]


def test_stage3_gather_order_mismatch_names_the_modules(world2) -> None:
    for r, res in enumerate(world2):
        msg = res["order-error"]
        assert "disagree" in msg and "of blocks.0" in msg and "of blocks.1" in msg, (r, msg)
        assert "rank 0" in msg and "rank 1" in msg


def test_zero_stages_with_tensor_and_sequence_parallelism(reference) -> None:
    """ZeRO over the DP group of a tp 2 x dp 2 grid (TP-replicated parameters counted once in the norm, SP
    gradient hooks on replicated parameters) still trains the single-process model."""
    ref_weights = dict(reference["weights"])
    ref_weights["wte.weight"] = ref_weights["wte.weight"][: MODEL.vocab_size]  # full_state_dict drops padding
    for key, (losses, weights) in run_world(tp_world, 4, tp=2, timeout=300)[0].items():
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"]))
        assert worst < 1e-5, (key, worst)
        assert normwise(weights, ref_weights) < 1e-5, key


def test_torchrun_memory_per_rank_falls_with_stage(subprocess_env, tmp_path) -> None:
    """Issue 3, must-show 5: ``torchrun --nproc-per-node 4 pretrain/gpt.py --dp 4 --zero-stage S`` in bf16 runs
    for S = 0..3 and metrics.jsonl shows every rank's model-state bytes at the ZeRO formula with fp32
    gradients (persistence 0) and the DP volume at 2Ψ / 3Ψ - Ψ_own (the embeddings and final norm, outside the
    blocks, gathered once per step)."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    psi = ModelConfig(num_layers=4, hidden_size=128, num_heads=4, seq_len=128, vocab_size=512).num_parameters()
    psi_own = (512 + 128) * 128 + 2 * 128  # token and position tables, final LayerNorm
    formula = {0: 18 * psi, 1: 6 * psi + 12 * psi / 4, 2: 2 * psi + 16 * psi / 4, 3: 18 * psi / 4}
    for stage in range(4):
        log_dir = tmp_path / f"s{stage}"
        cmd = ["--dp", "4", "--zero-stage", str(stage),
               "--precision", "bf16", "--vocab-size", "512", "--train-steps", "3", "--micro-batch-size", "2",
               "--log-interval", "1", "--eval-interval", "0", "--no-progress", "--deepspeed-config", str(ds),
               "--log-dir", str(log_dir)]
        r = launch.torchrun(4, cmd, subprocess_env, 300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        last = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()][-1]
        assert len(last["memory"]) == 4
        for rec in last["memory"]:
            states = sum(rec[k] for k in ("params_bytes", "grads_bytes", "master_params_bytes",
                                          "optimizer_states_bytes"))
            assert abs(states - formula[stage]) / formula[stage] < 0.01, (stage, rec)
        for rec in last["comm"]:
            want = 3 * psi - SWAP * psi_own if stage == 3 else 2 * psi
            assert abs(rec["volume_elements_per_step"] - want) / want < 0.01, (stage, rec)
