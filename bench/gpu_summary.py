"""The summary table bench/gpu_check.sh prints last, read from the files its steps wrote into OUTDIR.

    python bench/gpu_summary.py OUTDIR [--status STATUS_FILE] [--models gpt2-124m gpt2-1.3b llama-3.2-1b]

Reads bench/gpu.py's JSON results (``<model>.json``, ``offload.json``), bench/gpu_profile.py's
(``profile.json``), pytest's JUnit XML (``pytest.xml``) and the script's step statuses (one ``name rc seconds``
line per step) and prints: the GPU and torch version; per model megazero's and the plain model's ms/step, their
ratio (megazero tokens/s over plain tokens/s: above 1 megazero is faster), MFU and peak memory against the
estimate; the offload run with its split; the profile's kernels per step, GPU-busy fraction and top kernels;
the tests passed and failed; each step's exit status and time. Standard library only, so it runs even where a
step broke the import of torch or megazero.
"""

from __future__ import annotations

import argparse
import json
import os
import xml.etree.ElementTree as ET

BENCH_ORDER = ("gpt2-124m", "gpt2-1.3b", "llama-3.2-1b")


def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _ms(run: dict | None) -> str:
    return "n/a" if not run or run.get("median_step_s") is None else f"{1e3 * run['median_step_s']:.1f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _gib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2**30:.2f}"


def tests_line(path: str) -> list[str]:
    """``tests: N passed, F failed, S skipped`` and the failed tests' names, from JUnit XML."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return ["tests: no result (pytest.xml missing or unreadable: see check.log)"]
    cases = list(root.iter("testcase"))
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in cases
              if c.find("failure") is not None or c.find("error") is not None]
    skipped = sum(c.find("skipped") is not None for c in cases)
    lines = [f"tests: {len(cases) - len(failed) - skipped} passed, {len(failed)} failed, {skipped} skipped"]
    lines += [f"  FAILED {name}" for name in failed]
    return lines


def _status(rc: str) -> str:
    if rc == "0":
        return "ok"
    return {"-": "skipped (no time left)", "124": "TIMED OUT", "137": "TIMED OUT (killed)"}.get(rc, f"FAILED rc {rc}")


def _offload_line(off: dict | None, name: str) -> list[str]:
    """One line for bench/gpu.py's offload result ``off`` (read from ``name``): the step, MFU and split."""
    if off is None:
        return [f"offload ({name}): no result"]
    mz, m = off.get("megazero") or {}, off.get("model") or {}
    split = mz.get("offload_split") or {}
    parts = ", ".join(f"{k.removesuffix('_s')} {v:.3f} s" for k, v in split.items()) or "no split"
    after = off.get("delayed_update_after")
    mode = f" delayed update after {after}" if after is not None else ""
    return [f"offload {off.get('offload')}{mode}: {m.get('num_layers')} x {m.get('hidden_size')} "
            f"({(mz.get('params') or 0) / 1e9:.2f}B), {_ms(mz)} ms/step, "
            f"{mz.get('tflops_per_gpu') or 0:.1f} TFLOP/s, MFU {_pct(mz.get('mfu'))}; per step: {parts}"
            + (f"; error: {off['error'][:100]}" if off.get("error") else "")]


def summary(outdir: str, status_file: str | None = None, models: tuple[str, ...] = BENCH_ORDER) -> str:
    rows, head = [], None
    for model in models:
        res = _load(os.path.join(outdir, f"{model}.json"))
        if res is None:
            rows.append(f"| {model} | no result | | | | | | | |")
            continue
        head = head or res
        mz, plain = res.get("megazero"), res.get("plain")
        ratio = res.get("ratio_tokens_per_s")
        mb = f"{mz['micro_batch']} x {res.get('seq_len', '?')}" if mz else "?"
        err = res.get("error") or res.get("plain_error")
        rows.append(f"| {model} | {mb} | {_ms(mz)} | {_ms(plain)} | {'n/a' if ratio is None else f'{ratio:.2f}x'} | "
                    f"{_pct((mz or {}).get('mfu'))} | {_pct((plain or {}).get('mfu'))} | "
                    f"{_gib((mz or {}).get('peak_device_bytes'))} / {_gib((mz or {}).get('estimate_device_bytes'))} | "
                    f"{_gib((plain or {}).get('peak_device_bytes'))} |" + (f" error: {err[:100]}" if err else ""))
    lines = ["", "== megazero GPU check: summary =="]
    if head:
        lines.append(f"GPU: {head.get('device')}; torch {head.get('torch')}; {head.get('precision')}, compile "
                     f"{head.get('compile')}; matmul measured {head.get('matmul_ceiling_tflops') or 0:.0f} "
                     f"TFLOP/s, datasheet peak {head.get('peak_tflops') or 'unknown'} TFLOP/s (MFU's denominator)")
    lines += ["| model | micro-batch x seq | megazero ms/step | plain ms/step | ratio (tokens/s) | MFU megazero | "
              "MFU plain | peak / estimate GiB megazero | peak GiB plain |",
              "|---|---|---|---|---|---|---|---|---|", *rows]
    for name in ("offload.json", "offload-dpu.json"):  # (the second: gpu_check.sh's delayed-update run)
        lines += _offload_line(_load(os.path.join(outdir, name)), name)
    prof = _load(os.path.join(outdir, "profile.json"))
    if prof is None or "kernels_per_step" not in prof:
        lines.append("profile: no result" + (f" (error: {prof['error'][:100]})" if prof and prof.get("error") else ""))
    else:
        top = "; ".join(f"{k['name'][:50]} {k['ms_per_step']:.2f} ms" for k in prof["top_kernels"][:10])
        lines.append(f"profile {prof.get('model')} mb {prof.get('micro_batch')}: {prof['kernels_per_step']:.0f} "
                     f"kernels + {prof['copies_per_step']:.0f} copies per step, GPU busy "
                     f"{_pct(prof.get('busy_fraction'))} of {sum(prof['step_ms']) / max(prof['steps'], 1):.1f} ms; "
                     f"top: {top}")
    lines += tests_line(os.path.join(outdir, "pytest.xml"))
    if status_file and os.path.exists(status_file):
        with open(status_file) as f:
            steps = [line.split()[:3] for line in f if len(line.split()) >= 3]
        lines.append("steps: " + "; ".join(f"{name} {_status(rc)} {secs} s" for name, rc, secs in steps))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("outdir")
    p.add_argument("--status", default=None, help="the steps' 'name rc seconds' lines")
    p.add_argument("--models", nargs="+", default=list(BENCH_ORDER), help="bench/gpu.py's runs, in table order")
    args = p.parse_args()
    print(summary(args.outdir, args.status, tuple(args.models)), flush=True)


if __name__ == "__main__":
    main()
