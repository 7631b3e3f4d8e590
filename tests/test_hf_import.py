"""Hugging Face weights in (``--init-from``) and out (``tools/convert_checkpoint.py --format hf``).

Small GPT-2 and Llama (GQA, untied) models are built here with ``transformers`` from random weights (every
tensor perturbed, norms included, so no mapping error hides behind a constant) and saved with
``save_pretrained``: GPT-2 as one ``model.safetensors``, Llama sharded with an index and a tokenizer.json. The
first step's loss must equal the Hugging Face model's own loss on the same batch at one process and in one
4-rank world (Llama at tp2·pp2, GPT-2 at tp2·dp2 under ZeRO-3 with gather units); a run that starts from the
weights and saves at step 0 exports them back bit for bit; each rank reads exactly its own shards' elements.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megazero.checkpoint.hf_import import configure_from_inputs, hf_initializer, hf_model_config
from megazero.config.cli import parse_args
from megazero.config.errors import ConfigError, ConfigWarning
from tests.common import SMALL_FLAGS
from tests.dist import run_world
from tests.reference import RefSpec, reference_batches

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
# one step of tests/common.py's small model, global batch 8 (the reference's first batch), no warm-up
ONE_STEP = ["--train-steps", "1", "--warmup-steps", "0", "--micro-batch-size", "2", "--global-batch-size", "8"]
LLAMA_TP2_PP2 = ["--tp", "2", "--pp", "2", "--zero-stage", "1"]
GPT2_TP2_DP2_Z3 = ["--tp", "2", "--zero-stage", "3"]


def _perturbed(model, seed: int):
    """Every parameter random (norm weights around 1), so a wrong mapping of any tensor shows in the loss."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = p.ndim == 1 and name.endswith("weight") and ("norm" in name or "ln_" in name)
            p.copy_((1.0 if norm else 0.0) + 0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def hf(data_cache, tmp_path_factory):
    """The two Hugging Face directories, their models, the SentencePiece model of the data cache and the
    first global batch of the built-in corpus."""
    from megazero.data import build_datasets, resolve_tokenizer

    root = tmp_path_factory.mktemp("hf")
    gpt2 = _perturbed(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)), 1)
    gpt2.save_pretrained(root / "gpt2")
    llama = _perturbed(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)), 2)
    llama.save_pretrained(root / "llama", max_shard_size="40KB")
    tok = resolve_tokenizer([], 512, data_cache)
    tok.save_hf(root / "llama")  # the built-in tokenizer as tokenizer.json: the directory supplies it
    train_ds, _ = build_datasets([], tok, 32, data_cache)
    idx = reference_batches(len(train_ds), RefSpec(), 1)[0]
    batch = torch.stack([torch.as_tensor(np.asarray(train_ds[i]), dtype=torch.long) for i in idx])
    return {"dir": {"gpt2": root / "gpt2", "llama": root / "llama"}, "model": {"gpt2": gpt2, "llama": llama},
            "sp": str(tok.model_path), "batch": batch, "root": root}


def _hf_loss(model, batch: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=batch[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)).item()


def _hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _cfg(flags: list[str]):
    return configure_from_inputs(parse_args([*SMALL_FLAGS, *flags]))


def _flags(hf, arch: str, cache: str, log_dir: str, *extra: str, own_tokenizer: bool = False) -> list[str]:
    # training reads the data cache's SentencePiece model (the same ids as the Llama directory's tokenizer.json,
    # and the corpus already tokenised with it); ``own_tokenizer``: the directory's, as --init-from picks it
    tokenizer = [] if own_tokenizer else ["--tokenizer", hf["sp"]]
    return ["--init-from", str(hf["dir"][arch]), *tokenizer, *ONE_STEP, "--cache-dir", cache, "--log-dir", log_dir,
            *extra]


def _counting_reads() -> list[int]:
    """Count every element this process takes out of a safetensors file, at the library's boundary
    (``safe_open``'s slices and tensors; patched in a forked rank only)."""
    import safetensors

    counts: list[int] = []
    safe_open = safetensors.safe_open

    class Slice:
        def __init__(self, inner):
            self.inner = inner

        def __getitem__(self, index):
            t = self.inner[index]
            counts.append(t.numel())
            return t

        def get_shape(self):
            return self.inner.get_shape()

    class Handle:
        def __init__(self, inner):
            self.inner = inner

        def keys(self):
            return self.inner.keys()

        def get_slice(self, key):
            return Slice(self.inner.get_slice(key))

        def get_tensor(self, key):
            t = self.inner.get_tensor(key)
            counts.append(t.numel())
            return t

    safetensors.safe_open = lambda *args, **kw: Handle(safe_open(*args, **kw))
    return counts


