"""Packed micro-batches against the padded reference path: the same loss, metrics and gradients.

Each case trains one step on the same batch twice, ``learner.packing`` true and false, in float32
on the CPU, and compares every metric and every gradient (the policy's, and the critic's for
GAE); the largest and mean differences are printed (``pytest -s``) and must be within 1e-6 of
the largest value.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

from actors.learner import objective, packing
from actors.learner.batch import common_prefixes
from actors.learner.packing import (
    micro_batches,
    micro_limits,
    own_tokens,
    pack,
    packed_tokens,
    read_lengths,
    refine,
    share_groups,
)
from kernels import varlen_attention
from tests.learner_cases import OPTIONS, make_trainer, with_behaviour
from tests.test_learner import make_groups

REL = 1e-6
BUDGET = "learner.max_tokens_per_micro_batch=100"  # 3 or 4 of the test's sequences
# micro-batches of 3 rows whatever their tokens: the same micro-batches padded, packed whole and
# with shared prefixes (whose token budget counts the shared form, so a budget in tokens cuts
# them elsewhere, and a loss over a micro-batch's tokens, kl_cov's top share, sees others),
# each cutting a group of 4
ROWS = ["learner.micro_batch_size=3", "learner.max_tokens_per_micro_batch=0"]
CASES = {**OPTIONS,
         "seq-mean-token-mean": ["algorithm.loss_agg_mode=seq-mean-token-mean"],
         # a token budget: the shared side's micro-batches hold more rows (token-mean over the
         # mini-batch's tokens does not depend on how it is cut)
         "token_budget": ["learner.micro_batch_size=auto", BUDGET]}


def gradients(trainer) -> list[dict[str, torch.Tensor]]:
    """The gradients of the policy (and the critic) at each optimizer update, in order."""
    updates: list[dict[str, torch.Tensor]] = []
    models = [("", trainer.policy.model, trainer.policy.optimizer)]
    if trainer.policy.critic is not None:
        models.append(("critic.", trainer.policy.critic, trainer.policy.critic_optimizer))
    for prefix, model, optimizer in models:
        step = optimizer.step

        def recording(*args, _step=step, _model=model, _prefix=prefix, **kwargs):
            if not _prefix:  # the policy steps first: a new update
                updates.append({})
            updates[-1].update({_prefix + name: whole(p.grad)
                                for name, p in _model.named_parameters() if p.grad is not None})
            return _step(*args, **kwargs)

        optimizer.step = recording
        optimizer.step._wrapped_by_lr_sched = True  # the scheduler's own marker: no warning
    return updates


def whole(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``, gathered whole when it is a shard (a DTensor: FSDP2)."""
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().clone()


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    """(largest difference, mean difference, largest value) over every entry of ``a``."""
    assert a.keys() == b.keys() and a
    diffs = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    scale = max(float(v.abs().max()) for v in a.values())
    return float(diffs.max()), float(diffs.mean()), scale


LOSSES = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "critic/vf_loss")


