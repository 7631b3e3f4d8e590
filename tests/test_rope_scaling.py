"""Llama 3.1's rope scaling (Hugging Face ``rope_scaling: {"rope_type": "llama3", ...}``).

The inverse frequencies equal ``transformers``' own ``llama3`` rope bit for bit, the logits equal
``LlamaForCausalLM``'s within 1e-5 (fp32) on a tiny model whose ``original_max_position_embeddings`` of 64 puts
its rotary pairs in all three regimes (kept, blended, stretched), and the same weights without scaling give
other logits (the negative control). ``--init-from`` reads a scaled directory and the ``--format hf`` export
writes the scaling back: config and tensors as they were, logits equal; other rope types are refused by name.
In one 2-rank world: at tp 2 the logits and 8 greedy tokens equal ``LlamaForCausalLM``'s (logits and
``generate``), and at cp 2 the first step's loss from the directory equals its loss on the same batch (each
fails with the scaling read as none).
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megazero.checkpoint.hf_import import configure_from_inputs
from megazero.config.cli import parse_args
from megazero.config.errors import ConfigError
from megazero.config.schema import ModelConfig, model_preset
from megazero.model import GPT, init_parameters
from megazero.model.hf import hf_llama_config, to_hf_llama_state_dict
from megazero.model.layers import rotary_frequencies
from tests.dist import run_world

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
SCALING = dict(rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
               rope_original_max_positions=64)
UNSCALED = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, seq_len=48, vocab_size=512, arch="llama",
                       num_kv_heads=2, ffn_size=96, rope_theta=500000.0)
SCALED = replace(UNSCALED, **SCALING, max_positions=512)


def _hf_model(cfg: ModelConfig, state: dict[str, torch.Tensor]):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_llama_config(cfg))).eval()
    hf.load_state_dict(to_hf_llama_state_dict(state, cfg), strict=True)
    return hf


def test_frequencies_equal_transformers_llama3_rope_in_all_three_regimes():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(**hf_llama_config(SCALED))
    want, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_config)
    got = rotary_frequencies(SCALED.head_dim, SCALED.rope_theta, SCALED.rope_scaling)
    assert torch.equal(got, want) and attention_factor == 1.0
    plain = rotary_frequencies(SCALED.head_dim, SCALED.rope_theta)
    wavelength = 2 * math.pi / plain  # original 64: short below 16 tokens, long above 64
    short, long = wavelength < 64 / 4, wavelength > 64 / 1
    assert short.any() and long.any() and (~short & ~long).any()
    assert torch.equal(got[short], plain[short]) and torch.equal(got[long], plain[long] / 8)
    mid = ~short & ~long
    assert ((got[mid] < plain[mid]) & (got[mid] > plain[mid] / 8)).all()


@torch.no_grad()
def test_logits_equal_hugging_face_llama_with_llama3_rope_scaling():
    ours = GPT(SCALED)
    init_parameters(ours, seed=0)
    ours.eval()
    hf = _hf_model(SCALED, ours.state_dict())
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    ids = torch.randint(0, SCALED.vocab_size, (2, SCALED.seq_len), generator=torch.Generator().manual_seed(1))
    want = hf(ids).logits
    torch.testing.assert_close(ours.full_logits(ids), want, rtol=1e-5, atol=1e-5)
    # negative control: the same weights without the scaling are another model
    unscaled = GPT(UNSCALED)
    unscaled.load_state_dict(ours.state_dict())
    unscaled.eval()
    assert (unscaled.full_logits(ids) - want).abs().max() > 1e-3


def test_llama_3_2_1b_preset_has_the_published_rope_scaling():
    # meta-llama/Llama-3.2-1B config.json: rope_theta 500000, rope_scaling {factor 32, low_freq_factor 1,
    # high_freq_factor 4, original_max_position_embeddings 8192, rope_type llama3}, max_position_embeddings 131072
    m = model_preset("llama-3.2-1b")
    assert (m.rope_theta, m.rope_scaling, m.max_positions, m.seq_len) == (500000.0, (32.0, 1.0, 4.0, 8192), 131072,
                                                                         8192)
    written = hf_llama_config(m)
    assert written["max_position_embeddings"] == 131072
    assert written["rope_scaling"] == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert model_preset("llama-3-8b").rope_scaling is None  # Llama 3 (not 3.1) has none
    assert "rope_scaling" not in hf_llama_config(model_preset("llama-3-8b"))


@pytest.fixture(scope="module")
def scaled_dir(tmp_path_factory):
    """A Hugging Face directory of the scaled model (random weights, every tensor perturbed)."""
    path = tmp_path_factory.mktemp("llama3-rope")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_llama_config(SCALED)))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((1.0 if p.ndim == 1 else 0.0) + 0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    return path


def _init_flags(path: Path, *extra: str) -> list[str]:
    return ["--init-from", str(path), "--new-tokenizer", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--no-progress",
            *extra]


def test_init_from_reads_the_scaling_and_trains_at_the_original_context(scaled_dir):
    m = configure_from_inputs(parse_args(_init_flags(scaled_dir))).model
    assert (m.rope_scaling, m.max_positions, m.seq_len) == (SCALED.rope_scaling, 512, 64)  # seq: the original's
    m = configure_from_inputs(parse_args(_init_flags(scaled_dir, "--seq-len", "48"))).model
    assert (m.rope_scaling, m.seq_len) == (SCALED.rope_scaling, 48)


def test_a_preset_without_the_scaling_is_refused_naming_the_key(tmp_path):
    # llama-tiny's shapes, scaled: only the rope scaling disagrees with an explicit --model llama-tiny
    tiny = replace(model_preset("llama-tiny"), **SCALING)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_llama_config(tiny))).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"rope_parameters\.factor 8\.0, but --model llama-tiny gives "
                                          r"rope_scaling_factor None"):
        configure_from_inputs(parse_args(_init_flags(tmp_path, "--model", "llama-tiny")))
    assert configure_from_inputs(parse_args(_init_flags(tmp_path))).model.rope_scaling == tiny.rope_scaling


@pytest.mark.parametrize("rope, named", [
    ({"rope_type": "yarn", "factor": 4.0}, "no 'yarn' scaling"),
    ({"type": "linear", "factor": 2.0}, "no 'linear' scaling"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "needs factor, low_freq_factor and high"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}, "low_freq_factor <"),
], ids=["yarn", "linear", "missing", "inverted"])
def test_other_rope_scalings_are_refused_naming_them(scaled_dir, tmp_path, rope, named):
    config = json.loads((scaled_dir / "config.json").read_text())
    config.pop("rope_parameters", None)
    for f in scaled_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_theta": 500000.0, "rope_scaling": rope}))
    with pytest.raises(ConfigError, match="rope_scaling") as e:
        configure_from_inputs(parse_args(_init_flags(tmp_path)))
    assert named in str(e.value), str(e.value)


def _tp2_cp2(ctx, flags: list[str], out: str, cache: str, prompt: list[int]) -> dict:
    """At tp 2: save the engine built from the scaled directory at step 0 (each rank reads its slices), and the
    logits and greedy tokens of the model loaded there at tp 2; at cp 2 (the same two ranks): the first step's
    loss of a run from the directory."""
    from megazero.checkpoint import save_checkpoint
    from megazero.distributed.context import ParallelContext, RankGrid
    from megazero.generate import SamplingConfig, generate_ids, load_model
    from megazero.train.engine import Engine
    from megazero.train.loop import run_training

    cfg = configure_from_inputs(parse_args([*flags, "--tp", "2"])).resolve(ctx.world_size)
    save_checkpoint(Engine(cfg, ctx), None, f"{out}/run", None)
    model = load_model(flags[1], ctx.tp_group)
    with torch.no_grad():
        logits = model.full_logits(torch.tensor([prompt]))
    tokens = generate_ids(model, prompt, SamplingConfig(8, temperature=0))
    cp = ParallelContext.from_grid(RankGrid.from_world(ctx.world_size, cp_size=2))
    run = [*flags, "--cp", "2", "--train-steps", "1", "--warmup-steps", "0", "--eval-interval", "0", "--cache-dir",
           cache, "--log-dir", f"{out}/cp2"]
    loss = run_training(configure_from_inputs(parse_args(run)).resolve(ctx.world_size), cp).losses[0]
    return {"logits": logits, "tokens": tokens, "loss": loss}


@pytest.fixture(scope="module")
def world(scaled_dir, data_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("rope-world")
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ranks = run_world(_tp2_cp2, 2, _init_flags(scaled_dir), str(out), data_cache, prompt, tp=2)
    return {"out": out, "ranks": ranks, "prompt": prompt}


def test_logits_and_greedy_tokens_at_tp2_equal_llama_for_causal_lm(scaled_dir, world):
    reference = transformers.LlamaForCausalLM.from_pretrained(scaled_dir).eval()
    prompt = torch.tensor([world["prompt"]])
    with torch.no_grad():
        logits = reference(prompt).logits
        tokens = reference.generate(prompt, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompt),
                                    pad_token_id=0)[0, prompt.shape[1]:].tolist()
    for rank, r in enumerate(world["ranks"]):
        torch.testing.assert_close(r["logits"], logits, rtol=1e-5, atol=1e-5)
        assert r["tokens"] == tokens, (rank, r["tokens"], tokens)


def test_first_step_loss_at_cp2_equals_llama_for_causal_lm(scaled_dir, world, data_cache):
    # the run's first global batch (2 samples of 64 tokens + 1, the documented data order) through the HF model
    import numpy as np
    import torch.nn.functional as F

    from megazero.data import build_datasets, resolve_tokenizer
    from tests.reference import RefSpec, reference_batches

    train_ds, _ = build_datasets([], resolve_tokenizer([], 512, data_cache), 64, data_cache)
    idx = reference_batches(len(train_ds), RefSpec(seq_len=64, global_batch=2), 1)[0]
    batch = torch.stack([torch.as_tensor(np.asarray(train_ds[i]), dtype=torch.long) for i in idx])
    reference = transformers.LlamaForCausalLM.from_pretrained(scaled_dir).eval()
    with torch.no_grad():
        logits = reference(batch[:, :-1]).logits
    want = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)).item()
    for rank, r in enumerate(world["ranks"]):
        assert abs(r["loss"] - want) / want < 1e-5, (rank, r["loss"], want)


def test_round_trip_through_init_from_and_export_keeps_the_scaling(scaled_dir, world, tmp_path):
    from safetensors.torch import load_file

    from megazero.generate import load_model

    # tp 2: each rank reads its slices of the scaled directory; the export merges them
    spec = importlib.util.spec_from_file_location("_convert_checkpoint", ROOT / "tools" / "convert_checkpoint.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([str(world["out"] / "run"), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    source, exported = (json.loads((d / "config.json").read_text()) for d in (scaled_dir, tmp_path / "hf"))
    assert exported["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    assert exported["max_position_embeddings"] == source["max_position_embeddings"] == 512
    want, got = (load_file(str(d / "model.safetensors")) for d in (scaled_dir, tmp_path / "hf"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = transformers.LlamaForCausalLM.from_pretrained(scaled_dir).eval()(ids).logits
        reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
        assert reloaded.config.rope_parameters["rope_type"] == "llama3"
        torch.testing.assert_close(reloaded(ids).logits, reference, rtol=0, atol=0)
        torch.testing.assert_close(load_model(scaled_dir).full_logits(ids), reference, rtol=1e-5, atol=1e-5)
