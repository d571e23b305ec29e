#!/usr/bin/env bash
# The CUDA checks, in one command, for a machine with an NVIDIA GPU and a CUDA build of
# torch already installed (such as the device machine some development sessions are
# lent, which has no internet). Runs every test marked `gpu` (torch and xformers attention
# against a naive reference in tests/engine/test_attention.py; greedy engine output against
# transformers, n-gram and EAGLE speculation against plain decoding, seeded sampling, and
# token trees from every tree proposer beside every request kind in
# tests/engine/test_devices.py) and fails if CUDA is missing, so a silent skip cannot
# pass for a GPU run.
#
#   bash scripts/gpu_check.sh     # .venv/bin/python after scripts/install.sh, else python3
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
#
# Packages the machine lacks can be put in .whl/ as wheels (see the device tool's notes);
# they are installed into a private target first.
set -euo pipefail
cd "$(dirname "$0")/.."
# The README install's venv when there is one; a machine with torch preinstalled and no
# venv (the lent device machine) has its own python3.
if [[ -z "${PYTHON:-}" && -x .venv/bin/python ]]; then
    PYTHON=.venv/bin/python
fi
PY=${PYTHON:-python3}
"$PY" -c 'import sys, torch; torch.cuda.is_available() or sys.exit("gpu_check: torch sees no CUDA device; nothing to check")'
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/specserve-site .whl/*.whl
    export PYTHONPATH=/tmp/specserve-site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" - <<'PYEOF'
import torch
from engine.attention import xformers_problem
print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
for dtype in (torch.bfloat16, torch.float32):
    print(f"gpu_check: xformers attention in {dtype}: {xformers_problem('cuda', dtype) or 'runs'}")
PYEOF
export PYTHONUNBUFFERED=1
status=0
"$PY" -m pytest -q -m gpu -rs tests/engine/test_attention.py tests/engine/test_devices.py "$@" || status=$?
if [[ -n "${SPECSERVE_GPU_TOKENIZER:-}" ]]; then
    "$PY" scripts/gpu_bench.py --tokenizer "$SPECSERVE_GPU_TOKENIZER" ${OUT:+--out "$OUT"} || status=$?
fi
exit "$status"
