"""ZeRO-Offload's one-step delayed parameter update (``--offload-delayed-update``, megazero/zero/offload.py).

The host memory is emulated on the CPU (``device_io.EmulatedHost``, as in tests/test_offload.py). Checked:
parity with an independent plain-PyTorch reference that applies each step's AdamW update one step late (and a
negative control: the undelayed reference does not match); the flush (parameters, moments and step count of one
step, and a checkpoint resumed mid-run that trains exactly like the uninterrupted run); the overlap itself,
from timestamps taken inside the host Adam calls and around the next step's backward, with DPU off as the
negative control; a host Adam that raises on one rank of two raises the same error on both (none hangs), at dp 2
and at dp 1 x tp 2 (the flags cross the model-parallel group); an fp16 overflow-skip step lands a pending update
with no all-reduce beyond its norm's; stage 0 is refused; and the thread's intra-op threads (one fewer where a GPU
is the device).
"""

from __future__ import annotations

import contextlib
import copy
import re
import threading
import time

import pytest
import torch

from megazero.config.cli import parse_args
from megazero.config.errors import ConfigError
from megazero.config.schema import ModelConfig, OptimizerConfig, ZeroConfig
from megazero.distributed import device_io
from megazero.distributed.group import Group
from megazero.model.gpt import GPT, init_parameters
from tests.common import normwise_error, train_runs
from tests.dist import run_world

OPT = OptimizerConfig(clip_grad=0.05)
LR = 1e-2


def _model(device: str = "cpu") -> GPT:
    model = GPT(ModelConfig(num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=512))
    init_parameters(model, 0)
    return model.to(device)


def _optimizer(model: GPT, delayed_after: int | None, device: str = "cpu"):
    """ZeRO-2 with the optimizer offloaded (pinned on CUDA), the delayed update after ``delayed_after`` steps."""
    from megazero.zero import ZeroOptimizer

    zero = ZeroConfig(stage=2, offload_optimizer="cpu", offload_delayed_update=delayed_after is not None,
                      offload_delayed_update_after=delayed_after or 0, offload_optimizer_pin_memory=device == "cuda")
    return ZeroOptimizer(model, zero, OPT, Group("solo", [0], None, device=device))


def _batches(steps: int, device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (2, 32), generator=gen).to(device) for _ in range(steps)]


def _loss(model, x: torch.Tensor) -> torch.Tensor:
    return model(x, x).sum() / x.numel()


def _reference(steps: int, delayed_after: int | None, device: str = "cpu"
               ) -> tuple[list[float], GPT, GPT, torch.optim.AdamW]:
    """Plain PyTorch: ``torch.optim.AdamW`` (decay on matrices only) and ``clip_grad_norm_`` on a master copy; the
    forward copy is the master after each update, or (delayed steps: step s > delayed_after) the master before
    it, so step s + 1's gradient is taken at θ_{s-1}. Returns the norms, the forward copy, the master, the Adam."""
    fwd, master = _model(device), _model(device)
    params = list(master.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": OPT.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    adam = torch.optim.AdamW(groups, lr=LR, betas=OPT.betas, eps=OPT.eps, foreach=False)
    norms = []
    for s, x in enumerate(_batches(steps, device), start=1):
        fwd.zero_grad()
        _loss(fwd, x).backward()
        before = copy.deepcopy(master.state_dict())
        for p, q in zip(master.parameters(), fwd.parameters()):
            p.grad = q.grad.clone()
        norms.append(float(torch.nn.utils.clip_grad_norm_(master.parameters(), OPT.clip_grad)))
        adam.step()
        late = delayed_after is not None and s > delayed_after
        fwd.load_state_dict(before if late else master.state_dict())
    return norms, fwd, master, adam


def _state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().float() for n, p in model.named_parameters()}


def _train(steps: int, delayed_after: int | None, hook=None, device: str = "cpu"):
    """megazero's ZeRO-2 with the optimizer offloaded to (on the CPU: emulated) host memory, ``steps`` steps;
    ``hook(s)`` runs just before step s's backward. Returns norms, model, optimizer, unflushed."""
    host = device_io.use(device_io.EmulatedHost("cpu")) if device == "cpu" else contextlib.nullcontext()
    with host:
        model = _model(device)
        opt = _optimizer(model, delayed_after, device)
        norms = []
        for s, x in enumerate(_batches(steps, device), start=1):
            opt.zero_grad()
            loss = _loss(model, x)
            if hook is not None:
                hook(s)
            opt.backward(loss)
            norms.append(opt.step(LR).grad_norm)
    return norms, model, opt


