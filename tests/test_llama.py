"""The llama family: logits equal ``transformers``' LlamaForCausalLM (GQA, tied and untied), the published shapes,
the TP split of query and key/value heads, clear errors, and training that matches the independent reference
(tests/reference.py's Llama run: LlamaForCausalLM, torch AdamW, clip_grad_norm_, LambdaLR) at dp 2 under ZeRO
0-3 and offload, tp 2 with and without SP and recomputation, pp 2 under every schedule, and tp2·pp2·dp2 at ZeRO
1 and 3. One gloo world per topology, each running several configurations; the reference is computed once.
"""

from __future__ import annotations

import pytest
import torch

from megazero.checkpoint import CheckpointReader, find_checkpoint
from megazero.config.cli import parse_args
from megazero.config.schema import ConfigError, ModelConfig, model_preset
from megazero.model import GPT, init_parameters
from megazero.model.gpt import full_state_dict
from megazero.model.hf import hf_llama_config, llama_parts, to_hf_gpt2_tensor, to_hf_llama_state_dict
from megazero.tensor_parallel import shard_full_tensor
from tests.common import assert_matches_reference, merge_runs, train_runs
from tests.dist import run_world
from tests.reference import LLAMA as SPEC
from tests.reference import run_reference

transformers = pytest.importorskip("transformers")

# the reference's model as flags (tests/common.py's SMALL_FLAGS come first)
LLAMA = ["--arch", "llama", "--num-layers", str(SPEC.num_layers), "--num-kv-heads", str(SPEC.num_kv_heads),
         "--ffn-hidden-size", str(SPEC.ffn_size), "--train-steps", str(SPEC.train_steps)]
SMALL = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=1000, arch="llama",
                    num_kv_heads=2, ffn_size=96, rope_theta=500000.0)


@pytest.fixture(scope="module")
def llama_reference(data_cache):
    ref = run_reference(data_cache, SPEC)
    return ref.losses, ref.final


def _hf(cfg: ModelConfig, model: GPT):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_llama_config(cfg))).eval()
    hf.load_state_dict(to_hf_llama_state_dict(model.state_dict(), cfg), strict=True)  # every tensor, both ways
    return hf


@pytest.mark.parametrize("kv_heads, tied", [(2, False), (2, True), (1, False), (4, False)],
                         ids=["gqa-untied", "gqa-tied", "mqa", "mha"])
@torch.no_grad()
def test_logits_and_loss_equal_hugging_face_llama(kv_heads, tied):
    cfg = ModelConfig(**{**SMALL.__dict__, "num_kv_heads": kv_heads, "tie_embeddings": tied})
    ours = GPT(cfg)
    init_parameters(ours, seed=0)
    ours.eval()
    assert hasattr(ours, "lm_head") != tied and not hasattr(ours, "wpe")
    assert all(p.ndim == 2 or name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight"
               for name, p in ours.named_parameters())  # no biases
    hf = _hf(cfg, ours)
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    want, got = hf(ids).logits, ours.full_logits(ids)
    assert got.shape == want.shape == (3, cfg.seq_len, cfg.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours(ids[:, :-1], ids[:, 1:]).mean(), hf(ids, labels=ids).loss, rtol=1e-5, atol=1e-6)


def test_vocab_padding_never_reaches_the_untied_head_loss_or_export():
    model = GPT(SMALL)
    init_parameters(model, seed=0)
    assert model.lm_head.weight.shape[0] == model.padded_vocab_size == 1024
    ids = torch.randint(0, SMALL.vocab_size, (2, 16))
    logits = model(ids)
    assert torch.isinf(logits[..., 1000:]).all() and torch.isfinite(logits[..., :1000]).all()
    model(ids, ids).mean().backward()
    for layer in (model.wte, model.lm_head):
        assert torch.count_nonzero(layer.weight[1000:]) == 0 and torch.count_nonzero(layer.weight.grad[1000:]) == 0
    hf = to_hf_llama_state_dict(full_state_dict(model), SMALL)
    assert hf["lm_head.weight"].shape == hf["model.embed_tokens.weight"].shape == (1000, 64)
    with pytest.raises(ValueError, match="no GPT-2 layout"):
        to_hf_gpt2_tensor("wte.weight", model.wte.weight, SMALL)


