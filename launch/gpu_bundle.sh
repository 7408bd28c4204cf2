#!/usr/bin/env bash
# Prepare here, in .whl/, what an offline GPU machine lacks for launch/gpu_check.sh (issue 30),
# so that the GPU run installs from it with --no-index and prepares no data:
#   * Python wheels (for the GPU machine's Python, default 3.12) of what the check imports and
#     a CUDA image with torch, transformers, sentencepiece, safetensors, tensorboard and numpy
#     lacks: deepspeed, hydra-core, omegaconf, psutil and everything they require, at the
#     versions installed in this checkout's .venv (the versions the tests ran with);
#     .whl/requirements.txt lists them (and setuptools, to install this checkout there);
#   * .whl/cache: the prepared built-in data of the checks (tokenizers and shards: the tiny run's,
#     the ~1B benches' and the simulated llama3_8b's; the GPU run points LLAMA_TRAIN_CACHE there,
#     so it neither trains a tokenizer nor imports
#     datasets, which it does not have). The built-in corpus is the running Python's standard
#     library (its docstrings and comments), so each Python version has its own text, and its
#     prepared data is keyed by that text's digest: the GPU machine's Python finds this data only
#     if it is that text. So an interpreter of that version (--python; default python$PYVER on
#     PATH, else pyenv's newest $PYVER.*) extracts the corpus here (LLAMA_TRAIN_CORPUS_PYTHON)
#     into .whl/cache/corpus, where a GPU machine's python3 of the same X.Y.Z reads it, and this
#     .venv prepares the tiny run's data from it. .whl/data.json records that Python and the key.
# It checks what it made: every wheel installs for that Python (pip's dry run); the tiny run
# starts here from .whl/cache with `datasets` made unimportable and prepares nothing; and that
# interpreter, running llama_train/data/corpus.py alone (standard library only, as a bare
# python3 would), computes for its own corpus the key the data was prepared under, reading
# .whl/cache (as the GPU machine will) and extracting it afresh. Then: copy the checkout with
# .whl/ to the GPU machine (or carry .whl) and run `bash launch/gpu_check.sh` there.
#
#   bash launch/gpu_bundle.sh [--python-version 3.12] [--python /path/to/python3.12]
set -euo pipefail
cd "$(dirname "$0")/.."

PYVER=
TARGET=
usage="usage: bash launch/gpu_bundle.sh [--python-version X.Y] [--python PATH]"
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) PYVER=$2; shift 2 ;;
    --python) TARGET=$2; shift 2 ;;
    *) echo "gpu_bundle: unknown option $1 ($usage)" >&2; exit 2 ;;
  esac
done
# the GPU machine's Python here: it extracts the built-in corpus the tiny run's data is made of
if [ -z "$TARGET" ]; then
  want=${PYVER:-3.12}
  for c in "python$want" $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}/versions/$want".*/bin/python3 \
                           2>/dev/null | sort -rV); do
    TARGET=$("$c" -c 'import sys; print(sys.executable)' 2>/dev/null) && [ -n "$TARGET" ] && break
    TARGET=
  done
  [ -n "$TARGET" ] || { echo "gpu_bundle: no Python $want here to extract the built-in corpus" \
    "with (the GPU machine's python3 reads its own standard library): install one (e.g. pyenv" \
    "install $want) or give it with --python PATH ($usage)" >&2; exit 2; }
fi
TARGET_VERSION=$("$TARGET" -c 'import platform; print(platform.python_version())') \
  || { echo "gpu_bundle: --python $TARGET does not run" >&2; exit 2; }
if [ -n "$PYVER" ] && [ "${TARGET_VERSION%.*}" != "$PYVER" ]; then
  echo "gpu_bundle: --python $TARGET is Python $TARGET_VERSION, not --python-version $PYVER" >&2
  exit 2
fi
PYVER=${TARGET_VERSION%.*}
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
todo, pins = ["deepspeed", "hydra-core", "omegaconf", "psutil", "torchao"], {}
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

