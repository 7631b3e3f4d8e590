"""ZeRO step time and per-rank memory on CPU gloo ranks: megazero stages 0-3 against their peers.

    python bench/zero_bench.py                                   # megazero, DDP, ZeroRedundancyOptimizer, FSDP2
    bash bench/setup_peers.sh                                    # once: DeepSpeed in bench/.venv-peers
    bench/.venv-peers/bin/python bench/zero_bench.py --reps 5    # ... and DeepSpeed ZeRO 1/2/3 too

Every contender trains the same megazero GPT (built and initialised from the same seed), on the same global
batches (each of the ``--dp`` ranks takes its slice), with AdamW (lr, betas, eps and weight decay on matrices
only, identical everywhere), gradient clipping at the same global norm, in fp32, one micro-batch per step:

* ``mz0`` .. ``mz3``: :class:`megazero.zero.ZeroOptimizer` at that stage with its default settings (the
  defaults of DeepSpeed's ``zero_optimization`` block); ``mz3-p0`` is stage 3 with
  ``stage3_param_persistence_threshold`` 0, i.e. every parameter sharded, as FSDP2 does; ``mz3-nopark`` (not
  run by default) is stage 3 with the parking of its chunk's own units turned off, ``mz3-whole`` with a chunk's
  own parameters in one unit however large (``units.collect_units(apart_larger=False)``), ``mz3-before`` with
  neither change (as before issue 31 item 3), ``mz3-nocarry`` with ``stage3_max_reuse_distance`` 0 (a chunk's
  own units gathered again in backward: no carry, ``zero/stage3/gather.py``), for A/Bs in one run.
  ``engine0`` .. ``engine3`` (not run by default) go through :class:`megazero.train.engine.Engine` instead, the
  production step (token count and loss all-reduces, activation accounting).
* ``ddp``: ``DistributedDataParallel`` + ``torch.optim.AdamW`` + ``clip_grad_norm_``.
* ``torch-zero1``: DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer`` (optimizer-state sharding).
* ``fsdp2``: ``fully_shard`` on every block and the root over ``init_device_mesh("cpu", (dp,))``.
* ``ds1`` .. ``ds3``: ``deepspeed.initialize`` with ZeRO stage 1/2/3 (DeepSpeed's defaults), fp32, handed the
  same ``torch.optim.AdamW``; ``ds3-p0`` with ``stage3_param_persistence_threshold`` 0. Skipped, with the
  reason, where DeepSpeed cannot be imported (``bench/setup_peers.sh`` installs it in its own venv).

Each (repetition, contender) is a fresh world of ``--dp`` forked ranks (``tests/dist.py``'s ``run_world``,
one intra-op thread per rank); repetitions run every contender in turn, rotating the order, so background load
hits all of them alike. A step is timed on every rank between a barrier and the end of the optimizer step; its
time is the slowest rank's. The table shows the median over the timed steps of all repetitions, the range of
the per-repetition medians (a noise gauge) and, as "vs DDP", the best repetition's median over DDP's best (load
only ever adds time). On a shared machine wall time follows the other tenants' load, so the table also gives
the CPU time of a step summed over the ranks (``time.process_time``, all threads of each rank, gloo's included;
waiting costs none): the work each contender asks of the machine, which load barely changes.

Memory is taken after the last step, per rank (the table shows the largest rank): model-state bytes
(megazero: ``ZeroOptimizer.model_state_bytes()``, cross-checked against a walk of its tensors; peers: every
tensor reachable from the model and optimizer objects -- parameters, gradients, optimizer state, flat buffers --
merged by address range, DTensors by their local shard, meta tensors skipped; DDP's C++ reducer buckets, which
Python cannot reach, are added as Ψ fp32 elements) and the process RSS now / at its peak (the ranks are forked
from this process, so every RSS includes the same torch baseline; DeepSpeed adds its own import). The loss
column is the largest relative difference of the global-batch loss from DDP's over all steps, a parity check:
the script exits 1 if a megazero stage is off by more than 1e-4.

``--profile DIR`` runs torch.profiler on rank 0 over the timed steps of the first repetition; ``--json FILE``
keeps every measurement and ``--from-json FILE`` prints its table again.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from megazero.config.schema import PRESETS, ModelConfig, OptimizerConfig, ZeroConfig, model_preset  # noqa: E402
from megazero.model import GPT, init_parameters  # noqa: E402
from tests.dist import WorldError, run_world  # noqa: E402

SEED = 1234
LOSS_TOLERANCE = 1e-4  # relative, vs DDP, for the sanity verdict (fp32 parity tests hold 1e-5 over 10 steps)
BF16_LOSS_TOLERANCE = 2e-2  # bf16 runs differ in rounding (and DDP's autocast from a bf16 master copy)
STATE_FORMULA = {0: 16, 1: 4 + 4 + 8 / 4, 2: 4 + 12 / 4, 3: 16 / 4}  # fp32 bytes/param at dp 4, ZeRO paper


@dataclass(frozen=True)
class Contender:
    name: str
    label: str
    kind: str  # megazero | engine | ddp | torch-zero1 | fsdp2 | deepspeed
    stage: int | None = None
    zero: dict = field(default_factory=dict)
    needs: str | None = None  # importable module this contender needs
    parking: bool = True  # megazero stage 3: a chunk's own units parked from forward to backward (A/B: False)
    apart_larger: bool = True  # megazero stage 3: own parameters larger than a block in units of their own


CONTENDERS = {c.name: c for c in [
    Contender("ddp", "PyTorch DDP", "ddp"),
    Contender("torch-zero1", "torch ZeroRedundancyOptimizer (DDP)", "torch-zero1"),
    Contender("fsdp2", "FSDP2 fully_shard", "fsdp2"),
    *[Contender(f"ds{s}", f"DeepSpeed ZeRO-{s}", "deepspeed", s, needs="deepspeed") for s in (1, 2, 3)],
    Contender("ds3-p0", "DeepSpeed ZeRO-3, persistence 0", "deepspeed", 3,
              {"stage3_param_persistence_threshold": 0}, needs="deepspeed"),
    *[Contender(f"mz{s}", f"megazero ZeRO-{s}", "megazero", s) for s in range(4)],
    Contender("mz3-p0", "megazero ZeRO-3, persistence 0", "megazero", 3, {"stage3_param_persistence_threshold": 0}),
    Contender("mz3-nopark", "megazero ZeRO-3, no parking", "megazero", 3, parking=False),
    Contender("mz3-nocarry", "megazero ZeRO-3, no reuse", "megazero", 3, {"stage3_max_reuse_distance": 0}),
    Contender("mz3-whole", "megazero ZeRO-3, own parameters in one unit", "megazero", 3, apart_larger=False),
    Contender("mz3-before", "megazero ZeRO-3, neither", "megazero", 3, parking=False, apart_larger=False),
    *[Contender(f"engine{s}", f"megazero Engine ZeRO-{s}", "engine", s) for s in range(4)],
]}
DEFAULT_CONTENDERS = ["ddp", "torch-zero1", "fsdp2", "ds1", "ds2", "ds3", "ds3-p0", "mz0", "mz1", "mz2", "mz3",
                      "mz3-p0"]


# ---------------------------------------------------------------------------------------------------------
# Inside a rank
# ---------------------------------------------------------------------------------------------------------
def _global_batches(cfg: ModelConfig, global_batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)
        shape = (global_batch, cfg.seq_len)
        out.append((torch.randint(0, cfg.vocab_size, shape, generator=g),
                    torch.randint(0, cfg.vocab_size, shape, generator=g)))
    return out


def _model(cfg: ModelConfig) -> GPT:
    model = GPT(cfg)
    init_parameters(model, SEED)
    return model


def _adamw_groups(model: nn.Module, opt: OptimizerConfig) -> list[dict]:
    """megazero's decay rule: weight decay on parameters with ndim >= 2 only."""
    return [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": opt.weight_decay},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]


def _adamw_kwargs(opt: OptimizerConfig, impl: str) -> dict:
    kw = {"lr": opt.lr, "betas": opt.betas, "eps": opt.eps}
    if impl == "foreach":
        kw["foreach"] = True
    elif impl == "fused":
        kw["fused"] = True
    return kw


def _rss_mb() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MB, from /proc (no psutil needed)."""
    now = peak = math.nan
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    now = int(line.split()[1]) / 1024
                elif line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) / 1024
    except OSError:
        pass
    return now, peak


_WALK_PACKAGES = ("torch", "deepspeed", "megazero")


def held_tensors(roots: list[Any]) -> list[torch.Tensor]:
    """The tensors :func:`held_storage_bytes` walks (DTensors by their local shard)."""
    out: list[torch.Tensor] = []
    held_storage_bytes(roots, out)
    return out


def held_storage_bytes(roots: list[Any], found: list | None = None) -> list[int]:
    """Sizes of the distinct memory blocks behind the tensors reachable from ``roots`` through containers, module
    members and the attributes of torch/DeepSpeed/megazero objects (a parameter's ``.grad`` included; a DTensor
    counts its local shard; storages resized to 0, such as released ZeRO-3/FSDP buffers, are left out).

    Storages are merged by address range, not by identity: DeepSpeed builds storage objects that alias parts
    of its flat buffers, and live storages that overlap must share memory."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        DTensor = ()  # noqa: N806
    seen_obj: set[int] = set()
    ranges: set[tuple[int, int]] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen_obj:
            continue
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if DTensor and isinstance(obj, DTensor):
                stack.append(obj._local_tensor)
            else:
                st = obj.untyped_storage()
                if found is not None:
                    found.append(obj)
                if st.nbytes() and obj.device.type != "meta":  # meta tensors (DeepSpeed's shape records) own no memory
                    ranges.add((st.data_ptr(), st.data_ptr() + st.nbytes()))
            if obj.is_leaf:
                stack.append(obj.grad)
            stack.extend(v for v in getattr(obj, "__dict__", {}).values() if isinstance(v, torch.Tensor))
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif type(obj).__module__.split(".")[0] in _WALK_PACKAGES or isinstance(obj, nn.Module):
            stack.extend(getattr(obj, "__dict__", {}).values())
            for slot in getattr(type(obj), "__slots__", ()):
                stack.append(getattr(obj, slot, None))
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return sorted((hi - lo for lo, hi in merged), reverse=True)


@dataclass
class Setup:
    step: Any  # (x, y) -> detached per-token loss sum of this rank
    roots: list[Any]  # objects whose tensors are this contender's model states
    model_state_bytes: Any = None  # () -> int, where the contender measures itself
    extra_bytes: Any = None  # () -> int: what a walk finds beside the model states (megazero's buffers)
    hidden_bytes: int = 0  # model-state bytes no Python object exposes (DDP's reducer buckets)
    close: Any = None
    buffers: Any = None  # () -> {category: tensors}, for the peak tracker's breakdown
    forward_modules: list = field(default_factory=list)


def _torch_buffers(model: nn.Module, opt: Any) -> Any:
    """Categories of a torch contender's tensors: parameters (DTensors by their local shard), ``.grad`` and the
    optimizer's state (ZeroRedundancyOptimizer: its local optimizer)."""
    def local(t):
        return getattr(t, "_local_tensor", t)

    def buffers():
        params = list(model.parameters())
        inner = getattr(opt, "optim", opt)
        states = [local(v) for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return {"params": [local(p) for p in params],
                "grads": [local(p.grad) if p.grad is not None else None for p in params],
                "optimizer_states": states}

    return buffers


def _mz_state_bytes(opt) -> int:
    b = opt.model_state_bytes()
    return sum(b[k] for k in ("params_bytes", "grads_bytes", "master_params_bytes", "optimizer_states_bytes"))


def _mz_extra_bytes(opt) -> int:
    """What megazero holds beside its model states, which a walk of its tensors also finds: the communication
    buffers (stage 2's staging pool, stage 3's persistent pool) and Adam's step count (tests/test_zero_rss.py)."""
    return opt.model_state_bytes()["comm_buffers_bytes"] + opt._step_tensor.nbytes


def _setup_megazero(ctx, c: Contender, cfg: ModelConfig, opt_cfg: OptimizerConfig, tokens: int, precision: str,
                    **_) -> Setup:
    from megazero.observe.memory import zero_buffers
    from megazero.zero import ZeroOptimizer

    model = _model(cfg)
    if not c.apart_larger:  # the A/B of megazero/zero/stage3/units.py's own units larger than a block (this rank)
        import megazero.zero.stage3.params as stage3_params

        stage3_params.collect_units = functools.partial(stage3_params.collect_units, apart_larger=False)
    opt = ZeroOptimizer(model, ZeroConfig(stage=c.stage, **c.zero), opt_cfg, ctx.dp_group, precision=precision)
    if not c.parking:  # the A/B of stage 3's parking (megazero/zero/stage3/slots.py): its own units' memory freed
        opt.store.slots.parking = False

    def step(x, y):
        opt.zero_grad()
        loss = model(x, y).sum()
        opt.backward(loss / tokens)
        opt.step(opt_cfg.lr)
        return loss.detach()

    return Setup(step, [model, opt], model_state_bytes=lambda: _mz_state_bytes(opt),
                 extra_bytes=lambda: _mz_extra_bytes(opt), buffers=lambda: zero_buffers(opt), forward_modules=[model])


def _setup_engine(ctx, c: Contender, cfg: ModelConfig, opt_cfg: OptimizerConfig, tokens: int, micro: int,
                  **_) -> Setup:
    from megazero.config.schema import Config, SchedulerConfig, TrainingConfig
    from megazero.train.engine import Engine

    conf = Config(model=cfg, zero=ZeroConfig(stage=c.stage, **c.zero), optimizer=opt_cfg,
                  scheduler=SchedulerConfig(name="constant"),
                  training=TrainingConfig(micro_batch_size=micro, seed=SEED, train_steps=10**6))
    engine = Engine(conf.resolve(ctx.world_size), ctx)

    def step(x, y):
        r = engine.train_step([(x, y)])
        return torch.tensor(r.loss * tokens / ctx.dp_size)  # this rank's share, for the common loss check

    return Setup(step, [engine.model, engine.optimizer],
                 model_state_bytes=lambda: _mz_state_bytes(engine.optimizer),
                 extra_bytes=lambda: _mz_extra_bytes(engine.optimizer))


def _torch_step(model: nn.Module, opt: torch.optim.Optimizer, params: list, clip: float, local_tokens: int,
                autocast: bool = False):
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, y).sum()
        (loss / local_tokens).backward()  # DDP/FSDP average gradients over ranks: the global mean
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        return loss.detach()

    return step


def _setup_ddp(ctx, c: Contender, cfg: ModelConfig, opt_cfg: OptimizerConfig, local_tokens: int, adam: str,
               precision: str, **_) -> Setup:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model(cfg)
    ddp = DDP(model)
    groups = _adamw_groups(model, opt_cfg)
    if c.kind == "torch-zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **_adamw_kwargs(opt_cfg, adam))
    else:
        opt = torch.optim.AdamW(groups, **_adamw_kwargs(opt_cfg, adam))
    # the reducer's flat gradient buckets (gradient_as_bucket_view=False, the default): Ψ elements in C++
    hidden = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    # bf16: torch's autocast (fp32 parameters, gradients and AdamW; bf16 compute), what a DDP user runs
    return Setup(_torch_step(ddp, opt, list(model.parameters()), opt_cfg.clip_grad, local_tokens,
                             autocast=precision == "bf16"), [model, opt],
                 hidden_bytes=hidden, buffers=_torch_buffers(model, opt), forward_modules=[model])


def _setup_fsdp2(ctx, c: Contender, cfg: ModelConfig, opt_cfg: OptimizerConfig, local_tokens: int, adam: str,
                 precision: str, **_) -> Setup:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model(cfg)
    mesh = init_device_mesh("cpu", (ctx.dp_size,))
    # bf16: bf16 gathered parameters and compute, fp32 gradient reduction and fp32 sharded parameters + AdamW
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # the root: embeddings, tied LM head, final LayerNorm
    opt = torch.optim.AdamW(_adamw_groups(model, opt_cfg), **_adamw_kwargs(opt_cfg, adam))
    return Setup(_torch_step(model, opt, list(model.parameters()), opt_cfg.clip_grad, local_tokens), [model, opt],
                 buffers=_torch_buffers(model, opt), forward_modules=[model])


def _setup_deepspeed(ctx, c: Contender, cfg: ModelConfig, opt_cfg: OptimizerConfig, local_tokens: int,
                     micro: int, adam: str, precision: str, **_) -> Setup:
    import logging

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("RANK", ctx.rank), ("WORLD_SIZE", ctx.world_size), ("LOCAL_RANK", ctx.rank),
                       ("LOCAL_SIZE", ctx.world_size), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        os.environ[key] = str(value)  # DeepSpeed reads these; the gloo group itself already exists
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    model = _model(cfg)
    opt = torch.optim.AdamW(_adamw_groups(model, opt_cfg), **_adamw_kwargs(opt_cfg, adam))
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro * ctx.dp_size,
        "gradient_clipping": opt_cfg.clip_grad,
        "zero_optimization": {"stage": c.stage, **c.zero},
        "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": False},
        "bf16": {"enabled": precision == "bf16"},  # bf16 params/compute, fp32 master, gradients and AdamW
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    if c.stage == 3:  # read outside their owner's forward: the tied LM head and the position table
        deepspeed.zero.register_external_parameter(model, model.wte.weight)
        deepspeed.zero.register_external_parameter(model, model.wpe.weight)

    def step(x, y):
        loss = engine(x, y).sum()
        engine.backward(loss / local_tokens)  # DeepSpeed averages gradients over DP ranks
        engine.step()  # clips, updates, zeroes the gradients
        return loss.detach()

    def close():
        engine.destroy()

    return Setup(step, [engine, ds_opt, model], close=close, buffers=_torch_buffers(model, opt),
                 forward_modules=[model])