@pytest.mark.parametrize("after", [0, 2])
def test_delayed_update_matches_plain_adamw_applied_one_step_late(after):
    """fp32, 5 steps, clipping active, the delay from step 1 or after 2 synchronous steps: every gradient norm and
    the parameters equal the late-applying reference; before the flush the device parameters are the reference's
    forward copy (θ_4), after it its master (θ_5), with the moments and step count of step 5. The undelayed
    reference is far off (the negative control)."""
    steps = 5
    norms, model, opt = _train(steps, after)
    ref_norms, fwd, master, adam = _reference(steps, after)
    assert opt.host.pending
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    stale = normwise_error(_state(model), _state(fwd))
    assert stale < 1e-5, stale
    assert normwise_error(_state(model), _state(master)) > 1e-3  # the last update has not landed yet
    owned = opt.state_dict()["owned"]  # a state read flushes first
    assert not opt.host.pending and opt.step_count == steps
    err = normwise_error(_state(model), _state(master))
    assert err < 1e-5, err
    moments = {n: adam.state[p]["exp_avg"].reshape(-1) for n, p in master.named_parameters()}
    values = {n: p.detach().reshape(-1) for n, p in master.named_parameters()}
    names = {p: n for n, p in model.named_parameters()}
    got, want = {}, {}  # this rank's runs of master and exp_avg against the reference's same elements
    for i, (p, offset, views) in enumerate(owned):
        n, size = names[p], views["master"].numel()
        got[f"m{i}"], want[f"m{i}"] = views["master"], values[n][offset: offset + size]
        got[f"v{i}"], want[f"v{i}"] = views["exp_avg"], moments[n][offset: offset + size]
    for kind in "mv":
        err = normwise_error({k: v for k, v in got.items() if k[0] == kind},
                             {k: v for k, v in want.items() if k[0] == kind})
        assert err < 1e-5, (kind, err)
    _, _, undelayed, _ = _reference(steps, None)
    assert normwise_error(_state(model), _state(undelayed)) > 1e-3


def test_host_adam_runs_while_the_next_step_computes():
    """Measured from inside: each host Adam call records its thread and its start and end time; the test records
    when each step's backward starts. The Adam of a delayed step t waits (up to 20 s) for step t + 1's backward to
    start, so it can only finish if the main thread went on without it. With DPU every update of steps 1-3 ran on
    another thread and spans the start of the next step's backward (the thread read the gradients copied to the
    host while that backward rewrote the device ones: parity holds); with DPU off (the negative control) every
    call ran on the main thread and ended before the next step's forward."""
    main = threading.main_thread().ident
    for delayed in (True, False):
        spans, backward_at, (norms, model) = _timed_run(steps := 4, delayed)
        assert sorted(spans) == list(range(1, steps + 1))
        for t in range(1, steps):
            first, last = min(a for _, a, _ in spans[t]), max(b for _, _, b in spans[t])
            threads = {i for i, _, _ in spans[t]}
            if delayed:
                assert main not in threads and first < backward_at[t + 1] < last, (t, spans[t], backward_at)
            else:
                assert threads == {main} and last < backward_at[t + 1], (t, spans[t], backward_at)
        if delayed:
            ref_norms, _, master, _ = _reference(steps, 0)
            assert norms == pytest.approx(ref_norms, rel=1e-5)
            assert normwise_error(_state(model), _state(master)) < 1e-5


def _timed_run(steps: int, delayed: bool):
    """:func:`_train` with the host Adam calls timed from inside (thread, start, end per call, by step) and each
    step's backward start recorded; a delayed step's Adam first waits for the next step's backward to start."""
    from megazero.zero import optimizer as zero_optimizer

    real = zero_optimizer.adam_update
    spans: dict[int, list[tuple[int, float, float]]] = {}
    backward_at: dict[int, float] = {}
    started = threading.Condition()

    def hook(s: int) -> None:
        with started:
            backward_at[s] = time.perf_counter()
            started.notify_all()

    def spy(p, g, lr, lo, hi, **kw):
        t0, step = time.perf_counter(), kw["step"]
        if threading.current_thread() is not threading.main_thread():
            with started:  # the last step's update has no next backward: the flush joins it
                started.wait_for(lambda: step + 1 in backward_at or step == steps, timeout=20)
        real(p, g, lr, lo, hi, **kw)
        spans.setdefault(step, []).append((threading.get_ident(), t0, time.perf_counter()))

    zero_optimizer.adam_update = spy
    try:
        norms, model, opt = _train(steps, 0 if delayed else None, hook)
        opt.flush()
    finally:
        zero_optimizer.adam_update = real
    return spans, backward_at, (norms, model)


