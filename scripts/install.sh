#!/usr/bin/env bash
# Set up specserve in .venv (repository root): torch first (CPU build on machines
# without an NVIDIA GPU, CUDA build + xformers with one), then the project in editable
# mode with its test extras. Safe to re-run; it installs only what is missing.
#
#   SPECSERVE_TORCH_INDEX=https://download.pytorch.org/whl/cpu   small CPU-only torch
#   PYTHON=python3.12                                           interpreter for the venv
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[install] creating .venv with $($python --version 2>&1)" >&2
  "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[install] NVIDIA GPU found: installing CUDA torch and xformers" >&2
    "${pip[@]}" install torch
    "${pip[@]}" install xformers || echo "[install] xformers unavailable; the torch attention backend will be used" >&2
  else
    echo "[install] no NVIDIA GPU: installing CPU torch 2.13.0" >&2
    "${pip[@]}" install "torch==2.13.0" ${SPECSERVE_TORCH_INDEX:+--index-url "$SPECSERVE_TORCH_INDEX"}
  fi
fi

echo "[install] installing specserve (editable) with test extras" >&2
"${pip[@]}" install -e '.[test]'
echo "[install] done: .venv/bin/specserve --help" >&2
