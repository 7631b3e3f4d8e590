"""GPT-2 model: parity with Hugging Face, initialisation convention, vocabulary padding, clear errors."""

from __future__ import annotations

import pytest
import torch

from megazero.config.schema import ModelConfig, model_preset
from megazero.distributed.group import Group
from megazero.model import GPT, init_parameters
from megazero.model.gpt import CausalSelfAttention
from megazero.model.hf import hf_gpt2_config, to_hf_gpt2_state_dict

SMALL = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=1000)


def _model(cfg: ModelConfig = SMALL, seed: int = 0) -> GPT:
    m = GPT(cfg)
    init_parameters(m, seed)
    return m


def test_logits_match_hugging_face_gpt2():
    transformers = pytest.importorskip("transformers")
    ours = _model().eval()
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_gpt2_config(SMALL))).eval()
    missing, unexpected = hf.load_state_dict(to_hf_gpt2_state_dict(ours.state_dict(), SMALL), strict=False)
    assert not unexpected and all("attn.bias" in k or "masked_bias" in k for k in missing)
    ids = torch.randint(0, SMALL.vocab_size, (3, SMALL.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours.full_logits(ids)
    assert got.shape == want.shape == (3, SMALL.seq_len, SMALL.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the loss agrees with HF's shifted cross-entropy too
    hf_loss = hf(ids, labels=ids).loss
    with torch.no_grad():
        our_loss = ours(ids[:, :-1], ids[:, 1:]).mean()
    torch.testing.assert_close(our_loss, hf_loss, rtol=1e-5, atol=1e-6)


def test_presets_are_gpt2_shapes_and_parameter_counts():
    assert model_preset("gpt2-124m").num_parameters() == 124_439_808  # GPT-2 small, tied embedding
    assert model_preset("gpt2-350m").num_parameters() == 354_823_168  # GPT-2 medium
    tiny = model_preset("tiny")
    assert sum(p.numel() for p in GPT(tiny).parameters()) == tiny.num_parameters()
    assert model_preset("tiny", num_layers=2).num_layers == 2


def test_initialisation_depends_only_on_seed_and_name():
    a, b, c = _model(seed=0), _model(seed=0), _model(seed=1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.std() > 0:
            assert not torch.equal(pa, pc), name
    # a model holding only layer 1 (one pipeline stage) gets exactly the full model's layer 1
    stage = GPT(SMALL, layers=range(1, 2), pre_process=False, post_process=True)
    init_parameters(stage, seed=0)
    full = dict(a.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, full[name]), name
    # residual projections use GPT-2's scaled init
    assert a.blocks["0"].attn.proj.weight.std() < 0.75 * a.blocks["0"].attn.qkv.weight.std()


def test_vocab_padding_never_reaches_loss_or_gradients():
    m = _model()
    assert m.padded_vocab_size == 1024 and m.wte.weight.shape[0] == 1024
    assert torch.count_nonzero(m.wte.weight[1000:]) == 0
    ids = torch.randint(0, 1000, (2, 16))
    logits = m(ids)
    assert torch.isinf(logits[..., 1000:]).all() and torch.isfinite(logits[..., :1000]).all()
    m(ids, ids).mean().backward()
    assert torch.count_nonzero(m.wte.weight.grad[1000:]) == 0
    # the loss equals cross-entropy over the real vocabulary only
    real = torch.nn.functional.cross_entropy(logits[..., :1000].flatten(0, 1), ids.flatten())
    torch.testing.assert_close(m(ids, ids).mean(), real)


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match=r"--num-heads \(6\) must be divisible by --tp \(4\)"):
        CausalSelfAttention(ModelConfig(2, 96, 6, 16, 100), Group("tp", [0, 1, 2, 3], None))
    with pytest.raises(ValueError, match=r"--hidden-size \(100\) must be divisible by --num-heads \(3\)"):
        GPT(ModelConfig(2, 100, 3, 16, 100))
    with pytest.raises(ValueError, match="exceeds --seq-len"):
        _model()(torch.zeros(1, 40, dtype=torch.long))