def _world(ctx, hf, cache: str, out: str) -> dict:
    """Per topology: build the engine from the directory and save it at step 0 (the round trip; the elements
    read against the rank's own shards), then train one step (the loss; Llama saves, for the export test)."""
    from megazero.checkpoint import save_checkpoint
    from megazero.data import open_tokenizer
    from megazero.distributed.context import ParallelContext, RankGrid
    from megazero.train.engine import Engine
    from megazero.train.loop import run_training

    counts = _counting_reads()
    result = {}
    z3 = Path(out) / "z3.json"  # ZeRO-3 gather units (not only persistent parameters) are filled from the files
    for arch, (tp, pp), flags in (("llama", (2, 2), LLAMA_TP2_PP2),
                                  ("gpt2", (2, 1), [*GPT2_TP2_DP2_Z3, "--deepspeed-config", str(z3)])):
        sub = ParallelContext.from_grid(RankGrid.from_world(ctx.world_size, tp_size=tp, pp_size=pp))
        rt = _cfg(_flags(hf, arch, cache, f"{out}/log-{arch}", *flags, own_tokenizer=arch == "llama")
                  ).resolve(ctx.world_size)  # the GPT-2 directory has no tokenizer: the cache's (the same ids)
        del counts[:]
        engine = Engine(rt, sub)
        params = {p for c in engine.chunks for p in c.parameters()}
        read, own = sum(counts), sum(p.numel() for p in params)
        tokenizer = open_tokenizer(rt.data.tokenizer) if rt.data.tokenizer else None
        save_checkpoint(engine, None, f"{out}/{arch}-rt", tokenizer)
        save = ["--save", f"{out}/{arch}-trained"] if arch == "llama" else []
        losses = run_training(_cfg(_flags(hf, arch, cache, f"{out}/log-{arch}", *flags, *save))
                              .resolve(ctx.world_size), sub).losses
        result[arch] = {"loss": losses[0], "read": read, "own": own}
    return result


@pytest.fixture(scope="module")
def world(hf, data_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf-world")
    (out / "z3.json").write_text(json.dumps({"zero_optimization": {"stage": 3,
                                                                   "stage3_param_persistence_threshold": 100}}))
    return {"ranks": run_world(_world, 4, hf, data_cache, str(out), tp=2, pp=2), "out": out}


def _convert(step_root: Path, out: Path) -> None:
    spec = importlib.util.spec_from_file_location("_convert_checkpoint", ROOT / "tools" / "convert_checkpoint.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([str(step_root), "--out", str(out), "--format", "hf"]) == 0


# -- in -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_first_step_loss_equals_hugging_face_loss(arch, hf, world, data_cache, tmp_path):
    from megazero.train.loop import run_training

    want = _hf_loss(hf["model"][arch], hf["batch"])

    def one(ctx):
        return run_training(_cfg(_flags(hf, arch, data_cache, str(tmp_path))).resolve(1), ctx).losses[0]
    single = run_world(one, 1)[0]
    assert abs(single - want) / want < 1e-5, (single, want)
    for rank, r in enumerate(world["ranks"]):  # Llama at tp2·pp2 ZeRO-1, GPT-2 at tp2·dp2 ZeRO-3
        assert abs(r[arch]["loss"] - want) / want < 1e-5, (rank, r[arch]["loss"], want)


class _TPRank:
    """What the materialiser and the layers ask of a TP group at construction: its size and this rank."""

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank = size, rank


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_each_tp_shard_is_the_slice_of_the_full_tensor(arch, tmp_path):
    # a vocabulary of 500 (padded to 512 or 768 rows: zero rows the files do not have), fused and GQA blocks,
    # SwiGLU halves, Conv1D transposes: every rank's value equals megazero's own split of the full tensor
    from megazero.model import GPT
    from megazero.model.hf import from_hf_llama_tensors, to_hf_gpt2_tensor
    from megazero.tensor_parallel import shard_full_tensor

    if arch == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=500, n_embd=32, n_layer=1, n_head=4,
                                                                     n_positions=16))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=500, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False))
    _perturbed(model, 3).save_pretrained(tmp_path)
    cfg, _ = hf_model_config(json.loads((tmp_path / "config.json").read_text()))
    state = _hf_tensors(tmp_path)
    for tp in (1, 2):
        for rank in range(tp):
            group = _TPRank(tp, rank)
            with torch.device("meta"):
                ours = GPT(cfg, group)
            value = hf_initializer([ours], cfg, tmp_path, group, torch.device("cpu"))
            for name, p in ours.named_parameters():
                if arch == "llama":
                    full = from_hf_llama_tensors(name, state, cfg)
                else:  # Conv1D's transposes are their own inverse
                    full = to_hf_gpt2_tensor(name, state[to_hf_gpt2_tensor(name, torch.zeros(1, 1), cfg)[0]], cfg)[1]
                assert torch.equal(value(p), shard_full_tensor(full, p.shard_spec, rank, tp)), (tp, rank, name)


