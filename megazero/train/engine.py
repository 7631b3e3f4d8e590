"""The engine: one training step of this rank, and the evaluation and state reads around it.

Construction is the recipe (:mod:`megazero.train.recipe`): split for PP, build the TP shards on meta,
materialise inside the ZeRO wrapper, compile. A step runs the pipeline schedule over this rank's micro-batches
(with one stage: forward and backward per micro-batch), lets the optimizer reduce over DP (and sum the tied
embedding's two copies), then clips and updates.

The loss of a step is the token-weighted mean over the whole global batch (all micro-batches, all DP ranks):
each micro-batch contributes ``sum(per-token loss) / tokens_in_global_batch`` to the gradient, so the summed
gradient over DP ranks equals the single-process gradient of the mean. Under context parallelism the engine
hands each CP rank its chunks of every micro-batch's inputs and targets (``shard_sequence``; the sampler's
samples are the DP rank's, the same on all its CP ranks), and token counts, loss sums and gradients are summed
over DP x CP: the same mean, the same gradient. It is computed on the last stage and
broadcast along the pipeline, so every rank reports the same number. A step reads from the device once: the
loss, the squared gradient norm and the token count together.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from megazero.config.schema import Config
from megazero.context_parallel import shard_sequence
from megazero.distributed import device_io
from megazero.distributed.context import ParallelContext
from megazero.model.gpt import full_state_dict
from megazero.pipeline.executor import PipelineExecutor
from megazero.pipeline.p2p import last_stage_rank
from megazero.pipeline.schedules import SPLIT_SCHEDULES, build_schedule, transfer_ticks, transfer_units
from megazero.tensor_parallel import IGNORE_INDEX
from megazero.tensor_parallel.layers import VOCAB_PAD_MULTIPLE, pad_size
from megazero.train import recipe
from megazero.train.lr_schedule import lr_at

__all__ = ["Engine", "StepResult"]

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (input ids [B, S], targets [B, S])


@dataclass
class StepResult:
    step: int
    loss: float
    lr: float
    grad_norm: float
    loss_scale: float | None
    skipped: bool
    tokens: int  # tokens in the global batch
    micro_batches: int
    peak_in_flight: float = 1.0  # most micro-batches whose activations this rank held at once


class Engine:
    """Builds this rank's model chunks and optimizer from a resolved :class:`Config` and runs steps."""

    def __init__(self, cfg: Config, ctx: ParallelContext, device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.device = device or torch.device("cpu")
        parts = recipe.build(cfg, ctx, self.device)
        self.schedule, self.virtual_stages, self.specs = parts.schedule, parts.virtual_stages, parts.specs
        self.rng_tracker, self.chunks, self.tied = parts.rng_tracker, parts.chunks, parts.tied
        self.optimizer = parts.optimizer
        self.model = parts.model
        self.split_backward = self.schedule in SPLIT_SCHEDULES  # zero-bubble: B and W apart
        # the pipeline rank that holds the last stage (the loss): p - 1, or 0 under zbv's V
        self.loss_rank = last_stage_rank(self.schedule, ctx.pp_size, self.virtual_stages)
        self.executor = PipelineExecutor(self.chunks, self.specs, parts.p2p, ctx.pp_rank, ctx.pp_size, self.device,
                                         split=self.split_backward, schedule=self.schedule)
        self.activation_peak_bytes = 0  # most saved-activation bytes held at once, over all steps
        self.step = 0  # optimizer steps taken
        device_io.release_free_memory(self.device)  # CUDA blocks cached during construction (device_io)

    @property
    def padded_vocab_size(self) -> int:
        return pad_size(self.cfg.model.vocab_size, VOCAB_PAD_MULTIPLE * self.ctx.tp_size)

    def lr(self, step: int | None = None) -> float:
        t = self.cfg.training
        return lr_at(self.step if step is None else step, self.cfg.scheduler, self.cfg.optimizer.lr, t.train_steps)

    def _global_tokens(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """Tokens in the loss over the whole global batch, as a 0-dim fp64 tensor on the DP group's device.

        Counted where the targets live (no host read), summed over DP x CP ranks on the device."""
        local = sum((y != IGNORE_INDEX).sum() for _, y in micro_batches)
        group = self.ctx.dp_cp_group
        n = torch.as_tensor(local, dtype=torch.float64).reshape(1).to(group.device, non_blocking=True)
        group.all_reduce(n, tag="loss")
        return n[0]

    def _global_loss(self, loss_sum: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The token-weighted mean loss as a 0-dim device tensor: the last stage's loss sums added over DP x CP
        ranks, then broadcast along the pipeline from the last stage's rank (no host read)."""
        total = loss_sum.reshape(1).clone()
        self.ctx.dp_cp_group.all_reduce(total, tag="loss")
        self.ctx.pp_group.broadcast(total, src=self.loss_rank, tag="loss")
        return total[0] / tokens

    @torch.no_grad()
    def check_tied_embeddings(self, rtol: float = 1e-6) -> float:
        """Verify that the first and last stage hold the same tied embedding; raise on every rank if not.

        A collective over the whole world (so no rank waits for a peer that raised); returns the relative
        difference ``||E_last - E_first|| / ||E_first||`` (0 without pipelining or without tying).
        """
        if not self.ctx.pp_enabled or not self.cfg.model.tied:
            return 0.0
        world = self.ctx.world_group
        rel = torch.zeros(1, dtype=torch.float64, device=world.device)
        if self.optimizer.tied_pairs:  # zbv: both copies on pipeline rank 0, partitioned alike: compare the shards
            sums = torch.zeros(2, dtype=torch.float64, device=world.device)  # ||E_last - E_first||^2, ||E_first||^2
            for a, b in self.optimizer.tied_pairs:
                first, last = a.param.detach().reshape(-1), b.param.detach().reshape(-1)
                sums += _squared_sums((first[s].double(), last[s].double()) for s in _pieces(first.numel())).to(sums.device)
            self.ctx.dp_cp_group.all_reduce(sums)  # ZeRO's shards add up to the copy (stage 0: dp copies of both)
            rel = (sums[0] / sums[1].clamp_min(1e-60)).sqrt().reshape(1)
        else:
            for ps in self.optimizer.gathered_units(self.tied):  # ZeRO-3: the embedding's own units, one at a time
                for w in ps:
                    flat = w.detach().reshape(-1)
                    sq = _squared_sums(self.ctx.embedding_group.all_gather_list(flat[s].double())
                                       for s in _pieces(flat.numel())).to(rel.device)
                    rel = torch.maximum(rel, (sq[0] / sq[1].clamp_min(1e-60)).sqrt().reshape(1))
        world.all_reduce(rel, op="max")
        value = device_io.read(rel)[0]
        if value > rtol:
            raise RuntimeError(
                f"the tied word embedding differs between the first and last pipeline stage (relative difference"
                f" {value:.3e} > {rtol:g}): its two copies must receive the same summed gradient and update;"
                " a checkpoint or custom code changed one copy only")
        return value

    def _cp_local(self, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
        """This CP rank's chunks (i and 2cp-1-i) of every micro-batch's inputs and targets [B, S] -> [B, S/cp]."""
        if not self.ctx.cp_enabled:
            return micro_batches
        r, n = self.ctx.cp_rank, self.ctx.cp_size
        return [(shard_sequence(x, r, n), shard_sequence(y, r, n)) for x, y in micro_batches]

    def train_step(self, micro_batches: list[MicroBatch], measure: bool = True) -> StepResult:
        """One optimizer step over this DP rank's micro-batches of the global batch (whole sequences);
        ``measure`` counts saved activations (the trainer's logged steps only: a Python call per saved tensor)."""
        micro_batches = self._cp_local(micro_batches)
        for chunk in self.chunks:
            chunk.train()
        opt = self.optimizer
        opt.zero_grad(micro_batches=len(micro_batches))
        tokens = self._global_tokens(micro_batches)
        sched = (self.schedule, self.ctx.pp_size, self.ctx.pp_rank, len(micro_batches), self.virtual_stages)
        stats = self.executor.run(build_schedule(*sched), micro_batches, tokens, opt.backward,
                                  units=transfer_units(*sched), measure=measure,
                                  split=opt if self.split_backward else None,
                                  ticks=transfer_ticks(self.schedule, self.ctx.pp_size, len(micro_batches)))
        if stats.peak_activation_bytes is not None:
            self.activation_peak_bytes = max(self.activation_peak_bytes, stats.peak_activation_bytes)
        loss_t = self._global_loss(stats.loss_sum, tokens)
        sq_norm_t = opt.prepare_step()
        lr = self.lr()
        on_device = opt.steps_on_device
        if on_device:  # clip and skip decided on the device: the update is issued before the read, not after it
            opt.launch_step(lr, sq_norm_t)
        # the step's one read from the device: loss, squared gradient norm and token count together
        # (in fp64: launch_step's skip came from the fp64 norm, whose square may pass fp32's range)
        values = torch.stack([loss_t.double(), sq_norm_t.double(), tokens.double()])
        loss, sq_norm, n_tokens = device_io.read(values)
        step_stats = opt.settle_step(sq_norm) if on_device else opt.finish_step(lr, sq_norm)
        self.ctx.ledger.mark_step()
        self.step += 1
        return StepResult(
            step=self.step, loss=loss, lr=lr, grad_norm=step_stats.grad_norm, loss_scale=step_stats.loss_scale,
            skipped=step_stats.skipped, tokens=int(n_tokens), micro_batches=len(micro_batches),
            peak_in_flight=stats.peak_in_flight,
        )

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[MicroBatch]) -> float:
        """Token-weighted mean loss over the global batch, run through the pipeline without a graph. At ZeRO-3
        the forwards gather and release block by block as in training (the same hooks, prefetch and traced
        order, so no order check), never the whole model."""
        micro_batches = self._cp_local(micro_batches)
        for chunk in self.chunks:
            chunk.eval()
        tokens = self._global_tokens(micro_batches)
        # the training schedule's forwards in its order: every chunk's actions, transfers paired alike
        actions = build_schedule(self.schedule, self.ctx.pp_size, self.ctx.pp_rank, len(micro_batches),
                                 self.virtual_stages)
        stats = self.executor.run(actions, micro_batches, tokens, backward=None,
                                  ticks=transfer_ticks(self.schedule, self.ctx.pp_size, len(micro_batches)))
        return device_io.read(self._global_loss(stats.loss_sum, tokens))[0]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters, unsharded over TP, in fp32, in host memory (a collective over the TP and, at
        stage 3, DP groups). Merge the dicts of every pipeline rank for the whole model.

        At ZeRO-3 the units are gathered one at a time (the next prefetched), each parameter unsharded over TP
        and copied to host memory, then released: the device holds at most two units, never the replica."""
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for ps in itertools.chain(self.optimizer.gathered_units(), [None]):  # None: what no unit holds (frozen)
            if ps is None:
                ps = [p for c in self.chunks for p in c.parameters() if id(p) not in seen]
            only = set(ps)
            seen.update(id(p) for p in only)
            for chunk in self.chunks:
                for name, value in full_state_dict(chunk, self.ctx.tp_group, only).items():
                    out[name] = device_io.empty(value.numel(), value.dtype).view(value.shape).copy_(value)
        order = [n for c in self.chunks for n, _ in c.named_parameters()]
        return {n: out[n] for n in order if n in out}


def _pieces(numel: int, size: int = 1 << 20) -> Iterator[slice]:
    """Slices of ``size`` elements: the tied-embedding check holds fp64 copies of one piece at a time, never of the
    whole table (4x its fp32 bytes)."""
    return (slice(a, a + size) for a in range(0, numel, size))


def _squared_sums(pairs: Iterable[Sequence[torch.Tensor]]) -> torch.Tensor:
    """[sum ||last - first||^2, sum ||first||^2] in fp64 over (first, last) pieces."""
    sums = None
    for first, last in pairs:
        piece = torch.stack([(last - first).square().sum(), first.square().sum()])
        sums = piece if sums is None else sums + piece
    return sums if sums is not None else torch.zeros(2, dtype=torch.float64)
