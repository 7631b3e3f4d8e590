"""Text generation: greedy decoding equals transformers' generate on the Hugging Face export, the model's forward
with a KV cache equals its forward without one, sampling filters do what they say, and tp=2 (with and without
sequence parallelism) / pp=2 / dp=2 (ZeRO-3) decode what one process does, from a checkpoint
(tools/generate.py's loader) and as --sample-prompts samples during training."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from megazero.config.cli import parse_args
from megazero.config.schema import ModelConfig
from megazero.generate import SamplingConfig, generate_ids, load_model, load_tokenizer, sample_next
from megazero.model import GPT, init_parameters
from megazero.model.cache import KVCache
from megazero.train.loop import run_training
from tests.dist import run_world

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def ", "import os", "    return self."]
NEW = 12
STEPS = 120  # on a small repetitive corpus: loss ~0.3, so greedy choices have clear margins
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-heads", "4", "--seq-len", "32", "--vocab-size", "512",
         "--warmup-steps", "5", "--lr", "1e-2", "--clip-grad", "1", "--eval-interval", "0", "--log-interval", "50",
         "--no-progress", "--global-batch-size", "16", "--lr-decay-steps", str(STEPS)]
CORPUS = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count

import os
print(os.path.join("data", "train.txt"))
'''


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"_tools_{name}", ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _train(ctx, flags: list[str]) -> list:
    cfg = parse_args([*FLAGS, *flags]).resolve(ctx.world_size)
    return run_training(cfg, ctx).samples


def _sample_flags(w: Path) -> list[str]:
    """Resume the trained checkpoint for 2 steps and sample at the end (eval interval 2: step STEPS + 2)."""
    return [*w.read_text().split("\n")[0].split(), "--load", str(w.parent / "ckpt"), "--train-steps", str(STEPS + 2),
            "--eval-interval", "2", "--sample-prompts", str(w.parent / "prompts.txt"), "--sample-tokens", str(NEW)]


@pytest.fixture(scope="module")
def trained(data_cache, tmp_path_factory) -> dict:
    """A tiny GPT trained STEPS steps in one process and saved; its --sample-prompts samples 2 steps later."""
    from megazero.data import resolve_tokenizer

    d = tmp_path_factory.mktemp("generate")
    (d / "corpus.txt").write_text(CORPUS * 200)
    (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    tok = resolve_tokenizer([], 512, data_cache).model_path
    base = f"--data {d / 'corpus.txt'} --tokenizer {tok} --cache-dir {data_cache}"
    (d / "base_flags").write_text(base + "\n")
    run_world(_train, 1, [*base.split(), "--micro-batch-size", "16", "--train-steps", str(STEPS),
                          "--save", str(d / "ckpt"), "--log-dir", str(d / "log0")])
    [samples] = run_world(_train, 1, [*_sample_flags(d / "base_flags"), "--micro-batch-size", "16",
                                      "--log-dir", str(d / "log1")])
    return {"dir": d, "ckpt": d / "ckpt", "samples": samples, "log": d / "log1"}


def _greedy(model, tok, use_cache: bool = True) -> list[list[int]]:
    return [generate_ids(model, tok.encode(p), SamplingConfig(NEW, temperature=0), use_cache=use_cache,
                         eos_id=tok.eos_id) for p in PROMPTS]


def test_greedy_equals_transformers_generate(trained, tmp_path) -> None:
    from transformers import GPT2LMHeadModel

    ckpt = trained["ckpt"]
    convert = _tool("convert_checkpoint")
    step_dir = ckpt / f"step_{STEPS:08d}"
    convert.convert(step_dir, tmp_path / "hf", "hf")
    convert.convert(step_dir, tmp_path / "merged", "safetensors")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    tok = load_tokenizer(ckpt)
    ours = _greedy(load_model(ckpt), tok)
    theirs = []
    for p in PROMPTS:
        ids = torch.tensor([tok.encode(p)])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                          eos_token_id=tok.eos_id, pad_token_id=tok.eos_id)
        theirs.append(out[0, ids.shape[1]:].tolist())
    assert ours == theirs
    assert len({t for seq in ours for t in seq}) > 5, f"degenerate greedy output {ours}: the test would be weak"
    # the exports load too (HF names and layouts mapped back; merged: megazero names, vocab unpadded)
    assert _greedy(load_model(tmp_path / "hf"), load_tokenizer(tmp_path / "hf")) == ours
    assert _greedy(load_model(tmp_path / "merged"), tok) == ours
    # the command line prints the same (greedy, JSON lines)
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = _tool("generate").main([str(ckpt), *sum((["--prompt", p] for p in PROMPTS), []), "--temperature",
                                       "0", "--max-new-tokens", str(NEW), "--json"])
    assert code == 0
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [r["ids"] for r in lines] == ours and [r["text"] for r in lines] == [tok.decode(s) for s in ours]


def test_kv_cache_equals_recomputation(trained) -> None:
    model, tok = load_model(trained["ckpt"]), load_tokenizer(trained["ckpt"])
    cached = _greedy(model, tok)
    assert cached == _greedy(model, tok, use_cache=False)
    # token by token through the cache, the logits equal the training forward's over the whole sequence
    seq = tok.encode(PROMPTS[0]) + cached[0]
    ids = torch.tensor([seq])
    full = model.full_logits(ids)[0]  # no cache: the training forward
    cache = KVCache(model.cfg.seq_len)
    steps = [model.full_logits(ids[:, i: i + 1], cache)[0, 0] for i in range(len(seq))]
    torch.testing.assert_close(torch.stack(steps), full, rtol=1e-4, atol=1e-4)
    # a prompt processed at once, then one token: the same as well
    cache = KVCache(model.cfg.seq_len)
    model.full_logits(ids[:, :5], cache)
    torch.testing.assert_close(model.full_logits(ids[:, 5:6], cache)[0, 0], full[5], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@torch.no_grad()
def test_cached_forward_equals_uncached_at_every_position(arch) -> None:
    """The model's own forward, fed a prompt and then one, one and three tokens a call through a KV cache, gives
    every position the logits of the forward without a cache over the whole sequence (fp32), as one model and
    as two pipeline chunks sharing a cache (each appending to its own layers' slots). Llama's cache holds its 2
    KV heads (grouped-query attention) and rotary positions continue from the cache's length."""
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=1000, arch=arch,
                      num_kv_heads=2 if arch == "llama" else None)
    model = GPT(cfg)
    stages = [GPT(cfg, layers=range(0, 1), post_process=False), GPT(cfg, layers=range(1, 2), pre_process=False)]
    for m in (model, *stages):
        init_parameters(m, seed=0)
        m.eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    full = model.full_logits(ids)  # [B, S, vocab], no cache
    runs = {"one model": lambda x, c: model.full_logits(x, c),
            "two chunks": lambda x, c: stages[1].full_logits(stages[0](x, cache=c), c)}
    for name, run in runs.items():
        cache, got = KVCache(cfg.seq_len), []
        for start, end in ((0, 5), (5, 6), (6, 7), (7, 10)):
            assert cache.length == start, name
            got.append(run(ids[:, start:end], cache))
            torch.testing.assert_close(torch.cat(got, dim=1), full[:, :end], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")
    assert sorted(cache.layers) == [0, 1] and cache.length == 10
    assert cache.layers[0].k.shape == (2, cfg.kv_heads, cfg.seq_len, cfg.head_dim)
    cache = KVCache(cfg.seq_len)
    model(ids[:1, :2].repeat(1, 15), cache=cache)  # 30 positions
    with pytest.raises(ValueError, match="sequence of 33 tokens exceeds --seq-len 32"):
        model(ids[:1, :3], cache=cache)


def test_sampling_filters() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]]).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    assert (sample_next(logits, SamplingConfig(temperature=0)) == 1).all()
    assert set(sample_next(logits, SamplingConfig(top_k=2), g).tolist()) == {1, 2}
    assert (sample_next(logits, SamplingConfig(top_k=1), g) == 1).all()
    assert (sample_next(logits, SamplingConfig(top_p=1e-3), g) == 1).all()  # the nucleus of the top token
    nucleus = set(sample_next(logits, SamplingConfig(top_p=0.8), g).tolist())  # p = .46, .42, .13, ...
    assert nucleus == {1, 2}
    everything = sample_next(logits, SamplingConfig(temperature=1.0), g)
    assert set(everything.tolist()) == {0, 1, 2, 3, 4}
    frac = (everything == 1).float().mean().item()
    p1 = logits[0].softmax(-1)[1].item()
    assert abs(frac - p1) < 0.05
    hot = sample_next(logits, SamplingConfig(temperature=0.05), g)  # cold: nearly greedy
    assert (hot == 1).float().mean() > 0.8
    a = sample_next(logits[:5], SamplingConfig(), torch.Generator().manual_seed(7))
    assert torch.equal(a, sample_next(logits[:5], SamplingConfig(), torch.Generator().manual_seed(7)))
    with pytest.raises(ValueError, match="--top-p"):
        SamplingConfig(top_p=0)