SETUPS = {"megazero": _setup_megazero, "engine": _setup_engine, "ddp": _setup_ddp, "torch-zero1": _setup_ddp,
          "fsdp2": _setup_fsdp2, "deepspeed": _setup_deepspeed}


def _rank_run(ctx, c: Contender, cfg: ModelConfig, opt_cfg: OptimizerConfig, micro: int, warmup: int, steps: int,
              adam: str, profile_dir: str | None = None, precision: str = "fp32", peak: bool = True) -> dict:
    warnings.filterwarnings("ignore")
    total = warmup + steps
    batches = _global_batches(cfg, micro * ctx.dp_size, total + 1)  # + 1: the step whose peak is measured
    r = ctx.dp_rank
    local = [(x[r * micro: (r + 1) * micro], y[r * micro: (r + 1) * micro]) for x, y in batches]
    tokens = micro * ctx.dp_size * cfg.seq_len
    setup = SETUPS[c.kind](ctx, c, cfg, opt_cfg, tokens=tokens, local_tokens=micro * cfg.seq_len, micro=micro,
                           adam=adam, precision=precision)
    times, cpu, losses = [], [], []
    prof = None
    gc.collect()
    for i, (x, y) in enumerate(local[:total]):
        if i == warmup and profile_dir and ctx.rank == 0:
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CPU])
            prof.start()
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        losses.append(setup.step(x, y))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if prof is not None:
        prof.stop()
        os.makedirs(profile_dir, exist_ok=True)
        with open(os.path.join(profile_dir, f"{c.name}.txt"), "w") as f:
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)
            f.write(f"{c.label}: rank 0, {steps} timed steps\n{table}\n")
        prof.export_chrome_trace(os.path.join(profile_dir, f"{c.name}.trace.json"))
    loss = torch.stack([v.double().reshape(()) for v in losses])
    dist.all_reduce(loss)
    step_peak = None
    if peak:  # one more step, untimed, under megazero's tracker (it slows the step it measures)
        from megazero.observe.memory import PeakMemoryTracker

        tracker = PeakMemoryTracker("cpu", setup.buffers, setup.forward_modules,
                                    baseline=lambda: held_tensors(setup.roots))
        dist.barrier()
        with tracker:
            setup.step(*local[total])
        step_peak = dict(tracker.result())
        if setup.hidden_bytes:  # DDP's reducer buckets, allocated in C++ before the step: alive throughout
            step_peak["peak_bytes"] += setup.hidden_bytes
            step_peak["peak_by_category"]["comm_buffers"] += setup.hidden_bytes
    storages = held_storage_bytes(setup.roots)
    walked = sum(storages) + setup.hidden_bytes
    state_bytes = setup.model_state_bytes() if setup.model_state_bytes is not None else walked
    extra = setup.extra_bytes() if setup.extra_bytes is not None else 0
    rss, rss_peak = _rss_mb()
    if setup.close is not None:
        setup.close()
    return {"times": times[warmup:], "cpu": cpu[warmup:], "losses": (loss / tokens).tolist(), "state_bytes": state_bytes,
            "walked_bytes": walked, "extra_bytes": extra, "largest_bytes": storages[0] if storages else 0, "rss": rss, "rss_peak": rss_peak,
            "peak": step_peak}


