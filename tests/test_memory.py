"""The learner's memory estimate against torch's own numbers on the CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from actors.learner.memory import announce, describe, estimate, measured, saved_bytes
from actors.learner.objective import _forward
from actors.learner.packing import micro_limits
from tests.learner_cases import make_trainer
from tests.test_learner import make_groups
from tests.test_packing import gradients


def test_states_are_the_real_tensors_bytes(tiny_model, tmp_path):
    t = make_trainer(tiny_model, tmp_path)
    grads = gradients(t)
    seen: list[int] = []
    t.on_first_batch = lambda tokens, patches: seen.append(tokens)
    groups = make_groups(t)
    t.train_step(groups)
    t.train_step(groups)
    # once, before the first step, with the largest micro-batch it built (each sequence's
    # prompt and response tokens, micro_batch_size of them at most)
    lengths = sorted((len(g.prompt_ids.data) + len(s.response_ids.data)) // 4
                     for g in groups for s in g.samples)
    rows, _ = micro_limits(t.cfg, cuda=False)
    assert rows == 8 and len(seen) == 1 and max(lengths) <= seen[0] <= sum(lengths[-rows:])
    # on a CPU the learner says nothing of a model far from the machine's memory
    assert announce(t.policy, seen[0]) is None
    real = measured(t.policy.model, t.policy.optimizer)
    e = estimate(t.policy.model.config, tokens=100)
    assert e.parameters == real["parameters"] > 0
    assert e.gradients == sum(g.nbytes for g in grads[0].values())
    assert e.optimizer == real["optimizer"]
    table = describe(t.policy, seen[0])
    assert f"{seen[0]} tokens per micro-batch" in table
    assert "offload off" in table and "offload on" in table and "<- this run" in table


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_are_what_autograd_saves(checkpointing):
    """Within 15% of the bytes of the tensors the forward pass saves for backward (a Qwen2
    shape, float32, packed tokens); with checkpointing the estimate also counts the one layer
    recomputed during backward, which the forward pass does not hold."""
    config = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=704,
                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    ids = torch.randint(3, 500, (6, 40))
    tokens = ids.numel()  # the rows packed into one
    at = torch.ones(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)  # every next token
    got = saved_bytes(lambda: _forward(model, ids, torch.ones_like(ids), at, 1.0, False, False,
                                       True, None), list(model.parameters()))
    e = estimate(config, tokens=tokens, checkpointing=checkpointing)
    h, kv, i = 256, 64, 704
    recomputed = tokens * (10 * h + 2 * kv + 4 * i) * 4 if checkpointing else 0
    forward = e.activations - recomputed
    print(f"\ncheckpointing {checkpointing}: estimate {forward / 1e6:.2f} MB, saved "
          f"{got / 1e6:.2f} MB")
    assert forward == pytest.approx(got, rel=0.15)


def test_the_planned_table_without_a_token_budget_counts_a_whole_batch_at_most():
    """With no token budget and the GPU's auto (no row cap), the table assumes the batch's
    sequences (4 groups x 8) at 1024 tokens each, not an unbounded row count."""
    from actors.job.config.load import apply_overrides, decode_topology
    from actors.learner.memory import planned

    topology = decode_topology(apply_overrides({}, ["learner.max_tokens_per_micro_batch=0"]))
    assert "32768 tokens per micro-batch (no token budget" in planned(topology, "cuda")