def _parallel(ctx, ckpt: str, flags_file: str, log_dir: str) -> dict:
    """One 2-rank world: the tool's loader at tp=2 (greedy and sampled), the same weights in a sequence-parallel
    model in training mode, then --sample-prompts training runs at tp=2, pp=2 and dp=2 with ZeRO-3, each resuming
    the one-process checkpoint."""
    from megazero.distributed.context import ParallelContext, RankGrid

    sub = {k: ParallelContext.from_grid(RankGrid.from_world(2, tp_size=t, pp_size=p))
           for k, (t, p) in {"tp": (2, 1), "pp": (1, 2)}.items()}
    out: dict = {}
    model, tok = load_model(ckpt, sub["tp"].tp_group), load_tokenizer(ckpt)
    out["greedy"] = _greedy(model, tok)
    out["sampled"] = [generate_ids(model, tok.encode(p), SamplingConfig(NEW, 0.9, 20, 0.95, seed=3),
                                   eos_id=tok.eos_id) for p in PROMPTS]
    sp = GPT(model.cfg, sub["tp"].tp_group, sequence_parallel=True)  # decodes with the sequence whole, no dropout
    sp.load_state_dict(model.state_dict())
    out["sp_greedy"] = _greedy(sp.train(), tok)
    out["sp_restored"] = sp.training and all(m.sequence_parallel for m in (sp, sp.wte, sp.blocks["0"].mlp.fc))
    flags = _sample_flags(Path(flags_file))
    for name, c, extra in (("tp", sub["tp"], ["--tp", "2", "--micro-batch-size", "16"]),
                           ("pp", sub["pp"], ["--pp", "2", "--micro-batch-size", "8"]),
                           ("dp_z3", ctx, ["--zero-stage", "3", "--micro-batch-size", "8", "--log-interval", "1",
                                           "--wandb-project", "megazero-tests", "--wandb-mode", "offline"])):
        cfg = parse_args([*FLAGS, *flags, *extra, "--log-dir", f"{log_dir}/{name}"]).resolve(2)
        out[name] = run_training(cfg, c).samples
    return out


