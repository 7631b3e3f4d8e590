"""Generate text from a megazero checkpoint (sharded, any topology), a merged export or a Hugging Face GPT-2.

    python tools/generate.py runs/ckpt --prompt "def main(" --max-new-tokens 64            # sampled
    python tools/generate.py runs/ckpt --prompt "import os" --temperature 0                # greedy
    python tools/generate.py hf_export/ --prompt "class " --top-k 50 --top-p 0.9 --temperature 0.8
    torchrun --nproc-per-node 2 tools/generate.py runs/ckpt --tp 2 --prompt "x = " --temperature 0   # TP, greedy

Decodes with a KV cache (``--no-cache`` re-runs the whole sequence each token) on CPU or GPU; under torchrun
the model is split over ``--tp`` ranks with megazero's tensor-parallel layers (each rank reads only its shard
of a sharded checkpoint) and the remaining ranks are data-parallel copies. Rank 0 prints, for each prompt,
the prompt followed by the generated text (``--json``: one JSON object per prompt with the token ids).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

try:
    import megazero  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from megazero.config.errors import ConfigError
from megazero.generate import CP_REFUSAL, SamplingConfig, generate_ids, load_model, load_tokenizer
from megazero.observe.log import DEBUG_ENV, debug_requested, report_failure

__all__ = ["build_parser", "main"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/generate.py", description=__doc__.split("\n\n")[0],
                                epilog=f"A failure prints one line per rank; --debug (or {DEBUG_ENV}=1) adds its traceback.")
    p.add_argument("checkpoint", metavar="CKPT", help="--save directory, step_N directory, merged or HF export")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several)")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens to generate per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature; 0 is greedy (default: %(default)s, which samples)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the k likeliest tokens; 0 disables (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 disables (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    p.add_argument("--step", type=int, help="load step N of a --save directory instead of its latest")
    p.add_argument("--tokenizer", metavar="PATH", help="SentencePiece .model, Hugging Face tokenizer.json or a "
                   "directory holding one; its vocabulary must be the model's (default: the checkpoint's)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size under torchrun (default: %(default)s)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size: generation runs at 1 only, whatever "
                   "cp the checkpoint was trained at (default: %(default)s)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when available (default: %(default)s)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="compute dtype (default: %(default)s)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence for every token")
    p.add_argument("--no-stop", action="store_true", help="keep going after the end-of-sequence token")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--debug", action="store_true", help="a failure prints its traceback too")
    return p


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    from megazero.distributed.context import ParallelContext, RankGrid, TopologyError
    from megazero.distributed.launch import destroy_distributed, detect_env, init_distributed

    env = detect_env()
    try:
        sampling = SamplingConfig(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                                  stop_at_eos=not args.no_stop)
        if args.cp != 1:
            raise ValueError(CP_REFUSAL.format(cp=args.cp))
        grid = RankGrid.from_world(env.world_size, tp_size=args.tp)
    except (ValueError, TopologyError) as e:  # the sampling settings or --tp
        return report_failure(ConfigError(str(e)), env.rank, debug=args.debug or debug_requested())
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    tp_group = None
    if env.world_size > 1:
        init_distributed("nccl" if use_cuda else "gloo")
        tp_group = ParallelContext.from_grid(grid).tp_group
    device = torch.device("cuda", env.local_rank) if use_cuda else torch.device("cpu")
    try:
        model = load_model(args.checkpoint, tp_group, device, DTYPES[args.dtype], step=args.step)
        tok = load_tokenizer(args.checkpoint, args.tokenizer)
        for prompt in args.prompt:
            ids = tok.encode(prompt)
            new = generate_ids(model, ids, sampling, use_cache=not args.no_cache,
                               eos_id=getattr(tok, "eos_id", None), vocab_size=tok.vocab_size)
            if env.rank == 0:
                text = tok.decode(new)
                if args.json:
                    print(json.dumps({"prompt": prompt, "prompt_ids": ids, "ids": new, "text": text}), flush=True)
                else:
                    print(prompt + text, flush=True)
    except BaseException as e:  # noqa: BLE001 - one line per rank for what the user can fix, a traceback for bugs
        return report_failure(e, env.rank, world_size=env.world_size, debug=args.debug or debug_requested())
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # do not wait on gloo's background threads
