"""What the runner resolves, before anything starts, about where each process computes: its
CUDA_VISIBLE_DEVICES, its device and its share of a shared GPU, for a pretend number of GPUs
(the count is the runner's, so the resolution runs here without one)."""

from __future__ import annotations

import subprocess

import msgspec
import pytest

from actors.job.config.load import apply_overrides, decode_topology
from actors.job.launch import with_placement
from actors.job.supervisor import Job
from actors.runtime.config import ConfigError, visible_gpus


def topology(sockets: str, *extra: str):
    # zmq: auto is shm on one host, whose check reads the model (left unresolved here)
    return decode_topology(apply_overrides({}, [f"control_address=ipc://{sockets}/control",
                                                "learner.weights_transport=zmq", *extra]))


def envs(topo, tmp_path, gpus: list[str]) -> dict[str, dict[str, str]]:
    """The placement variables each process of the job is started with (the runner's Job)."""
    placed = with_placement(topo, tmp_path, gpus)
    job = Job(placed, tmp_path, home=tmp_path)
    try:
        keys = ("CUDA_VISIBLE_DEVICES", "FLOWRL_DEVICE", "FLOWRL_GPU_MEMORY_SHARE")
        return {name: {k: v for k, v in p.env.items() if k in keys}
                for name, p in job.procs.items()}
    finally:
        job.control.close()
        job.zmq.term()


def test_every_role_gets_gpus_of_its_own(tmp_path, sockets):
    topo = topology(sockets, "learner.nproc_per_node=2", "learner.groups_per_step=4",
                    "sampler.count=2", "sampler.engine=vllm", "sampler.engine.tensor_parallel_size=2")
    got = envs(topo, tmp_path, [str(i) for i in range(8)])
    gpu = {"FLOWRL_DEVICE": "cuda:0"}
    # a learner rank sees every rank's GPU (torchrun's way: NCCL peer-to-peer needs the peer
    # visible) and computes on its own
    assert got["learner-0"] == {"CUDA_VISIBLE_DEVICES": "0,1", "FLOWRL_DEVICE": "cuda:0"}
    assert got["learner-0.rank1"] == {"CUDA_VISIBLE_DEVICES": "0,1", "FLOWRL_DEVICE": "cuda:1"}
    assert got["sampler-0"] == {"CUDA_VISIBLE_DEVICES": "2,3", **gpu}
    assert got["sampler-1"] == {"CUDA_VISIBLE_DEVICES": "4,5", **gpu}
    for name in ("replay-0", "router-0", "reward-0"):  # they never touch a GPU
        assert got[name] == {"CUDA_VISIBLE_DEVICES": "", "FLOWRL_DEVICE": "cpu"}


def test_two_roles_on_one_gpu_split_its_memory(tmp_path, sockets):
    got = envs(topology(sockets, "sampler.engine=hf"), tmp_path, ["0"])
    assert got["learner-0"] == {"CUDA_VISIBLE_DEVICES": "0", "FLOWRL_DEVICE": "cuda:0",
                                "FLOWRL_GPU_MEMORY_SHARE": "0.45"}
    assert got["sampler-0"] == got["learner-0"]


def test_the_runners_own_visible_gpus_are_handed_out_by_name(tmp_path, sockets):
    gpus = visible_gpus({"CUDA_VISIBLE_DEVICES": "3,5"})
    got = envs(topology(sockets, "sampler.engine=hf"), tmp_path, gpus)
    assert got["learner-0"]["CUDA_VISIBLE_DEVICES"] == "3"
    assert got["sampler-0"]["CUDA_VISIBLE_DEVICES"] == "5"
    assert "FLOWRL_GPU_MEMORY_SHARE" not in got["sampler-0"]


def test_without_gpus_everything_computes_on_the_cpu(tmp_path, sockets):
    got = envs(topology(sockets), tmp_path, [])
    assert all(e == {"CUDA_VISIBLE_DEVICES": "", "FLOWRL_DEVICE": "cpu"} for e in got.values())


def test_a_cpu_setting_stays_on_the_cpu_beside_gpus(tmp_path, sockets):
    got = envs(topology(sockets, "sampler.device=cpu", "sampler.engine=hf"), tmp_path, ["0"])
    assert got["sampler-0"]["FLOWRL_DEVICE"] == "cpu"
    assert got["learner-0"] == {"CUDA_VISIBLE_DEVICES": "0", "FLOWRL_DEVICE": "cuda:0"}


@pytest.mark.parametrize(("extra", "gpus", "key"), [
    (["sampler.engine=vllm", "sampler.engine.tensor_parallel_size=4"], 2,
     "sampler.engine.tensor_parallel_size"),
    (["learner.nproc_per_node=4", "learner.groups_per_step=4"], 2, "learner.nproc_per_node"),
    (["sampler.engine=hf", "sampler.count=12"], 1, "sampler.count"),
    (["sampler.engine=hf", "sampler.device=cuda:1"], 1, "sampler.device"),
])
def test_a_layout_that_cannot_fit_is_an_error_naming_the_key(tmp_path, sockets, extra, gpus,
                                                              key):
    with pytest.raises(ConfigError, match=key):
        with_placement(topology(sockets, *extra), tmp_path, [str(i) for i in range(gpus)])


def test_the_placement_is_written_with_the_topology(tmp_path, sockets):
    placed = with_placement(topology(sockets, "sampler.engine=hf"), tmp_path, ["0", "1"])
    again = msgspec.json.decode(msgspec.json.encode(placed), type=type(placed))
    rows = {p.name: p for p in again.placement}
    assert rows["sampler-0"].gpus == ["1"] and rows["learner-0"].gpus == ["0"]
    assert rows["sampler-0"].describe() == "sampler-0: GPU 1"


