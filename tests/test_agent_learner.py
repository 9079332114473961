"""The learner on multi-turn samples: tool tokens count for nothing, the reward counts.

Responses here hold tool spans (loss mask 0) inside them and at their end. Whatever the
behaviour log-probs say at those positions, every loss, aggregation mode, KL term, entropy,
importance weight, rejection rule and metric must come out bit for bit the same; and a reward
whose response ends in tool tokens must still reach the model's own tokens.
"""

from __future__ import annotations

import pytest
import torch

from actors.data.chat import chat_ids
from actors.learner.batch import build_batch
from actors.learner.trainer import Trainer
from actors.runtime.tensors import to_wire
from messages.rollout import ChatMessage, Prompt, Sample, ScoredGroup, Turn
from tests.learner_cases import OPTIONS, SAMPLING, make_trainer, with_behaviour

SKIP = {"grad_ckpt", "cosine_warmup", "lora"}  # nothing about masks


def layout(i: int, g: int) -> list[int]:
    """Loss mask of sample i of group g: model, tool, model (and every third ends in a tool)."""
    own, tool, more = 2 + (i + g) % 3, 3 + i % 2, 1 + (i * g) % 2
    mask = [1] * own + [0] * tool + [1] * more
    return mask + [0] * 2 if (i + g) % 3 == 0 else mask


def multi_turn_groups(trainer: Trainer, tool_logprob: float, seed: int = 0) -> list[ScoredGroup]:
    """Two groups of four multi-turn samples; the behaviour log-probs of the model's tokens
    are the policy's own minus 0.1, those of tool tokens ``tool_logprob``."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(2):
        prompt_ids = torch.tensor(chat_ids(trainer.policy.tokenizer,
                                           [ChatMessage("user", f"say {'ab'[g]}")]),
                                  dtype=torch.int32)
        samples = []
        for i in range(4):
            mask = torch.tensor(layout(i, g), dtype=torch.int8)
            resp = torch.randint(3, 30, (len(mask),), generator=gen, dtype=torch.int32)
            turns = [Turn("assistant" if m else "tool", k, k + 1) for k, m in enumerate(mask)]
            samples.append(Sample(to_wire(resp), to_wire(torch.zeros(len(resp))), 0, "",
                                  "stop" if mask[-1] else "length",
                                  reward=float((i + g) % 3 == 0), loss_mask=to_wire(mask),
                                  reward_extra={"format": float(i % 2),
                                                "acc": float((i + g) % 3 == 0)},
                                  token_versions=to_wire(torch.zeros(len(resp), dtype=torch.int32)),
                                  turns=turns))
        groups.append(ScoredGroup(Prompt(g, [ChatMessage("user", "x")], "repeat_letter", "a"),
                                  to_wire(prompt_ids), samples, "s", baseline_reward=0.5,
                                  sampling=SAMPLING))

    def behaviour(s: Sample, own: torch.Tensor) -> torch.Tensor:
        mask = torch.frombuffer(bytearray(s.loss_mask.data), dtype=torch.int8).bool()
        return torch.where(mask, own - 0.1, torch.full_like(own, tool_logprob)).float()

    return with_behaviour(trainer, groups, behaviour)


@pytest.mark.parametrize("name", [n for n in OPTIONS if n not in SKIP])
def test_tool_tokens_count_for_nothing(tiny_model, tmp_path, name):
    runs = []
    for k, tool_logprob in enumerate((0.0, -7.5)):
        t = make_trainer(tiny_model, tmp_path / str(k), *OPTIONS[name])
        runs.append(t.train_step(multi_turn_groups(t, tool_logprob)))
    assert runs[0].keys() == runs[1].keys()
    differ = {k: (runs[0][k], runs[1][k]) for k in runs[0]
              if not k.startswith(("timing_s/", "perf/")) and runs[0][k] != runs[1][k]}
    assert not differ, differ


def test_response_length_and_agent_metrics_count_own_tokens(tiny_model, tmp_path):
    t = make_trainer(tiny_model, tmp_path)
    groups = multi_turn_groups(t, 0.0)
    m = t.train_step(groups)
    masks = [layout(i, g) for g in range(2) for i in range(4)]
    assert m["response_length/mean"] == pytest.approx(sum(map(sum, masks)) / 8)
    assert m["agent/tool_token_share"] == pytest.approx(
        sum(len(x) - sum(x) for x in masks) / sum(map(len, masks)))
    assert m["agent/tool_call_share"] == 1.0 and m["agent/tool_errors"] == 0


def test_a_reward_after_trailing_tool_tokens_reaches_the_models_tokens(tiny_model, tmp_path):
    t = make_trainer(tiny_model, tmp_path)
    groups = multi_turn_groups(t, 0.0)
    batch = build_batch(groups, t.policy.pad_id)
    for row, s in enumerate(s for g in groups for s in g.samples):
        p, mask = groups[0].prompt_ids.shape[0] if row < 4 else groups[1].prompt_ids.shape[0], \
            layout(row % 4, row // 4)
        last_own = p - 1 + max(k for k, m in enumerate(mask) if m)
        assert batch.token_rewards[row].nonzero().flatten().tolist() == (
            [last_own] if s.reward else [])
        assert batch.response_mask[row, last_own] == 1
    trace: dict[str, torch.Tensor] = {}
    t.train_step(groups, trace=trace)
    ends_in_tool = [r for r in range(8) if layout(r % 4, r // 4)[-1] == 0]
    rewarded = [r for r in ends_in_tool if batch.scores[r] == 1.0]
    assert rewarded  # the layout has a rewarded sample ending in tool tokens
    for r in rewarded:  # GRPO: it beat its group, so its own tokens get a positive advantage
        own = trace["mask"][r].bool()
        assert bool((trace["advantages"][r][own] > 0).all())
        assert bool((trace["advantages"][r][~own] == 0).all())
