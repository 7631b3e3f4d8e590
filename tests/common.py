"""Helpers shared by the end-to-end parity tests: a small GPT's flags, training inside a world, comparisons."""

from __future__ import annotations

import torch

from megazero.config.cli import parse_args
from megazero.train.loop import run_training

# A 2-layer GPT on the built-in corpus: 10 steps of global batch 8 take about a second per rank.
SMALL_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-heads", "4", "--seq-len", "32",
               "--vocab-size", "512", "--train-steps", "10", "--warmup-steps", "2", "--lr", "3e-3",
               "--clip-grad", "0.5", "--eval-interval", "0", "--log-interval", "5", "--no-progress"]
REFERENCE_FLAGS = ["--micro-batch-size", "8"]  # one process, the global batch of 8 as one micro-batch


def train_runs(ctx, runs: list[list[str]], cache: str, log_dir: str) -> list[tuple[list[float], dict | None]]:
    """Train each flag set in turn in this world. Each rank returns (losses, state): its pipeline stage's full
    fp32 parameters on ranks with tp_rank = dp_rank = 0, None elsewhere. See :func:`merge_runs`."""
    out = []
    for i, flags in enumerate(runs):
        cfg = parse_args([*SMALL_FLAGS, *flags, "--cache-dir", cache, "--log-dir", f"{log_dir}/{ctx.world_size}-{i}"])
        s = run_training(cfg.resolve(ctx.world_size), ctx, keep_final_state=True)
        out.append((s.losses, s.final_state if ctx.tp_rank == 0 and ctx.dp_rank == 0 else None))
    return out


EVAL = ["--eval-interval", "1000", "--eval-iters", "1"]  # one evaluation, after the last step


def train_eval_runs(ctx, runs: list[list[str]], cache: str, log_dir: str) -> list[tuple[list[float], dict | None]]:
    """:func:`train_runs` with one evaluation after the last step, whose loss is appended to the training losses
    (so a parity check covers evaluation under every schedule and topology too); the state is the stage's full
    state on its tp/dp/cp rank 0, None elsewhere."""
    from megazero.config.cli import parse_args
    from megazero.train.loop import run_training

    out = []
    for i, flags in enumerate(runs):
        cfg = parse_args([*SMALL_FLAGS, *flags, *EVAL, "--cache-dir", cache,
                          "--log-dir", f"{log_dir}/{ctx.world_size}-{i}"])
        s = run_training(cfg.resolve(ctx.world_size), ctx, keep_final_state=True)
        assert len(s.eval_losses) == 1, s.eval_losses
        first = ctx.tp_rank == 0 and ctx.dp_rank == 0 and ctx.cp_rank == 0
        out.append((s.losses + [s.eval_losses[0][1]], s.final_state if first else None))
    return out


def dp_volumes(ctx, engine, micro_batches: int, steps: int = 2, shape: tuple[int, int] = (2, 32),
               vocab: int = 512) -> list[int]:
    """The ledger's ZeRO-group volume of each of ``steps`` steps of ``engine`` over the same random micro-batches
    (seeded by the DP rank: each DP rank its own samples, its CP ranks the same ones)."""
    gen = torch.Generator().manual_seed(ctx.dp_rank)
    batch = [(torch.randint(0, vocab, shape, generator=gen), torch.randint(0, vocab, shape, generator=gen))
             for _ in range(micro_batches)]
    volumes = []
    for _ in range(steps):
        engine.train_step(batch)
        volumes.append(ctx.ledger.dp_volume_last_step())
    return volumes


def outside_blocks(chunks) -> int:
    """Elements of the parameters outside the transformer blocks (embeddings, final norm, an untied output
    layer), counted on the model: what ZeRO-3's own units of a chunk hold, gathered once per micro-batch where a
    rank runs one chunk (``zero/stage3/gather.py``, "Carry")."""
    return sum(p.numel() for c in chunks for n, p in c.named_parameters() if not n.startswith("blocks."))


def merge_runs(results: list) -> list[tuple[list[float], dict]]:
    """Per run: rank 0's losses and the whole model's state merged over pipeline stages (first copy wins)."""
    merged = []
    for i in range(len(results[0])):
        state: dict[str, torch.Tensor] = {}
        for rank_result in results:
            part = rank_result[i][1]
            for k, v in (part or {}).items():
                state.setdefault(k, v)
        merged.append((results[0][i][0], state))
    return merged


def normwise_error(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Whole-model ||w - w_ref|| / ||w_ref|| (DESIGN.md, Tolerances)."""
    assert state.keys() == ref.keys()
    diff = torch.cat([(state[k].float() - ref[k].float()).flatten() for k in ref])
    return (diff.norm() / torch.cat([ref[k].float().flatten() for k in ref]).norm()).item()


def assert_matches_reference(losses: list[float], state: dict | None, reference, tol: float = 1e-5) -> None:
    ref_losses, ref_state = reference
    assert len(losses) == len(ref_losses)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    assert worst < tol, f"loss relative error {worst:.2e}: {losses} vs {ref_losses}"
    if state is not None:
        err = normwise_error(state, ref_state)
        assert err < tol, f"weights normwise error {err:.2e}"
