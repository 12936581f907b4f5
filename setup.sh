#!/usr/bin/env bash
# Install jaxpar + torchpar (+ test tools) into the active Python environment.
# A torch or jax that is already installed (e.g. a CUDA build on a GPU machine) is kept; where
# none is, a CPU build is installed, so a CPU machine never downloads CUDA wheels.
set -euo pipefail
PY=${PYTHON:-python}
pip_install() { "$PY" -m pip install --quiet "$@"; }

if "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: keeping installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  # CPU wheel; this machine image serves it from a local wheel directory. Elsewhere set
  # TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to get the CPU build from PyTorch's index.
  pip_install "torch==${TORCH_VERSION:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple}
fi
if "$PY" -c "import jax" 2>/dev/null; then
  echo "setup: keeping installed jax $("$PY" -c 'import jax; print(jax.__version__)')"
else
  pip_install jax
fi
pip_install -e ".[torch,test,hf,report,tensorboard,data,eval]"
echo "setup: done"
