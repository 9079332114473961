"""The runner's placement of its processes on GPUs (the rules: ``actors/runtime/config/gpus.py``).
Torch-free."""

from __future__ import annotations

from collections.abc import Sequence

from actors.runtime.config import (
    MIN_SHARE,
    SHARED_BUDGET,
    ConfigError,
    PlacedProcess,
    ProcessName,
    of_kind,
    on_gpu,
    sampler_engine,
    served_devices,
)
from actors.runtime.transports.table import placement_problem


def place(topology, names: Sequence[str], gpus: Sequence[str]) -> list[PlacedProcess]:
    """The placement of the processes ``names`` (this runner's: ``learner-0``,
    ``learner-0.rankR``, ``sampler-I``, ``reward-I``, ...) on ``gpus``; raises ConfigError
    naming the key of a layout that cannot work."""
    taken: dict[str, list[str]] = {}  # process -> its GPUs
    learners = [str(p) for p in of_kind("learner", names)]
    samplers = [str(p) for p in sorted(of_kind("sampler", names))]
    _place_learners(topology.learner, learners, gpus, taken)
    _place_samplers(topology.sampler, samplers, gpus, taken)
    _place_teachers(topology, names, gpus, taken)
    _place_served_models(topology, names, gpus, taken)
    placed = _shared(names, learners, taken)
    _check_transport(topology.learner, learners, samplers, taken)
    return placed


def _place_learners(L, learners: list[str], gpus: Sequence[str],
                    taken: dict[str, list[str]]) -> None:
    """One GPU per learner rank, in rank order (``cuda:N``: that GPU, for one rank)."""
    if not learners or not on_gpu(L.device, bool(gpus)):
        return
    if not gpus:
        raise ConfigError(f"learner.device: {L.device} asked for, but the runner sees no GPU "
                          "(CUDA_VISIBLE_DEVICES / nvidia-smi -L)")
    if ":" in L.device:  # cuda:N, one rank (checked)
        index = int(L.device.split(":")[1])
        if index >= len(gpus):
            raise ConfigError(f"learner.device: {L.device} asked for, but the runner sees "
                              f"{len(gpus)} GPU(s)")
        taken[learners[0]] = [gpus[index]]
        return
    if len(learners) > len(gpus):
        raise ConfigError(f"learner.nproc_per_node: {len(learners)} ranks need one GPU "
                          f"each, but the runner sees {len(gpus)} GPU(s)")
    for i, name in enumerate(_by_rank(learners)):
        taken[name] = [gpus[i]]


def _place_samplers(S, samplers: list[str], gpus: Sequence[str],
                    taken: dict[str, list[str]]) -> None:
    """Each sampler its engine's width of GPUs: the GPUs no learner took first, then again
    from the first GPU (``cuda:N``: every sampler on the GPUs from N)."""
    if not samplers or not on_gpu(S.device, bool(gpus)):
        return
    used = {g for v in taken.values() for g in v}
    engine = sampler_engine(S)
    width = engine.gpus()
    if not gpus:
        raise ConfigError(f"sampler.device: {S.device} asked for, but the runner sees no GPU "
                          "(CUDA_VISIBLE_DEVICES / nvidia-smi -L)")
    if width > len(gpus):
        raise ConfigError(f"sampler.engine.{engine.gpus_key}: {width} GPUs per sampler, but "
                          f"the runner sees {len(gpus)} GPU(s)")
    if ":" in S.device:
        index = int(S.device.split(":")[1])
        if index + width > len(gpus):
            raise ConfigError(f"sampler.device: {S.device} with {width} GPUs per sampler "
                              f"needs GPUs {index}..{index + width - 1}, but the runner sees "
                              f"{len(gpus)}")
        for name in samplers:
            taken[name] = list(gpus[index:index + width])
        return
    free = [g for g in gpus if g not in used]
    # samplers take the free GPUs in order, then start again from the first GPU
    order = free + [g for g in gpus if g in used] if len(free) >= width else list(gpus)
    for i, name in enumerate(samplers):
        start = (i * width) % len(order)
        taken[name] = [order[(start + k) % len(order)] for k in range(width)]


def _place_served_models(topology, names: Sequence[str], gpus: Sequence[str],
                       taken: dict[str, list[str]]) -> None:
    """Each replica of a served model (``[[reward.models]]``) on the GPU its ``device`` names."""
    for name, (key, device) in served_devices(topology.reward).items():
        if name in names and device.startswith("cuda"):
            index = int(device.split(":")[1]) if ":" in device else 0
            if index >= len(gpus):
                raise ConfigError(f"{key}: {device} asked for, but the runner sees {len(gpus)} "
                                  "GPU(s)")
            taken[name] = [gpus[index]]


