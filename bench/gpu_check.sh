#!/usr/bin/env bash
# The one GPU check: a bare GPU machine (torch preinstalled, no internet, this tree copied in, megazero not
# installed: PYTHONPATH is set here) runs every GPU check of the project within a budget (default 450 s, under
# 8 minutes) and prints a summary table last.
#
#   bash bench/gpu_check.sh OUTDIR
#   GPU_CHECK_BUDGET_S=300 bash bench/gpu_check.sh OUTDIR     # a shorter budget
#   GPU_CHECK_DEVICE=cpu bash bench/gpu_check.sh OUTDIR       # CPU dry run: tiny models, the plumbing only
#
# Steps, most valuable first. Each is time-boxed with `timeout` (its whole process group), capped at what is
# left of the budget; one that fails or times out does not stop the others, and one with no time left is
# skipped and says so:
#   env       GPU, driver, python, torch, CUDA, triton, cores, host memory
#   gpt2-124m, gpt2-1.3b, llama-3.2-1b
#             bench/gpu.py: megazero against a plain compiled PyTorch model of the same shapes, same run
#   offload   bench/gpu.py --offload optimizer on a 4 x 4096 GPT (1.0B), 64 sequences of 1024 per step (8 x 8
#             accumulated): compute / copy to host / host Adam; offload-dpu: the same with the one-step
#             delayed update (the host Adam of step t beside the device's step t+1) after 1 synchronous step
#   pytest    pytest -m gpu: the GPU-marked tests plus every test skipped for want of CUDA (tests/conftest.py)
#   profile   bench/gpu_profile.py at gpt2-124m: kernels per step, GPU-busy fraction, top 10 kernels
#   summary   bench/gpu_summary.py (standard library only): the table, printed last
# OUTDIR receives at most 8 files: check.log (every step's output), pytest.xml, one JSON per bench step
# (gpt2-124m.json, gpt2-1.3b.json, llama-3.2-1b.json, profile.json, offload.json, offload-dpu.json).
set -u -o pipefail

OUT=${1:?usage: bash bench/gpu_check.sh OUTDIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
BUDGET=${GPU_CHECK_BUDGET_S:-450}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || PY=python
TMPD=$(mktemp -d)
LOG="$OUT/check.log"
STATUS="$TMPD/status"
: >"$LOG"
: >"$STATUS"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 WANDB_MODE=disabled
export TOKENIZERS_PARALLELISM=false PYTHONDONTWRITEBYTECODE=1
START=$SECONDS
RESERVE=20  # seconds kept for the summary

# step NAME CAP_SECONDS SHOW_LINES COMMAND...: run COMMAND time-boxed, its output appended to check.log; print
# its last SHOW_LINES lines (40 when it fails) and record "NAME rc seconds" for the summary.
step() {
    local name=$1 cap=$2 show=$3
    shift 3
    local left=$((BUDGET - (SECONDS - START) - RESERVE))
    if ((left < 15)); then
        echo "== $name: skipped, the budget is spent ($((SECONDS - START)) s of $BUDGET)" | tee -a "$LOG"
        echo "$name - 0" >>"$STATUS"
        return
    fi
    ((cap > left)) && cap=$left
    local cmd="$*"
    echo "== $name (at most ${cap} s): ${cmd:0:200}" | tee -a "$LOG"
    local t0=$SECONDS rc
    timeout -k 10 "$cap" "$@" >"$TMPD/step.log" 2>&1
    rc=$?
    cat "$TMPD/step.log" >>"$LOG"
    local took=$((SECONDS - t0))
    echo "$name $rc $took" >>"$STATUS"
    if ((rc == 0)); then
        grep -v '^USDT:' "$TMPD/step.log" | tail -n "$show"
        echo "== $name: ok in ${took} s" | tee -a "$LOG"
    else
        grep -v '^USDT:' "$TMPD/step.log" | tail -n 40
        if ((rc == 124 || rc == 137)); then
            echo "== $name: TIMED OUT after ${took} s (cap ${cap} s)" | tee -a "$LOG"
        else
            echo "== $name: FAILED (exit $rc) after ${took} s" | tee -a "$LOG"
        fi
    fi
}

env_info() {
    date -u +"date: %Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 || true
    echo "cores: $(nproc); host memory: $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 2^20}' /proc/meminfo)"
    echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo "unknown (no .git)")"
    "$PY" - <<'EOF'
import platform, torch
print(f"python {platform.python_version()}; torch {torch.__version__}; CUDA {torch.version.cuda}; "
      f"cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
          f"capability {p.major}.{p.minor}")
try:
    import triton
    print(f"triton {triton.__version__}")
except ImportError:
    print("triton: not installed")
EOF
}

