"""Single-GPU throughput: megazero against a plain PyTorch model of the same shapes (bench/plain_gpt.py for GPT-2,
bench/plain_llama.py for Llama), in the same run.

    python bench/gpu.py --model gpt2-1.3b                       # one model per call (each well under 10 min)
    python bench/gpu.py --model gpt2-124m --micro-batch-size 16 # a fixed micro-batch instead of the search
    python bench/gpu.py --model llama-3.2-1b --micro-batch-size 1
    python bench/gpu.py --offload optimizer                     # largest GPT trainable with ZeRO-Offload
    python bench/gpu.py --offload optimizer --offload-layers 4  #   ... or a GPT of 4 x 4096 layers, quicker
    python bench/gpu.py --offload all                           #   ... with optimizer + parameter offload
    python bench/gpu.py --offload optimizer --offload-delayed-update 1  # the host Adam beside the next step (DPU)
    python bench/gpu.py --device cpu --model tiny --steps 2     # CPU smoke run (tests/test_bench_gpu.py)
    python bench/gpu.py --summary OUTDIR                        # the table of bench/gpu_check.sh's results

Prints the GPU's name and torch version, a bf16 matmul ceiling measured on the spot (8192^3, median of 10),
then for megazero and for the plain model: micro-batch, median step time, tokens/s, model TFLOP/s per GPU
(Megatron-LM's FLOPs count for the model's shape, megazero.observe.flops), MFU against the card's dense bf16 peak
(megazero.observe.flops.PEAK_FLOPS) and against the measured ceiling, peak device memory and, for megazero, the
memory estimator's figure (megazero/plan/estimate.py). The micro-batch is the largest power of two the estimator
says fits in 90% of the device, lowered by halving on out-of-memory; both models use the one megazero ran.
``--json`` writes every figure. ``--offload`` sizes a GPT (hidden 4096, 32 heads, layers grown) to the
largest the estimator says fits the host memory (fp32 master + Adam moments + an fp32 gradient copy:
16 bytes per parameter) and the device (or takes ``--offload-layers``), trains it a few steps, states that host
bound and splits each step into the device's compute, the gradients' copy to the host and the host Adam with
the parameters' copy back (timed around megazero.zero.offload.HostOffload's two calls, with a device
synchronisation before each, so the split costs a little overlap). With ``--offload-delayed-update AFTER`` (the
one-step delayed update after AFTER synchronous steps) the split is the wait for the previous step's host Adam
(the part the device's step did not hide) and the copies (gradients to the host, parameters back) with the
thread's start.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import NoReturn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.plain_gpt import PlainGPT, make_optimizer  # noqa: E402
from bench.plain_llama import PlainLlama  # noqa: E402
from megazero.config.cli import parse_args  # noqa: E402
from megazero.config.schema import ModelConfig, model_preset  # noqa: E402
from megazero.distributed.context import ParallelContext, RankGrid  # noqa: E402
from megazero.distributed.launch import init_distributed  # noqa: E402
from megazero.observe.flops import flops_shape, megatron_model_flops, peak_flops_per_device  # noqa: E402
from megazero.plan.estimate import activation_bytes, model_state_bytes, padded_vocab_size  # noqa: E402
from megazero.train.engine import Engine  # noqa: E402

HOST_BYTES_PER_PARAM = 16  # offload: fp32 master 4 + Adam moments 8 + the fp32 gradient partition copy 4
MODELS = ("tiny", "llama-tiny", "gpt2-124m", "gpt2-350m", "gpt2-760m", "gpt2-1.3b", "llama-3.2-1b")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_ceiling(device: torch.device) -> float:
    """Measured matmul FLOP/s: bf16 8192^3 on CUDA (fp32 512^3 on CPU), median of 10 after 3 warm-ups."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    times = []
    for i in range(13):
        _sync(device)
        t = time.perf_counter()
        a @ b
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def _batch(b: int, s: int, vocab: int, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (b, s + 1), generator=g)
    if device.type == "cuda":
        x = x.pin_memory()
    return x[:, :-1], x[:, 1:]


def _timed(step, n_warmup: int, n_steps: int, device: torch.device) -> tuple[list[float], list[float]]:
    """(losses, step seconds) of ``n_warmup`` untimed and ``n_steps`` timed calls of ``step``."""
    losses, times = [], []
    for i in range(n_warmup + n_steps):
        _sync(device)
        t = time.perf_counter()
        loss = step()
        _sync(device)
        if i >= n_warmup:
            times.append(time.perf_counter() - t)
        losses.append(loss)
    return losses, times