def test_a_skipped_fp16_step_lands_the_pending_update_and_launches_none():
    """fp16 loss scaling with the delay: step 3's loss is made infinite, so its norm is not finite before anything
    is launched; the step is skipped on the host's read, launches no update (the step count stays at 2), and the
    pending update of step 2 lands (the device parameters are the master rounded to fp16); training goes on."""
    from megazero.zero import ZeroOptimizer

    with device_io.use(device_io.EmulatedHost("cpu")):
        model = _model()
        zero = ZeroConfig(stage=2, offload_optimizer="cpu", offload_delayed_update=True)
        opt = ZeroOptimizer(model, zero, OPT, Group("solo", [0], None), precision="fp16")
        for s, x in enumerate(_batches(5), start=1):
            opt.zero_grad()
            loss = _loss(model, x)
            opt.backward(loss * float("inf") if s == 3 else loss)
            stats = opt.step(LR)
            assert stats.skipped == (s == 3) and opt.host.pending == (s != 3), s
            if s == 3:
                assert opt.step_count == 2
                for p, offset, views in opt.state.owned():
                    flat = p.detach().reshape(-1)[offset: offset + views["master"].numel()]
                    assert torch.equal(flat, views["master"].to(p.dtype))
        opt.flush()
    assert opt.step_count == 4 and all(torch.isfinite(p).all() for p in model.parameters())


def test_delayed_update_needs_offload_optimizer(tmp_path):
    base = ["--zero-stage", "2", "--offload-delayed-update", "--cache-dir", str(tmp_path)]
    with pytest.raises(ConfigError, match="--offload-delayed-update.*--offload-optimizer"):
        parse_args(base).resolve(1)
    with pytest.raises(ConfigError, match="--offload-delayed-update-after must be >= 0"):
        parse_args([*base, "--offload-optimizer", "--offload-delayed-update-after", "-1"]).resolve(1)
    cfg = parse_args([*base, "--offload-optimizer", "--offload-delayed-update-after", "3"]).resolve(1)
    assert cfg.zero.offload_delayed_update and cfg.zero.offload_delayed_update_after == 3


DPU = ["--dp", "2", "--micro-batch-size", "4", "--zero-stage", "2", "--offload-optimizer",
       "--offload-delayed-update", "--train-steps", "6"]


def _resume_runs(ctx, cache: str, log_dir: str):
    """Three runs of 6 delayed-update steps at dp 2 (each with an evaluation, so the eval flush runs): one saving
    at step 3, one resumed from that checkpoint, and one without the delay."""
    ckpt = f"{log_dir}/ckpt"
    eval_flags = ["--eval-interval", "2", "--eval-iters", "1"]
    whole = train_runs(ctx, [[*DPU, *eval_flags, "--save", ckpt, "--save-interval", "3"]], cache, f"{log_dir}/a")
    resumed = train_runs(ctx, [[*DPU, *eval_flags, "--load", f"{ckpt}/step_00000003"]], cache, f"{log_dir}/b")
    plain = train_runs(ctx, [[*DPU[:-3], "--train-steps", "6", *eval_flags]], cache, f"{log_dir}/c")
    return whole[0], resumed[0], plain[0]


def test_checkpoint_mid_run_holds_one_step_and_resumes_exactly(data_cache, tmp_path):
    """At dp 2 (ZeRO-2, the parameters all-gathered after each landing): a run saving at step 3 flushes there, so a
    run resumed from that checkpoint trains steps 4-6 exactly like the uninterrupted one (losses and final weights
    equal); without the flush the checkpoint would hold θ_2's parameters beside θ_3's master, or a master being
    written. The same run without the delay ends elsewhere (the delay is in force)."""
    (whole, whole_state), (resumed, resumed_state), (plain, plain_state) = run_world(
        _resume_runs, 2, data_cache, str(tmp_path))[0]
    assert len(whole) == 6 and len(resumed) == 3
    assert resumed == whole[3:]
    assert all(torch.equal(whole_state[k], resumed_state[k]) for k in whole_state)
    assert normwise_error(whole_state, plain_state) > 1e-4


