"""CUDA's current device is per thread: every function that does device work in a worker
thread is wrapped so that it sets its device there (``actors/runtime/devices.py``)."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import anyio
import pytest
import torch

from actors.runtime import devices
from actors.runtime.devices import on_device

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.anyio
async def test_the_device_is_set_in_the_thread_that_does_the_work(monkeypatch):
    # no CUDA here: torch.cuda.set_device is replaced by a recorder of (thread, device)
    calls: list[tuple[int, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(
        (threading.get_ident(), torch.device(d))))
    ran: list[int] = []

    def work(x: int) -> int:
        ran.append(threading.get_ident())
        return x + 1

    gpu = torch.device("cuda:1")
    assert await anyio.to_thread.run_sync(on_device(gpu, work), 1) == 2
    assert calls == [(ran[0], gpu)] and ran[0] != threading.get_ident()
    calls.clear()
    assert await anyio.to_thread.run_sync(on_device(torch.device("cpu"), work), 1) == 2
    assert calls == []  # a CPU device sets nothing


# the functions handed to worker threads that touch no device
NO_DEVICE_WORK = {"self.recorder.flush", "learner_group", "_save"}


def _thread_calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if name in ("anyio.to_thread.run_sync", "run_compute") and node.args:
            yield node.lineno, node.args[0]


@pytest.mark.parametrize("rel", ["actors/learner/actor.py", "actors/sampler/engines/hf.py"])
def test_every_worker_thread_doing_device_work_sets_its_device(rel):
    found = 0
    for line, fn in _thread_calls(ROOT / rel):
        found += 1
        if ast.unparse(fn) in NO_DEVICE_WORK:
            continue
        assert isinstance(fn, ast.Call) and ast.unparse(fn.func) == "on_device", \
            f"{rel}:{line}: {ast.unparse(fn)} runs in a worker thread without on_device"
    assert found >= 2


def test_on_device_names_its_device_and_function():
    def f() -> None: ...
    wrapped = on_device(torch.device("cuda:0"), f)
    assert wrapped.device == torch.device("cuda:0") and wrapped.__wrapped__ is f
    assert devices.set_thread_device(torch.device("cpu")) is None


def test_the_reference_model_is_held_in_the_compute_dtype(tiny_model, tmp_path):
    from actors.job.config.load import apply_overrides, decode_topology
    from actors.learner.policy import Policy

    topo = decode_topology(apply_overrides({}, [
        f"model.path={tiny_model}", "model.dtype=float32", "learner.dtype=bfloat16",
        "algorithm.use_kl_loss=true"]))
    policy = Policy(topo, tmp_path, None)
    try:
        assert {p.dtype for p in policy.model.parameters()} == {torch.float32}  # master weights
        assert policy.ref is not None
        assert {p.dtype for p in policy.ref.parameters()} == {torch.bfloat16}
    finally:
        policy.group.close()


def test_fused_adamw_steps_the_learners_sharded_parameters_as_the_default_does(tiny_model,
                                                                               tmp_path):
    """The learner's AdamW is the fused kernel (``policy.fused_adamw``) on a GPU and on a CPU,
    over FSDP2's DTensor parameters where it computes in bf16 on one rank: here, on the same
    sharded parameters, it lands where torch's default AdamW does (to rounding)."""
    from actors.job.config.load import apply_overrides, decode_topology
    from actors.learner.policy import Policy, fused_adamw

    assert fused_adamw(torch.device("cuda", 0)) and fused_adamw(torch.device("cpu"))
    topo = decode_topology(apply_overrides({}, [
        f"model.path={tiny_model}", "model.dtype=float32", "learner.dtype=bfloat16"]))
    policy = Policy(topo, tmp_path, None)
    try:
        params = [p for p in policy.model.parameters() if p.requires_grad]
        assert all(hasattr(p, "full_tensor") for p in params)  # FSDP2's, on one rank
        start = [p.detach().clone() for p in params]
        ends = []
        for fused in (None, True):
            with torch.no_grad():
                for p, s in zip(params, start, strict=True):
                    p.copy_(s)
            optimizer = torch.optim.AdamW(params, lr=1e-2, fused=fused)
            for seed in range(3):
                torch.manual_seed(seed)
                ids = torch.randint(0, policy.model.config.vocab_size, (2, 6))
                policy.model(input_ids=ids).logits.float().pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            ends.append([p.full_tensor().detach().clone() for p in params])
        moved = max(float((e - s.full_tensor()).abs().max()) for e, s in zip(ends[0], start, strict=True))
        assert moved > 1e-3  # the steps did move the weights
        for a, b in zip(*ends, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    finally:
        policy.group.close()


def test_the_default_suite_pins_the_cpu_and_gpu_sessions_see_the_gpus(pytestconfig):
    import os

    from tests.conftest import selects_gpu_tests

    assert not selects_gpu_tests("not slow and not gpu and not vllm")  # pyproject's addopts
    assert selects_gpu_tests("gpu") and selects_gpu_tests("gpu and not slow")
    assert not selects_gpu_tests("vllm")
    if selects_gpu_tests(pytestconfig.option.markexpr):
        pytest.skip("this pytest run selects the gpu tests: the GPUs stay visible")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # so it runs on the CPU, as do its jobs
    assert not torch.cuda.is_available()


def test_every_cuda_device_built_carries_an_index(monkeypatch):
    """``torch.cuda.set_device`` refuses a bare ``cuda`` (ValueError: Expected a torch.device
    with a specified index): every device the project keeps names its index."""
    from actors.runtime.transports.ipc import IpcReceiver, IpcSender
    from actors.runtime.transports.nccl import BroadcastReceiver

    assert devices.indexed("cuda") == torch.device("cuda", 0)
    assert devices.indexed(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert devices.indexed("cpu") == torch.device("cpu")
    assert IpcSender("cuda").device.index == 0 and IpcReceiver("cuda").device.index == 0
    assert BroadcastReceiver("cuda").device.index == 0
    seen = []
    monkeypatch.setattr(torch.cuda, "set_device", seen.append)  # no GPU here: record the call
    devices.set_thread_device(torch.device("cuda"))
    assert seen == [torch.device("cuda", 0)]


def local_step_against_torchs(model, workdir, device: str = "cpu") -> dict:
    """Four optimizer steps of one rank's FSDP2 learner (bf16 compute) twice from the same
    weights: with ``distributed.clip_grad_norm_`` and ``optimizer_step`` on local tensors, and
    with torch's own calls on the DTensors. What a check asserts: the norms (``norms``, clipping
    exercised: ``clipped``) and the parameters after (``same``) equal bit for bit, the steps
    moved them (``moved``), the optimizer's state stayed DTensors (``state_dtensors``), and no
    gradient outlived ``zero_grad`` on a parameter or its local tensor (``freed``). Shared with
    bench/gpu_check.py, which runs it on a GPU."""
    from actors.job.config.load import apply_overrides, decode_topology
    from actors.learner import distributed
    from actors.learner.policy import Policy

    topo = decode_topology(apply_overrides({}, [
        f"model.path={model}", "model.dtype=float32", "learner.dtype=bfloat16",
        f"learner.device={device}"]))
    policy = Policy(topo, workdir, None)
    try:
        params = [p for p in policy.model.parameters() if p.requires_grad]
        assert distributed._lone_shards(params)
        start = [p.detach().clone() for p in params]
        ends, norms, freed, dtensors = [], [], True, True
        for local in (False, True):
            with torch.no_grad():
                for p, s in zip(params, start, strict=True):
                    p.copy_(s)
            optimizer = torch.optim.AdamW(params, lr=1e-2)
            seen = []
            for seed in range(4):
                torch.manual_seed(seed)
                ids = torch.randint(0, policy.model.config.vocab_size, (2, 6)).to(device)
                policy.model(input_ids=ids).logits.float().pow(2).mean().backward()
                if local:
                    seen.append(float(distributed.clip_grad_norm_(params, 0.05)))
                    distributed.optimizer_step(optimizer)
                else:
                    seen.append(float(torch.nn.utils.clip_grad_norm_(params, 0.05).full_tensor()))
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                with torch.no_grad():
                    freed &= all(p.grad is None and p.to_local().grad is None for p in params)
            norms.append(seen)
            ends.append([p.full_tensor().detach().clone() for p in params])
            dtensors &= all(hasattr(v, "full_tensor") for s in optimizer.state.values()
                            for k, v in s.items() if k != "step")
        moved = max(float((e - s.full_tensor()).abs().max())
                    for e, s in zip(ends[1], start, strict=True))
        return {"norms": norms[0] == norms[1], "clipped": max(norms[0]) > 0.05,
                "same": all(torch.equal(a, b) for a, b in zip(*ends, strict=True)),
                "moved": moved > 1e-3, "state_dtensors": dtensors, "freed": freed}
    finally:
        policy.group.close()


def test_one_ranks_sharded_step_runs_on_local_tensors_and_lands_where_dtensors_do(tiny_model,
                                                                                   tmp_path):
    """On one rank computing in bf16 the learner's parameters are FSDP2 DTensors, whose
    dispatch per tensor cost the GPU step more CPU time than its kernels (BENCHMARKS.md, the
    job's profile). ``distributed.clip_grad_norm_`` and ``optimizer_step`` run on their local
    tensors instead: the same norms and the same parameters as torch's own calls on the
    DTensors, bit for bit, and the optimizer's state stays DTensors (checkpoints unchanged);
    ``zero_grad`` frees every gradient (none is left on a local tensor through the next step)."""
    facts = local_step_against_torchs(tiny_model, tmp_path)
    assert facts == {"norms": True, "clipped": True, "same": True, "moved": True,
                     "state_dtensors": True, "freed": True}


def test_the_gradient_norm_of_plain_parameters_is_torchs_with_fewer_ops():
    """On plain parameters of one device and dtype, ``distributed.clip_grad_norm_`` is torch's
    arithmetic bit for bit (the norm and the clipped gradients) without the per-parameter
    ``to`` torch dispatches to bring each norm to the first one's device (one op per
    parameter per update, hundreds on the default model); mixed dtypes take torch's path."""
    from actors.learner import distributed
    from actors.runtime.profiling import dispatched_ops

    def grads_of(params_dtype: torch.dtype) -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (7, 300, 1, 64)]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        params[2].grad = None  # a parameter with no gradient this step
        params[3] = torch.nn.Parameter(params[3].detach().to(params_dtype))
        params[3].grad = torch.randn(64, generator=gen).to(params_dtype)
        return params

    for dtype in (torch.float32, torch.bfloat16):
        ours, theirs = grads_of(dtype), grads_of(dtype)
        with torch.profiler.profile() as prof:
            norm = distributed.clip_grad_norm_(ours, 0.5)
        with torch.profiler.profile() as torchs:
            expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
        assert torch.equal(norm, expected) and float(norm) > 0.5  # clipping exercised
        assert all((a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
                   for a, b in zip(ours, theirs, strict=True))
        ops, their_ops = dispatched_ops(prof.events()), dispatched_ops(torchs.events())
        if dtype == torch.float32:  # the clip coefficient's alone, however many parameters
            assert ops["aten::to"] == 1 and their_ops["aten::to"] > 1, (ops, their_ops)
        else:
            assert ops == their_ops