def test_each_rank_reads_exactly_its_own_shards(world):
    # every element read is one this rank holds (its TP shard of its pipeline stage's parameters, replicated
    # ones whole), and each exactly once: no rank reads a tensor, or a part of one, that it does not own
    for rank, r in enumerate(world["ranks"]):
        for arch in ("gpt2", "llama"):
            assert r[arch]["read"] == r[arch]["own"], (rank, arch, r[arch])


def test_round_trip_gives_back_the_same_tensors_bit_for_bit(hf, world, tmp_path):
    for arch in ("gpt2", "llama"):
        step_dir = world["out"] / f"{arch}-rt" / "step_00000000"
        _convert(step_dir.parent, tmp_path / arch)
        want, got = _hf_tensors(hf["dir"][arch]), _hf_tensors(tmp_path / arch)
        assert got.keys() == want.keys(), arch
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (arch, k)
    # the directory's tokenizer travelled: stored as tokenizer.json (+ config) in the checkpoint and exported
    step_dir = world["out"] / "llama-rt" / "step_00000000"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["tokenizer"]["file"] == "tokenizer.json" and manifest["tokenizer"]["vocab_size"] == 512
    assert not (step_dir / "tokenizer.model").exists() and (step_dir / "tokenizer_config.json").is_file()
    for d in (step_dir, tmp_path / "llama"):
        assert (d / "tokenizer.json").read_bytes() == (hf["dir"]["llama"] / "tokenizer.json").read_bytes()


# -- out ------------------------------------------------------------------------------------------------------
def test_llama_export_loads_in_transformers_with_equal_logits(world, tmp_path):
    from megazero.generate import load_model, load_tokenizer

    trained = world["out"] / "llama-trained"
    _convert(trained, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    ours = load_model(trained)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ours.full_logits(ids), rtol=1e-5, atol=1e-5)
        # and megazero reads the export back (as --init-from does) with the same logits
        torch.testing.assert_close(load_model(tmp_path / "out").full_logits(ids), ours.full_logits(ids),
                                   rtol=0, atol=0)
    text = "def main():\n    return 0\n"
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert hf_tok(text)["input_ids"] == load_tokenizer(trained).encode(text)


# -- refusals -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, named", [
    (["--num-heads", "8"], ["num_attention_heads 4", "--num-heads", "8"]),
    (["--num-kv-heads", "4"], ["num_key_value_heads 2", "--num-kv-heads", "4"]),
    (["--num-layers", "3"], ["num_hidden_layers 2", "--num-layers", "3"]),
    (["--hidden-size", "128"], ["hidden_size 64", "--hidden-size", "128"]),
    (["--vocab-size", "1000"], ["vocab_size 512", "--vocab-size", "1000"]),
    (["--arch", "gpt2"], ["model_type llama", "--arch", "gpt2"]),
    (["--model", "llama-tiny"], ["--model llama-tiny"]),
], ids=["heads", "kv-heads", "layers", "hidden", "vocab", "arch", "preset"])
def test_a_config_that_does_not_match_is_refused_naming_the_field(hf, flags, named):
    with pytest.raises(ConfigError) as e:
        _cfg(["--init-from", str(hf["dir"]["llama"]), *flags])
    assert all(n in str(e.value) for n in named), str(e.value)


def test_config_follows_the_directory(hf):
    cfg = _cfg(["--init-from", str(hf["dir"]["llama"])])  # SMALL_FLAGS' shape matches; the rest is config.json's
    m = cfg.model
    assert (m.arch, m.kv_heads, m.ffn_hidden_size, m.rope_theta, m.tied, m.vocab_size) == ("llama", 2, 96, 5e5,
                                                                                          False, 512)
    assert cfg.data.tokenizer == str(hf["dir"]["llama"])  # the directory supplies its tokenizer
    cfg = configure_from_inputs(parse_args(["--init-from", str(hf["dir"]["gpt2"]), "--tokenizer", hf["sp"]]))
    assert (cfg.model.arch, cfg.model.num_layers, cfg.model.seq_len, cfg.data.tokenizer) == ("gpt2", 2, 32, hf["sp"])


