import os
import shutil
import subprocess
import sys
import tempfile

import pytest


def selects_gpu_tests(markexpr: str) -> bool:
    """Whether ``-m MARKEXPR`` selects tests marked ``gpu`` (``-m gpu``, ``-m "gpu and not
    slow"``); the default suite's expression (``not gpu``, from pyproject) does not."""
    if not markexpr:
        return True  # no expression at all (-m ''): every test, the gpu ones too
    try:
        from _pytest.mark.expression import Expression

        return bool(Expression.compile(markexpr).evaluate(lambda name, **kw: name == "gpu"))
    except Exception:  # a pytest without that module: read the words
        return "gpu" in markexpr and "not gpu" not in markexpr


def pytest_configure(config):
    # The default suite runs on the CPU on any machine: its tests and the jobs they start would
    # otherwise pick a GPU (``auto`` devices: CUDA, bf16) and fail for test reasons. Only a
    # session that selects the ``gpu`` tests sees the GPUs. Set before anything asks CUDA
    # (torch reads CUDA_VISIBLE_DEVICES once, at its first CUDA call); jobs inherit it.
    if not selects_gpu_tests(config.option.markexpr):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    # Without a GPU, Triton kernels run under Triton's interpreter. It must be chosen before
    # triton is first imported (torch and transformers may import it while probing for it), so
    # here, at collection start, rather than in a fixture.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


LONGEST = "test_slow.py"  # the real default job: 30 steps on the embedded model


def pytest_collection_modifyitems(config, items):
    """The default job's file (by far the longest test) first, then the other files with
    ``slow`` tests, then the rest, each group in its collection order: the workers
    (pyproject's ``-n 2 --dist loadfile``) take whole files in this order, two queued on each,
    and a minutes-long file started last would leave one worker idle while it runs alone. Whole
    files move, so a module's fixtures still start once."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: (item.path.name != LONGEST, item.path not in slow))


@pytest.fixture(scope="session", autouse=True)
def fork_server_zygote():
    """One zygote per test session (each worker): the jobs the tests start fork their fork
    server from it instead of importing torch, transformers and the actors' bodies again
    (``actors/job/launchers/forkserver.py``; a tiny job's CPU is mostly those imports). A
    runner whose environment is not the session's, or that runs in a session of its own,
    starts its fork server afresh, as users' runners do. ``FLOWRL_FORKSERVER_ZYGOTE=0``: no
    zygote."""
    from actors.job.launchers.base import ACTOR_ENV
    from actors.job.launchers.forkserver import ZYGOTE_ENV

    if os.environ.get(ZYGOTE_ENV) == "0":
        yield
        return
    folder = tempfile.mkdtemp(dir="/tmp", prefix="flowrl-zygote-")
    path = os.path.join(folder, "zygote")
    process = subprocess.Popen([sys.executable, "-m", "actors.job.launchers.forkserver",
                                "--zygote", path], stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, text=True,
                               env={**os.environ, **ACTOR_ENV})  # a fork server's environment
    assert process.stdout is not None
    ready = process.stdout.readline().strip() == "zygote ready"  # before the first job asks
    if ready:
        os.environ[ZYGOTE_ENV] = path
    try:
        yield
    finally:
        os.environ.pop(ZYGOTE_ENV, None)
        process.kill()
        process.wait()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def anyio_backend():
    """Every async test runs on trio, the backend the actors use."""
    return "trio"


@pytest.fixture
def sockets():
    """A fresh short directory for ipc:// endpoints (their paths must stay under ~100 bytes),
    removed after the test."""
    path = tempfile.mkdtemp(dir="/tmp", prefix="flowrl-test-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random llama with the embedded model's tokenizer, built once per test session."""
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory):
    """A tiny random Qwen2.5-VL and its processor, built once per test session."""
    from tests.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm") / "model")


@pytest.fixture(scope="session")
def tiny_vllm_model(tmp_path_factory):
    """The tiny llama made wide enough for vLLM's CPU attention (head size 32; 16 is not
    supported there)."""
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-vllm") / "model", hidden=128)