# ---------------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------------
def _unavailable(c: Contender, cache: dict[str, str | None]) -> str | None:
    """Why ``c`` cannot run here (None if it can). Imports are probed in a subprocess, keeping this one clean."""
    if c.needs is None:
        return None
    if c.needs not in cache:
        probe = subprocess.run([sys.executable, "-c", f"import {c.needs}"], capture_output=True, text=True,
                               env={**os.environ, "DS_ACCELERATOR": "cpu"})
        if probe.returncode == 0:
            cache[c.needs] = None
        else:
            last = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
            hint = " (bash bench/setup_peers.sh, then run with bench/.venv-peers/bin/python)" \
                if c.needs == "deepspeed" else ""
            cache[c.needs] = f"{c.needs} not importable: {last}{hint}"
    return cache[c.needs]


def _source_version() -> str:
    """Where megazero was imported from, with the git commit (and whether the tree differs from it)."""
    import megazero

    root = os.path.dirname(os.path.dirname(os.path.abspath(megazero.__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "megazero"], capture_output=True,
                               text=True).stdout.strip()
        return f"{root} @ {head}{' (megazero/ modified)' if dirty else ''}"
    except (OSError, subprocess.CalledProcessError):
        return root


def _first_error_line(exc: BaseException) -> str:
    text = str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.split(":")[0].endswith(("Error", "Exception", "error"))]
    return (errors[-1] if errors else (lines[-1] if lines else type(exc).__name__))[:200]