def test_gpu_bench_offload_delayed_run_and_its_summary_line(subprocess_env, tmp_path):
    """bench/gpu.py --offload optimizer --offload-delayed-update 1 (bench/gpu_check.sh's offload-dpu step) trains on
    the CPU: with the same batch every step, step 3's forward sees θ_1 as step 2's did (step 2's update is still
    on the host thread), so their losses are equal and step 4's differs; the split is the wait for the host Adam,
    the copies and the rest; bench/gpu_summary.py prints the run as a second offload line."""
    from bench.gpu_summary import summary
    from tests.test_bench_gpu import SMOKE, _run

    out = tmp_path / "offload-dpu.json"
    res = _run("gpu.py", ["--offload", "optimizer", "--offload-delayed-update", "1", *SMOKE, "--warmup", "2"],
               subprocess_env, out)
    run, split = res["megazero"], res["megazero"]["offload_split"]
    losses = run["losses"]
    assert len(losses) == 4 and losses[1] == losses[2] != losses[3] and losses[0] != losses[1], losses
    assert set(split) == {"host_adam_wait_s", "copies_and_launch_s", "device_compute_and_rest_s"}
    assert res["delayed_update_after"] == 1
    text = summary(str(tmp_path))
    assert "offload (offload.json): no result" in text
    assert "offload optimizer delayed update after 1: 2 x 128" in text and "host_adam_wait" in text, text


def _failing_runs(ctx, cases: list[tuple[tuple[int, ...], int, int]]) -> list[dict]:
    """On each rank, per case ``(failing ranks, step, steps)``: ZeRO-2 with the delayed update over the DP group
    (and the model-parallel group, as the recipe passes them), ``steps`` steps and a flush, the host Adam of
    ``step`` raising MemoryError on the failing ranks' threads. Records where an error came (the step, or the
    flush), its type (``DelayedUpdateError`` expected), message and cause, and what a second flush did after it."""
    from megazero.zero import ZeroOptimizer
    from megazero.zero import optimizer as zero_optimizer

    real, out = zero_optimizer.adam_update, []
    for ranks, bad_step, steps in cases:
        def failing(p, g, lr, lo, hi, *, _ranks=ranks, _step=bad_step, **kw):
            if kw["step"] == _step and ctx.rank in _ranks and threading.current_thread() is not threading.main_thread():
                raise MemoryError("injected: the host ran out of memory")
            return real(p, g, lr, lo, hi, **kw)

        zero_optimizer.adam_update = failing
        try:
            with device_io.use(device_io.EmulatedHost("cpu")):
                model = _model()
                zero = ZeroConfig(stage=2, offload_optimizer="cpu", offload_delayed_update=True)
                opt = ZeroOptimizer(model, zero, OPT, ctx.dp_cp_group, norm_group=ctx.mp_group)
                res: dict = {"at": None}
                try:
                    for s, x in enumerate(_batches(steps), start=1):
                        res["at"] = s
                        opt.zero_grad()
                        opt.backward(_loss(model, x))
                        opt.step(LR)
                    res["at"] = "flush"
                    opt.flush()
                    res["at"] = None  # (no error)
                except Exception as e:  # (any error: a rank that raised another must not stop the world early)
                    res.update(error=type(e).__name__, message=str(e),
                               cause=type(e.__cause__).__name__ if e.__cause__ else None)
                res["pending"], res["second_flush"] = opt.host.pending, opt.flush()
                out.append(res)
        finally:
            zero_optimizer.adam_update = real
    return out


