"""The sampler's engine and its agreement with the learner, in-process on the tiny model.

The parity test is the one the off-policy correction stands on: with the same weights, the
behaviour log-probs the engine returns for the tokens it sampled and the log-probs the learner
recomputes for those tokens must agree (fp32 on the CPU), before and after a weight update.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from actors.data.chat import ChatTokenizer
from actors.job.config.load import apply_overrides, decode_topology
from actors.learner.batch import build_batch
from actors.learner.objective import response_logprobs
from actors.learner.trainer import Trainer
from actors.runtime.tensors import to_wire
from actors.sampler.engines.base import GenerateRequest
from actors.sampler.engines.hf import HFEngine
from messages.rollout import ChatMessage, Prompt, Sample, SamplingParams, ScoredGroup

TOLERANCE = 1e-5  # fp32 on the CPU: the paths differ only in the order of float operations
# (measured on the tiny model: max 4.8e-7, mean 8e-8 per token)


def scored_group(prompt_ids: list[int], completions, params: SamplingParams, gid: int = 0):
    samples = [Sample(to_wire(c.token_ids), to_wire(c.logprobs), c.version, "", c.finish_reason,
                      reward=float(i % 2), token_versions=to_wire(c.versions),
                      loss_mask=to_wire(c.loss_mask)) for i, c in enumerate(completions)]
    return ScoredGroup(Prompt(gid, [ChatMessage("user", "x")], "repeat_letter", "a"),
                       to_wire(torch.tensor(prompt_ids, dtype=torch.int32)), samples, "s",
                       sampling=params)


def learner_logprobs(trainer: Trainer, groups: list[ScoredGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """(behaviour, recomputed) log-probs of every response token of ``groups``."""
    batch = build_batch(groups, trainer.policy.pad_id).to(trainer.policy.device)
    mask = batch.response_mask.bool()
    with torch.no_grad():
        lp = response_logprobs(trainer.policy.model, batch, groups[0].sampling.temperature)
    return batch.behaviour_logprobs[mask], lp[mask]


@pytest.mark.anyio
@pytest.mark.parametrize(("temperature", "decode"),
                         [(1.0, "eager"), (0.7, "eager"),
                          # inductor's C++ compile: tens of seconds on a fresh machine
                          pytest.param(0.7, "inductor", marks=pytest.mark.slow)])
async def test_behaviour_logprobs_match_the_learners_recomputation(tiny_model, tmp_path,
                                                                   temperature, decode):
    """(``inductor``: a static cache over padded prompts; on a CPU transformers decodes it
    eagerly, on a GPU the same path runs compiled: bench/gpu_check.py's hf parity rows.)"""
    topo = decode_topology(apply_overrides({}, [f"model.path={tiny_model}", "learner.lr=1e-2",
                                                "algorithm.n=4", "learner.groups_per_step=2"]))
    trainer = Trainer(topo, tmp_path)
    engine = HFEngine(tiny_model, "float32", seed=0, decode=decode)
    tok = ChatTokenizer(tiny_model)
    params = SamplingParams(temperature=temperature, max_tokens=8)
    prompts = [tok.prompt_ids([ChatMessage("user", f"say {c}")]) for c in "ab"]
    await engine.load_weights(0, dict(trainer.policy.snapshot()))
    report = []
    for version in (0, 1):
        groups = [scored_group(ids, gens, params, gid)
                  for gid, (ids, gens) in enumerate(zip(prompts, await engine.generate(
                      [GenerateRequest(ids, params, 4) for ids in prompts]), strict=True))]
        assert {int(v) for g in groups for s in g.samples
                for v in torch.frombuffer(bytearray(s.token_versions.data), dtype=torch.int32)} \
            <= {version}
        behaviour, recomputed = learner_logprobs(trainer, groups)
        diff = (behaviour - recomputed).abs()
        report.append(f"v{version} T={temperature}: {diff.numel()} tokens, max |diff| "
                      f"{float(diff.max()):.2e}, mean {float(diff.mean()):.2e}")
        assert float(diff.max()) < TOLERANCE, report[-1]
        if version == 0:  # a step moves the weights; the engine gets them as the sampler would
            trainer.train_step(groups)
            await engine.load_weights(1, dict(trainer.policy.snapshot()))
            moved = learner_logprobs(trainer, groups)
            assert float((moved[0] - moved[1]).abs().max()) > 1e-3  # the step changed the policy
    print("\n" + "\n".join(report))


@pytest.mark.anyio
async def test_engine_returns_token_ids_with_per_token_facts(tiny_model):
    engine = HFEngine(tiny_model, "float32", seed=0)
    tok = ChatTokenizer(tiny_model)
    await engine.load_weights(3, {})
    ids = tok.prompt_ids([ChatMessage("user", "say a")])
    params = SamplingParams(temperature=1.0, max_tokens=5)
    (group,) = await engine.generate([GenerateRequest(ids, params, 3)])
    assert len(group) == 3
    for g in group:
        n = g.token_ids.shape[0]
        assert 1 <= n <= 5 and g.token_ids.dtype == torch.int32
        assert g.logprobs.shape == (n,) and bool((g.logprobs <= 0).all())
        assert g.versions.tolist() == [3] * n and g.version == 3
        assert g.loss_mask.tolist() == [1] * n
        assert g.finish_reason == ("stop" if int(g.token_ids[-1]) == tok.eos_token_id else "length")
        assert g.finish_reason == "stop" or n == 5
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    (a,), (b,) = (await engine.generate([GenerateRequest(ids, greedy, 1)]))[0], \
        (await engine.generate([GenerateRequest(ids, greedy, 1)]))[0]
    assert a.token_ids.tolist() == b.token_ids.tolist()  # greedy is deterministic
    with pytest.raises(ValueError, match="same sampling parameters"):
        await engine.generate([GenerateRequest(ids, params, 1), GenerateRequest(ids, greedy, 1)])


@pytest.mark.anyio
async def test_cancelling_a_generation_stops_it_at_the_next_token(tiny_model):
    engine = HFEngine(tiny_model, "float32", seed=0)
    ids = ChatTokenizer(tiny_model).prompt_ids([ChatMessage("user", "say a")])
    params = SamplingParams(temperature=1.0, max_tokens=200)
    with anyio.move_on_after(0.05) as scope:
        await engine.generate([GenerateRequest(ids, params, 64)])
    assert scope.cancelled_caught and engine.abort.is_set()


@pytest.mark.anyio
async def test_a_group_carries_the_scorers_extras(tiny_model):
    """Each sample keeps its ScoreResult.extra (gdpo's reward components) in reward_extra."""
    from actors.sampler.engines.base import Generation
    from actors.sampler.rollout import Generated, Rollout
    from messages.reward import ScoreReply, ScoreResult

    class Scoring:  # answers every request at once
        attempts, timeout_s = 1, 1.0

        async def score(self, request):
            return ScoreReply([ScoreResult(1.0, extra={"format": 1.0, "acc": 0.0}),
                               ScoreResult(0.0, "boom")])

    ids = torch.tensor([5, 6], dtype=torch.int32)
    gen = Generation(ids, torch.zeros(2), torch.zeros(2, dtype=torch.int32),
                     torch.ones(2, dtype=torch.int8), "stop", 0)
    rollout = Rollout(None, ChatTokenizer(tiny_model), Scoring(), params=SamplingParams(), n=2,
                      greedy_baseline=False, sampler="s")
    group = await rollout.score_group(Generated(Prompt(0, [], "x", "y"), [1, 2], [gen, gen], None,
                                                0.0))
    assert [s.reward_extra for s in group.samples] == [{"format": 1.0, "acc": 0.0}, {}]
    assert group.samples[1].reward_error == "boom"


@pytest.mark.anyio
async def test_shared_weights_removed_before_loading_leave_the_old_weights(tiny_model, tmp_path):
    """The learner's shm file can go before a sampler opens it (a newer version replaced it, or
    the learner exited at the end of the job): the engine keeps its weights and version."""
    from safetensors.torch import save_file

    from actors.runtime.transports.sources import SharedWeights

    engine = HFEngine(tiny_model, "float32", seed=0)
    before = {n: p.detach().clone() for n, p in engine.params.items()}
    path = tmp_path / "v3.safetensors"
    save_file({n: torch.zeros_like(p) for n, p in before.items()}, str(path))
    gone = SharedWeights(str(path))  # received: the header named it and it was there
    path.unlink()
    await engine.load_weights(3, gone)
    assert engine.version != 3
    assert all(torch.equal(engine.params[n], before[n]) for n in before)
    save_file({n: torch.zeros_like(p) for n, p in before.items()}, str(path))
    await engine.load_weights(4, SharedWeights(str(path)))  # one still there loads
    assert engine.version == 4 and all(not engine.params[n].any() for n in before)