def test_presets_have_the_published_shapes_and_parameter_counts():
    # Hugging Face's meta-llama config.json (hidden, layers, heads, kv heads, intermediate, rope theta 500000,
    # rms_norm_eps 1e-5, vocabulary 128256, tie_word_embeddings) and the published parameter counts
    published = {"llama-3.2-1b": ((2048, 16, 32, 8, 8192, True), 1_235_814_400),
                 "llama-3-8b": ((4096, 32, 32, 8, 14336, False), 8_030_261_248),
                 "llama-3-70b": ((8192, 80, 64, 8, 28672, False), 70_553_706_496)}
    for name, (shape, count) in published.items():
        m = model_preset(name)
        assert (m.hidden_size, m.num_layers, m.num_heads, m.kv_heads, m.ffn_hidden_size, m.tied) == shape, name
        assert (m.arch, m.rope_theta, m.layernorm_eps, m.vocab_size) == ("llama", 500000.0, 1e-5, 128256), name
        assert m.num_parameters() == count, name
        with torch.device("meta"):  # the model holds exactly that (the vocabulary 128256 needs no padding)
            assert sum(p.numel() for p in GPT(m).parameters()) == count, name
    tiny = model_preset("llama-tiny")
    assert tiny.vocab_size == model_preset("tiny").vocab_size  # the built-in tokenizer's
    assert sum(p.numel() for p in GPT(tiny).parameters()) == tiny.num_parameters()
    # a flag re-derives the family's defaults: --arch llama on the default preset is untied with SwiGLU 8H/3
    cfg = parse_args(["--arch", "llama", "--hidden-size", "192"]).model
    assert (cfg.tied, cfg.ffn_hidden_size, cfg.kv_heads) == (False, 512, cfg.num_heads)
    assert parse_args(["--model", "llama-3.2-1b", "--no-tie-embeddings"]).model.tied is False


def test_tensor_parallel_splits_query_and_kv_heads_like_the_hugging_face_tensors():
    """A TP rank's rows of the fused qkv are its rows of q_proj, then k_proj, then v_proj (and gate, then up), so
    rank r holds query heads r·nh/tp.. and the KV heads they use; each part is split alike."""
    cfg = ModelConfig(**{**SMALL.__dict__, "num_heads": 8, "num_kv_heads": 4, "hidden_size": 128})
    model = GPT(cfg)
    init_parameters(model, seed=0)
    hf = to_hf_llama_state_dict(model.state_dict(), cfg)
    for name in ("blocks.0.attn.qkv.weight", "blocks.0.mlp.fc.weight"):
        parts = [hf[n] for n, _ in llama_parts(name, cfg)]
        spec = model.get_parameter(name).shard_spec
        for tp in (2, 4):
            for r in range(tp):
                want = torch.cat([p.chunk(tp)[r] for p in parts])
                assert torch.equal(shard_full_tensor(model.get_parameter(name).detach(), spec, r, tp), want)
        with torch.device("meta"):
            layer = GPT(cfg, tp_group=_FakeGroup(4)).blocks["0"].attn
        assert (layer.local_heads, layer.local_kv_heads) == (2, 1)


class _FakeGroup:
    """Only the size and rank a layer reads when it is built."""

    def __init__(self, size: int) -> None:
        self.size, self.rank = size, 0


@pytest.mark.parametrize("flags, message", [
    (["--num-kv-heads", "3"], "--num-heads 4 is not divisible by --num-kv-heads 3"),
    (["--num-heads", "12", "--hidden-size", "192", "--num-kv-heads", "4", "--tp", "6"],
     r"--num-kv-heads 4 and --tp 6 do not divide one another; .* a --tp that divides 4 or a multiple of it"),
    (["--ffn-hidden-size", "97", "--num-kv-heads", "4", "--tp", "2"], "--ffn-hidden-size 97 is not divisible"),
    (["--arch", "gpt2", "--num-kv-heads", "2"], "--num-kv-heads 2 needs --arch llama"),
    (["--arch", "gpt2", "--num-kv-heads", "4", "--no-tie-embeddings"], "--no-tie-embeddings needs --arch llama"),
    (["--hidden-size", "60", "--num-heads", "4"], "rotary embeddings rotate pairs"),
    (["--rope-theta", "0"], "--rope-theta must be positive"),
])
def test_bad_shapes_are_refused_naming_the_flag(flags, message):
    world = int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 2
    with pytest.raises(ConfigError, match=message):
        parse_args(["--model", "llama-tiny", "--num-kv-heads", "2", *flags]).resolve(world)


