"""Pretrain a GPT with tensor, pipeline and ZeRO data parallelism.

    python pretrain/gpt.py                                  # tiny GPT on the built-in corpus, one process
    torchrun --nproc-per-node 4 pretrain/gpt.py --dp 4      # four data-parallel ranks
    python pretrain/gpt.py --help                           # every option
    python pretrain/gpt.py --dry-run --tp 8 --dp 16 --model gpt2-1.3b   # every rank role of 128 ranks, no GPU

Runs under torchrun, SLURM (srun) or as a plain process. Configuration errors are reported on every rank
before any process group exists, so a bad flag never leaves a rank waiting for its peers. Every failure the user
can fix (a setting, a data file, a checkpoint, a peer that died) is one line per rank on stderr, ``error (rank
R): ...``, written in one piece so that ranks' lines never run together, and a non-zero exit: 2 for a setting
(as argparse), 1 for anything else (130 for Ctrl-C); ``--debug`` (or ``MEGAZERO_DEBUG=1``) adds the traceback.
"""

from __future__ import annotations

import os
import sys
import warnings

try:
    import megazero  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


import torch

from megazero.checkpoint.hf_import import configure_from_inputs
from megazero.config.cli import parse_args
from megazero.config.errors import UserError
from megazero.config.schema import ConfigError
from megazero.distributed.context import ParallelContext, RankGrid, TopologyError
from megazero.distributed.launch import default_backend, destroy_distributed, detect_env, init_distributed
from megazero.observe.log import debug_requested, log_warnings, report_failure, setup_logging
from megazero.train.loop import run_training
from megazero.train.resume import resolve_for_resume


def dry_run_main(argv: list[str]) -> int:
    """``--dry-run``: one step per rank role of the whole topology in this process (megazero/plan/dryrun.py)."""
    import argparse

    from megazero.plan.dryrun import dry_run, format_report
    from megazero.plan.roofline import GPUS, cluster

    p = argparse.ArgumentParser(prog="pretrain/gpt.py --dry-run", add_help=False)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--gpu", default="h100", choices=tuple(GPUS))
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--efficiency", type=float, default=0.5)
    p.add_argument("--memory-gb", type=float, default=None)
    p.add_argument("--device-type", choices=("cuda", "cpu"), default="cuda",
                   help="plan for ranks of this device type: its defaults (bf16, compile) and kernels")
    known, rest = p.parse_known_args(argv)
    try:
        cfg = configure_from_inputs(parse_args(rest))
        par = cfg.parallel
        cfg = cfg.resolve(par.tp_size * par.cp_size * par.pp_size * (par.dp_size or 1),
                          device_type=known.device_type)
        c = cluster(known.gpu, known.gpus_per_node, efficiency=known.efficiency,
                    memory_bytes=known.memory_gb * 1e9 if known.memory_gb else None)
    except (ConfigError, TopologyError, ValueError) as e:
        return report_failure(e if isinstance(e, (ConfigError, TopologyError)) else ConfigError(str(e)))
    setup_logging(0, 1)
    report = dry_run(cfg, c, cfg.logging.log_dir, device_type=known.device_type)
    print(format_report(report))
    print(f"written: {os.path.join(cfg.logging.log_dir, 'dryrun.json')}")
    return 0 if report.fits else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = debug_requested(argv)  # --debug or MEGAZERO_DEBUG=1: failures show their traceback
    argv = [a for a in argv if a != "--debug"]
    if "--dry-run" in argv:
        return dry_run_main(argv)
    env = detect_env()
    try:
        with warnings.catch_warnings(record=True) as caught:  # logged below: one line each, on rank 0
            warnings.simplefilter("default")
            cfg = configure_from_inputs(parse_args(argv))  # --init-from, --tokenizer (or a .bin's)
            backend = cfg.parallel.backend or default_backend()
            cfg, resumed = resolve_for_resume(cfg, env.world_size, "cuda" if backend == "nccl" else "cpu",
                                              micro_given="training.micro_batch_size" in cfg.explicit)
    except (UserError, TopologyError) as e:  # a setting, or a file the settings name
        return report_failure(e, env.rank, debug=debug)
    log = setup_logging(env.rank, env.world_size)
    log_warnings(caught, env.rank)
    if resumed:  # the checkpoint's global batch kept, or a given one that differs from it
        (log.warning if resumed.startswith("--global-batch-size") else log.info)(resumed)
    timeout_s = cfg.parallel.dist_timeout_s
    try:
        init_distributed(backend, timeout_s)
        ctx = ParallelContext.from_grid(
            RankGrid(env.world_size, cfg.parallel.tp_size, cfg.parallel.pp_size, cfg.parallel.dp_size,
                     cfg.parallel.cp_size),
            timeout_s=timeout_s)
        device = torch.device("cuda", env.local_rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cpu" and env.world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, env.world_size)))
        run_training(cfg, ctx, device)
    except BaseException as e:  # noqa: BLE001 - one line per rank for what the user can fix, a traceback for bugs
        return report_failure(e, env.rank, world_size=env.world_size, timeout_s=timeout_s, debug=debug,
                              how_to_debug="--debug")
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit without waiting on gloo's background threads (they can abort at interpreter shutdown).
    os._exit(code)