def _fmt(x: float, digits: int = 1) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Contenders: " + ", ".join(f"{c.name} ({c.label})" for c in CONTENDERS.values())
        + f". Default: {','.join(DEFAULT_CONTENDERS)}.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = ap.add_argument_group("model (megazero GPT, fp32)")
    g.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="architecture preset (default: tiny)")
    g.add_argument("--num-layers", type=int, help="override the preset's layer count")
    g.add_argument("--hidden-size", type=int, help="override the preset's hidden size")
    g.add_argument("--num-heads", type=int, help="override the preset's head count")
    g.add_argument("--seq-len", type=int, help="override the preset's sequence length")
    g.add_argument("--vocab-size", type=int, help="override the preset's vocabulary size")
    g = ap.add_argument_group("run")
    g.add_argument("--dp", type=int, default=4, help="data-parallel ranks (gloo processes) (default: 4)")
    g.add_argument("--micro-batch-size", type=int, default=1, help="sequences per rank per step (default: 1)")
    g.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    g.add_argument("--steps", type=int, default=10, help="timed steps per repetition (default: 10)")
    g.add_argument("--reps", type=int, default=3,
                   help="repetitions, each running every contender in a fresh world, order rotated (default: 3)")
    g.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS),
                   help="comma-separated names, or 'all' (see the list below)")
    g.add_argument("--torch-adam", default="default", choices=("default", "foreach", "fused"),
                   help="torch.optim.AdamW implementation for the torch/DeepSpeed peers (default: torch's own "
                        "choice, the single-tensor loop on CPU)")
    g.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="bf16: megazero and DeepSpeed keep bf16 parameters with an fp32 master copy, FSDP2 gathers "
                        "bf16 parameters (fp32 shards, fp32 reduction), DDP runs torch.autocast (default: fp32)")
    g.add_argument("--no-peak", action="store_true",
                   help="skip the extra step measured by megazero's peak tracker (first repetition only)")
    g.add_argument("--timeout", type=float, default=900.0, help="seconds per world before it is killed")
    g.add_argument("--json", metavar="FILE", help="also write every measurement to FILE")
    g.add_argument("--from-json", metavar="FILE", help="print the table of a --json record again; run nothing")
    g.add_argument("--profile", metavar="DIR",
                   help="torch.profiler on rank 0 over the timed steps of the first repetition: DIR/NAME.txt (top "
                        "ops by self CPU time) and DIR/NAME.trace.json (chrome://tracing) per contender")
    return ap


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples) if samples else math.nan


