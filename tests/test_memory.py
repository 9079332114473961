"""The learner's memory estimate against torch's own numbers on the CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from actors.learner.batch import build_batch
from actors.learner.memory import announce, describe, estimate, measured, saved_bytes
from actors.learner.objective import _forward
from actors.learner.packing import micro_limits, own_tokens
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
    # each group's prompt counted once (learner.share_prefixes)
    batch = build_batch(groups, t.policy.pad_id)
    assert sum(own_tokens(list(batch.lengths), batch.shared)) <= sum(lengths) - sum(
        (len(g.samples) - 1) * len(g.prompt_ids.data) // 4 for g in groups)
    rows, budget = micro_limits(t.cfg, cuda=False, token_bytes=t.policy.token_activation_bytes)
    assert rows > 10**6 and budget == 8192  # auto: a tiny model's tokens all fit the CPU's budget
    assert len(seen) == 1 and seen[0] == sum(own_tokens(list(batch.lengths), batch.shared))
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


def test_the_planned_table_counts_rows_of_the_longest_prompt_and_response(tiny_model):
    """``runner.py check``'s table: a micro-batch of at most ``micro_batch_size`` rows, each the longest
    prompt the task issues plus sampler.max_tokens, when that is under the token budget (the
    budget alone put the default job's activations at 12 GB, four times its learner's peak);
    with no token budget and the GPU's auto (no row cap), the whole batch (4 groups x 8) at
    most; task.max_prompt_length bounds the prompt when set; a multi-turn rollout's samples
    have no bound but the budget."""
    import re

    from actors.data.chat import prompt_token_counter
    from actors.data.sources import make_task
    from actors.job.config.load import apply_overrides, decode_topology
    from actors.learner.memory import PROMPTS_SAMPLED, planned

    def table(*overrides: str, device: str = "cpu") -> str:
        return planned(decode_topology(apply_overrides({}, [
            f"model.path={tiny_model}", "task.name=repeat_letter", "sampler.max_tokens=8",
            *overrides])), device)

    topology = decode_topology(apply_overrides({}, [f"model.path={tiny_model}",
                                                    "task.name=repeat_letter"]))
    count, task = prompt_token_counter(str(tiny_model)), make_task(topology.task, seed=0)
    longest = max(count(task.prompt(i, prompt_id=i)) for i in range(PROMPTS_SAMPLED))
    assert f"{8 * (longest + 8)} tokens per micro-batch (8 rows of at most {longest + 8} " \
           f"tokens: the longest of the first {PROMPTS_SAMPLED} prompts, {longest}, + " \
           "sampler.max_tokens 8) on cpu" in table("learner.micro_batch_size=8")
    # auto on a CPU: a tiny model's activations are far from the budget: the whole batch
    assert f"{32 * (longest + 8)} tokens per micro-batch (32 rows" in table()
    assert f"{32 * (longest + 8)} tokens per micro-batch (32 rows" in \
        table("learner.max_tokens_per_micro_batch=0", device="cuda")
    assert "8 rows of at most 108 tokens: task.max_prompt_length" in \
        table("task.max_prompt_length=100", "learner.micro_batch_size=8")
    assert re.search(r" 8192 tokens per micro-batch \(learner.max_tokens_per_micro_batch",
                     table("agent.tools=[{builtin='calculator'}]"))
    # a group over the CPU's auto budget is kept whole up to twice it: 8,000 prompt tokens
    # once, then 8 responses of 100 (8,800), where the budget is 8,192
    long = ("task.max_prompt_length=8000", "sampler.max_tokens=100")
    assert " 8800 tokens per micro-batch (a group sharing its prompt, kept whole up to twice " \
           "the budget 8192)" in table(*long)
    assert " 8192 tokens per micro-batch (learner.max_tokens_per_micro_batch" in \
        table(*long, "learner.share_prefixes=false")
    assert " 32768 tokens per micro-batch (learner.max_tokens_per_micro_batch" in \
        table(*long, device="cuda")


def test_the_estimate_is_within_1_5x_of_a_measured_learners_peak(tmp_path):
    """Two layers of the embedded model's shape (its vocabulary: the LM head's logits weigh as in
    the default job), three steps, in a process of its own: how much it grew from after its
    imports to its peak RSS against the estimate's total (parameters, gradients, AdamW state,
    activations and logits for the largest micro-batch)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-m", "tests.memory_worker", str(tmp_path)], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    ratio = got["peak"] / got["estimate"]
    print(f"\n{got['tokens']} tokens: peak {got['peak'] / 1e6:.0f} MB, estimate "
          f"{got['estimate'] / 1e6:.0f} MB, ratio {ratio:.2f}")
    assert 1 / 1.5 <= ratio <= 1.5