def test_parallel_decoding_equals_one_process(trained, tmp_path) -> None:
    d = trained["dir"]
    ranks = run_world(_parallel, 2, str(trained["ckpt"]), str(d / "base_flags"), str(tmp_path))
    model, tok = load_model(trained["ckpt"]), load_tokenizer(trained["ckpt"])
    sampled = [generate_ids(model, tok.encode(p), SamplingConfig(NEW, 0.9, 20, 0.95, seed=3), eos_id=tok.eos_id)
               for p in PROMPTS]
    for r in ranks:
        assert r["greedy"] == r["sp_greedy"] == _greedy(model, tok)
        assert r["sp_restored"]
        assert r["sampled"] == sampled
    ref = trained["samples"]
    assert [s for s, _ in ref] == [STEPS + 2] and len(ref[0][1]) == len(PROMPTS)
    assert len({t for smp in ref[0][1] for t in smp["ids"]}) > 5
    for name in ("tp", "pp", "dp_z3"):
        for r in ranks:
            assert r[name] == ref, name
    # metrics.jsonl carries the samples on the evaluation step
    recs = [json.loads(line) for line in (trained["log"] / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["samples"]) for r in recs if "samples" in r] == ref
    # the dp=2 run's W&B (offline) files: the memory dashboard (one line per rank) and the samples table
    from tests.test_dashboard import check_dashboard

    log = tmp_path / "dp_z3"
    recs = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    tables = check_dashboard(log, recs, 2)
    assert tables["samples"]["data"] == [[STEPS + 2, s["prompt"], s["text"]] for s in ref[0][1]]


def _v_and_interleaved(ctx) -> dict:
    """Each rank builds its two chunks of a 4-layer model in zbv's V and in the interleaved order, loads them from
    the one-process model's weights, and decodes greedily and sampled."""
    from megazero.distributed.context import ParallelContext, RankGrid
    from megazero.pipeline.partition import stage_specs

    pc = ParallelContext.from_grid(RankGrid.from_world(2, pp_size=2))
    cfg = ModelConfig(num_layers=4, hidden_size=64, num_heads=4, seq_len=32, vocab_size=500)
    full = GPT(cfg)
    init_parameters(full, seed=0)
    weights = full.state_dict()
    out = {}
    for schedule in ("zbv", "interleaved"):
        chunks = []
        for s in stage_specs(cfg.num_layers, 2, pc.pp_rank, 2, schedule=schedule):
            chunk = GPT(cfg, layers=s.layers, pre_process=s.pre_process, post_process=s.post_process)
            chunk.load_state_dict({k: weights[k] for k in chunk.state_dict()})
            chunks.append(chunk)
        out[schedule] = [generate_ids(chunks, [3, 1, 4, 1, 5], sampling, pc.pp_group, schedule=schedule)
                         for sampling in (SamplingConfig(8, temperature=0), SamplingConfig(8, 0.9, 20, seed=3))]
    return out


def test_pipelined_decoding_in_the_v_and_interleaved() -> None:
    """Decoding through two chunks per rank, placed in zbv's V (rank 0 holds the first and the last stage, the turn
    at rank 1 stays on the rank) and in the interleaved order, gives one process's tokens on every rank."""
    cfg = ModelConfig(num_layers=4, hidden_size=64, num_heads=4, seq_len=32, vocab_size=500)
    model = GPT(cfg)
    init_parameters(model, seed=0)
    want = [generate_ids(model, [3, 1, 4, 1, 5], sampling)
            for sampling in (SamplingConfig(8, temperature=0), SamplingConfig(8, 0.9, 20, seed=3))]
    for r in run_world(_v_and_interleaved, 2):
        assert r == {"zbv": want, "interleaved": want}