# -- training parity with the independent reference -----------------------------------------------------------
def _check(runs: list[list[str]], merged, reference) -> None:
    for flags, (losses, state) in zip(runs, merged):
        try:
            assert_matches_reference(losses, state, reference)
        except AssertionError as e:
            raise AssertionError(f"{flags}: {e}") from None


def test_reference_llama_learns(llama_reference):
    losses, _ = llama_reference
    assert losses[-1] < losses[0] - 0.3


def test_dp2_zero_stages_offload_and_recompute_match_reference(llama_reference, data_cache, tmp_path):
    base = [*LLAMA, "--micro-batch-size", "2", "--global-batch-size", "8"]
    runs = [[*base, "--zero-stage", str(z)] for z in range(4)]
    runs += [[*base, "--zero-stage", "2", "--offload-optimizer"],
             [*base, "--zero-stage", "3", "--offload-optimizer", "--offload-param", "--activation-checkpointing",
              "full"]]
    _check(runs, merge_runs(run_world(train_runs, 2, runs, data_cache, str(tmp_path))), llama_reference)


def test_tp2_with_and_without_sp_and_recompute_match_reference(llama_reference, data_cache, tmp_path):
    """tp 2 splits 4 query heads and 2 KV heads (one each); under SP rotary positions must be those of the whole
    sequence (attention sees it after the all-gather). The last run's checkpoint reassembles the full tensors
    from the two shards (GQA's unequal q/k/v blocks)."""
    base = [*LLAMA, "--tp", "2", "--micro-batch-size", "4", "--global-batch-size", "8"]
    sp = [*base, "--sequence-parallel"]
    runs = [base, sp, [*sp, "--activation-checkpointing", "full"],
            [*base, "--activation-checkpointing", "selective", "--save", str(tmp_path / "ckpt")]]
    merged = merge_runs(run_world(train_runs, 2, runs, data_cache, str(tmp_path), tp=2))
    _check(runs, merged, llama_reference)
    reader = CheckpointReader(find_checkpoint(tmp_path / "ckpt"))
    assert reader.tensors["blocks.0.attn.qkv.weight"]["blocks"] == [4, 2, 2]
    for name, value in merged[-1][1].items():
        assert torch.equal(reader.full_tensor(name), value), name


def test_pp2_schedules_match_reference(llama_reference, data_cache, tmp_path):
    """Untied, the output layer lives on the last stage only and nothing crosses the embedding group; tied (as
    Llama 3.2), the two stages' copies of the embedding are summed over it, as GPT-2's are."""
    base = [*LLAMA, "--pp", "2", "--micro-batch-size", "2", "--global-batch-size", "8"]
    runs = [[*base, "--pp-schedule", "gpipe"], [*base, "--pp-schedule", "1f1b"],
            [*base, "--pp-schedule", "interleaved", "--virtual-stages", "2"], [*base, "--tie-embeddings"]]
    results = run_world(_train_counting_tied_traffic, 2, runs, data_cache, str(tmp_path), pp=2)
    merged = merge_runs([[run for run, _ in rank] for rank in results])
    _check(runs[:3], merged[:3], llama_reference)
    tied = run_reference(data_cache, SPEC.with_(tie_embeddings=True))
    _check(runs[3:], merged[3:], (tied.losses, tied.final))
    traffic = [[n for _, n in rank] for rank in results]
    assert all(t[:3] == [0, 0, 0] and t[3] > 0 for t in traffic), traffic


def _train_counting_tied_traffic(ctx, runs, cache, log_dir):
    """Each run's result with the elements this rank moved over the embedding group (the tied copies' sum)."""
    out = []
    for i, flags in enumerate(runs):
        before = sum(n for (group, _, _), n in ctx.ledger.totals.items() if group == "embedding")
        [result] = train_runs(ctx, [flags], cache, f"{log_dir}/{i}")
        out.append((result, sum(n for (group, _, _), n in ctx.ledger.totals.items() if group == "embedding")
                    - before))
    return out


def test_tp2_pp2_dp2_zero_1_and_3_match_reference(llama_reference, data_cache, tmp_path):
    base = [*LLAMA, "--tp", "2", "--pp", "2", "--dp", "2", "--micro-batch-size", "2", "--global-batch-size", "8"]
    runs = [[*base, "--zero-stage", "1", "--sequence-parallel"], [*base, "--zero-stage", "3"]]
    merged = merge_runs(run_world(train_runs, 8, runs, data_cache, str(tmp_path), tp=2, pp=2))
    _check(runs, merged, llama_reference)