def test_a_host_adam_failing_on_one_rank_raises_on_every_rank():
    """2 gloo ranks, ZeRO-2 with the delayed update; MemoryError injected into the host Adam threads of: rank 0 at
    step 2 (every rank raises in step 3, before the parameters' all-gather), rank 1 at the last step (every rank
    raises in the end's flush), both ranks at step 1. Each time both ranks raise DelayedUpdateError at the same
    place, naming the failing ranks, the step and --offload-delayed-update, the failing rank's chained to its
    MemoryError; the update is dropped, so a second flush does nothing. The world's timeout (60 s) is far below the
    collectives' (600 s): a rank left waiting fails the test. With the agreement broken (no flag set), the healthy
    rank waited in the all-gather until the world timed out."""
    cases = [((0,), 2, 4), ((1,), 3, 3), ((0, 1), 1, 2)]
    per_rank = run_world(_failing_runs, 2, cases, timeout=60, dist_timeout=600)
    for k, (ranks, step, _) in enumerate(cases):
        got = [per_rank[r][k] for r in (0, 1)]
        where = "flush" if k == 1 else step + 1
        which = f"failed on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} ("
        for r, res in enumerate(got):
            assert res["at"] == where and res["error"] == "DelayedUpdateError", (k, r, res)
            assert which in res["message"] and f"optimizer step {step} " in res["message"], (k, r, res)
            assert "--offload-delayed-update" in res["message"], res
            assert res["cause"] == ("MemoryError" if r in ranks else None), (k, r, res)
            assert not res["pending"] and res["second_flush"] is False, (k, r, res)
        same = [re.sub(r" \((this rank's error|see the log)[^)]*\)", "", res["message"]) for res in got]
        assert same[0] == same[1] and "this rank's" not in same[0], same


def _model_parallel_runs(ctx) -> dict:
    """On a dp 1 x tp 2 world (DP collectives are no-ops, so only the model-parallel group carries the flags): rank
    0's host Adam failing at step 2 of 3 (:func:`_failing_runs`), and an fp16 run with the delay whose step 2
    overflows while step 1's update is pending: the all-reduces that step made, counted in the ledger by tag."""
    from megazero.zero import ZeroOptimizer

    out = {"failing": _failing_runs(ctx, [((0,), 2, 3)])}
    with device_io.use(device_io.EmulatedHost("cpu")):
        model = _model()
        zero = ZeroConfig(stage=2, offload_optimizer="cpu", offload_delayed_update=True)
        opt = ZeroOptimizer(model, zero, OPT, ctx.dp_cp_group, norm_group=ctx.mp_group, precision="fp16")
        ledgers = list({id(g.ledger): g.ledger for g in (ctx.dp_cp_group, ctx.mp_group)}.values())
        for s, x in enumerate(_batches(3), start=1):
            opt.zero_grad()
            loss = _loss(model, x)
            opt.backward(loss * float("inf") if s == 2 else loss)
            before = [dict(ledger.calls) for ledger in ledgers]
            stats = opt.step(LR)
            if s == 2:
                out["skipped"], out["landed"] = stats.skipped, not opt.host.pending
                out["all_reduces"] = {tag: n - b.get((g, op, tag), 0) for ledger, b in zip(ledgers, before)
                                      for (g, op, tag), n in ledger.calls.items()
                                      if op == "all_reduce" and n > b.get((g, op, tag), 0)}
        opt.flush()
    return out


def test_failure_flags_cross_the_model_parallel_group_and_a_skipped_step_adds_no_all_reduce():
    """dp 1 x tp 2: rank 0's host Adam fails at step 2, and both ranks raise DelayedUpdateError in step 3, naming rank
    0 (the flags crossed the model-parallel group: with them summed over DP only, rank 1 went on alone). An fp16
    overflow-skip step with an update pending lands it on the flags its norm carried: its only all-reduce is the
    norm's (the agreement of a flush, one more all-reduce and host read, is not repeated there)."""
    per_rank = run_world(_model_parallel_runs, 2, tp=2, timeout=60, dist_timeout=600)
    for r, res in enumerate(per_rank):
        fail = res["failing"][0]
        assert fail["at"] == 3 and fail["error"] == "DelayedUpdateError", (r, fail)
        assert "failed on rank 0 (" in fail["message"] and "optimizer step 2 " in fail["message"], (r, fail)
        assert fail["cause"] == ("MemoryError" if r == 0 else None), (r, fail)
        assert res["skipped"] and res["landed"], (r, res)
        assert res["all_reduces"] == {"norm": 1}, (r, res)


def test_the_delayed_update_needs_sharded_optimizer_states():
    """A ZeroOptimizer built directly (not through config/resolve.py) at stage 0 with the delay refuses it: the
    failure flags ride on the norm's all-reduce over DP, which stage 0 does not make."""
    from megazero.zero import ZeroOptimizer

    zero = ZeroConfig(stage=0, offload_optimizer="cpu", offload_delayed_update=True)
    with device_io.use(device_io.EmulatedHost("cpu")), pytest.raises(ValueError, match="needs ZeRO stage 1-3"):
        ZeroOptimizer(_model(), zero, OPT, Group("solo", [0], None))


