import os
import tempfile

import pytest
import torch

# Without a GPU, Triton kernels run under Triton's interpreter. It must be chosen before triton
# is first imported (torch and transformers may import it while probing for it), so here, at
# collection start, rather than in a fixture.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def anyio_backend():
    """Every async test runs on trio, the backend the actors use."""
    return "trio"


@pytest.fixture
def sockets() -> str:
    """A fresh short directory for ipc:// endpoints (their paths must stay under ~100 bytes)."""
    return tempfile.mkdtemp(dir="/tmp", prefix="flowrl-test-")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random llama with the embedded model's tokenizer, built once per test session."""
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_vllm_model(tmp_path_factory):
    """The tiny llama made wide enough for vLLM's CPU attention (head size 32; 16 is not
    supported there)."""
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-vllm") / "model", hidden=128)