def _shared(names: Sequence[str], learners: list[str],
            taken: dict[str, list[str]]) -> list[PlacedProcess]:
    """Each process with its GPUs, its share of a GPU it shares, and who it shares with;
    ConfigError when a share would fall under ``MIN_SHARE``."""
    # learner ranks see every GPU of the node's ranks (NCCL peer-to-peer needs the peer visible)
    ranks_gpus = [taken[n][0] for n in _by_rank(learners) if n in taken]
    users: dict[str, list[str]] = {}
    for name, on in taken.items():
        for g in on:
            users.setdefault(g, []).append(name)
    placed = []
    for name in names:
        on = taken.get(name, [])
        sharing = sorted({u for g in on for u in users[g]} - {name})
        share = 0.0
        if sharing:
            most = max(len(users[g]) for g in on)
            share = int(SHARED_BUDGET / most * 100) / 100
            if share < MIN_SHARE:
                # teachers, then samplers, are what wraps around onto used GPUs
                crowded = [name, *sharing]
                kinds = {ProcessName.parse(u).kind for u in crowded}
                key = "teacher.replicas" if "teacher" in kinds \
                    else "sampler.count" if "sampler" in kinds else "learner.nproc_per_node"
                raise ConfigError(f"{key}: {most} processes on GPU "
                                  f"{','.join(g for g in on if len(users[g]) == most)} would "
                                  f"get {share:.0%} of its memory each (at least "
                                  f"{MIN_SHARE:.0%}): use fewer samplers or more GPUs")
        placed.append(PlacedProcess(name, list(on), share, sharing,
                                    ranks_gpus if name in learners and len(learners) > 1 else []))
    return placed


def _check_transport(L, learners: list[str], samplers: list[str],
                     taken: dict[str, list[str]]) -> None:
    """The weights transport can reach every sampler from where learner rank 0 sends."""
    sender = next((n for n in learners if ProcessName.parse(n).rank == 0), None)  # it sends
    if sender is None:  # (on this runner: a learner node k > 0 places its ranks only)
        return
    for name in samplers:
        problem = placement_problem(L.weights_transport, sender, taken.get(sender, []),
                                    name, taken.get(name, []))
        if problem is not None:
            raise ConfigError(f"learner.weights_transport: {problem}")


def start_after(topology, placed: Sequence[PlacedProcess]) -> dict[str, list[str]]:
    """The processes each one waits for (until they are ready) before it is started.

    An engine that sizes its cache from the GPU's free memory as it starts (``measures_memory``:
    vLLM measures the whole device before and after its profile run) must have the GPU to
    itself meanwhile: another process loading or freeing memory then would shrink its KV cache
    or trip its profiling assert. So on a shared GPU those engines start first, one at a time,
    and the other processes on it once they are ready (a learner's ranks together: they meet
    in one rendezvous). Processes on GPUs of their own start at once, as before."""
    measures = topology.sampler.engine.measures_memory  # (auto is resolved by now)
    measuring = [p for p in placed if ProcessName.parse(p.name).kind == "sampler" and p.gpus
                 and p.shared_with and measures]
    after: dict[str, list[str]] = {}
    for i, p in enumerate(measuring):  # (placed in sampler order)
        if before := [q.name for q in measuring[:i] if set(q.gpus) & set(p.gpus)]:
            after[p.name] = before
    for p in placed:
        if p in measuring or not p.shared_with:
            continue
        if before := [q.name for q in measuring if set(q.gpus) & set(p.gpus)]:
            after[p.name] = before
    ranks = [p.name for p in placed if ProcessName.parse(p.name).kind == "learner"]
    gang = sorted({n for r in ranks for n in after.get(r, [])})
    for r in ranks if gang else ():
        after[r] = gang
    return after


def _by_rank(learners: list[str]) -> list[str]:
    return sorted(learners, key=lambda name: ProcessName.parse(name).rank)


def _place_teachers(topology, names: Sequence[str], gpus: Sequence[str],
                    taken: dict[str, list[str]]) -> None:
    """Teacher workers (``teacher-I``, one GPU each) by the samplers' rules: ``cuda:N`` names
    their GPU; otherwise they take the GPUs no learner rank or sampler has, in order, then share
    from the first GPU again (a memory share each)."""
    T = topology.teacher
    teachers = [str(p) for p in sorted(of_kind("teacher", names))]
    if not teachers or not on_gpu(T.device, bool(gpus)):
        return
    if not gpus:
        raise ConfigError(f"teacher.device: {T.device} asked for, but the runner sees no GPU "
                          "(CUDA_VISIBLE_DEVICES / nvidia-smi -L)")
    if ":" in T.device:
        index = int(T.device.split(":")[1])
        if index >= len(gpus):
            raise ConfigError(f"teacher.device: {T.device} asked for, but the runner sees "
                              f"{len(gpus)} GPU(s)")
        for name in teachers:
            taken[name] = [gpus[index]]
        return
    used = {g for v in taken.values() for g in v}
    order = [g for g in gpus if g not in used] + [g for g in gpus if g in used]
    for i, name in enumerate(teachers):
        taken[name] = [order[i % len(order)]]
