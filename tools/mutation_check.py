"""Mutation check: plant one known bug at a time in a copy of the repository and show a test catches it.

Not part of the default ``pytest`` run. Each mutation names a file, an exact anchor text and its replacement;
if the anchor is gone (the code moved on) the mutation is reported as STALE and the script fails, rather than
silently testing nothing. The copy is ``git archive`` of a ref (default ``HEAD``) under a temporary
directory: no worktree is touched. For each mutation the chosen tests run with ``PYTHONPATH`` set to the copy;
a mutation is CAUGHT when at least one of them fails.

    python tools/mutation_check.py                   # all mutations against HEAD of this checkout
    python tools/mutation_check.py --ref main --only fp16-unscale sampler-resume
    python tools/mutation_check.py --list
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MUTATIONS", "Mutation", "main"]

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    path: str
    anchor: str
    replacement: str
    tests: tuple[str, ...]


MUTATIONS = [
    Mutation("fp16-unscale", "fp16: the update never divides by the loss scale (norm and gradients stay scaled)",
             "megazero/zero/optimizer.py",
             "        scale = self.scaler.scale if self.scaler is not None else 1.0\n",
             "        scale = 1.0\n",
             ("tests/test_mixed_precision.py::test_bf16_and_fp16_track_fp32_reference_and_controls_do_not",)),
    Mutation("bf16-master-copy", "bf16: the updated fp32 master is not copied back into the bf16 parameters",
             "megazero/zero/optimizer.py",
             "        if self.mixed and not self.offload:  # (offload copies each updated chunk back as it goes)\n"
             "            self.state.write_params()",
             "        if self.mixed and not self.offload:  # (offload copies each updated chunk back as it goes)\n"
             "            pass",
             ("tests/test_mixed_precision.py::test_bf16_and_fp16_track_fp32_reference_and_controls_do_not",)),
    Mutation("dp-grad-scaling", "DP: gradients averaged instead of summed over the DP group (stages 0-1 boundary)",
             "megazero/zero/bucketed.py",
             "            work = self.dp_group.all_reduce(g, tag=\"grad\", async_op=True)",
             "            g.div_(self.dp_group.size)\n"
             "            work = self.dp_group.all_reduce(g, tag=\"grad\", async_op=True)",
             ("tests/test_reference.py::test_zero_stages_match_reference_at_dp2",
              "tests/test_training.py::test_data_parallel_matches_single_process")),
    Mutation("tp-backward-allreduce", "TP: the all-reduce of the input gradient in a column-parallel backward is dropped",
             "megazero/tensor_parallel/mappings.py",
             "class _CopyToTP(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x, group):\n"
             "        ctx.group = group\n        return x\n\n    @staticmethod\n    def backward(ctx, g):\n"
             "        return _all_reduce(g, ctx.group), None",
             "class _CopyToTP(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x, group):\n"
             "        ctx.group = group\n        return x\n\n    @staticmethod\n    def backward(ctx, g):\n"
             "        return g, None",
             ("tests/test_tensor_parallel.py::test_whole_gpt_matches_single_process_at_tp_2",)),
    Mutation("pp-grad-send", "PP: the gradient sent back to the previous stage is zeros",
             "megazero/pipeline/executor.py",
             "                    sent[send.key] = grad_in\n",
             "                    sent[send.key] = torch.zeros_like(grad_in)\n",
             ("tests/test_checkpointing.py::test_parity_pp2",)),
    Mutation("offload-copy-back", "offload: the host Adam's updated chunk is not copied back to the parameters",
             "megazero/zero/offload.py",
             "                    s.param[a_lo - a: a_hi - a].copy_(master[a_lo:a_hi], non_blocking=True)",
             "                    pass",
             ("tests/test_offload.py::test_offload_matches_single_process",)),
    Mutation("checkpoint-optimizer-reshard", "checkpoint: Adam moments are read from offset 0 of the saved "
             "parameter instead of this rank's run (master values still right)",
             "megazero/checkpoint/load.py",
             "ctx.tp_size, offset, n, k)",
             "ctx.tp_size, offset if k == \"master\" else 0, n, k)",
             ("tests/test_checkpoint.py::test_reshard_on_load_continues_the_uninterrupted_run",)),
    Mutation("sampler-resume", "sampler: a resumed run restarts one global batch early",
             "megazero/data/sampler.py",
             "        self.consumed_samples = consumed\n",
             "        self.consumed_samples = max(0, consumed - self.global_batch_size)\n",
             ("tests/test_data.py::test_sampler_resume_from_state_dict",
              "tests/test_checkpoint.py::test_reshard_on_load_continues_the_uninterrupted_run")),
    Mutation("overflow-agreement", "fp16: the squared norm (overflow flag) is not summed over the model-parallel "
             "group, so a TP/PP peer's overflow is missed",
             "megazero/zero/optimizer.py",
             "            self.norm_group.all_reduce(sq, tag=\"norm\")",
             "            pass",
             ("tests/test_mixed_precision.py::test_fp16_overflow_on_one_rank_skips_on_every_rank_at_tp2_and_pp2",)),
    Mutation("stage3-no-reuse", "ZeRO-3: a block recomputed in backward is released at once (gathered again)",
             "megazero/zero/stage3/gather.py",
             "        if reused and self.reuse_distance > 0:",
             "        if False:",
             ("tests/test_stage3.py::test_stage3_interleaved_and_recompute_match_one_process_and_the_ledger",)),
    Mutation("stage3-reduce-every-chunk", "ZeRO-3: a backward also reduces the chunks it did not run through",
             "megazero/zero/stage3/params.py",
             "            if unit.chunk in self._touched and not unit.reduced:",
             "            if not unit.reduced:",
             ("tests/test_stage3.py::test_stage3_interleaved_and_recompute_match_one_process_and_the_ledger",)),
    Mutation("stage3-keep-blocks", "ZeRO-3: a block is not released after its forward",
             "megazero/zero/stage3/params.py",
             "        self.sched.done_with(unit, reused=grad and self._in_backward)",
             "        self.sched.done_with(unit, reused=True)",
             ("tests/test_stage3.py::test_stage3_peaks_order_check_holding_and_sharded_init_at_dp4",)),
    Mutation("stage3-unbounded-inflight", "ZeRO-3: gradient reductions are waited on only at the end of backward",
             "megazero/zero/stage3/params.py",
             "        limit = self.max_inflight if self.overlap_comm else 0",
             "        limit = 1 << 30",
             ("tests/test_stage3.py::test_stage3_peaks_order_check_holding_and_sharded_init_at_dp4",)),
    Mutation("stage3-always-check", "ZeRO-3: the order check runs before every gather, traced or not",
             "megazero/zero/stage3/gather.py",
             "        if self.follow is None and check:\n            self.check(unit)",
             "        if True:\n            self.check(unit)",
             ("tests/test_stage3.py::test_stage3_peaks_order_check_holding_and_sharded_init_at_dp4",)),
    Mutation("stage3-prefetch-over-budget", "ZeRO-3: prefetch ignores stage3_max_live_parameters",
             "megazero/zero/stage3/gather.py",
             "            if u.gathered or u.numel > self.prefetch_numel or self.live + u.numel > self.max_live:",
             "            if u.gathered or u.numel > self.prefetch_numel:",
             ("tests/test_stage3.py::test_stage3_peaks_order_check_holding_and_sharded_init_at_dp4",)),
    Mutation("stage3-hold-released", "ZeRO-3: gathered_parameters() gathers everything but does not hold it",
             "megazero/zero/stage3/gather.py",
             "            self.phase, self.seq, self.follow = saved\n        self.hold += 1",
             "            self.phase, self.seq, self.follow = saved",
             ("tests/test_stage3.py::test_stage3_peaks_order_check_holding_and_sharded_init_at_dp4",)),
    Mutation("stage3-slots-per-use", "ZeRO-3: block buffers are allocated per use instead of borrowed slots",
             "megazero/zero/stage3/slots.py",
             "SWAP = hasattr(torch.UntypedStorage, \"_swap_data_ptr_\")",
             "SWAP = False",
             ("tests/test_stage3_outside.py::test_block_buffers_come_from_the_slots",)),
    Mutation("stage3-eval-gathers-all", "ZeRO-3: evaluation gathers the whole model",
             "megazero/train/engine.py",
             "        stats = self.executor.run(actions, micro_batches, tokens, backward=None,",
             "        with self.optimizer.gathered_parameters():\n"
             "            stats = self.executor.run(actions, micro_batches, tokens, backward=None,",
             ("tests/test_stage3_outside.py::test_evaluation_sampling_and_export_stay_below_the_step_at_dp4",)),
    Mutation("gloo-poison-off", "test worlds: the non-owned part of an in-place reduce-scatter is not poisoned",
             "megazero/distributed/group.py",
             "        if not (self.poison and in_place and input.is_floating_point()):",
             "        if True:",
             ("tests/test_zero_comm.py::test_a_planted_read_of_what_a_reduce_scatter_does_not_own_fails",)),
    Mutation("stage3-full-init", "the recipe builds the whole replica with storage before the ZeRO store",
             "megazero/train/recipe.py",
             "    with torch.device(\"meta\"):",
             "    with torch.device(\"cpu\"):",
             ("tests/test_stage3.py::test_stage3_peaks_order_check_holding_and_sharded_init_at_dp4",)),
    Mutation("meta-hooks-lost", "meta build: a parameter's gradient hooks are not carried over its materialisation",
             "megazero/zero/flat.py",
             "    p._backward_hooks = None  # the hooks stayed",
             "    pass  # the hooks stayed",
             ("tests/test_stage3.py::test_stage3_with_sequence_parallelism_built_on_meta",)),
    Mutation("stage3-init-name", "meta build: the materialiser seeds a parameter from another name",
             "megazero/model/init.py",
             "        return self.names[p]",
             "        return self.names[p] + \".x\"",
             ("tests/test_zero_rss.py::test_construction_frees_no_temporary",)),
]


def _export(ref: str, dest: Path) -> None:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def _run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, list[str], float]:
    env = {**os.environ, "PYTHONPATH": str(copy), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider", "-rf", "--no-header"]
    start = time.monotonic()
    r = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    failed = sorted(set(re.findall(r"^FAILED (\S+)", r.stdout, re.M)))
    return r.returncode, failed, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="HEAD", help="git ref of this repository to mutate (default HEAD)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    ap.add_argument("--baseline", action="store_true", help="first run each mutation's tests unmutated")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per pytest run (default %(default)s)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.what}\n    {m.path}; tests: {', '.join(m.tests)}")
        return 0
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        ap.error(f"unknown mutation(s) {sorted(unknown)}; see --list")
    results = []
    with tempfile.TemporaryDirectory(prefix="megazero-mutation-") as tmp:
        copy = Path(tmp)
        _export(args.ref, copy)
        for m in chosen:
            target = copy / m.path
            original = target.read_text()
            count = original.count(m.anchor)
            if count != 1:
                results.append((m, "STALE", [f"anchor found {count} times in {m.path}"], 0.0))
                print(f"[{m.name}] STALE: anchor found {count} times in {m.path}", flush=True)
                continue
            if args.baseline:
                rc, failed, secs = _run_tests(copy, m.tests, args.timeout)
                if rc != 0:
                    results.append((m, "BASELINE-FAILS", failed, secs))
                    print(f"[{m.name}] tests fail without the mutation: {failed}", flush=True)
                    continue
            target.write_text(original.replace(m.anchor, m.replacement))
            try:
                rc, failed, secs = _run_tests(copy, m.tests, args.timeout)
            except subprocess.TimeoutExpired:
                rc, failed, secs = 1, ["(timed out)"], args.timeout
            finally:
                target.write_text(original)
            status = "CAUGHT" if rc != 0 else "MISSED"
            results.append((m, status, failed, secs))
            print(f"[{m.name}] {status} in {secs:.0f}s: {', '.join(failed) or '(no test failed)'}", flush=True)
    print("\n| mutation | planted bug | result | failing tests |\n|---|---|---|---|")
    for m, status, failed, _ in results:
        print(f"| {m.name} | {m.what} (`{m.path}`) | {status} | {'<br>'.join(failed)} |")
    return 0 if all(s == "CAUGHT" for _, s, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
