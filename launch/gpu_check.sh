#!/usr/bin/env bash
# One command for a machine with CUDA GPUs, with one deadline: set up from the repo (keeping the
# machine's CUDA torch), then the staged GPU checks of llama_train/bench/gpu_check.py, each stage
# with its own time limit, each writing its figures to the report as it ends (a stage cut short
# keeps the ones before it). Prints the seconds each stage used. On a machine without a GPU it
# says so and exits 0 without touching anything.
#
#   bash launch/gpu_check.sh [--budget-s 480] [--out DIR] [--quick] [--print-commands]
#   bash launch/gpu_check.sh --setup-only      # the set-up alone (any machine): .venv that sees
#                                              # the machine's torch, llama_train installed
#
# --budget-s (default 480) covers everything, set-up included: it fits one call of a GPU machine
# lent for about 10 minutes. The report: DIR/gpu_check.json (default DIR: a temp dir, printed).
#
# Offline GPU machines: run `bash launch/gpu_bundle.sh` beforehand on a machine with an index:
# it puts into .whl/ wheels of what the machine's python lacks (deepspeed, hydra-core, omegaconf
# and their dependencies; .whl/requirements.txt) and the checks' prepared data (.whl/cache);
# the set-up then installs from there with --no-index, and the runs read that data.
#
# When python3 is itself a virtualenv (as on many CUDA images: torch lives in that venv), a venv
# made from it with --system-site-packages sees the *base* interpreter's packages, not that
# venv's, so torch would not import: the set-up adds the parent venv's site-packages to .venv.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)

BUDGET=480 SETUP_ONLY=0 PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --budget-s) BUDGET=$2; shift 2 ;;
    --budget-s=*) BUDGET=${1#*=}; shift ;;
    --setup-only) SETUP_ONLY=1; shift ;;
    *) PASS+=("$1"); shift ;;
  esac
done
case "$BUDGET" in ''|*[!0-9]*) echo "gpu-check: --budget-s takes whole seconds, not '$BUDGET'" >&2; exit 2 ;; esac

PY=${PYTHON:-python3}
VENV=${GPU_CHECK_VENV:-.venv}

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    # --system-site-packages: the machine's CUDA torch (and what else it has) stays visible
    "$PY" -m venv --system-site-packages "$VENV" || return 1
  fi
  # python3 itself a venv: its site-packages (torch) added to .venv, .pth files in it included
  local parent_sites venv_site
  # (one line of a .pth that starts with "import" runs; addsitedir reads that dir's .pth files)
  parent_sites=$("$PY" -c 'import site, sys
if sys.prefix != sys.base_prefix:
    print("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in site.getsitepackages()))
') || return 1
  venv_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [ -n "$parent_sites" ]; then
    echo "$parent_sites" > "$venv_site/_gpu_check_parent_venv.pth"
  fi
  if ! "$VENV/bin/python" -c "import llama_train, deepspeed, hydra" 2>/dev/null; then
    local pip=("$VENV/bin/python" -m pip install --no-compile)
    if [ -f .whl/requirements.txt ]; then  # launch/gpu_bundle.sh's: only what the image lacks
      "${pip[@]}" --no-index --find-links .whl --no-deps -r .whl/requirements.txt || return 1
      "${pip[@]}" --no-index --find-links .whl --no-deps -e . || return 1
    elif [ -d .whl ]; then
      "${pip[@]}" --no-index --find-links .whl -e ".[dev]" || return 1
    else
      "${pip[@]}" -e ".[dev]" || return 1
    fi
  fi
  "$VENV/bin/python" -c "import torch, llama_train, deepspeed, hydra; print('torch', torch.__version__, \
'cuda', torch.version.cuda, 'from', torch.__file__)"
}

if [ "$SETUP_ONLY" = 1 ]; then
  setup
  exit $?
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: skipped: no CUDA GPU on $(hostname) (nvidia-smi missing or lists no GPU)."
  echo "gpu-check: run 'bash launch/gpu_check.sh' (or 'make gpu-check') on a machine with one."
  exit 0
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
   && ! { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c \
          "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }; then
  echo "gpu-check: skipped: nvidia-smi sees a GPU but no CUDA build of torch is importable" \
       "($PY or $VENV); install one (make setup TORCH_SPEC=...) and run again."
  exit 0
fi

echo "== stage setup (keeps the machine's CUDA torch)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if ! setup; then
  echo "gpu-check: set-up failed after $(( $(date +%s) - T0 )) s (see above)"
  exit 1
fi
USED=$(( $(date +%s) - T0 ))
echo "-- setup: ${USED} s; budget left $(( BUDGET - USED )) of ${BUDGET} s"
export DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled
# DeepSpeed's FusedAdam JIT build (~40 s): for the GPU it runs on, with every core
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST=$("$VENV/bin/python" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null) \
    && export TORCH_CUDA_ARCH_LIST
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [ -d .whl/cache ] && [ -z "${LLAMA_TRAIN_CACHE:-}" ]; then
  export LLAMA_TRAIN_CACHE=$PWD/.whl/cache  # the bundle's prepared data: no tokenizing here
  if [ -f .whl/data.json ]; then  # made for this Python's built-in corpus? (corpus.py: stdlib only)
    want=$("$VENV/bin/python" -c 'import json; print(json.load(open(".whl/data.json"))["corpus_key"])')
    got=$("$VENV/bin/python" -I llama_train/data/corpus.py key builtin 2>/dev/null)
    if [ "$want" = "$got" ]; then
      echo "gpu-check: the bundle's prepared data is this Python's corpus: nothing to prepare"
    else
      echo "gpu-check: the bundle's data was made for Python" \
        "$("$VENV/bin/python" -c 'import json; print(json.load(open(".whl/data.json"))["python"])');" \
        "this one's corpus differs, so the data stage prepares its own first (no datasets needed)"
    fi
  fi
fi
exec "$VENV/bin/python" -m llama_train.bench.gpu_check --budget-s "$(( BUDGET - USED ))" ${PASS[@]+"${PASS[@]}"}
