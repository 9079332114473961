"""The transport and engine tables, and a whole job on the nccl transport over gloo.

``learner.weights_transport = auto`` resolves in one function; a transport that cannot carry a
job's weights stops the runner naming the key; every engine the schema accepts has one row; and
a job whose weights go through the nccl transport's per-sampler broadcast group (gloo on this
CPU: the learner's and the sampler's real processes, the actors' own wiring) trains and ends."""

from __future__ import annotations

import subprocess
import typing

import msgspec
import pytest

from actors.job.config.load import apply_overrides, decode_topology, shares_learners_gpu
from actors.runtime.config import ENGINES, ConfigError, LearnerConfig, SamplerConfig
from actors.runtime.config.engines import auto_engine
from actors.runtime.transports.table import TRANSPORTS, resolve_transport
from tests.jobs import ROOT, command, metrics, status_lines


def test_auto_is_shm_on_one_host_and_zmq_across_hosts():
    assert resolve_transport("auto", weights_address="ipc:///tmp/x/weights") == "shm"
    assert resolve_transport("auto", weights_address="tcp://10.0.0.1:5555") == "zmq"
    assert resolve_transport("nccl", weights_address="ipc:///tmp/x/weights") == "nccl"


def test_every_choice_in_the_schema_has_one_row():
    choices = typing.get_args(typing.get_type_hints(LearnerConfig)["weights_transport"])
    assert set(choices) == {"auto", *TRANSPORTS}
    engines = typing.get_args(typing.get_type_hints(SamplerConfig)["engine"])
    assert {e.__struct_config__.tag for e in engines} == {"auto", *ENGINES}
    assert all(ENGINES[name] is row for name, row in zip(list(ENGINES), engines[1:], strict=True))
    assert ENGINES["hf"].problem() is None
    assert auto_engine().name == "hf"  # no GPU here


def test_auto_engine_follows_the_samplers_own_device():
    """On a GPU host with vLLM installed, ``sampler.device = "cpu"`` gets hf: auto reads the
    device (vLLM started with no GPU visible could only crash and restart)."""
    gpu_engines = [n for n, r in ENGINES.items() if r.prefer_on_gpu and r.problem() is None]
    assert auto_engine("cpu").name == "hf"
    assert auto_engine("cuda:1").name == (gpu_engines[0] if gpu_engines else "hf")
    topo = decode_topology(apply_overrides({}, ["sampler.device=cpu"]))
    assert topo.sampler.engine == ENGINES["hf"]()  # auto resolved, with the engine's defaults


@pytest.mark.parametrize(("overrides", "message"), [
    (["learner.weights_transport=ipc", "learner.device=cpu", "sampler.device=cpu"],
     "learner.weights_transport: ipc moves weights GPU to GPU for sampler.engine = hf"),
    (["learner.weights_transport=shm", "learner.weights_address=tcp://10.0.0.1:5555"],
     "learner.weights_transport: shm needs every sampler on the learner's host"),
])
def test_a_transport_that_cannot_carry_the_weights_names_the_key(overrides, message):
    with pytest.raises(ConfigError) as caught:
        decode_topology(apply_overrides({}, overrides))  # sampler.engine = auto: hf here
    assert str(caught.value).startswith(message)


@pytest.mark.anyio
async def test_an_engine_starts_from_its_row(tiny_model):
    import torch

    from actors.sampler.engines.base import EngineSpec
    from actors.sampler.engines.hf import HFEngine
    topo = decode_topology(apply_overrides({}, ["sampler.engine=hf"]))
    engine = await topo.sampler.engine.start(EngineSpec(tiny_model, "float32", 0,
                                                        torch.device("cpu"), topo.sampler))
    assert isinstance(engine, HFEngine) and engine.version == -1 and not engine.continuous


