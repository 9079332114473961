#!/usr/bin/env bash
# The torch versions the project claims, tested: the tests that touch torch's internals (the
# engines and their decode modes, the learner's distributed step and optimizer, checkpoints,
# the kernels) under the oldest supported torch (2.11, the GPU machines' own, with their
# transformers 5.17) and the newest on PyPI, beside .venv's 2.13 that runs every suite.
#
#   bash .ci/torch.sh setup VERSION   # .venv-torch-VERSION: that torch over .venv's other packages
#   bash .ci/torch.sh test VERSION    # the torch-internal tests in it (two workers)
#
# PyPI's Linux x86_64 torch wheels are CUDA builds: they run on a CPU, with the CUDA libraries
# they name installed beside them as packages (about 2.6 GB to download per version). This
# machine's pip caps torch (/etc/xdg/pip); the cap does not apply to these folders. Needs .venv
# (.ci/setup.sh --tests) first.
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST=2.11.0
NEWEST=2.15.0
TESTS=(tests/test_kernels_*.py tests/test_hf_engine.py tests/test_devices.py tests/test_learner.py
       tests/test_learner_fit.py tests/test_learner_ranks.py tests/test_lora_checkpoint.py
       tests/test_packing.py)
usage() { echo "usage: bash .ci/torch.sh setup|test oldest|newest|VERSION" >&2; exit 2; }
[ $# = 2 ] || usage
case "$2" in
  oldest) VERSION=$OLDEST ;;
  newest) VERSION=$NEWEST ;;
  *) VERSION=$2 ;;
esac
VENV=.venv-torch-$VERSION
case "$1" in
  setup)
    PY=${PYTHON:-python3}
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    pip() { PIP_CONSTRAINT=/dev/null "$VENV/bin/python" -m pip -q --disable-pip-version-check "$@"; }
    extra=()
    # the GPU machines' transformers beside their torch; Triton 3.6 (torch 2.11's) runs the
    # kernels' tests in its interpreter, which numpy 2.4 breaks
    [ "$VERSION" = "$OLDEST" ] && extra=("transformers==5.17.0" "numpy<2.4")
    pip install "torch==$VERSION" "${extra[@]}"
    # everything else (the project's other packages, pytest) is .venv's, found after this
    # folder's own: a path file written once pip is done here, so pip never sees .venv's
    # packages as this folder's to upgrade or remove
    site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    base=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$base" > "$site/flowrl-base-venv.pth"
    "$VENV/bin/python" -c "import torch, transformers, pytest; v = torch.__version__; \
assert v.split('+')[0] == '$VERSION', f'torch {v}: expected $VERSION'; \
assert torch.__file__.startswith('$VENV/') or '/$VENV/' in torch.__file__, torch.__file__; \
print(f'$VENV: torch {v}, transformers {transformers.__version__}')"
    ;;
  test)
    [ -x "$VENV/bin/python" ] || { echo "no $VENV: run bash .ci/torch.sh setup $2 first" >&2; exit 2; }
    "$VENV/bin/python" -c "import torch, transformers; \
print(f'torch {torch.__version__}, transformers {transformers.__version__}')"
    # the slow ones of these files too (compiling the decode step): the torch versions' point
    "$VENV/bin/python" -m pytest -q -m "not gpu and not vllm and not ray" "${TESTS[@]}"
    ;;
  *) usage ;;
esac
