"""A served reward model (``[[reward.models]] kind = "reward_model"``) on a tiny random
``LlamaForSequenceClassification``: its scores are the model's own forward on the
chat-templated text, batching changes nothing, bad checkpoints are config errors (and the old
way, a ``reward_model`` function, names the new one), and a live replica serves its scores
behind the router, added to a rule's by weight as the sampler adds them."""

from __future__ import annotations

import anyio
import pytest
import torch
import zmq
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from actors.reward import reward_actor
from actors.router.actor import router_actor
from actors.runtime.actor import ActorContext, serve_actor
from actors.runtime.config import ConfigError, score_targets
from actors.runtime.zmq_bridge import make_socket
from actors.sampler.scoring_client import ScoringClient
from actors.scoring.items import ScoreItem, items_of
from actors.scoring.served import ServedScoring
from messages.reward import Response, ScoreRequest
from messages.rollout import ChatMessage
from tests.helpers import actor_context, live_topology
from tests.tiny_model import build_tiny_model, build_tiny_reward_model


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "model")


def requests() -> list[ScoreRequest]:
    """Two groups: responses of different lengths (so a batch pads) to a prompt, and one
    response without a prompt."""
    prompt = [ChatMessage("system", "answer with a number"), ChatMessage("user", "what is 2 + 3?")]
    texts = ["5", "it is 5", "the answer is five", "", "55 55 55 55 55 55 55 55"]
    return [ScoreRequest("mine", "5", [Response(t) for t in texts], prompt=prompt),
            ScoreRequest("mine", "5", [Response("6")])]


def items() -> list[ScoreItem]:
    """Both groups' items in one list, as a batch mixing them."""
    return [item for request in requests() for item in items_of(request)]


def reference(path, item: ScoreItem) -> float:
    """The checkpoint's own forward, one sequence, no padding."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    messages = [{"role": m.role, "content": m.content} for m in item.prompt]
    messages.append({"role": "assistant", "content": item.solution_str})
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits[0, 0].item()


def entry(path, *extra: str) -> str:
    fields = ", ".join(['kind="reward_model"', 'name="rm"', f'path="{path}"', *extra])
    return f"reward.models=[{{{fields}}}]"


def scoring(path, *extra: str, sockets: str = "/tmp") -> ServedScoring:
    topo = live_topology(sockets, entry(path, *extra))
    return ServedScoring(topo.reward.models[0], topo)


@pytest.mark.anyio
async def test_scores_are_the_models_forward_and_batching_changes_nothing(reward_model):
    expected = [reference(reward_model, item) for item in items()]
    one_by_one = scoring(reward_model, "batch_size=1")
    batched = scoring(reward_model, "batch_size=4")
    normalised = scoring(reward_model, "batch_size=8", "reward_mean=0.5", "reward_std=2.0")
    try:
        for s in (one_by_one, batched, normalised):
            await s.load()
        single = [r.score for r in await one_by_one.score(items())]
        many = [r.score for r in await batched.score(items())]
        norm = [r.score for r in await normalised.score(items())]
    finally:
        for s in (one_by_one, batched, normalised):
            await s.aclose()
    diff = max(abs(a - b) for a, b in zip(single, many, strict=True))
    print(f"batched vs one by one: max diff {diff:.2e}")
    assert diff < 1e-5
    assert single == pytest.approx(expected, abs=1e-5)
    assert norm == pytest.approx([(e - 0.5) / 2.0 for e in expected], abs=1e-5)
    assert len(set(round(s, 6) for s in single)) == len(single)  # the texts really differ


def test_bad_reward_model_paths_are_config_errors(reward_model, tmp_path, sockets):
    def check(override: str, match: str) -> None:
        with pytest.raises(ConfigError, match=match):
            live_topology(sockets, override)

    check('reward.models=[{kind="reward_model", name="rm"}]',
          r"reward.models\[0\].path: '' is not a model directory")
    check(entry(tmp_path), r"reward.models\[0\].path: .*no config")
    causal = build_tiny_model(tmp_path / "causal")
    check(entry(causal),
          r"reward.models\[0\].path: .*LlamaForCausalLM, not a ...ForSequenceClassification")
    check(entry(reward_model, "batch_size=0"), r"reward.models\[0\].batch_size: must be >= 1")
    # a reward model is a [[reward.models]] entry, not a rule worker's builtin
    check(f'reward.functions=[{{builtin="reward_model", path="{reward_model}"}}]',
          r"reward.functions\[0\].builtin: 'reward_model' is not one of ")
    check(f'reward.pools=[{{name="rm", path="{reward_model}"}}]', "reward.pools: unknown key")


@pytest.mark.anyio
async def test_a_live_replica_serves_reward_model_scores_weighted_with_a_rule(reward_model,
                                                                             tmp_path, sockets):
    topo = live_topology(sockets, entry(reward_model, "weight=0.5", "batch_size=4"),
                         'reward.functions=[{builtin="exact_match", weight=2.0}]')
    zctx = zmq.Context()
    replica = ActorContext(kind="reward", index=topo.reward.count, topology=topo,
                           run_dir=tmp_path, zmq=zctx)  # reward-1: the model's replica 0
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                await tg.start(serve_actor, actor_context("router", topo, zctx, tmp_path),
                               router_actor, None)
                await tg.start(serve_actor, actor_context("reward", topo, zctx, tmp_path),
                               reward_actor, None)
                await tg.start(serve_actor, replica, reward_actor, None)
                sock = make_socket(zctx, zmq.DEALER, connect=topo.router.address)
                client = ScoringClient(sock, timeout_s=30, attempts=1,
                                       targets=score_targets(topo.reward))
                tg.start_soon(client.serve)
                for request in requests():
                    expected = [0.5 * reference(reward_model, item)
                                + 2.0 * (item.solution_str == "5") for item in items_of(request)]
                    reply = await client.score(request)
                    assert reply is not None
                    assert [r.error for r in reply.results] == [""] * len(expected)
                    assert [r.score for r in reply.results] == pytest.approx(expected, abs=1e-5)
                    assert set(reply.results[0].extra) == {"reward", "rm"}
                sock.close(linger=0)
                tg.cancel_scope.cancel()
    finally:
        zctx.destroy(linger=0)