def _best_ratio(runs: list[dict], ref_runs: list[dict], key: str) -> float:
    """Best repetition's median over DDP's best repetition's median. Other tenants' load only ever adds time,
    and repetitions interleave the contenders, so the best repetitions are the least disturbed ones."""
    if not runs or not ref_runs:
        return math.nan
    return min(statistics.median(r[key]) for r in runs) / min(statistics.median(r[key]) for r in ref_runs)


def render(record: dict) -> int:
    """Print the Markdown table (and the checks under it) from a measurement record; 1 if megazero's losses
    do not match DDP's."""
    names, results, skipped, failed = record["names"], record["results"], record["skipped"], record["failed"]
    psi = record["psi"]
    ddp_runs = results.get("ddp") or []
    tolerance = LOSS_TOLERANCE if record["args"].get("precision", "fp32") == "fp32" else BF16_LOSS_TOLERANCE
    ref_losses = ddp_runs[0]["per_rank"][0]["losses"] if ddp_runs else None
    print(f"load average before / after: {' '.join(f'{x:.2f}' for x in record['load_before'])} / "
          f"{' '.join(f'{x:.2f}' for x in record['load_after'])}; wall {record['wall_s']:.0f} s\n")
    print("| contender | step time median (ms) | best rep median (ms) | rep medians, min–max (ms) | vs DDP | CPU time / step, all ranks (ms) "
          "| CPU vs DDP | model states / rank (MB) | RSS / rank, end / peak (MB) | loss vs DDP (max rel) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    full_states_mb = 16 * psi / 1e6
    notes, mz_bad = [], []
    for n in names:
        c = CONTENDERS[n]
        runs = results.get(n) or []
        if n in skipped or n in failed or not runs:
            why = f"skipped ({skipped[n]})" if n in skipped else f"failed ({failed.get(n, 'no result')})"
            print(f"| {c.label} (`{n}`) | {why} | | | | | | | | |")
            continue
        per_rank = runs[0]["per_rank"]
        losses = per_rank[0]["losses"]
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) if ref_losses else math.nan
        rep_medians = [_median_ms(r["step_times"]) for r in runs]
        state_mb = max(r["state_bytes"] for r in per_rank) / 1e6
        walked_mb = max(r["walked_bytes"] for r in per_rank) / 1e6
        extra_mb = max(r["extra_bytes"] for r in per_rank) / 1e6
        largest_mb = max(r["largest_bytes"] for r in per_rank) / 1e6
        state = f"{state_mb:.2f}"
        if largest_mb > full_states_mb:  # one buffer bigger than all of the model's states together
            notes.append(f"`{n}` holds one {largest_mb:.1f} MB buffer, more than the whole unsharded model's states "
                         f"({full_states_mb:.2f} MB): a bucket allocated up front at its configured size, of which "
                         f"gradients only ever touch a model's worth, so little is resident (see RSS); without it "
                         f"{state_mb - largest_mb:.2f} MB")
            state += f" ({state_mb - largest_mb:.2f})¹"
        print(f"| {c.label} (`{n}`) | {_median_ms([t for r in runs for t in r['step_times']]):.1f} "
              f"| {min(rep_medians):.1f} | {min(rep_medians):.0f}–{max(rep_medians):.0f} | {_best_ratio(runs, ddp_runs, 'step_times'):.2f} "
              f"| {_median_ms([t for r in runs for t in r['step_cpu']]):.1f} "
              f"| {_best_ratio(runs, ddp_runs, 'step_cpu'):.2f} | {state} "
              f"| {max(r['rss'] for r in per_rank):.0f} / {max(r['rss_peak'] for r in per_rank):.0f} "
              f"| {loss_err:.1e} |")
        if c.kind in ("megazero", "engine"):
            if abs(walked_mb - state_mb - extra_mb) > 0.01 * state_mb:  # the walk also sees the buffers
                notes.append(f"`{n}`: model_state_bytes() {state_mb:.2f} MB (+ {extra_mb:.2f} MB of buffers) but a "
                             f"walk of its tensors finds {walked_mb:.2f} MB")
            if not loss_err <= tolerance:
                mz_bad.append(f"{n} ({loss_err:.1e})")
    for note in notes:
        print(f"\n¹ {note}" if "bucket" in note else f"\nnote: {note}")
    print(f"\nΨ = {psi:,} parameters; unsharded fp32 AdamW model states (16 B/param) = {full_states_mb:.2f} MB. "
          "'vs DDP' columns: the best repetition's median over DDP's best repetition's median.")
    verdict = "OK" if not mz_bad else "MISMATCH: " + ", ".join(mz_bad)
    _render_peaks(record)
    print(f"sanity: megazero losses vs DDP within {tolerance:g} relative over all {record['total_steps']} "
          f"steps: {verdict}")
    return 0 if not mz_bad else 1