def _flags(model: str, m: ModelConfig, micro: int, precision: str, compile_: bool, extra: list[str]) -> list[str]:
    """The run's flags: the preset, then every shape field of ``m`` (the vocabulary too: the batches draw ids
    up to ``m.vocab_size``, whatever the preset's own)."""
    return ["--model", model, "--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
            "--num-heads", str(m.num_heads), "--seq-len", str(m.seq_len), "--vocab-size", str(m.vocab_size),
            "--micro-batch-size", str(micro),
            "--precision", precision, "--compile" if compile_ else "--no-compile", "--lr", "1e-4",
            "--train-steps", "1000", "--clip-grad", "1.0", *extra]


class OffloadSplit:
    """Seconds per step inside ZeRO-Offload's two host calls, :class:`megazero.zero.offload.HostOffload`'s
    ``owned_grads`` (the reduced gradients copied to the host) and ``adam`` (Adam on the host master, each updated
    chunk copied back to the device parameters), patched for the duration of a ``with`` block. Each call starts
    after a device synchronisation, so the device's compute is not counted in it, and ends with one."""

    CALLS = {"owned_grads": "copy_to_host_s", "adam": "host_adam_and_copy_back_s"}
    # --offload-delayed-update: the wait for the previous step's host Adam (the part the device's step did not
    # hide), then adam(): the gradients' copy to the host, the parameters' copy back and the thread's start
    DELAYED = {"settle": "host_adam_wait_s", "adam": "copies_and_launch_s"}  # (settle: joined before the norm)

    def __init__(self, device: torch.device, delayed: bool = False) -> None:
        self.device = device
        self.CALLS = self.DELAYED if delayed else self.CALLS
        self.totals = dict.fromkeys(self.CALLS.values(), 0.0)
        self.steps: list[dict[str, float]] = []
        self._saved: dict[str, object] = {}

    def __enter__(self) -> OffloadSplit:
        from megazero.zero import offload

        for name, key in self.CALLS.items():
            fn = getattr(offload.HostOffload, name, None)
            if fn is not None:  # a reworked offload may have renamed them: the split is then left out
                self._saved[name] = fn
                setattr(offload.HostOffload, name, self._timed(fn, key))
        return self

    def _timed(self, fn, key: str):
        def call(host, *a, **k):
            _sync(self.device)
            t = time.perf_counter()
            out = fn(host, *a, **k)
            _sync(self.device)
            self.totals[key] += time.perf_counter() - t
            return out
        return call

    def end_step(self) -> None:
        self.steps.append(dict(self.totals))
        self.totals = dict.fromkeys(self.CALLS.values(), 0.0)

    def __exit__(self, *exc) -> None:
        from megazero.zero import offload

        for name, fn in self._saved.items():
            setattr(offload.HostOffload, name, fn)

    def summary(self, step_s: list[float]) -> dict | None:
        """Medians over the timed steps (the last ``len(step_s)``): each call's seconds and the rest, the device's
        compute (forward, backward, gradient reduction) and Python."""
        if not self._saved:
            return None
        steps = self.steps[-len(step_s):]
        out = {key: statistics.median(s[key] for s in steps) for key in self.CALLS.values()}
        out["device_compute_and_rest_s"] = statistics.median(t - sum(s.values()) for t, s in zip(step_s, steps))
        return out