def test_a_missing_or_misshapen_tensor_is_refused(hf, tmp_path):
    bad = tmp_path / "llama"
    shutil.copytree(hf["dir"]["llama"], bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"no tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        configure_from_inputs(parse_args(["--init-from", str(bad)]))
    shutil.copytree(hf["dir"]["gpt2"], tmp_path / "gpt2")
    config = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({**config, "n_inner": 128}))
    with pytest.raises(ConfigError, match=r"transformer\.h\.0\.mlp\.c_fc\.weight has shape \[64, 256\].*\[64, 128\]"):
        configure_from_inputs(parse_args(["--init-from", str(tmp_path / "gpt2")]))
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({**config, "scale_attn_by_inverse_layer_idx": True}))
    with pytest.raises(ConfigError, match="scale_attn_by_inverse_layer_idx"):
        configure_from_inputs(parse_args(["--init-from", str(tmp_path / "gpt2")]))


# -- tokenizers -----------------------------------------------------------------------------------------------
def _word_tokenizer(path: Path, words: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(words - 1)} | {"</s>": words - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def padded(hf, tmp_path_factory):
    """The Llama weights (an untied embedding of 512 rows) with a tokenizer of 300 entries, as Qwen2's and
    Pythia's embeddings have more rows than their tokenizers; eos and bos named by its tokenizer_config.json."""
    d = tmp_path_factory.mktemp("padded")
    for f in hf["dir"]["llama"].iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy(f, d / f.name)
    _word_tokenizer(d / "tokenizer.json", 300)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "w1"}))
    return d


def test_embedding_rows_beyond_the_tokenizer_are_kept_never_sampled_and_exported(padded, data_cache, tmp_path):
    """--init-from the padded directory: the model keeps 512 rows; a run of one step at lr 0 (the loop with a
    300-entry tokenizer) saves weights that export back bit for bit, all 512 rows; generation never picks a row
    of 300 or more (sampled or greedy), which the unmasked model does (negative control)."""
    from megazero.generate import SamplingConfig, generate_ids, load_model, load_tokenizer
    from megazero.train.loop import run_training

    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"w{(7 * i) % 298 + 1}" for i in range(4000)))
    flags = [*SMALL_FLAGS, "--init-from", str(padded), *ONE_STEP, "--lr", "0", "--data", str(text), "--cache-dir",
             data_cache, "--log-dir", str(tmp_path / "log"), "--save", str(tmp_path / "ck")]
    cfg = configure_from_inputs(parse_args(flags))
    assert (cfg.model.vocab_size, cfg.data.tokenizer) == (512, str(padded))
    run_world(lambda ctx: run_training(cfg.resolve(1), ctx).losses, 1)
    _convert(tmp_path / "ck", tmp_path / "out")
    want, got = _hf_tensors(padded), _hf_tensors(tmp_path / "out")
    assert got.keys() == want.keys() and got["model.embed_tokens.weight"].shape[0] == 512
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 512
    tok = load_tokenizer(tmp_path / "out")
    assert (tok.vocab_size, tok.eos_id, tok.bos_id) == (300, 299, 1)

    model, prompt = load_model(padded), [1, 2, 3]
    sampling = SamplingConfig(max_new_tokens=24, temperature=1.0, seed=0, stop_at_eos=False)
    assert max(generate_ids(model, prompt, sampling)) >= 300  # the rows do get sampled without the mask
    assert max(generate_ids(model, prompt, sampling, vocab_size=tok.vocab_size)) < 300
    with torch.no_grad():
        logits = model.full_logits(torch.tensor([prompt]))[0, -1]
    greedy = generate_ids(model, prompt, SamplingConfig(1, temperature=0), vocab_size=300)
    assert greedy == [int(logits[:300].argmax())]


def test_qwen2_is_refused_naming_its_qkv_biases():
    config = transformers.Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2).to_dict()
    with pytest.raises(ConfigError, match="model_type 'qwen2': Qwen2 is Llama with biases on q, k and v"):
        hf_model_config(config)