def _render_peaks(record: dict) -> None:
    """The second table: each contender's peak per rank (megazero's tracker, one extra step) and its model
    states at rest against stage 0's and the ZeRO formula."""
    results, psi = record["results"], record["psi"]
    rows = [(n, runs[0]["per_rank"]) for n in record["names"] if (runs := results.get(n))
            and runs[0]["per_rank"][0].get("peak")]
    if not rows:
        return
    mz0 = next((max(r["state_bytes"] for r in pr) for n, pr in rows if n == "mz0"), None)
    cats = ("params", "grads", "master_params", "optimizer_states", "activations", "comm_buffers", "other")
    print(f"\nPeak of live tensors per rank during one step (megazero/observe/memory.py's tracker, MB = 1e6 bytes; the "
          f"rank with the largest peak; categories for that rank: {', '.join(cats)}):\n")
    print("| contender | peak, largest rank (MB) | peak, smallest rank (MB) | " + " | ".join(cats)
          + " | model states at rest (MB) | states / stage-0 states | formula (fp32, dp 4) |")
    print("|---|---|---|" + "---|" * len(cats) + "---|---|---|")
    for n, per_rank in rows:
        c = CONTENDERS[n]
        top = max(per_rank, key=lambda r: r["peak"]["peak_bytes"])
        low = min(r["peak"]["peak_bytes"] for r in per_rank)
        by = top["peak"]["peak_by_category"]
        state = max(r["state_bytes"] for r in per_rank)
        ratio = f"{state / mz0:.3f}" if mz0 else "—"
        stage = c.stage if c.kind in ("megazero", "deepspeed") else {"ddp": 0, "torch-zero1": 1, "fsdp2": 3}.get(n)
        formula = f"{STATE_FORMULA[stage] / 16:.3f}" if stage is not None else "—"
        print(f"| {c.label} (`{n}`) | {top['peak']['peak_bytes'] / 1e6:.2f} | {low / 1e6:.2f} | "
              + " | ".join(f"{by[k] / 1e6:.2f}" for k in cats)
              + f" | {state / 1e6:.2f} | {ratio} | {formula} |")
    print(f"\nΨ = {psi:,}. Before the step the tracker registers every tensor reachable from the contender's "
          "model and optimizer objects (as for the model-state column), so buffers allocated up front count; "
          "DDP's C++ reducer buckets (Ψ fp32, unreachable from Python) are added as comm_buffers. Peers' categories: parameters, .grad and optimizer state by identity; their flat "
          "buffers and communication staging count as other (or activations when allocated inside the forward).")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.from_json:
        import json

        with open(args.from_json) as f:
            record = json.load(f)
        print("\n".join(record["header"]))
        return render(record)
    names = list(CONTENDERS) if args.contenders == "all" else [n.strip() for n in args.contenders.split(",") if n]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise SystemExit(f"unknown contender(s) {', '.join(unknown)}; choose from {', '.join(CONTENDERS)}")
    if "ddp" not in names:
        names.insert(0, "ddp")  # the reference for speed and loss
    cfg = model_preset(args.model, num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_heads=args.num_heads, seq_len=args.seq_len, vocab_size=args.vocab_size)
    opt_cfg = OptimizerConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip_grad=1.0)
    probe_cache: dict[str, str | None] = {}
    skipped = {n: why for n in names if (why := _unavailable(CONTENDERS[n], probe_cache))}
    runnable = [n for n in names if n not in skipped]
    psi = sum(p.numel() for p in _model(cfg).parameters())

    header = [
        f"# ZeRO benchmark: dp={args.dp} gloo ranks on CPU ({os.cpu_count()} cores, 1 thread per rank), "
        f"torch {torch.__version__}",
        f"megazero from {_source_version()}",
        f"model {args.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_heads}, seq "
        f"{cfg.seq_len}, vocab {cfg.vocab_size}: {psi / 1e6:.2f}M parameters, {args.precision}; micro-batch "
        f"{args.micro_batch_size}/rank (global {args.micro_batch_size * args.dp}); AdamW lr {opt_cfg.lr} betas "
        f"{opt_cfg.betas} eps {opt_cfg.eps} wd {opt_cfg.weight_decay} (ndim>=2), clip {opt_cfg.clip_grad}; "
        f"{args.warmup} warm-up + {args.steps} timed steps x {args.reps} reps",
        *[f"skipping {n}: {why}" for n, why in skipped.items()],
    ]
    print("\n".join(header), flush=True)
    load_before = os.getloadavg()
    results: dict[str, list[dict]] = {n: [] for n in runnable}
    failed: dict[str, str] = {}
    t_start = time.monotonic()
    for rep in range(args.reps):
        order = runnable[rep % len(runnable):] + runnable[: rep % len(runnable)]
        for n in order:
            if n in failed:
                continue
            t0 = time.monotonic()
            try:
                per_rank = run_world(_rank_run, args.dp, CONTENDERS[n], cfg, opt_cfg, args.micro_batch_size,
                                     args.warmup, args.steps, args.torch_adam, args.profile if rep == 0 else None,
                                     args.precision, not args.no_peak and rep == 0,
                                     timeout=args.timeout)
            except (WorldError, Exception) as exc:  # noqa: BLE001 - one contender's failure is a table row
                failed[n] = _first_error_line(exc)
                print(f"rep {rep + 1}: {n} FAILED: {failed[n]}", flush=True)
                if os.environ.get("ZERO_BENCH_TRACE"):
                    traceback.print_exc()
                continue
            step_times = [max(t) for t in zip(*(r["times"] for r in per_rank))]
            step_cpu = [sum(t) for t in zip(*(r["cpu"] for r in per_rank))]
            results[n].append({"rep": rep, "step_times": step_times, "step_cpu": step_cpu, "per_rank": per_rank})
            print(f"rep {rep + 1}: {n:12s} median {_median_ms(step_times):7.1f} ms, CPU {_median_ms(step_cpu):7.1f} "
                  f"ms ({time.monotonic() - t0:.0f} s)", flush=True)
    record = {"header": header, "names": names, "psi": psi, "skipped": skipped, "failed": failed,
              "results": results, "load_before": load_before, "load_after": os.getloadavg(),
              "wall_s": time.monotonic() - t_start, "total_steps": args.warmup + args.steps, "args": vars(args)}
    print()
    code = render(record)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(record, f, indent=1, default=str)
    return code


if __name__ == "__main__":
    sys.exit(main())
