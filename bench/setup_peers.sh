#!/usr/bin/env bash
# Creates the ZeRO benchmark's own environment for its DeepSpeed peer (bench/zero_bench.py):
#
#     bash bench/setup_peers.sh            # -> bench/.venv-peers (git-ignored)
#     bench/.venv-peers/bin/python bench/zero_bench.py ...
#
# DeepSpeed is NOT a megazero dependency: it lives only in this virtual environment. The environment sees
# the system site-packages, so it reuses the CPU torch and the editable megazero already installed there;
# a constraints file pins torch to that exact build so pip never swaps in a (CUDA) torch from the index.
# DeepSpeed ships as a source distribution; without a CUDA toolkit it installs with no pre-built ops,
# which is all the benchmark needs (it hands DeepSpeed torch.optim.AdamW, no fused/CPU-Adam kernels).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${PEERS_VENV:-$here/.venv-peers}"
python="${PYTHON:-python3}"
deepspeed_spec="${DEEPSPEED_SPEC:-deepspeed}"

torch_version="$("$python" -c 'import torch; print(torch.__version__)')"
echo "system torch: $torch_version"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv --system-site-packages "$venv"
fi

constraints="$venv/torch-constraints.txt"
# '==2.13.0+cpu' pins the exact local build already installed; pip treats it as satisfied and downloads no torch
echo "torch==$torch_version" > "$constraints"

export DS_BUILD_OPS=0 DS_ACCELERATOR=cpu
"$venv/bin/pip" install --disable-pip-version-check --constraint "$constraints" "$deepspeed_spec"

"$venv/bin/python" - <<'PY'
import torch, deepspeed
assert torch.__version__.endswith("+cpu") or not torch.cuda.is_available(), torch.__version__
print(f"ok: deepspeed {deepspeed.__version__} on torch {torch.__version__} ({torch.__file__})")
PY