def test_a_job_on_the_nccl_transport_over_gloo(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    res = subprocess.run(command(tiny_model, run_dir, "learner.total_steps=3",
                                 "learner.weights_transport=nccl"),
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]
    status = status_lines(run_dir)
    last = status[-1]  # the runner's last record of each actor
    assert last["event"] == "stopped" and last["learner-0"]["weights_transport"] == "nccl"
    # version 0 and a trained one at least went through the group and into the engine
    assert last["sampler-0"]["weight_loads"] >= 2 and last["sampler-0"]["version"] >= 1
    assert "weights_error" not in last["sampler-0"]


@pytest.mark.anyio
async def test_a_header_naming_no_usable_transport_costs_its_version_not_the_channel(sockets):
    """An unknown transport, or an nccl header without its group, is reported in the
    sampler's status and the next version (zmq) is taken whole."""
    import anyio
    import torch
    import zmq

    from actors.runtime.tensors import meta, raw_bytes
    from actors.runtime.weights import WeightsSubscriber
    from actors.runtime.zmq_bridge import make_socket
    from messages.codec import encode
    from messages.weights import WeightsHeader

    zctx = zmq.Context()
    address = f"ipc://{sockets}/weights"
    t = torch.arange(6, dtype=torch.float32)
    try:
        with anyio.fail_after(30), make_socket(zctx, zmq.ROUTER, bind=address) as learner, \
             make_socket(zctx, zmq.DEALER, connect=address) as sampler_sock:
            subscriber = WeightsSubscriber(sampler_sock)
            async with anyio.create_task_group() as tg:
                tg.start_soon(subscriber.serve)
                for good, bad, error in (
                        (2, WeightsHeader(version=1, tensors=[], transport="carrier"),
                         "unknown transport 'carrier'"),
                        (3, WeightsHeader(version=3, tensors=[meta("w", t)], transport="nccl"),
                         "without a group")):
                    before = subscriber.received
                    peer, _ = await learner.recv_multipart()
                    await learner.send_multipart([peer, encode(bad)])
                    peer, _ = await learner.recv_multipart()  # polled again, after a second
                    assert error in subscriber.error and subscriber.received == before
                    await learner.send_multipart([peer, encode(WeightsHeader(
                        version=good, tensors=[meta("w", t)])), raw_bytes(t)])
                    await subscriber.wait_for(good)
                    version, got = subscriber.take()
                    assert version == good and torch.equal(got["w"], t)
                tg.cancel_scope.cancel()
    finally:
        zctx.destroy(linger=0)


@pytest.mark.parametrize(("overrides", "gpus", "shares"), [
    ([], ["0"], True),  # the default job on a one-GPU machine: hf samplers beside the learner
    (["sampler.count=2"], ["0"], True),
    ([], [], False),  # no GPU
    (["sampler.device=cpu"], ["0"], False),
    ([], ["0", "1"], False),  # the samplers take the free GPU
    (["learner.device=cuda:1", "sampler.device=cuda:1"], ["0", "1"], True),
    (["learner.lora.rank=8", "learner.lora.alpha=16"], ["0"], False),  # adapters: megabytes
    (["learner.nproc_per_node=2"], ["0", "1"], False),
])
def test_auto_picks_ipc_only_for_samplers_on_the_learners_one_gpu(overrides, gpus, shares):
    topo = decode_topology(apply_overrides({}, ["sampler.device=cpu", "learner.device=cpu"]))
    raw = apply_overrides({}, overrides)
    L = msgspec.convert(raw.get("learner", {}), LearnerConfig)
    S = msgspec.structs.replace(msgspec.convert(raw.get("sampler", {}), SamplerConfig),
                                engine=auto_engine("cpu"))  # hf
    assert shares_learners_gpu(L, S, gpus) is shares
    assert topo.learner.weights_transport == "shm"  # CPUs: the file in /dev/shm
    assert resolve_transport("auto", weights_address="auto", beside=True) == "ipc"
    assert resolve_transport("auto", weights_address="auto", hosts=True, beside=True) == "zmq"
    assert resolve_transport("shm", weights_address="auto", beside=True) == "shm"


def test_the_runner_on_a_one_gpu_machine_sends_hf_samplers_weights_by_ipc(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # what the runner would see (torch not asked)
    assert decode_topology(apply_overrides({}, ["sampler.engine=hf"])).learner.weights_transport \
        == "ipc"
    assert decode_topology(apply_overrides({}, ["sampler.engine=hf", "learner.weights_transport=shm"])
                           ).learner.weights_transport == "shm"  # a named one stays