if [[ $DEVICE == cpu ]]; then  # the dry run: tiny shapes, every step's plumbing
    BENCH=("tiny 2 128" "llama-tiny 2 128")
    COMMON=(--device cpu --no-compile --warmup 1 --steps 2)
    PROFILE=(--model tiny --micro-batch-size 2 --device cpu --no-compile --warmup 1 --steps 2)
    TESTS=(tests/test_gpu.py)
else
    BENCH=("gpt2-124m 16 1024" "gpt2-1.3b 8 1024" "llama-3.2-1b 1 8192")
    COMMON=(--warmup 2 --steps 8)
    PROFILE=(--model gpt2-124m --micro-batch-size 16 --warmup 2 --steps 3)
    TESTS=(tests)
fi

export PY ROOT
step env 30 20 bash -c "$(declare -f env_info); env_info"  # timeout runs programs, not functions
MODELS=()
for spec in "${BENCH[@]}"; do
    read -r model micro seq <<<"$spec"
    MODELS+=("$model")
    step "$model" 100 8 "$PY" bench/gpu.py --model "$model" --micro-batch-size "$micro" --seq-len "$seq" \
        "${COMMON[@]}" --json "$OUT/$model.json"
done
if [[ $DEVICE == cpu ]]; then
    step offload 60 3 "$PY" bench/gpu.py --offload optimizer --device cpu --no-compile --warmup 1 --steps 2 \
        --micro-batch-size 2 --global-batch-size 4 --json "$OUT/offload.json"
    step offload-dpu 60 3 "$PY" bench/gpu.py --offload optimizer --offload-delayed-update 1 --device cpu \
        --no-compile --warmup 2 --steps 2 --micro-batch-size 2 --global-batch-size 4 --json "$OUT/offload-dpu.json"
else
    step offload 75 3 "$PY" bench/gpu.py --offload optimizer --offload-layers 4 --no-compile --warmup 1 \
        --steps 3 --micro-batch-size 8 --global-batch-size 64 --json "$OUT/offload.json"
    # warm-up 2: step 1 synchronous, step 2 the first delayed (nothing lands yet), so the 3 timed steps are steady
    step offload-dpu 75 3 "$PY" bench/gpu.py --offload optimizer --offload-layers 4 --offload-delayed-update 1 \
        --no-compile --warmup 2 --steps 3 --micro-batch-size 8 --global-batch-size 64 --json "$OUT/offload-dpu.json"
fi
step pytest 170 15 "$PY" -m pytest -q -m gpu -p no:cacheprovider -o timeout=150 --continue-on-collection-errors \
    --junitxml="$OUT/pytest.xml" "${TESTS[@]}"
step profile 50 14 "$PY" bench/gpu_profile.py "${PROFILE[@]}" --json "$OUT/profile.json"
echo "== total $((SECONDS - START)) s of a $BUDGET s budget; OUTDIR $OUT: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$LOG"
"$PY" bench/gpu_summary.py "$OUT" --status "$STATUS" --models "${MODELS[@]}" 2>&1 | tee -a "$LOG"
rm -rf "$TMPD"