def test_the_gpu_count_comes_without_torch():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == ["0"]  # CUDA stops at -1

    def smi(cmd, **kwargs):
        assert cmd == ["nvidia-smi", "-L"]
        return subprocess.CompletedProcess(cmd, 0, stdout="GPU 0: NVIDIA H200 (UUID: a)\n"
                                           "GPU 1: NVIDIA H200 (UUID: b)\n")

    assert visible_gpus({}, run=smi) == ["0", "1"]

    def missing(cmd, **kwargs):
        raise FileNotFoundError(cmd[0])

    assert visible_gpus({}, run=missing) == []


@pytest.mark.parametrize(("extra", "gpus", "why"), [
    # vLLM's IPC engine looks the handles up by its own GPU's UUID
    (["learner.weights_transport=ipc", "sampler.engine=vllm"], 2,
     "sampler-0 is on GPU 1"),
    (["learner.weights_transport=ipc", "sampler.engine=vllm",
      "sampler.engine.tensor_parallel_size=2"], 2, "sampler-0 is on GPU 0,1"),
    (["learner.weights_transport=ipc", "sampler.engine=hf", "sampler.device=cpu"], 1,
     "sampler-0 is on the CPU"),
    # NCCL refuses two ranks of one group on one GPU
    (["learner.weights_transport=nccl", "sampler.engine=hf"], 1, "shares GPU 0 with learner-0"),
    (["learner.weights_transport=nccl", "sampler.engine=vllm", "sampler.count=2"], 2,
     "sampler-1 shares GPU 0"),
    (["learner.weights_transport=nccl", "sampler.engine=hf", "sampler.device=cpu"], 1,
     "learner-0 is on GPU 0 and sampler-0 on the CPU"),
])
def test_a_gpu_transport_the_placement_cannot_serve_is_refused(tmp_path, sockets, extra, gpus,
                                                               why):
    topo = topology(sockets, *extra)
    with pytest.raises(ConfigError, match=f"^learner.weights_transport: .*{why}"):
        with_placement(topo, tmp_path, [str(i) for i in range(gpus)])


@pytest.mark.parametrize(("extra", "gpus"), [
    (["learner.weights_transport=ipc", "sampler.engine=vllm"], 1),  # the learner's own GPU
    (["learner.weights_transport=ipc", "sampler.engine=hf", "sampler.count=2"], 1),
    (["learner.weights_transport=nccl", "sampler.engine=vllm"], 2),  # a GPU of its own
    (["learner.weights_transport=nccl", "sampler.engine=vllm",
      "sampler.engine.tensor_parallel_size=2", "learner.nproc_per_node=2",
      "learner.groups_per_step=4"], 4),
    (["learner.weights_transport=nccl", "sampler.engine=hf"], 0),  # gloo on the CPU
])
def test_a_gpu_transport_on_a_placement_it_serves_is_kept(tmp_path, sockets, extra, gpus):
    with_placement(topology(sockets, *extra), tmp_path, [str(i) for i in range(gpus)])


def test_the_runner_refuses_the_layout_before_starting_anything(tmp_path, tiny_model):
    """The runner, given one pretend GPU (CUDA_VISIBLE_DEVICES: it never asks torch), refuses
    nccl between a learner and a sampler that would share it: exit 2, the key named."""
    import os
    import sys

    from tests.jobs import ROOT, TINY

    done = subprocess.run(
        [sys.executable, "runner.py", "topology.toml", f"model.path={tiny_model}",
         f"run.dir={tmp_path / 'run'}", *TINY, "learner.weights_transport=nccl"],
        cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"}, capture_output=True,
        text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: bad topology: learner.weights_transport: nccl: NCCL refuses")
    assert not (tmp_path / "run" / "logs").exists()  # nothing was started


def afters(topo, tmp_path, gpus: int) -> dict[str, list[str]]:
    """What each process of the runner's Job waits for before it is started."""
    job = Job(with_placement(topo, tmp_path, [str(i) for i in range(gpus)]), tmp_path,
              home=tmp_path)
    try:
        return {name: p.after for name, p in job.procs.items() if p.after}
    finally:
        job.control.close()
        job.zmq.term()


@pytest.mark.parametrize(("extra", "gpus", "expected"), [
    # vLLM measures the GPU's free memory while it starts
    (["sampler.engine=vllm"], 1, {"learner-0": ["sampler-0"]}),
    (["sampler.engine=vllm", "sampler.count=2"], 1,
     {"sampler-1": ["sampler-0"], "learner-0": ["sampler-0", "sampler-1"]}),
    (["sampler.engine=vllm", "sampler.count=2", "learner.nproc_per_node=2",
      "learner.groups_per_step=4"], 2,  # ranks meet in one rendezvous: they start together
     {"learner-0": ["sampler-0", "sampler-1"], "learner-0.rank1": ["sampler-0", "sampler-1"]}),
    (["sampler.engine=vllm"], 2, {}),  # a GPU of its own
    (["sampler.engine=hf"], 1, {}),  # nothing measures: all start at once, as before
])
def test_processes_sharing_a_gpu_with_vllm_start_after_it(tmp_path, sockets, extra, gpus,
                                                         expected):
    assert afters(topology(sockets, *extra), tmp_path, gpus) == expected