def run_megazero(ctx, model: str, m: ModelConfig, micro: int, args, device: torch.device, extra=(),
                 split: OffloadSplit | None = None, accumulation: int = 1) -> dict:
    """megazero's step timed: ``accumulation`` micro-batches of ``micro`` sequences per optimizer step."""
    extra = [*extra, "--global-batch-size", str(micro * accumulation)]
    cfg = parse_args(_flags(model, m, micro, args.precision, args.compile, extra))
    cfg = cfg.resolve(1, device_type=device.type)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    engine = Engine(cfg, ctx, device)
    build_s = time.perf_counter() - t0
    batch = [_batch(micro, m.seq_len, m.vocab_size, device, seed=i) for i in range(accumulation)]

    def step() -> float:
        loss = engine.train_step(batch, measure=False).loss  # as the trainer between logged steps
        if split is not None:
            split.end_step()
        return loss

    losses, times = _timed(step, args.warmup, args.steps, device)
    z = cfg.zero
    numels = [p.numel() for p in engine.model.parameters()]
    states = model_state_bytes(numels, z.stage, 1, cfg.training.precision,
                               offload_optimizer=z.offload_optimizer == "cpu", offload_param=z.offload_param == "cpu")
    est = states.device + activation_bytes(m, micro, precision=cfg.training.precision)
    out = {"micro_batch": micro, "accumulation": accumulation, "losses": losses, "step_s": times, "build_s": build_s,
           "params": sum(numels), "estimate_device_bytes": est, "estimate_host_bytes": states.offloaded,
           "precision": cfg.training.precision, "compile": cfg.training.compile, "seq_len": m.seq_len}
    if split is not None:
        out["offload_split"] = split.summary(times)
    if device.type == "cuda":
        out["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def plain_model(m: ModelConfig) -> torch.nn.Module:
    """The plain PyTorch model of ``m``'s family and shapes."""
    if m.arch == "llama":
        return PlainLlama(m.num_layers, m.hidden_size, m.num_heads, m.kv_heads, m.ffn_hidden_size, m.seq_len,
                          m.vocab_size, tied=m.tied, rope_theta=m.rope_theta, eps=m.layernorm_eps)
    return PlainGPT(m.num_layers, m.hidden_size, m.num_heads, m.seq_len, m.vocab_size)


def run_plain(m: ModelConfig, micro: int, args, device: torch.device) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    model = plain_model(m).to(device)
    opt = make_optimizer(model)
    fwd = torch.compile(model) if args.compile else model
    x, y = _batch(micro, m.seq_len, m.vocab_size, device)
    bf16 = args.precision == "bf16"

    def step() -> float:
        xs, ys = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = fwd(xs, ys)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    losses, times = _timed(step, args.warmup, args.steps, device)
    out = {"micro_batch": micro, "losses": losses, "step_s": times}
    if device.type == "cuda":
        out["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def _speed(res: dict, m: ModelConfig, peak: float | None, ceiling: float) -> dict:
    sec = statistics.median(res["step_s"])
    sequences = res["micro_batch"] * res.get("accumulation", 1)
    flops = megatron_model_flops(sequences, m.seq_len, m.num_layers, m.hidden_size,
                                 padded_vocab_size(m.vocab_size, 1), **flops_shape(m))
    res.update(median_step_s=sec, tokens_per_s=sequences * m.seq_len / sec,
               tflops_per_gpu=flops / sec / 1e12, mfu=flops / sec / peak if peak else None,
               mfu_vs_measured_ceiling=flops / sec / ceiling)
    return res


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def search_micro_batch(ctx, model: str, m: ModelConfig, args, device: torch.device) -> tuple[int, dict]:
    """Largest power of two the estimator fits in 90% of the device, halved on out-of-memory."""
    if args.micro_batch_size:
        return args.micro_batch_size, run_megazero(ctx, model, m, args.micro_batch_size, args, device)
    if device.type != "cuda":  # CPU smoke run: no search
        return 2, run_megazero(ctx, model, m, 2, args, device)
    total = torch.cuda.get_device_properties(device).total_memory
    psi = m.num_parameters()
    states = model_state_bytes(psi, 0, 1, args.precision).total + 2 * psi  # fp32 gradients in bf16
    micro = 1
    while micro < 256 and states + activation_bytes(m, 2 * micro, precision=args.precision) < 0.9 * total:
        micro *= 2
    while True:
        try:
            return micro, run_megazero(ctx, model, m, micro, args, device)
        except Exception as e:  # noqa: BLE001 - an OOM anywhere in the step: halve
            if not _is_oom(e) or micro == 1:
                raise
            print(f"micro-batch {micro}: out of memory, trying {micro // 2}", flush=True)
            micro //= 2
            torch.cuda.empty_cache()


def host_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemTotal"]


def offload_model(mode: str, device: torch.device, args) -> tuple[ModelConfig, dict]:
    """The largest GPT of hidden 4096 / 32 heads / seq 1024 whose offloaded states fit 90% of host memory and
    whose device share (bf16 parameters, fp32 gradients, activations at micro-batch 1) fits 90% of the GPU."""
    if args.device == "cpu":
        base = ModelConfig(num_layers=2, hidden_size=128, num_heads=4, seq_len=128, vocab_size=2000)  # not tiny's
        return base, {"host_bytes": host_memory_bytes(), "layers": 2}
    host, gpu = host_memory_bytes(), torch.cuda.get_device_properties(device).total_memory
    best = None
    for layers in [args.offload_layers] if args.offload_layers else range(1, 400):
        m = ModelConfig(num_layers=layers, hidden_size=4096, num_heads=32, seq_len=1024, vocab_size=50257)
        psi = m.num_parameters()
        st = model_state_bytes(psi, 3 if mode == "all" else 1, 1, "bf16", offload_optimizer=True,
                               offload_param=mode == "all")
        host_need = HOST_BYTES_PER_PARAM * psi + (2 * psi if mode == "all" else 0)
        dev_need = st.device + 2 * psi + activation_bytes(m, 1, precision="bf16")  # + fp32 grads (4 B) vs 2
        if host_need > 0.9 * host or dev_need > 0.9 * gpu:
            break
        best = (m, {"host_bytes": host, "device_bytes": gpu, "layers": layers, "params": psi,
                    "host_need_bytes": host_need, "device_need_bytes": dev_need,
                    "host_bound_params": 0.9 * host / (HOST_BYTES_PER_PARAM + (2 if mode == "all" else 0))})
    if best is None:
        raise RuntimeError("not even one layer fits")
    return best


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2-124m", choices=MODELS)
    p.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: the largest that fits")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--precision", default=None, choices=("bf16", "fp32"), help="default: bf16 on CUDA")
    p.add_argument("--compile", default=None, action=argparse.BooleanOptionalAction, help="default: on CUDA")
    p.add_argument("--no-plain", action="store_true", help="skip the plain PyTorch baseline")
    p.add_argument("--offload", choices=("optimizer", "all"), default=None,
                   help="instead: the largest GPT with optimizer (or optimizer + parameter) offload")
    p.add_argument("--offload-layers", type=int, default=None,
                   help="--offload: this many 4096-wide layers instead of the largest that fits")
    p.add_argument("--offload-delayed-update", type=int, default=None, metavar="AFTER",
                   help="--offload: the one-step delayed parameter update (the host Adam of step t beside the device's "
                        "step t+1), starting after AFTER synchronous steps (default: off)")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="--offload: sequences per optimizer step, by gradient accumulation of --micro-batch-size "
                        "(default 1) micro-batches (default: one micro-batch)")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def setup(args) -> tuple[torch.device, ParallelContext, str]:
    """The device (CUDA with its index: ``torch.cuda.set_device`` wants one on torch 2.11), a world of one
    process (NCCL on CUDA, gloo on the CPU) and the device's name; fills in ``args.precision``/``args.compile``."""
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA device here (use --device cpu --model tiny for a smoke run)")
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device.index)
    args.precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    args.compile = device.type == "cuda" if args.compile is None else args.compile
    os.environ.setdefault("MEGAZERO_COMPILE_BACKEND", "inductor" if device.type == "cuda" else "aot_eager")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}; precision {args.precision}; compile {args.compile}",
          flush=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    init_distributed("nccl" if device.type == "cuda" else "gloo")
    return device, ParallelContext.from_grid(RankGrid(1, 1, 1, 1)), name


