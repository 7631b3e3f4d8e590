"""The pretraining loop: data -> engine steps -> evaluation -> metrics -> checkpoints, for one rank of a world.

``--load`` restores a checkpoint (any topology) before the first step and the loop continues after its step;
``--save`` writes one every ``--save-interval`` steps and at the end (:mod:`megazero.checkpoint`).

``pretrain/gpt.py`` parses flags, starts the process group and calls :func:`run_training`; tests call it
directly inside a world of the test harness.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megazero.checkpoint import faults, load_checkpoint, save_checkpoint
from megazero.config.schema import Config
from megazero.data import DistributedBatchSampler, build_datasets, collate, resolve_tokenizer
from megazero.data.loader import PrefetchLoader
from megazero.distributed.context import ParallelContext
from megazero.distributed.timeouts import first_step_timeout_s, process_groups, set_collective_timeout
from megazero.generate import generate_samples, read_prompts
from megazero.observe.device_peak import DevicePeak
from megazero.observe.flops import flops_shape, peak_flops_per_device, throughput
from megazero.observe.log import get_logger
from megazero.observe.memory import PeakMemoryTracker, StepPeak, zero_buffers
from megazero.observe.metrics import MetricsWriter, gather_rank_records, rank_memory_record
from megazero.train.engine import Engine, StepResult

__all__ = ["TrainSummary", "run_training", "wandb_mode"]


@dataclass
class TrainSummary:
    losses: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    samples: list[tuple[int, list[dict[str, Any]]]] = field(default_factory=list)  # (step, --sample-prompts out)
    seconds: float = 0.0
    tokens: int = 0
    # this rank's parameters unsharded over TP (fp32), when asked for; merge pipeline ranks for the whole model
    final_state: dict[str, torch.Tensor] | None = None


def wandb_mode(requested: str | None) -> str:
    """``--wandb-mode`` if given, else online only when an account is configured, else offline."""
    if requested:
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = os.path.expanduser("~/.netrc")
    if os.path.exists(netrc):
        with open(netrc) as f:
            if "api.wandb.ai" in f.read():
                return "online"
    return "offline"


def _init_wandb(cfg: Config, ctx: ParallelContext) -> Any | None:
    if cfg.logging.wandb_project is None or ctx.rank != 0:
        return None
    import wandb

    mode = wandb_mode(cfg.logging.wandb_mode)
    os.makedirs(cfg.logging.log_dir, exist_ok=True)
    ranks = [ctx.grid.position(r)._asdict() for r in range(ctx.world_size)]
    topology = {"tp": ctx.tp_size, "cp": ctx.cp_size, "pp": ctx.pp_size, "dp": ctx.dp_size,
                "world_size": ctx.world_size,
                "ranks": ranks}  # rank r of the memory/rank{r}/ series sits at ranks[r]
    name = (f"{cfg.model_preset}-tp{ctx.tp_size}{f'-cp{ctx.cp_size}' if ctx.cp_enabled else ''}-pp{ctx.pp_size}-"
            f"dp{ctx.dp_size}-zero{cfg.zero.stage}-"
            f"{cfg.training.precision}")
    run = wandb.init(
        project=cfg.logging.wandb_project, mode=mode, dir=cfg.logging.log_dir, name=name,
        config={**dataclasses.asdict(cfg), "topology": topology},
    )
    run.define_metric("memory/*", summary="max")  # the dashboard's run table then shows each rank's peak
    get_logger().info("W&B run %s (id %s, %s mode) in %s", run.name or name, run.id, mode, run.dir)
    return run


def _step_record(cfg: Config, ctx: ParallelContext, engine: Engine, res: StepResult, pace: tuple[int, float],
                 eval_loss: float | None, peak: StepPeak | None = None) -> dict[str, Any] | None:
    """Gather every rank's memory and comm records (a collective) and build the metrics.jsonl object on rank 0.

    ``pace`` is (tokens, seconds) of the steps the speed figures average over; ``peak`` what
    :class:`~megazero.observe.memory.PeakMemoryTracker` measured during this step (logged steps).
    """
    memory = rank_memory_record(ctx.coords(), engine.optimizer.model_state_bytes(), engine.activation_peak_bytes,
                                engine.device, peak)
    comm = {"rank": ctx.rank, "volume_elements_per_step": ctx.ledger.dp_volume_last_step(),
            "breakdown": ctx.ledger.breakdown_last_step()}
    gathered = gather_rank_records({"memory": memory, "comm": comm})
    if ctx.rank != 0:
        return None
    m = cfg.model
    speed = throughput(pace[0], m.seq_len, pace[1], ctx.world_size, m.num_layers, m.hidden_size,
                       engine.padded_vocab_size, cfg.activation_checkpointing.mode,
                       peak_flops_per_device(cfg.training.precision, engine.device, cfg.training.peak_tflops),
                       **flops_shape(m))
    return {
        "step": res.step, "loss": res.loss, "eval_loss": eval_loss, "lr": res.lr, "grad_norm": res.grad_norm,
        "loss_scale": res.loss_scale, **speed,
        "micro_batches": res.micro_batches, "skipped": res.skipped, "skipped_steps": engine.optimizer.skipped_steps,
        "memory": [g["memory"] for g in gathered], "comm": [g["comm"] for g in gathered],
    }


def _eval_batches(cfg: Config, ctx: ParallelContext, eval_ds) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """A fixed set of evaluation global batches (the same at every evaluation and for any topology)."""
    t = cfg.training
    n_batches = min(t.eval_iters, len(eval_ds) // t.global_batch_size)
    if n_batches == 0:
        return []
    sampler = DistributedBatchSampler(len(eval_ds), t.global_batch_size, t.micro_batch_size, ctx.dp_rank,
                                      ctx.dp_size, seed=t.seed, shuffle=False)
    return [[collate(eval_ds, idx) for idx in sampler.next_global_batch()] for _ in range(n_batches)]


def _say_what_was_written(cfg: Config, metrics: Path, saved: Path | None) -> None:
    """The end of a run: where its metrics and checkpoint went, and the commands that read them (rank 0)."""
    log = get_logger()
    log.info("metrics: %s; plot them: python tools/plot_metrics.py %s", metrics, metrics.parent)
    if saved is None:
        log.info("checkpoint: nothing saved; pass --save DIR to keep the model (then tools/generate.py and "
                 "tools/convert_checkpoint.py read it)")
        return
    root = saved.parent
    log.info("checkpoint: %s; generate: python tools/generate.py %s --prompt \"def \" --temperature 0; "
             "export to Hugging Face: python tools/convert_checkpoint.py %s --out %s-hf --format hf",
             saved, root, root, root)


def run_training(cfg: Config, ctx: ParallelContext, device: torch.device | None = None,
                 keep_final_state: bool = False) -> TrainSummary:
    """Train ``cfg`` (already resolved for this world) on this rank; returns losses and timing."""
    log = get_logger()
    t, m = cfg.training, cfg.model
    torch.manual_seed(t.seed)
    tokenizer = resolve_tokenizer(cfg.data.paths, m.vocab_size, cfg.data.cache_dir, cfg.data.tokenizer,
                                  rows_beyond_ok=t.init_from is not None or t.load is not None)  # a checkpoint's
    train_ds, eval_ds = build_datasets(cfg.data.paths, tokenizer, m.seq_len, cfg.data.cache_dir,
                                       cfg.data.eval_fraction)
    sampler = DistributedBatchSampler(len(train_ds), t.global_batch_size, t.micro_batch_size, ctx.dp_rank,
                                      ctx.dp_size, seed=t.seed)
    # a long collective timeout until the first step (and first evaluation) ran: compile, NCCL's lazy set-up
    timeout_s, first_timeout_s = cfg.parallel.dist_timeout_s, first_step_timeout_s(
        cfg.parallel.dist_timeout_s, t.compile, (device or torch.device("cpu")).type)
    warming = first_timeout_s > timeout_s and set_collective_timeout(first_timeout_s, process_groups())
    engine = Engine(cfg, ctx, device)
    if warming:  # the groups the engine made too
        set_collective_timeout(first_timeout_s, process_groups())
        log.info("collective timeout %.0fs until the first step and evaluation ran (compile, NCCL set-up), then "
                 "--dist-timeout %gs", first_timeout_s, timeout_s)
    n_params = sum(p.numel() for p in engine.model.parameters())
    log.info("model %s: %d layers, hidden %d, %d heads, seq %d, vocab %d (padded %d); %.2fM parameters on rank 0",
             cfg.model_preset, m.num_layers, m.hidden_size, m.num_heads, m.seq_len, m.vocab_size,
             engine.padded_vocab_size, n_params / 1e6)
    log.info("topology tp=%d cp=%d pp=%d dp=%d, ZeRO stage %d, %s; global batch %d = micro %d x accumulation %d x "
             "dp %d; %d training samples of %d tokens", ctx.tp_size, ctx.cp_size, ctx.pp_size, ctx.dp_size,
             cfg.zero.stage,
             t.precision, t.global_batch_size, t.micro_batch_size, t.gradient_accumulation_steps, ctx.dp_size,
             len(train_ds), m.seq_len)
    if t.load is not None:  # auto: the newest checkpoint under --save, if any (a torchrun restart)
        auto = t.load == "auto"
        if load_checkpoint(engine, sampler, t.save if auto else t.load, tokenizer, missing_ok=auto,
                           fallback=auto) is None:
            log.info("--load auto: no checkpoint under %s yet, starting from step 0", t.save)
    engine.check_tied_embeddings()
    prompts = read_prompts(cfg.logging.sample_prompts) if cfg.logging.sample_prompts else []
    eval_batches = _eval_batches(cfg, ctx, eval_ds) if eval_ds is not None and t.eval_interval > 0 else []
    writer = MetricsWriter(cfg.logging.log_dir, enabled=ctx.rank == 0, wandb_run=_init_wandb(cfg, ctx))
    bar = None
    if ctx.rank == 0 and cfg.logging.progress and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=t.train_steps, initial=engine.step, desc="train", unit="step", dynamic_ncols=True)
    summary = TrainSummary()
    start = time.perf_counter()
    first = engine.step + 1  # after a resume, the step after the checkpoint's
    first_done: float | None = None  # when step `first` ended: the ETA leaves out its warm-up
    saved = None
    # the peak of live tensors by category, measured on logged steps only (it slows the step it measures, so
    # the speed figures, console and metrics.jsonl alike, average the untracked steps since the last record,
    # where there are any)
    peak_tracker = PeakMemoryTracker(engine.device, lambda: zero_buffers(engine.optimizer), engine.chunks)
    # under --compile the tracker cannot run: on CUDA the allocator's peak, split by walking tensors instead
    device_peak = (DevicePeak(engine.device, lambda: zero_buffers(engine.optimizer),
                              lambda: engine.activation_peak_bytes)
                   if t.compile and engine.device.type == "cuda" else None)
    # the next step's batch is collated (pinned on CUDA) on a thread while this one trains; same order
    loader = PrefetchLoader(train_ds, sampler, pin_memory=engine.device.type == "cuda")
    evaluated = False
    pace_tokens, pace_seconds = 0, 0.0
    try:
        for step in range(first, t.train_steps + 1):
            step_start = time.perf_counter()
            batch = loader.next_global_batch()
            logged = step % cfg.logging.log_interval == 0 or step == 1 or step == t.train_steps
            # a dispatch mode makes Dynamo skip the compiled blocks for good: no tracker under --compile
            tracked = logged and (not t.compile or device_peak is not None)
            meter = (peak_tracker if not t.compile else device_peak) if tracked else contextlib.nullcontext()
            with meter:  # saved activations are counted on logged steps only (a Python call per tensor)
                res = engine.train_step(batch, measure=logged)
            if warming and step == first:
                set_collective_timeout(timeout_s, process_groups())
            faults.maybe_inject_fault("step", ctx.rank, step)
            step_seconds = time.perf_counter() - step_start
            if not tracked:
                pace_tokens, pace_seconds = pace_tokens + res.tokens, pace_seconds + step_seconds
            summary.losses.append(res.loss)
            summary.tokens += res.tokens
            eval_loss = None
            if eval_batches and (step % t.eval_interval == 0 or step == t.train_steps):
                engine.optimizer.flush()  # offload's delayed update lands first (megazero/zero/offload.py)
                if warming and not evaluated:  # the first evaluation compiles the blocks again (eval mode)
                    set_collective_timeout(first_timeout_s, process_groups())
                eval_loss = sum(engine.eval_loss(b) for b in eval_batches) / len(eval_batches)
                if warming and not evaluated:
                    set_collective_timeout(timeout_s, process_groups())
                evaluated = True
                engine.check_tied_embeddings()
                summary.eval_losses.append((step, eval_loss))
            samples = None
            if prompts and ((t.eval_interval and step % t.eval_interval == 0) or step == t.train_steps):
                engine.optimizer.flush()
                samples = generate_samples(engine, tokenizer, prompts, cfg.logging.sample_tokens)
                summary.samples.append((step, samples))
            engine.optimizer.check_skipped_steps(step)  # non-finite gradient norms: skipped, stop after too many
            if logged or samples:
                pace = (pace_tokens, pace_seconds) if pace_seconds > 0 else (res.tokens, step_seconds)
                record = _step_record(cfg, ctx, engine, res, pace, eval_loss,
                                      meter.result() if tracked else None)
                pace_tokens, pace_seconds = 0, 0.0
                if record is not None:
                    if samples:
                        record["samples"] = samples
                        for smp in samples:
                            log.info("sample at step %d: %r -> %r", step, smp["prompt"], smp["text"])
                    writer.write(record)
                    eta = ""  # from the steps after the first (warm-up, a tracked step), wall time per step
                    if first_done is not None:
                        per_step = (time.perf_counter() - first_done) / (step - first)
                        eta = f" ETA {per_step * (t.train_steps - step):.0f}s"
                    msg = (f"step {step}/{t.train_steps} loss {res.loss:.4f}"
                           + (f" eval {eval_loss:.4f}" if eval_loss is not None else "")
                           + f" lr {res.lr:.2e} grad_norm {res.grad_norm:.3f} {record['tokens_per_s']:,.0f} tok/s"
                           + eta)
                    if bar is not None:
                        bar.write(msg)
                    else:
                        log.info(msg)
            if t.save is not None and (step == t.train_steps or (t.save_interval and step % t.save_interval == 0)):
                engine.optimizer.flush()  # a checkpoint holds the parameters and moments of one step
                saved = save_checkpoint(engine, sampler, t.save, tokenizer, t.keep_last)
            if bar is not None:
                bar.set_postfix(loss=f"{res.loss:.3f}", lr=f"{res.lr:.1e}")
                bar.update(1)
            if step == first:
                first_done = time.perf_counter()
    finally:
        if engine.optimizer.host is not None:  # no host Adam thread outlives the loop, even one that raised
            engine.optimizer.host.join()
        loader.close()
        if bar is not None:
            bar.close()
        writer.close()
    engine.optimizer.flush()  # the end of training: offload's delayed update lands
    engine.check_tied_embeddings()
    summary.seconds = time.perf_counter() - start
    if summary.losses:
        evaluated = (f", eval loss {summary.eval_losses[-1][1]:.4f} at step {summary.eval_losses[-1][0]}"
                     if summary.eval_losses else "")
        log.info("trained steps %d-%d in %.1fs (%s tokens); loss %.4f -> %.4f%s", first, t.train_steps,
                 summary.seconds, f"{summary.tokens:,}", summary.losses[0], summary.losses[-1], evaluated)
    else:
        log.info("nothing to train: resumed at step %d of --train-steps %d", engine.step, t.train_steps)
    _say_what_was_written(cfg, writer.path, saved)
    if keep_final_state:
        summary.final_state = engine.full_state_dict()
    return summary
