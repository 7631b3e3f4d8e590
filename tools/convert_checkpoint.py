"""Merge a megazero sharded checkpoint into one fp32 state dict or a Hugging Face GPT-2 or Llama directory.

    python tools/convert_checkpoint.py runs/ckpt --out merged/                  # latest checkpoint, safetensors
    python tools/convert_checkpoint.py runs/ckpt --step 200 --out hf/ --format hf

Every TP, PP and DP/ZeRO shard is merged (vocab padding removed) from the fp32 master weights. Runs on one
CPU process, no torchrun. Tensors are streamed: each parameter is assembled from just the pieces that hold
it and written out before the next is read (the safetensors header is computed from the manifest's shapes
first), so peak memory is the largest parameter plus one TP shard of it, not a copy of the model.

``--format safetensors`` (default) writes ``OUT/model.safetensors`` with the single-process GPT's names
(``wte.weight`` unpadded: ``[vocab_size, hidden]``), ``OUT/config.json`` (megazero's model config) and the
tokenizer (``tokenizer.model``, or ``tokenizer.json`` for a Hugging Face one). ``--format hf`` writes
``config.json`` + ``model.safetensors`` that ``transformers.GPT2LMHeadModel.from_pretrained(OUT)`` (tied
``lm_head``) or ``LlamaForCausalLM.from_pretrained(OUT)`` (q/k/v_proj and gate/up_proj split out of megazero's
fused weights; ``lm_head`` written when untied) loads, written without ``transformers``, and the tokenizer as
``tokenizer.json`` + ``tokenizer_config.json`` for ``transformers.AutoTokenizer.from_pretrained(OUT)`` (the
same ids as megazero's tokenizer; see the tokenizers' ``save_hf``); its eos and bos ids go into config.json.
A directory ``--init-from`` read comes back with the same tensors, bit for bit, in fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

try:
    import megazero  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from megazero.checkpoint import CheckpointError, CheckpointReader, find_checkpoint
from megazero.checkpoint.safetensors_io import write_safetensors
from megazero.checkpoint.store import TOKENIZER
from megazero.config.schema import ModelConfig
from megazero.data import HFTokenizer, open_tokenizer
from megazero.model.hf import hf_config, to_hf_tensors
from megazero.observe.log import DEBUG_ENV, debug_requested, report_failure

__all__ = ["build_parser", "convert", "main"]


def _order(name: str) -> tuple[int, int, str]:
    """Model order: embeddings, blocks by layer index, final LayerNorm."""
    m = re.match(r"blocks\.(\d+)\.", name)
    if m:
        return 1, int(m.group(1)), name
    return (2 if name.startswith("ln_f") else 0), 0, name


def convert(step_dir: Path, out: Path, fmt: str = "safetensors", verify: bool = True) -> dict:
    """Write the merged checkpoint of ``step_dir`` to ``out``; returns a summary dict."""
    start = time.perf_counter()
    reader = CheckpointReader(step_dir, verify=verify)
    manifest = reader.manifest
    cfg = ModelConfig(**manifest["model"])
    names = sorted(reader.tensors, key=_order)
    shapes = {n: tuple(reader.tensors[n]["shape"]) for n in names}
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "hf":
        # names and shapes after conversion (vocab padding is already gone): GPT-2's four block matrices
        # transposed, Llama's qkv and fc split into q/k/v_proj and gate/up_proj
        target = {n: to_hf_tensors(n, torch.empty(shapes[n], device="meta"), cfg) for n in names}
        entries = [(key, torch.float32, tuple(t.shape)) for n in names for key, t in target[n]]
        source = {key: n for n in names for key, _ in target[n]}
        held: dict[str, dict[str, torch.Tensor]] = {}  # the parameter whose parts are being written

        def produce(key: str) -> torch.Tensor:
            name = source[key]
            if name not in held:
                held.clear()
                held[name] = dict(to_hf_tensors(name, reader.full_tensor(name), cfg))
            return held[name][key].contiguous()
    else:
        entries = [(n, torch.float32, shapes[n]) for n in names]

        def produce(key: str) -> torch.Tensor:
            return reader.full_tensor(key)

    written = write_safetensors(out / "model.safetensors", entries, produce, {"format": "pt"})
    tokenizer_file = reader.tokenizer_path()
    tok = open_tokenizer(tokenizer_file) if tokenizer_file is not None else None
    if fmt == "hf":
        ids = {"bos_token_id": tok.bos_id if tok.bos_id >= 0 else None, "eos_token_id": tok.eos_id} if tok else {}
        (out / "config.json").write_text(json.dumps(hf_config(cfg, **ids), indent=2) + "\n")
    else:
        (out / "config.json").write_text(json.dumps({"megazero_model": manifest["model"],
                                                     "step": manifest["step"]}, indent=2) + "\n")
    if tok is not None and (fmt == "hf" or isinstance(tok, HFTokenizer)):
        tok.save_hf(out, model_max_length=cfg.seq_len)
    if tok is not None and not isinstance(tok, HFTokenizer):
        shutil.copyfile(tokenizer_file, out / TOKENIZER)
    topo = manifest["topology"]
    return {"step": manifest["step"], "parameters": sum(int(torch.Size(s).numel()) for s in shapes.values()),
            "tensors": len(names), "tp": topo["tp"], "pp": topo["pp"], "dp": topo["dp"],
            "zero_stage": manifest["zero_stage"], "precision": manifest["precision"],
            "files": len(manifest["files"]), "bytes": written["bytes"], "seconds": time.perf_counter() - start}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tools/convert_checkpoint.py",
        description="Merge a megazero sharded checkpoint into one fp32 state dict or a Hugging Face GPT-2 or Llama "
        "model.",
        epilog=f"A failure prints one line; --debug (or {DEBUG_ENV}=1) adds its traceback.")
    parser.add_argument("checkpoint", metavar="CKPT_DIR",
                        help="a --save directory (its latest checkpoint) or one step_N directory")
    parser.add_argument("--step", type=int, help="convert step N of CKPT_DIR instead of its latest")
    parser.add_argument("--out", required=True, metavar="OUT", help="output directory")
    parser.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                        help="megazero names or a Hugging Face GPT-2 or Llama directory (default: %(default)s)")
    parser.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check of the shard files")
    parser.add_argument("--debug", action="store_true", help="a failure prints its traceback too")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    root = Path(args.checkpoint)
    try:
        step_dir = root / f"step_{args.step:08d}" if args.step is not None else find_checkpoint(root)
        if step_dir is None:
            raise CheckpointError(f"no checkpoint in {root}: no latest file and no complete step_* directory")
        if not (step_dir / "manifest.json").is_file():
            raise CheckpointError(f"{step_dir} is not a complete checkpoint (no manifest.json)")
        s = convert(step_dir, Path(args.out), args.format, verify=not args.no_verify)
    except BaseException as e:  # noqa: BLE001 - one line for what the user can fix, a traceback for bugs
        return report_failure(e, debug=args.debug or debug_requested())
    print(f"step {s['step']} of {step_dir}: {s['parameters']:,} parameters in {s['tensors']} tensors, saved at "
          f"tp={s['tp']} pp={s['pp']} dp={s['dp']} ZeRO-{s['zero_stage']} {s['precision']} ({s['files']} shard "
          f"files)\nwrote {args.out} ({args.format}, {s['bytes'] / 1e6:.2f} MB) in {s['seconds']:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