echo "== the checks' prepared data for Python $TARGET_VERSION ($TARGET) -> $OUT/cache"
# Everything prepared here is made from the built-in corpus $TARGET extracts (kept in
# $OUT/cache/corpus for the GPU machine), under that text's key.
export LLAMA_TRAIN_CACHE="$PWD/$OUT/cache" LLAMA_TRAIN_CORPUS_PYTHON="$TARGET"
# every prepared dataset the checks read (llama_train/bench/gpu_check.py's data stage: the tiny
# run's, the ~1B bench's 8192-piece data and the padded 128256-piece tokenizer with its data);
# then, without `datasets`, the tiny run and the data stage again must find it all and prepare
# nothing
TINY="model=tiny data.max_documents=600 data.num_proc=1 trainer.seq_len=64 trainer.micro_batch=4
      trainer.max_steps=1 trainer.eval_every=1000 sample.tokens=0 tracking.wandb.mode=disabled"
run=$(mktemp -d)
prepared() { (cd "$OUT/cache" && ls -d builtin-*/ 2>/dev/null) || true; }
DS_ACCELERATOR=cpu "$PY" -m llama_train.bench.gpu_check --prepare-data "$run/first.json" \
  > "$run/first.log" 2>&1 || { tail -20 "$run/first.log"; exit 1; }
dirs=$(prepared)
[ -n "$dirs" ] || { echo "gpu_bundle: the data stage prepared nothing in $OUT/cache"; exit 1; }
mkdir -p "$run/nodatasets"
printf 'import sys\nsys.modules["datasets"] = None  # as on the GPU image: not installed\n' \
  > "$run/nodatasets/sitecustomize.py"
# shellcheck disable=SC2086
PYTHONPATH="$run/nodatasets" DS_ACCELERATOR=cpu \
  "$PY" -m llama_train.train $TINY "trainer.output_dir=$run/again" > "$run/again.log" 2>&1 \
  || { echo "gpu_bundle: the tiny run needs more than .whl/cache:"; tail -20 "$run/again.log"
       exit 1; }
PYTHONPATH="$run/nodatasets" DS_ACCELERATOR=cpu \
  "$PY" -m llama_train.bench.gpu_check --prepare-data "$run/again.json" > "$run/again2.log" 2>&1 \
  || { echo "gpu_bundle: the data stage needs more than .whl/cache:"; tail -20 "$run/again2.log"
       exit 1; }
if [ "$(prepared)" != "$dirs" ] || grep -q "prepared data in" "$run/again.log" \
   || grep -q '"created": true' "$run/again.json"; then
  echo "gpu_bundle: the second start prepared its data again:"; tail -20 "$run/again.log"
  cat "$run/again.json"; exit 1
fi
# The key the GPU machine's python3 computes for its own corpus, running corpus.py alone: from
# $OUT/cache (as it will there) and extracted afresh (that text's key). The data's it must be.
key=$("$PY" -c 'import json, sys; print(*sorted({json.load(open(f))["source"]["corpus"]
                                                 for f in sys.argv[1:]}))' \
      "$OUT"/cache/builtin-*/meta.json)
for cache in "$LLAMA_TRAIN_CACHE" "$run/fresh"; do
  got=$(LLAMA_TRAIN_CACHE=$cache "$TARGET" -I llama_train/data/corpus.py key builtin) \
    || { echo "gpu_bundle: $TARGET could not compute its corpus key"; exit 1; }
  [ "$got" = "$key" ] || { echo "gpu_bundle: Python $TARGET_VERSION computes the key $got for" \
    "its built-in corpus (LLAMA_TRAIN_CACHE=$cache), but $OUT/cache was prepared for $key"
    exit 1; }
done
unset LLAMA_TRAIN_CACHE LLAMA_TRAIN_CORPUS_PYTHON
printf '{"python": "%s", "corpus_key": "%s"}\n' "$TARGET_VERSION" "$key" > "$OUT/data.json"
rm -rf "$run" "$OUT/cache/peak_flops.json"  # this CPU's matmul peak: nothing to a GPU
du -sh "$OUT"
echo "gpu_bundle: Python $TARGET_VERSION computes the key of its corpus, ${key:0:22}...," \
  "from $OUT/cache and afresh: a GPU machine whose python3 is $TARGET_VERSION finds" \
  "$OUT/cache/$(prepared | tr '\n' ' ')and prepares nothing (another version prepares its own," \
  "without datasets; $OUT/data.json)"
echo "gpu_bundle: done; on the GPU machine: bash launch/gpu_check.sh (it installs from .whl)"
