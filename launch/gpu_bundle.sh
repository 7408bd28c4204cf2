#!/usr/bin/env bash
# Prepare here, in .whl/, what an offline GPU machine lacks for launch/gpu_check.sh (issue 30),
# so that the GPU run installs from it with --no-index and prepares no data:
#   * Python wheels (for the GPU machine's Python, default 3.12) of what the check imports and
#     a CUDA image with torch, transformers, sentencepiece, safetensors, tensorboard and numpy
#     lacks: deepspeed, hydra-core, omegaconf, psutil and everything they require, at the
#     versions installed in this checkout's .venv (the versions the tests ran with);
#     .whl/requirements.txt lists them (and setuptools, to install this checkout there);
#   * .whl/cache: the prepared built-in data of the check's tiny run (tokenizer and shards; the
#     GPU run points LLAMA_TRAIN_CACHE there, so it neither trains a tokenizer nor imports
#     datasets, which it does not have).
# It checks what it made: every wheel installs for that Python (pip's dry run), and the tiny run
# starts here from .whl/cache with `datasets` made unimportable. Then: copy the checkout with .whl/
# to the GPU machine (or carry .whl) and run `bash launch/gpu_check.sh` there.
#
#   bash launch/gpu_bundle.sh [--python-version 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."

PYVER=3.12
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) PYVER=$2; shift 2 ;;
    *) echo "gpu_bundle: unknown option $1 (usage: bash launch/gpu_bundle.sh [--python-version X.Y])" >&2; exit 2 ;;
  esac
done
PY=.venv/bin/python
[ -x "$PY" ] || { echo "gpu_bundle: no .venv here: run 'make setup' first" >&2; exit 2; }
OUT=.whl
rm -rf "$OUT"
mkdir -p "$OUT"

# the closure of what the check needs beyond the GPU image, pinned to this venv's versions
"$PY" - "$OUT/requirements.txt" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement

# on the GPU image already (CUDA torch and what it and transformers bring)
HAVE = {"torch", "triton", "transformers", "sentencepiece", "safetensors", "tensorboard", "numpy",
        "pyyaml", "packaging", "filelock", "tqdm", "requests", "huggingface-hub", "tokenizers",
        "regex", "typing-extensions", "jinja2", "markupsafe", "networkx", "sympy", "mpmath",
        "fsspec", "setuptools", "pillow", "protobuf", "grpcio", "absl-py", "markdown",
        "werkzeug", "six", "certifi", "charset-normalizer", "idna", "urllib3"}
todo, pins = ["deepspeed", "hydra-core", "omegaconf", "psutil"], {}
while todo:
    name = todo.pop().lower().replace("_", "-")
    if name in pins or name in HAVE or name.startswith("nvidia-"):
        continue  # nvidia-*: the CUDA libraries come with the image's torch
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        sys.exit(f"gpu_bundle: {name} is not installed in .venv (make setup)")
    pins[name] = dist.version
    for r in dist.requires or []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(req.name)
with open(sys.argv[1], "w") as f:
    f.writelines(f"{n}=={v}\n" for n, v in sorted(pins.items()))
PY
echo "== wheels for Python $PYVER: $(tr '\n' ' ' < "$OUT/requirements.txt")"
# DeepSpeed and antlr4's runtime ship sources only: built here into pure-Python wheels
SDIST_ONLY="deepspeed antlr4-python3-runtime"
binary=$(grep -v -E "^($(echo $SDIST_ONLY | tr ' ' '|'))==" "$OUT/requirements.txt")
# shellcheck disable=SC2086
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux2014_x86_64 -d "$OUT" $binary
# setuptools: the build backend of `pip install -e .` there (pip builds it from --find-links)
"$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$OUT" "setuptools>=64"
for name in $SDIST_ONLY; do
  pin=$(grep -E "^$name==" "$OUT/requirements.txt")
  DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$OUT" "$pin"
done
# every pin has a wheel this Python can install (a resolve without the index, installing nothing)
"$PY" -m pip install --dry-run --quiet --no-index --find-links "$OUT" --no-deps --ignore-installed \
  --python-version "$PYVER" --implementation cp --platform manylinux2014_x86_64 \
  --only-binary=:all: --target "$(mktemp -d)" -r "$OUT/requirements.txt"

echo "== the tiny run's prepared data -> $OUT/cache"
# the check's tiny run (llama_train/bench/gpu_check.py), one step here, without `datasets`:
# preflight prepares its data into the cache; a second start must find it there
TINY="model=tiny data.max_documents=600 data.num_proc=1 trainer.seq_len=64 trainer.micro_batch=4
      trainer.max_steps=1 trainer.eval_every=1000 sample.tokens=0 tracking.wandb.mode=disabled"
run=$(mktemp -d)
# shellcheck disable=SC2086
LLAMA_TRAIN_CACHE="$PWD/$OUT/cache" DS_ACCELERATOR=cpu "$PY" -m llama_train.train $TINY \
  "trainer.output_dir=$run/first" > "$run/first.log" 2>&1 || { tail -20 "$run/first.log"; exit 1; }
mkdir -p "$run/nodatasets"
printf 'import sys\nsys.modules["datasets"] = None  # as on the GPU image: not installed\n' \
  > "$run/nodatasets/sitecustomize.py"
# shellcheck disable=SC2086
PYTHONPATH="$run/nodatasets" LLAMA_TRAIN_CACHE="$PWD/$OUT/cache" DS_ACCELERATOR=cpu \
  "$PY" -m llama_train.train $TINY "trainer.output_dir=$run/again" > "$run/again.log" 2>&1 \
  || { echo "gpu_bundle: the tiny run needs more than .whl/cache:"; tail -20 "$run/again.log"; exit 1; }
rm -rf "$run" "$OUT/cache/peak_flops.json"  # this CPU's matmul peak: nothing to a GPU
du -sh "$OUT"
echo "gpu_bundle: done; on the GPU machine: bash launch/gpu_check.sh (it installs from .whl)"