@pytest.mark.parametrize("name", list(CASES))
def test_packed_step_equals_padded_step(tiny_model, tmp_path, name):
    """The first update's gradients and the losses within 1e-6 relative, every metric within
    1e-5. An update after the first starts from weights that AdamW moved by about ``lr`` on
    every coordinate whatever the gradient's size, so two paths whose first gradients differ by
    rounding (or two micro-batch sizes on one path) start it from different weights: its
    gradients are reported, not compared."""
    opts = [*ROWS, "learner.max_grad_norm=1e9", *CASES[name]]
    padded = make_trainer(tiny_model, tmp_path / "padded", "learner.packing=false", *opts)
    packed = make_trainer(tiny_model, tmp_path / "packed", "learner.packing=true", *opts)
    g_padded, g_packed = gradients(padded), gradients(packed)
    noise = torch.Generator().manual_seed(3)  # behaviour log-probs off the policy's, per token
    groups = with_behaviour(padded, make_groups(padded), lambda s, own: own - 0.4 * torch.rand(
        own.shape, generator=noise))
    m_padded, m_packed = padded.train_step(groups), packed.train_step(groups)
    assert m_packed["perf/shared_prefix_tokens"] > 0  # the packed side shares its prompts
    assert len(g_padded) == len(g_packed) >= 1
    diffs = [compare(a, b) for a, b in zip(g_padded, g_packed, strict=True)]
    g_max, g_mean, g_scale = diffs[0]
    values = {k: v for k, v in m_padded.items() if not k.startswith(("timing_s/", "perf/"))}
    worst = max(values, key=lambda k: abs(values[k] - m_packed[k]) / max(1.0, abs(values[k])))
    print(f"\n{name}: gradients max diff {g_max:.2e} mean {g_mean:.2e} (largest {g_scale:.2e})"
          + "".join(f"; update {i + 2} max {d[0]:.2e}" for i, d in enumerate(diffs[1:]))
          + f"; pg_loss {m_padded['actor/pg_loss']:+.8e} vs {m_packed['actor/pg_loss']:+.8e}"
          + f"; worst metric {worst} {values[worst]:.8g} vs {m_packed[worst]:.8g}")
    assert g_scale > 1e-4
    assert g_max <= REL * g_scale, (g_max, g_scale)
    for k, v in values.items():
        tol = (REL if k in LOSSES else 10 * REL) * max(1.0, abs(v))
        assert abs(v - m_packed[k]) <= tol, (k, v, m_packed[k])


@pytest.mark.parametrize("attn", ["sdpa", "eager", varlen_attention.NAME])
def test_packed_rows_isolate_sequences(tiny_model, attn):
    """The packed row's hidden states are each sequence's own, run alone (no attention across a
    boundary): for SDPA and eager, transformers builds a block-diagonal mask from the restarting
    position ids; ``flowrl_varlen`` attends within each sequence's bounds. Each row but the
    one-token one is packed without its last token (``read_lengths``)."""
    varlen_attention.register()
    model = AutoModel.from_pretrained(tiny_model, attn_implementation=attn).eval()
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 9, 1, 7]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, 30, (n,), generator=gen)
        attention[i, :n] = 1
    rows = pack(ids, attention)
    read = read_lengths(lengths)
    assert read == [4, 8, 1, 6]
    assert rows.position_ids.tolist() == [[*range(4), *range(8), 0, *range(6)]]
    call = varlen_attention.packed_call(model.config, rows.input_ids, rows.position_ids)
    assert ("flowrl_bounds" in call) == (attn == varlen_attention.NAME)
    with torch.no_grad():
        packed = model(**call).last_hidden_state[0]  # (T, H)
        for i, n in enumerate(read):
            alone = model(input_ids=ids[i:i + 1, :n]).last_hidden_state[0]  # (n, H)
            got = packed[int(rows.offsets[i]):int(rows.offsets[i]) + n]
            assert torch.allclose(got, alone, atol=1e-5, rtol=1e-5), (attn, i)
        # padded rows through the same implementation: as before (its masks are SDPA's)
        padded = model(input_ids=ids, attention_mask=attention).last_hidden_state
        for i, n in enumerate(read):
            got = packed[int(rows.offsets[i]):int(rows.offsets[i]) + n]
            assert torch.allclose(padded[i, :n], got, atol=1e-5, rtol=1e-5), (attn, i)
        # without restarting positions the same row is one causal sequence: the check can fail
        plain = model(input_ids=rows.input_ids, use_cache=False).last_hidden_state[0]
        assert not torch.allclose(plain[4:12], packed[4:12], atol=1e-3)