def _offload(args, device, ctx, peak: float | None, ceiling: float, out: dict) -> None:
    m, bound = offload_model(args.offload, device, args)
    extra = ["--zero-stage", "3", "--offload-optimizer", "--offload-param"] if args.offload == "all" else \
        ["--zero-stage", "1", "--offload-optimizer"]
    extra += ["--no-compile"] if args.offload == "all" else []
    if args.offload_delayed_update is not None:
        extra += ["--offload-delayed-update", "--offload-delayed-update-after", str(args.offload_delayed_update)]
    print(f"offload {args.offload}: {m.num_layers} layers x {m.hidden_size} = {m.num_parameters() / 1e9:.2f}B parameters;"
          f" host {bound['host_bytes'] / 2**30:.0f} GiB bounds it at "
          f"{bound.get('host_bound_params', 0) / 1e9:.2f}B", flush=True)
    out.update(offload=args.offload, model=vars_of(m), bound=bound, delayed_update_after=args.offload_delayed_update)
    micro = args.micro_batch_size or 1
    accumulation = max(1, (args.global_batch_size or micro) // micro)
    with OffloadSplit(device, delayed=args.offload_delayed_update is not None) as split:
        res = _speed(run_megazero(ctx, "tiny", m, micro, args, device, extra, split=split,
                                  accumulation=accumulation), m, peak, ceiling)
    out["megazero"] = res
    print(f"micro-batch {micro} x {accumulation} accumulated = {micro * accumulation} sequences of {m.seq_len} per step; "
          f"trained {len(res['losses'])} steps, losses {[round(x, 3) for x in res['losses']]}, "
          f"{res['median_step_s']:.2f} s/step, {res['tflops_per_gpu']:.1f} TFLOP/s", flush=True)
    if res.get("offload_split"):
        print("per step: " + ", ".join(f"{k.removesuffix('_s')} {v:.3f} s" for k, v in res["offload_split"].items()),
              flush=True)


def _compare(args, device, ctx, name: str, peak: float | None, ceiling: float, out: dict) -> None:
    m = model_preset(args.model, seq_len=args.seq_len)
    out.update(model=args.model, seq_len=m.seq_len)
    micro, res = search_micro_batch(ctx, args.model, m, args, device)
    out["megazero"] = _speed(res, m, peak, ceiling)
    if not args.no_plain:
        try:
            out["plain"] = _speed(run_plain(m, micro, args, device), m, peak, ceiling)
            out["ratio_tokens_per_s"] = out["megazero"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
        except Exception as e:  # noqa: BLE001 - keep megazero's figures; say what broke
            out["plain_error"] = f"{type(e).__name__}: {e}"
            print(f"plain baseline failed: {out['plain_error']}", flush=True)
    print(f"\n{args.model} on {name}, seq {m.seq_len}, micro-batch {micro}, {args.precision}, torch "
          f"{torch.__version__}\n")
    print("| run | ms/step | tokens/s | TFLOP/s | MFU (datasheet) | MFU (measured matmul) | peak mem GiB | estimate GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for key in ("megazero", "plain"):
        r = out.get(key)
        if r is not None:
            print(f"| {key} | {1e3 * r['median_step_s']:.1f} | {r['tokens_per_s']:,.0f} | {r['tflops_per_gpu']:.1f} | "
                  f"{_pct(r['mfu'])} | {_pct(r['mfu_vs_measured_ceiling'])} | "
                  f"{_gib(r.get('peak_device_bytes'))} | {_gib(r.get('estimate_device_bytes'))} |")
    if "ratio_tokens_per_s" in out:
        print(f"\nmegazero / plain tokens/s: {out['ratio_tokens_per_s']:.3f}")


def main() -> None:
    args = parser().parse_args()
    out: dict = {"torch": torch.__version__}
    try:
        device, ctx, name = setup(args)
        ceiling = matmul_ceiling(device)
        peak = peak_flops_per_device(args.precision, device)
        print(f"matmul ceiling measured: {ceiling / 1e12:.1f} TFLOP/s; datasheet dense peak: "
              f"{peak / 1e12 if peak else float('nan'):.1f} TFLOP/s", flush=True)
        out.update(device=name, precision=args.precision, compile=args.compile, matmul_ceiling_tflops=ceiling / 1e12,
                   peak_tflops=peak / 1e12 if peak else None)
        if args.offload:
            _offload(args, device, ctx, peak, ceiling, out)
        else:
            _compare(args, device, ctx, name, peak, ceiling, out)
    except Exception as e:  # noqa: BLE001 - write what was measured, say what broke, exit non-zero
        finish(out, args.json, e)
    finish(out, args.json)


def finish(out: dict, json_path: str | None, error: BaseException | None = None) -> NoReturn:
    """End a bench process: print ``error``'s traceback and record it in ``out``, write ``out`` to
    ``json_path`` (what was measured survives a failure) and exit, 1 on an error, without process-group
    teardown (its races at exit)."""
    if error is not None:
        traceback.print_exception(error)
        out["error"] = f"{type(error).__name__}: {error}"
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if error is None else 1)


def vars_of(m: ModelConfig) -> dict:
    return {k: getattr(m, k) for k in ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size")}


def _pct(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def _gib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2**30:.2f}"


if __name__ == "__main__":
    main()