def test_the_delayed_update_thread_leaves_a_core_where_a_gpu_is_the_device(monkeypatch):
    """Measured inside the host Adam calls (torch's intra-op threads there), with host_threads() at 3: where a GPU
    is the device, the delayed updates' thread runs on 2 and the synchronous first step on the main thread on 3;
    on the CPU device (the negative control) the thread runs on all 3."""
    from megazero.zero import offload
    from megazero.zero import optimizer as zero_optimizer

    monkeypatch.setattr(offload, "host_threads", lambda: 3)
    real = zero_optimizer.adam_update
    seen: list[tuple[bool, int]] = []

    def spy(p, g, lr, lo, hi, **kw):
        seen.append((threading.current_thread() is threading.main_thread(), torch.get_num_threads()))
        return real(p, g, lr, lo, hi, **kw)

    monkeypatch.setattr(zero_optimizer, "adam_update", spy)
    before = torch.get_num_threads()
    for gpu, want in ((True, 2), (False, 3)):
        seen.clear()
        with device_io.use(device_io.EmulatedHost("cpu")):
            model = _model()
            opt = _optimizer(model, 1)
            opt.host.gpu = gpu  # (what a CUDA device sets: the thread count is all this test reads)
            for x in _batches(3):
                opt.zero_grad()
                opt.backward(_loss(model, x))
                opt.step(LR)
            opt.flush()
        assert seen and {n for main, n in seen if main} == {3}, (gpu, seen)
        assert {n for main, n in seen if not main} == {want}, (gpu, seen)
    assert torch.get_num_threads() == before


SIDE_STREAM_SLEEP = 400_000_000  # GPU clock cycles (torch.cuda._sleep) before each gradient copy: ~0.2 s on an H100


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pinned_delayed_update_matches_the_late_reference(monkeypatch):
    """On a GPU, pinned (the gradients' copy on the side stream, the thread waiting on its event and on the
    copy-back's; the compute stream waiting for the gradients before the next backward), fp32 with TF32 off,
    sub-groups of 3000 elements: the same parity with the late-applying plain reference, run on the GPU too. The
    races are made wide: each host Adam is held back 50 ms (the device's next step runs meanwhile), and the side
    stream sleeps ~0.2 s before each gradient copy (torch.cuda._sleep), so a thread reading the host buffer before
    the copy's event, or a next backward not waiting for the side stream, sees old or overwritten gradients. The
    negative control drops the copy's event from the thread's waits: it reads the buffer after 50 ms, before the
    copy, and the parameters must differ from the reference."""
    from megazero.zero import offload
    from megazero.zero import optimizer as zero_optimizer

    monkeypatch.setattr(offload, "SUB_GROUP", 3000)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    real, real_issue = zero_optimizer.adam_update, offload.HostOffload._issue
    wait_for_copy = [True]

    def held_back(p, g, lr, lo, hi, **kw):
        if lo == 0 and threading.current_thread() is not threading.main_thread():
            time.sleep(0.05)
        return real(p, g, lr, lo, hi, **kw)

    def slow_issue(self, g, lo, hi, first):
        if self.pin:  # the side stream sleeps first, so the copy behind it lands late
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            with torch.cuda.stream(self._stream):
                torch.cuda._sleep(SIDE_STREAM_SLEEP)
        event = real_issue(self, g, lo, hi, first)
        return event if wait_for_copy[0] else None  # (None: the thread does not wait for the copy)

    monkeypatch.setattr(zero_optimizer, "adam_update", held_back)
    monkeypatch.setattr(offload.HostOffload, "_issue", slow_issue)
    steps = 5
    ref_norms, _, master, _ = _reference(steps, 0, device="cuda")
    for wait in (True, False):
        wait_for_copy[0] = wait
        norms, model, opt = _train(steps, 0, device="cuda")
        assert opt.host.pin and opt.host.pending and opt.master.is_pinned() and opt.owned_numel // 3000 > 40
        opt.flush()
        torch.cuda.synchronize()
        err = normwise_error(_state(model), _state(master))
        if wait:
            assert norms == pytest.approx(ref_norms, rel=1e-5)
            assert err < 1e-5, err
        else:  # (NaN counts as a difference: the first step's buffer was never written when it was read)
            assert not err < 1e-5, err