def test_the_packed_learner_attends_per_sequence(tiny_model, tmp_path, monkeypatch):
    """learner.packing switches the policy to ``flowrl_varlen`` (no flash-attention on a CPU),
    and its step calls it with each micro-batch's sequence bounds."""
    seen = []
    real = varlen_attention.varlen_sdpa

    def spy(*args, flowrl_bounds=None, **kwargs):
        seen.append(flowrl_bounds)
        return real(*args, flowrl_bounds=flowrl_bounds, **kwargs)

    t = make_trainer(tiny_model, tmp_path, BUDGET, "learner.share_prefixes=false")
    assert t.policy.model.config._attn_implementation == varlen_attention.NAME
    from transformers import AttentionInterface
    monkeypatch.setitem(AttentionInterface._global_mapping, varlen_attention.NAME, spy)
    groups = make_groups(t)  # reads the policy's log-probs on padded rows (no bounds)
    seen.clear()
    t.train_step(groups)
    assert seen and all(b is not None and b[0] == 0 and len(b) >= 2 for b in seen)
    assert max(len(b) - 1 for b in seen) >= 3  # several sequences in one row


def test_shared_prefixes_attend_as_each_row_alone(tiny_model):
    """Rows that begin alike, packed with their common prefix once: every row's hidden states
    equal the row run alone, through ``index`` (its prefix columns read the one copy). Groups:
    a prompt with four rests (one a single token, two identical rows), a row alone, and two
    rows that share their prompt and their first response token."""
    varlen_attention.register()
    model = AutoModel.from_pretrained(tiny_model, attn_implementation=varlen_attention.NAME).eval()
    gen = torch.Generator().manual_seed(2)

    def tokens(n):
        return torch.randint(3, 30, (n,), generator=gen).tolist()

    prompt, first = tokens(6), tokens(5)
    rest = tokens(3)
    seqs = [prompt + tokens(3), prompt + tokens(1), prompt + rest, prompt + rest,
            tokens(7), first + tokens(4), first + tokens(2)]
    sizes = [4, 1, 2]
    shared = common_prefixes([torch.tensor(q) for q in seqs], sizes)
    assert shared == (0, 6, 6, 8, 0, 0, 5)  # identical rows: all but their last token
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, q in enumerate(seqs):
        ids[i, :len(q)], attention[i, :len(q)] = torch.tensor(q), 1
    rows = pack(ids, attention, shared)
    lengths = [len(q) for q in seqs]
    read = read_lengths(lengths)  # each row without its last token
    # the first group shares 5 of its 6 prompt tokens: its one-token rest is read as the prompt
    # alone, and each row keeps a rest of its own
    assert rows.input_ids.shape[1] == sum(own_tokens(lengths, shared)) == sum(read) - 3 * 5 - 5
    assert rows.tree[0][:2] == (0, 5) and rows.tree[1] == (rows.tree[0][-1],) * 2 + (
        rows.tree[0][-1] + 6,)
    call = varlen_attention.packed_call(model.config, rows.input_ids, rows.position_ids, rows.tree)
    assert "flowrl_tree" in call
    index, valid = rows.index(ids.shape[1])
    with torch.no_grad():
        packed = model(**call).last_hidden_state[0]  # (T, H)
        for i, n in enumerate(read):
            alone = model(input_ids=ids[i:i + 1, :n]).last_hidden_state[0]
            got = packed[index[i, :n]]
            assert valid[i].sum() == n
            assert torch.allclose(got, alone, atol=1e-5, rtol=1e-5), i
        # the same row read without the tree (one causal sequence per group) differs
        plain = model(**varlen_attention.packed_call(
            model.config, rows.input_ids, torch.arange(rows.input_ids.shape[1])[None])
                      ).last_hidden_state[0]
        assert not torch.allclose(plain[index[1, :6]], packed[index[1, :6]], atol=1e-3)
    sdpa = AutoModel.from_pretrained(tiny_model, attn_implementation="sdpa").config
    with pytest.raises(ValueError, match="shared prefixes need the flowrl_varlen attention"):
        varlen_attention.packed_call(sdpa, rows.input_ids, rows.position_ids, rows.tree)


