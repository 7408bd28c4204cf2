#!/usr/bin/env bash
# One command for a machine with CUDA GPUs: set up from the repo as the README does (keeping the
# machine's CUDA torch), then run the GPU checks of llama_train/bench/gpu_check.py and print
# every figure with the command that produced it. On a machine without a GPU it says so and
# exits 0 without touching anything.
#
#   bash launch/gpu_check.sh [--out DIR] [--quick] [--print-commands]
#
# Offline GPU machines: run `bash launch/gpu_bundle.sh` beforehand on a machine with an index:
# it puts into .whl/ wheels of what the machine's python lacks (deepspeed, hydra-core, omegaconf
# and their dependencies; .whl/requirements.txt) and the tiny run's prepared data (.whl/cache);
# the set-up then installs from there with --no-index, and the runs read that data.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: skipped: no CUDA GPU on $(hostname) (nvidia-smi missing or lists no GPU)."
  echo "gpu-check: run 'bash launch/gpu_check.sh' (or 'make gpu-check') on a machine with one."
  exit 0
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
   && ! { [ -x .venv/bin/python ] && .venv/bin/python -c \
          "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }; then
  echo "gpu-check: skipped: nvidia-smi sees a GPU but no CUDA build of torch is importable" \
       "($PY or .venv); install one (make setup TORCH_SPEC=...) and run again."
  exit 0
fi

echo "== set-up (keeps the machine's CUDA torch)"
if [ ! -x .venv/bin/python ]; then
  # --system-site-packages: the machine's CUDA torch (and what else it has) stays visible.
  "$PY" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import llama_train, deepspeed, hydra" 2>/dev/null; then
  if [ -f .whl/requirements.txt ]; then  # launch/gpu_bundle.sh's: only what the image lacks
    .venv/bin/pip install --no-index --find-links .whl --no-deps -r .whl/requirements.txt
    .venv/bin/pip install --no-index --find-links .whl --no-deps -e .
  elif [ -d .whl ]; then
    .venv/bin/pip install --no-index --find-links .whl -e ".[dev]"
  else
    .venv/bin/pip install -e ".[dev]"
  fi
fi
.venv/bin/python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
  'devices', torch.cuda.device_count(), torch.cuda.get_device_name(0))"
export DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
if [ -d .whl/cache ] && [ -z "${LLAMA_TRAIN_CACHE:-}" ]; then
  export LLAMA_TRAIN_CACHE=$PWD/.whl/cache  # the bundle's prepared data: no tokenizing here
fi
exec .venv/bin/python -m llama_train.bench.gpu_check "$@"
