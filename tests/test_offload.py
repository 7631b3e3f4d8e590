"""ZeRO-Offload: optimizer states (stages 1-3) and parameter shards (stage 3) in host memory.

Parity with the independent reference, and the split of model states between device and host, read from
the devices of the tensors themselves: on a CPU-only run nothing is off the device (offloaded 0); a CPU unit
test moves what the model computes with to the meta device, standing in for the accelerator, and checks the
host bytes and that moving a tensor moves its bytes; on CUDA (``-m gpu``) the real split, pinned, is
compared with the estimator.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megazero.config.cli import parse_args
from megazero.plan.estimate import model_state_bytes
from megazero.train.engine import Engine
from tests.common import assert_matches_reference, train_runs
from tests.dist import run_world

DP2 = ["--dp", "2", "--micro-batch-size", "4"]


def test_offload_matches_single_process(reference, data_cache, tmp_path):
    runs = [[*DP2, "--zero-stage", "1", "--offload-optimizer"],
            [*DP2, "--zero-stage", "2", "--offload-optimizer"],
            [*DP2, "--zero-stage", "3", "--offload-optimizer", "--offload-param"]]
    for losses, state in run_world(train_runs, 2, runs, data_cache, str(tmp_path))[0]:
        assert_matches_reference(losses, state, reference)


def test_bf16_offload_trains_exactly_like_no_offload(data_cache, tmp_path):
    base = [*DP2, "--precision", "bf16", "--zero-stage", "2"]
    (with_offload, _), (without, _) = run_world(train_runs, 2, [[*base, "--offload-optimizer"], base],
                                                data_cache, str(tmp_path))[0]
    assert with_offload == without  # the same arithmetic, only where it runs differs


def _offload_param_alone(ctx, cache: str, log_dir: str):
    """ZeRO-3 with ``--offload-param`` and no ``--offload-optimizer``, host memory emulated apart from the device
    (the accelerator's stand-in): fp32 and bf16, and bf16 without offload; per Adam call, which of its tensors
    (updated values, moments, gradients) live in host memory."""
    from megazero.distributed import device_io
    from megazero.zero import optimizer as zero_optimizer

    real, calls = zero_optimizer.adam_update, []

    def spy(p, g, lr, lo, hi, **kw):
        calls.append(sorted({device_io.is_host(t) for t in (p, kw["exp_avg"], kw["exp_avg_sq"], *g.parts)}))
        return real(p, g, lr, lo, hi, **kw)

    zero_optimizer.adam_update = spy
    units = os.path.join(log_dir, "units.json")  # every parameter sharded (none persistent): host shards
    with open(units, "w") as f:
        json.dump({"zero_optimization": {"stage3_param_persistence_threshold": 0}}, f)
    z3 = [*DP2, "--zero-stage", "3", "--deepspeed-config", units]
    runs = [[*z3, "--offload-param"], [*z3, "--offload-param", "--precision", "bf16"], [*z3, "--precision", "bf16"]]
    try:
        with device_io.use(device_io.EmulatedHost("cpu")):
            return train_runs(ctx, runs, cache, log_dir), calls
    finally:
        zero_optimizer.adam_update = real


def test_offload_param_alone_trains_with_the_optimizer_states_on_the_device(reference, data_cache, tmp_path):
    """``--offload-param`` without ``--offload-optimizer`` (stage 3): the parameter shards live in (emulated) host
    memory, while every Adam call reads and writes device tensors only (the fp32 master, kept apart from the
    host shards even in fp32, the moments and the gradients); fp32 matches the independent reference and bf16
    trains exactly like bf16 without offload."""
    (runs, calls), _ = run_world(_offload_param_alone, 2, data_cache, str(tmp_path))
    (fp32, state), (bf16, _), (bf16_plain, _) = runs
    assert_matches_reference(fp32, state, reference)
    assert bf16 == bf16_plain
    assert calls and all(c == [False] for c in calls), calls  # one device, never host memory, in every call


def _states(ctx, cache: str):
    out = {}
    for stage, flags in ((1, ["--offload-optimizer"]), (2, ["--offload-optimizer"]), (2, []),
                         (3, ["--offload-optimizer", "--offload-param"])):
        cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-heads", "4", "--seq-len", "32",
                          "--vocab-size", "512", "--precision", "bf16", "--zero-stage", str(stage), "--cache-dir",
                          cache, *DP2, *flags]).resolve(ctx.world_size)
        from dataclasses import replace

        cfg = replace(cfg, zero=replace(cfg.zero, stage3_param_persistence_threshold=0))
        engine = Engine(cfg, ctx)
        batch = [(torch.randint(0, 512, (4, 32)), torch.randint(0, 512, (4, 32)))]
        engine.train_step(batch)
        psi = sum(p.numel() for p in engine.model.parameters())
        out[(stage, tuple(flags))] = (engine.optimizer.model_state_bytes(), psi)
    return out


def test_measured_model_states_match_the_estimator_and_nothing_is_offloaded_without_a_device(data_cache):
    for rank_result in run_world(_states, 2, data_cache):
        for (stage, flags), (measured, psi) in rank_result.items():
            est = model_state_bytes(psi, stage, 2, "bf16", offload_optimizer="--offload-optimizer" in flags,
                                    offload_param="--offload-param" in flags)
            total = sum(measured[k] for k in ("params_bytes", "grads_bytes", "master_params_bytes",
                                              "optimizer_states_bytes"))
            assert abs(total - (est.device + est.offloaded)) <= 0.01 * total + 64, (stage, flags, measured, est)
            assert measured["offloaded_bytes"] == 0  # CPU only: host and device are one memory


def _nbytes(*tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _states_at(device_of: dict[str, str], offload_label: bool):
    """A stand-in holding a ZeRO-2 rank's model states where ``device_of`` says (meta: the accelerator)."""
    from types import SimpleNamespace

    from torch import nn

    n = 1000
    model = nn.Linear(10, 100, device=device_of["params"], dtype=torch.bfloat16)  # 1100 bf16 elements
    flat = torch.empty(n + 100, dtype=torch.bfloat16, device=device_of["params"])
    grads = torch.empty(n // 2, dtype=torch.bfloat16, device=device_of["grads"])  # this rank's gradient partition
    store = SimpleNamespace(held_tensors=lambda: {"params": [flat], "grads": [grads]})
    return SimpleNamespace(model=model, store=store, offload=offload_label,
                           master=torch.empty(n // 2, device=device_of["master"]),
                           exp_avg=torch.empty(n // 2, device=device_of["moments"]),
                           exp_avg_sq=torch.empty(n // 2, device=device_of["moments"]))


def test_offloaded_bytes_come_from_tensor_devices_with_meta_as_the_accelerator():
    """``ZeroOptimizer.model_state_bytes`` reads where each tensor is, not which attribute holds it or whether
    offload was asked for: meta stands in for the accelerator, meta storages are counted like any other."""
    from megazero.zero import ZeroOptimizer

    offloaded = {"params": "meta", "grads": "meta", "master": "cpu", "moments": "cpu"}
    for label in (True, False):
        st = _states_at(offloaded, label)
        m = ZeroOptimizer.model_state_bytes(st)
        assert m["offloaded_bytes"] == _nbytes(st.master, st.exp_avg, st.exp_avg_sq) == 3 * 500 * 4
        assert m["params_bytes"] == 2 * (1100 + 1100) and m["grads_bytes"] == 2 * 500  # meta storages counted
    moments_on_device = ZeroOptimizer.model_state_bytes(_states_at({**offloaded, "moments": "meta"}, True))
    assert moments_on_device["offloaded_bytes"] == 500 * 4  # the master only
    all_cpu = ZeroOptimizer.model_state_bytes(_states_at(dict.fromkeys(offloaded, "cpu"), True))
    assert all_cpu["offloaded_bytes"] == 0  # no accelerator: host and device are one memory
    assert sum(all_cpu.values()) == sum(m.values()) - m["offloaded_bytes"]


def _solo_optimizer(precision: str, layers: int, offload: bool, dp_rank_seed: int = 0):
    """A one-rank ZeRO-2 optimizer over a tiny GPT (the same weights for the same arguments)."""
    from megazero.config.schema import ModelConfig, OptimizerConfig, ZeroConfig
    from megazero.distributed.group import Group
    from megazero.model.gpt import GPT, init_parameters
    from megazero.zero import ZeroOptimizer

    model = GPT(ModelConfig(num_layers=layers, hidden_size=64, num_heads=4, seq_len=32, vocab_size=512))
    init_parameters(model, dp_rank_seed)
    zero = ZeroConfig(stage=2, offload_optimizer="cpu" if offload else None)
    return model, ZeroOptimizer(model, zero, OptimizerConfig(clip_grad=0.05), Group("solo", [0], None),
                                precision=precision)


def _steps(model, opt, steps: int = 3) -> list[float]:
    gen, norms = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        x = torch.randint(0, 512, (2, 32), generator=gen)
        opt.zero_grad()
        opt.backward(model(x, x).sum() / x.numel())
        norms.append(opt.step(1e-2).grad_norm)
    return norms


def test_pipelined_offload_step_equals_the_plain_step_bit_for_bit(monkeypatch):
    """ZeRO-2 with the optimizer offloaded to (emulated) host memory in sub-groups of 3000 elements (about 50 per
    step, segment and chunk boundaries apart, clipping active) against the same optimizer without offload, fp32,
    bf16, bf16 with the copy-back cast through the staging chunks and fp16 so too (16-bit gradients,
    loss-scaled): every gradient norm and every parameter after 3 steps identical."""
    from megazero.distributed import device_io
    from megazero.zero import offload

    monkeypatch.setattr(offload, "SUB_GROUP", 3000)
    for precision, stage_out in (("fp32", False), ("bf16", False), ("bf16", True), ("fp16", True)):
        with device_io.use(device_io.EmulatedHost("cpu")):
            m_off, o_off = _solo_optimizer(precision, 2, True)
            o_off.host.stage_out = stage_out  # True: the copy-back cast through the two staging chunks
            norms_off = _steps(m_off, o_off)
        m_ref, o_ref = _solo_optimizer(precision, 2, False)
        assert o_off.owned_numel // 3000 > 40 and device_io.emulated(o_off.master)
        assert len(o_off.host._out) == (2 if stage_out else 0)
        assert _steps(m_ref, o_ref) == norms_off, precision
        for (name, a), b in zip(m_off.named_parameters(), m_ref.parameters()):
            assert torch.equal(a, b), (precision, name)


class _StepLog(TorchDispatchMode):
    """Logs, in dispatch order, the offloaded step's copies into the host gradient buffer ("d2h"), its fused Adam
    calls ("adam") and its copies out of the host master ("h2d"), each with its sub-group (storage offset //
    chunk), and the intra-op threads each Adam call ran with."""

    def __init__(self, host_grads: torch.Tensor, master: torch.Tensor, chunk: int) -> None:
        super().__init__()
        self.keys = (host_grads.untyped_storage().data_ptr(), master.untyped_storage().data_ptr())
        self.chunk, self.ops, self.threads = chunk, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("_fused_adamw_", "_fused_adam_"):
            self.ops.append(("adam", args[0][0].storage_offset() // self.chunk))
            self.threads.append(torch.get_num_threads())
        elif name == "copy_":
            dst, src = args[0], args[1]
            if dst.untyped_storage().data_ptr() == self.keys[0]:
                self.ops.append(("d2h", dst.storage_offset() // self.chunk))
            elif src.untyped_storage().data_ptr() == self.keys[1]:
                self.ops.append(("h2d", src.storage_offset() // self.chunk))
        return func(*args, **(kwargs or {}))


def _logged_step(model, opt) -> _StepLog:
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    opt.zero_grad()
    opt.backward(model(x, x).sum() / x.numel())
    sq = opt.prepare_step()
    with _StepLog(opt._host_grads, opt.master, opt.host.chunk) as log:
        opt.finish_step(1e-2, float(sq))
    return log


def test_offload_step_issues_each_copy_before_the_adam_it_overlaps(monkeypatch):
    """The order of the offloaded step's operations, read from the dispatched ops: sub-group k+1's gradient copy
    to the host is issued before Adam of sub-group k starts (and after Adam of k-1), k's own copy before its Adam;
    k's copy back to the device after its Adam and before Adam of k+1. Under torchrun (LOCAL_WORLD_SIZE set, here
    1 rank on 2 cores) the Adam calls run on 2 threads, and the caller's setting (1) is back afterwards."""
    from megazero.distributed import device_io
    from megazero.zero import offload

    monkeypatch.setattr(offload, "SUB_GROUP", 20000)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    with device_io.use(device_io.EmulatedHost("cpu")):
        model, opt = _solo_optimizer("bf16", 2, True)
        _steps(model, opt, 1)  # allocates the host gradient buffer
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            log = _logged_step(model, opt)
            after = torch.get_num_threads()
        finally:
            torch.set_num_threads(before)
    chunks = -(-opt.owned_numel // 20000)
    assert chunks >= 5
    first, last = {}, {}
    for i, op in enumerate(log.ops):
        first.setdefault(op, i)
        last[op] = i
    assert {k for kind, k in log.ops if kind == "d2h"} == set(range(chunks)), log.ops
    for k in range(chunks):
        assert last[("d2h", k)] < first[("adam", k)] <= last[("adam", k)] < first[("h2d", k)], (k, log.ops)
        if k + 1 < chunks:
            assert last[("d2h", k + 1)] < first[("adam", k)], (k, log.ops)  # issued before Adam of k
            assert last[("h2d", k)] < first[("adam", k + 1)], (k, log.ops)
        if 1 <= k < chunks - 1:
            assert first[("d2h", k + 1)] > last[("adam", k - 1)], (k, log.ops)  # one sub-group ahead, no more
    assert log.threads and set(log.threads) == {2} and after == 1, (log.threads, after)


def test_host_adam_runs_over_flat_chunks_not_per_parameter():
    """One sub-group holding the whole partition: the host Adam is 2 fused calls per step (decayed and undecayed
    runs of the flat buffer) at 2 and at 4 layers, whatever the number of parameters (counted dispatches)."""
    from megazero.distributed import device_io

    calls = {}
    for layers in (2, 4):
        with device_io.use(device_io.EmulatedHost("cpu")):
            model, opt = _solo_optimizer("bf16", layers, True)
            _steps(model, opt, 1)
            log = _logged_step(model, opt)
        calls[layers] = (sum(kind == "adam" for kind, _ in log.ops), len(list(model.parameters())))
    assert calls[2][0] == calls[4][0] == 2 and calls[4][1] > calls[2][1] > 2, calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_split_is_pinned_and_matches_the_estimator():
    """On a GPU: ZeRO-2 with the optimizer offloaded keeps 2Ψ + 4Ψ/Nd on the device (Nd = 1 here: params and fp32
    gradients) and master + moments (12Ψ) and the fp32 gradient copy (4Ψ) pinned in host memory, as the
    estimator says."""
    from megazero.config.schema import ModelConfig, OptimizerConfig, ZeroConfig
    from megazero.distributed.group import Group
    from megazero.model.gpt import GPT, init_parameters
    from megazero.zero import ZeroOptimizer

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=512)
    model = GPT(cfg)
    init_parameters(model, 0)
    model.cuda()
    psi = sum(p.numel() for p in model.parameters())
    opt = ZeroOptimizer(model, ZeroConfig(stage=2, offload_optimizer="cpu", offload_optimizer_pin_memory=True),
                        OptimizerConfig(), Group("solo", [0], None, device="cuda"), precision="bf16")
    x = torch.randint(0, 512, (2, 32), device="cuda")
    opt.zero_grad()
    opt.backward(model(x, x).sum() / x.numel())
    opt.step(1e-3)
    m = opt.model_state_bytes()
    host = [opt.master, opt.exp_avg, opt.exp_avg_sq, opt._host_grads]  # + the fp32 gradient copy Adam reads
    assert all(t.device.type == "cpu" and t.is_pinned() for t in host)
    assert m["offloaded_bytes"] == _nbytes(*host)
    est = model_state_bytes(psi, 2, 1, "bf16", offload_optimizer=True)
    device = sum(m[k] for k in ("params_bytes", "grads_bytes", "master_params_bytes",
                                "optimizer_states_bytes")) - m["offloaded_bytes"]
    for got, want in ((m["offloaded_bytes"], est.offloaded), (device, est.device)):
        assert abs(got - want) <= 0.01 * want + 64, (m, est)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pipelined_offload_equals_one_sub_group_without_staging():
    """On a GPU, pinned: the pipelined step (sub-groups of 3000 elements, gradient copies on the side stream, the
    copy-back cast on the host through the pinned staging chunks) against one sub-group copied straight back
    (cast on the GPU), bf16: the same host
    arithmetic, so a chunk read before its copy landed (or a staging chunk overwritten before its copy left)
    would show as a difference in the parameters after 3 steps."""
    from megazero.config.schema import ModelConfig, OptimizerConfig, ZeroConfig
    from megazero.distributed.group import Group
    from megazero.model.gpt import GPT, init_parameters
    from megazero.zero import ZeroOptimizer

    models = []
    for chunk, stage_out in ((3000, True), (1 << 30, False)):
        model = GPT(ModelConfig(num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=512))
        init_parameters(model, 0)
        model.cuda()
        opt = ZeroOptimizer(model, ZeroConfig(stage=2, offload_optimizer="cpu", offload_optimizer_pin_memory=True),
                            OptimizerConfig(clip_grad=0.05), Group("solo", [0], None, device="cuda"),
                            precision="bf16")
        opt.host.chunk, opt.host.stage_out = chunk, stage_out
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randint(0, 512, (2, 32), generator=gen).cuda()
            opt.zero_grad()
            opt.backward(model(x, x).sum() / x.numel())
            opt.step(1e-2)
        torch.cuda.synchronize()
        assert len(opt.host._out) == (2 if stage_out else 0)
        models.append(model)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a, b), name