@pytest.mark.parametrize("name", ["grpo", "gae", "lora", "kl_loss", "epochs_minibatches",
                                  "token_budget", "grad_ckpt"])
def test_shared_prefix_step_equals_unshared(tiny_model, tmp_path, monkeypatch, name):
    """learner.share_prefixes against each row packed whole: the first update's gradients and
    the losses within 1e-6 relative, every metric within 1e-5, and the tokens it saved: what
    the update's forward passes put through the model, counted as they run."""
    opts = [*ROWS, "learner.max_grad_norm=1e9", *CASES[name]]
    whole_rows = make_trainer(tiny_model, tmp_path / "whole", "learner.share_prefixes=false", *opts)
    shared = make_trainer(tiny_model, tmp_path / "shared", *opts)
    g_whole, g_shared = gradients(whole_rows), gradients(shared)
    groups = make_groups(whole_rows)
    seen: list[int] = []  # the tokens of each packed row the update's forwards run

    def counted(*args, **kwargs):
        rows = packing.pack(*args, **kwargs)
        if torch.is_grad_enabled():
            seen.append(rows.input_ids.shape[1])
        return rows

    monkeypatch.setattr(objective, "pack", counted)
    m_whole = whole_rows.train_step(groups)
    whole_seen, seen[:] = sum(seen), []
    m_shared = shared.train_step(groups)
    epochs = shared.cfg.ppo_epochs
    read = sum(read_lengths([g.prompt_ids.shape[0] + x.response_ids.shape[0]
                             for g in groups for x in g.samples]))
    assert whole_seen == read * epochs and m_whole["perf/shared_prefix_tokens"] == 0
    assert m_shared["perf/shared_prefix_tokens"] == read - sum(seen) / epochs > 0
    g_max, _, g_scale = compare(g_whole[0], g_shared[0])
    assert g_scale > 1e-4 and g_max <= REL * g_scale, (g_max, g_scale)
    for k, v in m_whole.items():
        if not k.startswith(("timing_s/", "perf/")):
            tol = (REL if k in LOSSES else 10 * REL) * max(1.0, abs(v))
            assert abs(v - m_shared[k]) <= tol, (k, v, m_shared[k])


def test_micro_batches_follow_the_budget_and_ranks_get_as_many():
    lengths = [30, 30, 30, 120, 10, 10, 10, 10]
    parts = micro_batches(lengths, 0, 8, max_rows=8, max_tokens=64)
    assert parts == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 8)]  # 120 alone
    assert micro_batches(lengths, 0, 8, max_rows=3, max_tokens=0) == [
        slice(0, 3), slice(3, 6), slice(6, 8)]
    four = refine([slice(0, 4), slice(4, 8)], lengths, 4)
    assert len(four) == 4 and [i for p in four for i in range(p.start, p.stop)] == list(range(8))
    with pytest.raises(ValueError, match="too few rows"):
        refine([slice(0, 1)], lengths, 2)