def test_the_vocabulary_follows_the_tokenizer_and_a_disagreeing_one_is_refused(hf, tmp_path, capsys):
    tok = _word_tokenizer(tmp_path / "tok.json", 300)
    assert configure_from_inputs(parse_args(["--tokenizer", str(tok)])).model.vocab_size == 300
    assert configure_from_inputs(parse_args(["--tokenizer", str(hf["dir"]["llama"])])).model.vocab_size == 512
    with pytest.raises(ConfigError, match="--vocab-size 1000 does not match tokenizer .* 300 tokens"):
        configure_from_inputs(parse_args(["--tokenizer", str(tok), "--vocab-size", "1000"]))
    big = _word_tokenizer(tmp_path / "big.json", 600)
    with pytest.raises(ConfigError, match="vocab_size 512, but tokenizer .* has 600 tokens, more than the embedding"):
        configure_from_inputs(parse_args(["--init-from", str(hf["dir"]["llama"]), "--tokenizer", str(big)]))
    with pytest.warns(ConfigWarning, match="has 300 tokens, the embedding .* 512 rows: the rows beyond are kept"):
        cfg = configure_from_inputs(parse_args(["--init-from", str(hf["dir"]["llama"]), "--tokenizer", str(tok)]))
    assert cfg.model.vocab_size == 512  # the embedding's rows, not the tokenizer's entries
    assert _entry_point().main(["--tokenizer", str(tok), "--vocab-size", "1000"]) != 0
    assert "--vocab-size 1000 does not match" in capsys.readouterr().err


def test_a_tokenizer_of_another_vocabulary_is_refused_for_a_checkpoint(world, tmp_path):
    from megazero.generate import load_tokenizer

    ckpt = world["out"] / "llama-rt"
    assert load_tokenizer(ckpt).vocab_size == 512
    with pytest.raises(ValueError, match="has 600 tokens, but the model .* vocabulary of 512"):
        load_tokenizer(ckpt, str(_word_tokenizer(tmp_path / "tok.json", 600)))
    assert load_tokenizer(ckpt, str(_word_tokenizer(tmp_path / "tok.json", 300))).vocab_size == 300  # padded rows


def test_a_directory_without_a_tokenizer_is_refused_unless_one_is_named_or_asked_for(hf, capsys):
    """The GPT-2 directory has weights and no tokenizer: refused in one line (exit 2) naming --tokenizer and
    --new-tokenizer; either one starts the run; --new-tokenizer also sets the Llama directory's own aside."""
    gpt2, llama = str(hf["dir"]["gpt2"]), str(hf["dir"]["llama"])
    with pytest.raises(ConfigError, match=r"no tokenizer\.json or tokenizer\.model there.*--tokenizer.*"
                                          r"--new-tokenizer.* vocabulary of 512"):
        configure_from_inputs(parse_args(["--init-from", gpt2]))
    assert configure_from_inputs(parse_args(["--init-from", gpt2, "--new-tokenizer"])).data.tokenizer is None
    assert configure_from_inputs(parse_args(["--init-from", llama, "--new-tokenizer"])).data.tokenizer is None
    assert configure_from_inputs(parse_args(["--init-from", llama])).data.tokenizer == llama
    with pytest.warns(ConfigWarning, match="--new-tokenizer has no effect without --init-from"):
        configure_from_inputs(parse_args(["--new-tokenizer"]))
    entry = _entry_point()
    assert entry.main(["--init-from", gpt2]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error (rank 0): --init-from ") and "--new-tokenizer" in err, err


def _entry_point():
    spec = importlib.util.spec_from_file_location("_pretrain_gpt", ROOT / "pretrain" / "gpt.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    return entry


def test_init_from_with_a_checkpoint_to_load_reads_only_config_json(hf, world, tmp_path):
    """--init-from with --load of an existing checkpoint keeps config.json's model and the directory's tokenizer
    but drops the weights (init_from None: the seed's initialisation, then the checkpoint's values), saying so;
    --load auto before any checkpoint exists reads them."""
    llama, ck = str(hf["dir"]["llama"]), str(world["out"] / "llama-rt")
    with pytest.warns(ConfigWarning, match="its weights are not read, --load resumes .*step_00000000"):
        cfg = configure_from_inputs(parse_args([*SMALL_FLAGS, "--init-from", llama, "--load", ck]))
    assert cfg.training.init_from is None and cfg.model.kv_heads == 2 and cfg.data.tokenizer == llama
    with pytest.warns(ConfigWarning, match="its weights are not read"):
        cfg = configure_from_inputs(parse_args([*SMALL_FLAGS, "--init-from", llama, "--load", "auto", "--save", ck]))
    assert cfg.training.init_from is None
    empty = str(tmp_path / "none-yet")
    cfg = configure_from_inputs(parse_args([*SMALL_FLAGS, "--init-from", llama, "--load", "auto", "--save", empty]))
    assert cfg.training.init_from == llama