def test_auto_micro_batches_follow_the_device():
    """auto: on a GPU a packed micro-batch has no row cap and 32768 tokens, a padded one keeps 8
    rows; on a CPU a packed one holds the tokens whose activations take 1 GiB (the default
    model's: about 700 tokens; a thin model's: the 8192 cap), a padded one 8 rows."""
    from transformers import AutoConfig

    from actors.job.config.load import apply_overrides, decode_topology
    from actors.learner.memory import token_activation_bytes

    def limits(*extra, cuda, token_bytes=0):
        return micro_limits(decode_topology(apply_overrides({}, list(extra))).learner, cuda,
                            token_bytes)

    smollm = AutoConfig.for_model("llama", hidden_size=576, intermediate_size=1536,
                                  num_hidden_layers=30, num_attention_heads=9,
                                  num_key_value_heads=3, vocab_size=49152)
    per_token = token_activation_bytes(smollm, 4)  # float32
    rows, tokens = limits(cuda=False, token_bytes=per_token)
    assert rows > 10**6 and tokens == (1 << 30) // per_token and 600 < tokens < 800
    assert limits(cuda=False, token_bytes=per_token // 20) == (rows, 8192)
    assert limits("learner.packing=false", cuda=False, token_bytes=per_token) == (8, 8192)
    assert limits(cuda=False) == (8, 8192)  # no model to measure: 8 rows
    rows, tokens = limits(cuda=True)
    assert tokens == 32768 and rows > 10**6
    assert limits("learner.packing=false", cuda=True) == (8, 32768)
    assert limits("learner.micro_batch_size=3", "learner.max_tokens_per_micro_batch=0",
                  cuda=True) == (3, 0)
    # 32 sequences of 540 tokens: four micro-batches on a CPU, one on a GPU
    lengths = [540] * 32
    assert len(micro_batches(lengths, 0, 32, *limits(cuda=False))) == 4
    assert micro_batches(lengths, 0, 32, *limits(cuda=True)) == [slice(0, 32)]


def test_a_group_sharing_its_prefix_is_cut_only_when_it_alone_is_over_the_budget():
    """Rows 0-1 share a 40-token prefix, rows 2-5 another (rows of 51 tokens, 50 read; own
    tokens: 50 for a group's first row, 10 for each other). A group that fits is never cut across micro-batches (a cut computes
    its prefix twice); one over the budget is cut by rows, each later part holding the prefix
    again, counted; with ``whole`` (the CPU's auto budget) it stays one micro-batch."""
    full = [51] * 6
    shared = (0, 40, 0, 40, 40, 40)
    lengths = own_tokens(full, shared)
    assert lengths == [50, 10, 50, 10, 10, 10]
    groups = share_groups(full, shared)
    assert groups == [([0, 1], 40), ([2, 3, 4, 5], 40)]
    # 120 tokens: rows alone cut inside the second group; groups cut between them
    assert micro_batches(lengths, 0, 6, 8, 120) == [slice(0, 4), slice(4, 6)]
    assert micro_batches(lengths, 0, 6, 8, 120, groups) == [slice(0, 2), slice(2, 6)]
    # 70 tokens: the second group (80) is over alone; its part after the cut starts with the
    # prefix again (40 + 10)
    assert micro_batches(lengths, 0, 6, 8, 70, groups) == [slice(0, 2), slice(2, 5), slice(5, 6)]
    # a group up to ``keep`` tokens stays whole over the budget (the CPU's auto: twice it)
    assert micro_batches(lengths, 0, 6, 8, 70, groups, keep=80) == [slice(0, 2), slice(2, 6)]
    assert micro_batches(lengths, 0, 6, 8, 70, groups, keep=79) == [
        slice(0, 2), slice(2, 5), slice(5, 6)]
    # a row cap alone cuts by rows, as the padded path does; with a budget it keeps groups too
    assert micro_batches(lengths, 0, 6, 3, 0, groups) == [slice(0, 3), slice(3, 6)]
    assert micro_batches(lengths, 0, 6, 3, 500, groups) == [
        slice(0, 2), slice(2, 5), slice(5, 6)]
    # a rank's or a mini-batch's share takes its own groups only
    assert micro_batches(lengths, 2, 6, 8, 120, groups) == [slice(2, 6)]
    assert micro_batches(lengths, 0, 6, 8, 120, None) == micro_batches(lengths, 0, 6, 8, 120)
    # what each cut puts through the model: the prefix again where a part starts inside a group
    assert packed_tokens(lengths, [slice(0, 2), slice(2, 6)], groups) == 140
    assert packed_tokens(lengths, [slice(0, 2), slice(2, 5), slice(5, 6)], groups) == 180
    assert packed_tokens(read_lengths(full), [slice(0, 6)], None) == 300
