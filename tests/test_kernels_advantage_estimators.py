import math

import pytest
import torch

from actors.runtime.config.estimators import ROWS, Custom
from kernels.advantages import compute_advantages
from kernels.masked import masked_whiten

# Four sequences in two groups of two, right-padded to T = 5 with different lengths.
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
SCORES = [1.0, 0.0, 0.5, 2.0]
ESTIMATORS = sorted(n for n, r in ROWS.items() if r is not Custom)  # a user's own: its own tests


def row(name, **options):
    """The estimator's config row with these options (gdpo's keys, read by the learner and not
    by the kernel, filled in)."""
    if "gdpo_reward_keys" in ROWS[name].__struct_fields__:  # one key per weight
        weights = options.get("gdpo_reward_weights") or [1.0]
        options.setdefault("gdpo_reward_keys", [f"r{i}" for i in range(len(weights))])
    return ROWS[name](**options)


def _outcome(scores=SCORES, mask=MASK):
    """Each score on its sequence's last response token, NaN in the padding."""
    rewards = torch.full(mask.shape, math.nan)
    rewards[mask.bool()] = 0.0
    for i, length in enumerate(mask.long().sum(-1).tolist()):
        rewards[i, length - 1] = scores[i]
    return rewards


def _per_sequence(adv, mask=MASK):
    """The one value each sequence carries on all its tokens (checked constant)."""
    out = []
    for row, m in zip(adv, mask.bool(), strict=True):
        vals = row[m]
        torch.testing.assert_close(vals, vals[:1].expand_as(vals))
        out.append(vals[0].item())
    return out


def _unbiased_whiten(xs):
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


@pytest.mark.parametrize("name", ESTIMATORS)
def test_every_estimator_zero_outside_mask_and_finite(name):
    rewards = _outcome()
    values = torch.randn(MASK.shape, generator=torch.Generator().manual_seed(0))
    values[~MASK.bool()] = math.nan  # garbage in padding must not leak
    old_logprobs = -torch.rand(MASK.shape, generator=torch.Generator().manual_seed(1))
    old_logprobs[~MASK.bool()] = math.nan
    sum_pi_squared = old_logprobs.exp().square() + 0.01
    discount = {k: v for k, v in dict(gamma=0.9, lam=0.8).items()
                if k in ROWS[name].__struct_fields__}
    adv, ret = compute_advantages(
        row(name, **discount),
        rewards,
        MASK,
        group_size=2,
        values=values,
        reward_baselines=torch.tensor([0.5, 0.5, 1.0, 1.0]),
        old_logprobs=old_logprobs,
        sum_pi_squared=sum_pi_squared,
    )
    for t in (adv, ret):
        assert t.dtype == torch.float32 and t.shape == MASK.shape and not t.requires_grad
        assert torch.isfinite(t).all()
        assert torch.all(t[MASK == 0] == 0)


def test_grpo_broadcast_and_group_mean_zero():
    adv, ret = compute_advantages(row("grpo"), _outcome(), MASK, group_size=2)
    # group [1, 0]: +-0.5 / (std 0.7071 + 1e-6); group [0.5, 2]: +-0.75 / (1.06066 + 1e-6)
    expected = [0.7071063, -0.7071063, -0.7071063, 0.7071063]
    assert _per_sequence(adv) == pytest.approx(expected, abs=1e-6)
    assert torch.equal(adv, ret)
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(6 * 4, generator=gen).tolist()
    mask = torch.ones(24, 3)
    adv, _ = compute_advantages(row("grpo"), _outcome(scores, mask), mask, group_size=6)
    per_seq = torch.tensor(_per_sequence(adv, mask)).view(4, 6)
    torch.testing.assert_close(per_seq.mean(-1), torch.zeros(4), atol=1e-6, rtol=0)


def test_dr_grpo_ignores_norm_flag_and_grpo_honours_it():
    for name, flag in (("dr_grpo", True), ("grpo", False)):
        options = {"norm_adv_by_std_in_grpo": flag} if name == "grpo" else {}
        adv, _ = compute_advantages(row(name, **options), _outcome(), MASK, group_size=2)
        assert _per_sequence(adv) == pytest.approx([0.5, -0.5, -0.75, 0.75])


def test_rloo_is_leave_one_out():
    scores = [1.0, 0.0, 0.5, 3.0, 2.0, -1.0]
    mask = torch.ones(6, 2)
    adv, _ = compute_advantages(row("rloo"), _outcome(scores, mask), mask, group_size=3)
    got = _per_sequence(adv, mask)
    for i, r in enumerate(scores):
        group = scores[(i // 3) * 3 : (i // 3) * 3 + 3]
        others = list(group)
        others.remove(r)
        assert got[i] == pytest.approx(r - sum(others) / 2)
    single, _ = compute_advantages(row("rloo"), _outcome(scores, mask), mask, group_size=1)
    assert _per_sequence(single, mask) == pytest.approx(scores)  # no other sample: A = r


def test_opo_length_weighted_baseline():
    adv, _ = compute_advantages(row("opo"), _outcome(), MASK, group_size=2)
    # group 1: lengths 3, 2 -> baseline (3*1 + 2*0) / 5 = 0.6
    # group 2: lengths 5, 1 -> baseline (5*0.5 + 1*2) / 6 = 0.75
    assert _per_sequence(adv) == pytest.approx([0.4, -0.6, -0.25, 1.25])


def test_grpo_passk_only_best_gets_credit():
    scores = [0.0, 1.0, 0.25, 0.5, 0.5, 0.5]
    mask = torch.ones(6, 2)
    raw, _ = compute_advantages(row("grpo_passk", norm_adv_by_std_in_grpo=False),
                                _outcome(scores, mask), mask, group_size=3)
    assert _per_sequence(raw, mask) == pytest.approx([0.0, 0.75, 0.0, 0.0, 0.0, 0.0])
    normed, _ = compute_advantages(row("grpo_passk"), _outcome(scores, mask), mask, group_size=3)
    std = torch.tensor([0.0, 1.0, 0.25]).std().item()
    assert _per_sequence(normed, mask)[1] == pytest.approx(0.75 / (std + 1e-6))
    assert sum(v != 0 for v in _per_sequence(normed, mask)) == 1
    with pytest.raises(ValueError, match="group_size >= 2, got 1"):
        compute_advantages(row("grpo_passk"), _outcome(scores, mask), mask, group_size=1)


def test_reinforce_plus_plus_return_to_go_resets_per_sequence():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    rewards = torch.tensor([[0.1, 0.0, 1.0, 9.0], [-0.2, 2.0, 7.0, 7.0]])  # padding ignored
    adv, ret = compute_advantages(row("reinforce_plus_plus", gamma=0.5), rewards, mask,
                                  group_size=1)
    # row 0: G2 = 1, G1 = 0 + 0.5, G0 = 0.1 + 0.25; row 1 starts afresh: G1 = 2, G0 = -0.2 + 1
    expected = torch.tensor([[0.35, 0.5, 1.0, 0.0], [0.8, 2.0, 0.0, 0.0]])
    torch.testing.assert_close(ret, expected)
    whitened = _unbiased_whiten([0.35, 0.5, 1.0, 0.8, 2.0])
    torch.testing.assert_close(adv[mask.bool()], torch.tensor(whitened))
    assert torch.all(adv[mask == 0] == 0)


def test_reinforce_plus_plus_baseline_whitens_centred_scores_over_tokens():
    adv, _ = compute_advantages(row("reinforce_plus_plus_baseline"), _outcome(), MASK, group_size=2)
    centred = [0.5, -0.5, -0.75, 0.75]
    tokens = [c for c, n in zip(centred, MASK.sum(-1).tolist(), strict=True) for _ in range(n)]
    whitened = _unbiased_whiten(tokens)
    torch.testing.assert_close(adv[MASK.bool()], torch.tensor(whitened))


def test_remax_needs_baselines_and_subtracts_them():
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantages(row("remax"), _outcome(), MASK, group_size=2)
    with pytest.raises(ValueError, match=r"reward_baselines shape \(2,\)"):
        compute_advantages(row("remax"), _outcome(), MASK, group_size=2,
                           reward_baselines=torch.zeros(2))
    rewards = torch.tensor([[0.5, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_advantages(row("remax"), rewards, mask, group_size=1,
                                  reward_baselines=torch.tensor([1.0, 0.5]))
    torch.testing.assert_close(ret, torch.tensor([[1.5, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.0], [1.5, 1.5, 0.0]]))


def _gae_loop(rewards, values, mask, gamma, lam):
    """Textbook GAE per row over the masked positions only, in plain Python."""
    adv_rows, ret_rows = [], []
    for r, v, m in zip(rewards.tolist(), values.tolist(), mask.tolist(), strict=True):
        idx = [t for t, keep in enumerate(m) if keep]
        adv, ret = [0.0] * len(m), [0.0] * len(m)
        last = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            v_next = v[idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = r[t] + gamma * v_next - v[t]
            last = delta + gamma * lam * last
            adv[t], ret[t] = last, last + v[t]
        adv_rows.append(adv)
        ret_rows.append(ret)
    return adv_rows, ret_rows


def test_gae_matches_direct_loop_with_padding_and_tool_tokens():
    gen = torch.Generator().manual_seed(3)
    mask = torch.tensor(
        [
            [1, 1, 1, 1, 1, 1],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 1],  # tool tokens in the middle: skipped, not a reset
            [1, 0, 0, 0, 0, 0],
        ]
    )
    rewards = torch.randn(4, 6, generator=gen)
    values = torch.randn(4, 6, generator=gen)
    gamma, lam = 0.9, 0.7
    adv, ret = compute_advantages(row("gae", gamma=gamma, lam=lam), rewards, mask, group_size=1,
                                  values=values)
    loop_adv, loop_ret = _gae_loop(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(ret, torch.tensor(loop_ret))
    flat = [
        a
        for row, m in zip(loop_adv, mask.tolist(), strict=True)
        for a, keep in zip(row, m, strict=True)
        if keep
    ]
    torch.testing.assert_close(adv[mask.bool()], torch.tensor(_unbiased_whiten(flat)))


def test_gae_with_gamma_lambda_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.2, 0.4, 0.6], [0.5, 1.0, 3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    _, ret = compute_advantages(row("gae"), rewards, mask, group_size=1, values=values)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    with pytest.raises(ValueError, match="values"):
        compute_advantages(row("gae"), rewards, mask, group_size=1)


def test_masked_whiten_is_verl_unbiased_and_survives_one_token():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    got = masked_whiten(x, mask)[mask.bool()]
    torch.testing.assert_close(got, torch.tensor([-1.0, 0.0, 1.0]), atol=1e-6, rtol=0)
    one = masked_whiten(torch.tensor([[5.0, 7.0]]), torch.tensor([[1, 0]]))
    assert one[0, 0].item() == 0.0


def test_bad_inputs():
    rewards = _outcome()
    with pytest.raises(ValueError, match="multiple of group_size 3"):
        compute_advantages(row("grpo"), rewards, MASK, group_size=3)
    with pytest.raises(ValueError, match="group_size must be an int >= 1, got 0"):
        compute_advantages(row("grpo"), rewards, MASK, group_size=0)
    with pytest.raises(ValueError, match=r"response_mask shape \(4, 4\)"):
        compute_advantages(row("grpo"), rewards, MASK[:, :4], group_size=2)
    with pytest.raises(ValueError, match=r"\(N, T\)"):
        compute_advantages(row("grpo"), rewards[0], MASK[0], group_size=2)
    with pytest.raises(ValueError, match="gamma must be in"):
        compute_advantages(row("reinforce_plus_plus", gamma=1.5), rewards, MASK, group_size=2)
    with pytest.raises(ValueError, match="lam must be in"):
        compute_advantages(row("gae", lam=-0.1), rewards, MASK, group_size=2, values=rewards)
    with pytest.raises(ValueError, match=r"values shape \(4, 4\)"):
        compute_advantages(row("gae"), rewards, MASK, group_size=2, values=rewards[:, :4])


def test_constant_groups_get_exact_zeros_in_float32():
    # six rewards of 0.3: float32 r - mean is ~3e-8, and GRPO divided it by a std of ~3e-8
    mask = torch.ones(12, 2)
    scores = [0.3] * 6 + [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    for name in ("grpo", "dr_grpo", "rloo", "opo", "gpg"):
        adv, _ = compute_advantages(row(name), _outcome(scores, mask), mask, group_size=6)
        assert torch.all(adv[:6] == 0), name
        assert torch.all(adv[6:] != 0), name


def test_float64_rewards_stay_float64():
    adv, ret = compute_advantages(row("grpo"), _outcome().double(), MASK, group_size=2)
    assert adv.dtype == ret.dtype == torch.float64


def test_gpg_scales_centred_rewards_by_the_share_of_rewarded_samples():
    scores = [1.0, 0.0, 0.0, 0.0, 2.0, 0.0]  # 2 of 6 samples rewarded: alpha = 3
    mask = torch.ones(6, 2)
    adv, _ = compute_advantages(row("gpg"), _outcome(scores, mask), mask, group_size=3)
    expected = [3 * (1 - 1 / 3), 3 * (-1 / 3), 3 * (-1 / 3), 3 * (-2 / 3), 3 * (4 / 3), -2.0]
    assert _per_sequence(adv, mask) == pytest.approx(expected)
    halved, _ = compute_advantages(row("gpg"), _outcome(scores, mask), mask, group_size=3, f_norm=2.0)
    assert _per_sequence(halved, mask) == pytest.approx([e / 2 for e in expected])
    single, _ = compute_advantages(row("gpg"), _outcome(scores, mask), mask, group_size=1)
    assert _per_sequence(single, mask) == pytest.approx([3 * s for s in scores])


def test_gdpo_normalises_each_component_then_whitens_the_weighted_sum():
    mask = torch.ones(4, 2)
    fmt = torch.tensor([1.0, 0.0, 1.0, 1.0])
    acc = torch.tensor([0.0, 10.0, 5.0, 3.0])
    adv, ret = compute_advantages(row("gdpo", gdpo_reward_weights=[1.0, 0.5]),
                                  _outcome([0.0] * 4, mask), mask, group_size=2,
                                  reward_components=torch.stack([fmt, acc]))
    grpo = compute_advantages(row("grpo"), _outcome(fmt.tolist(), mask), mask, group_size=2)[0]
    grpo_acc = compute_advantages(row("grpo"), _outcome(acc.tolist(), mask), mask, group_size=2)[0]
    torch.testing.assert_close(adv, masked_whiten(grpo + 0.5 * grpo_acc, mask))
    assert torch.equal(adv, ret)
    # without components: GRPO of the total reward, whitened
    plain, _ = compute_advantages(row("gdpo"), _outcome(), MASK, group_size=2)
    grpo_total, _ = compute_advantages(row("grpo"), _outcome(), MASK, group_size=2)
    torch.testing.assert_close(plain[MASK.bool()], masked_whiten(grpo_total, MASK)[MASK.bool()])
    with pytest.raises(ValueError, match="2 reward components but 1 weights"):
        compute_advantages(row("gdpo", gdpo_reward_weights=[1.0]), _outcome([0.0] * 4, mask),
                           mask, group_size=2, reward_components=torch.stack([fmt, acc]))


def _otb_inputs():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1]])
    rewards = torch.zeros(4, 4)  # each score on the row's last response token
    rewards[0, 2], rewards[2, 3], rewards[3, 3] = 1.0, 2.0, 1.0
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]] * 4))
    spsq = torch.full((4, 4), 0.5)  # w_t = 1 - 2 * 0.5 + 0.5 = 0.5 on every token
    return rewards, mask, old, spsq


def test_optimal_token_baseline_hand_case():
    rewards, mask, old, spsq = _otb_inputs()
    adv, ret = compute_advantages(row("optimal_token_baseline"), rewards, mask, group_size=2,
                                  old_logprobs=old, sum_pi_squared=spsq, handle_zero_tail=False)
    # group 1 (rows 0, 1): returns 1 / 0 on every token; W = 0.5 * (t + 1) on both rows
    # at t = 0, 1 the baseline is (1 * W + 0 * W) / (2 W + 1e-8) = 0.5; at t = 2 only row 0
    # has a token, baseline 1 * W / W = 1
    torch.testing.assert_close(adv[0], torch.tensor([0.5, 0.5, 0.0, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv[1], torch.tensor([-0.5, -0.5, 0.0, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(ret[0], torch.tensor([1.0, 1.0, 1.0, 0.0]))
    # zero tail: row 0 is the only longest of its group (3 > 2): baseline 0 from column 2 on
    tail, _ = compute_advantages(row("optimal_token_baseline"), rewards, mask, group_size=2,
                                 old_logprobs=old, sum_pi_squared=spsq)
    assert tail[0, 2].item() == pytest.approx(1.0)
    single, _ = compute_advantages(row("optimal_token_baseline"), rewards, mask, group_size=1,
                                   old_logprobs=old, sum_pi_squared=spsq)
    assert torch.equal(single, ret)  # a group of one has no baseline
    with pytest.raises(ValueError, match="old_logprobs"):
        compute_advantages(row("optimal_token_baseline"), rewards, mask, group_size=2)


def test_tir_optimal_token_baseline_aligns_the_kth_response_token():
    rewards, mask, old, spsq = _otb_inputs()
    adv, _ = compute_advantages(row("tir_optimal_token_baseline"), rewards, mask, group_size=2,
                                old_logprobs=old, sum_pi_squared=spsq, handle_zero_tail=False)
    # group 2: row 2 has a tool token at column 1, so its 2nd response token (column 2) is
    # compared with row 3's 2nd (column 1); returns 2 and 1, W equal: baseline 1.5 everywhere
    # both rows have a k-th token, row 3's 4th token alone: baseline 1
    torch.testing.assert_close(adv[2], torch.tensor([0.5, 0.0, 0.5, 0.5]), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv[3], torch.tensor([-0.5, -0.5, -0.5, 0.0]), atol=1e-6, rtol=0)
    column, _ = compute_advantages(row("optimal_token_baseline"), rewards, mask, group_size=2,
                                   old_logprobs=old, sum_pi_squared=spsq, handle_zero_tail=False)
    assert column[3, 1].item() == pytest.approx(0.0, abs=1e-6)  # alone at column 1: baseline 1


def _grouping_case():
    """Three groups of two (the last constant, so a batch-wide share of signal differs from a
    group's), with every input some estimator needs, per row."""
    gen = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0],
                         [1, 1, 1, 0]])
    rewards = _outcome([1.0, 0.0, 0.5, 2.0, 0.3, 0.3], mask).nan_to_num()
    old = -torch.rand(mask.shape, generator=gen)
    inputs = dict(values=torch.randn(mask.shape, generator=gen),
                  reward_baselines=torch.tensor([0.5, 0.5, 1.0, 1.0, 0.2, 0.2]),
                  old_logprobs=old, sum_pi_squared=old.exp().square() + 0.01)
    return rewards, mask, inputs


@pytest.mark.parametrize("name", ESTIMATORS)
def test_a_rows_group_traits_are_what_its_kernel_does(name):
    """``grouped = False``: the advantages do not depend on the groups. ``unequal_groups`` (of a
    grouped row): each group's advantages depend on its own rows alone, so running group by group
    is exact; a grouped row without it scales over the whole batch, and group by group differs."""
    est = row(name)
    rewards, mask, inputs = _grouping_case()
    adv, _ = compute_advantages(est, rewards, mask, group_size=2, **inputs)
    if est.min_group == 1:  # (else a group of one is refused)
        alone, _ = compute_advantages(est, rewards, mask, group_size=1, **inputs)
        assert torch.allclose(adv, alone) == (not est.grouped)
    if est.grouped:
        by_group = torch.cat([compute_advantages(
            est, rewards[g:g + 2], mask[g:g + 2], group_size=2,
            **{k: v[g:g + 2] for k, v in inputs.items()})[0] for g in (0, 2, 4)])
        assert torch.allclose(adv, by_group) == est.unequal_groups


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", [2, 4])
def test_grpo_batch_std_is_trls_scale_rewards_batch(n, dtype):
    """TRL 1.16's GRPOTrainer with scale_rewards = "batch" (one reward function), its own lines
    with its own nanstd, on rewards of no constant group (where ours is exactly 0: a
    deliberate difference, as grpo's)."""
    nanstd = pytest.importorskip("trl.trainer.utils").nanstd
    gen = torch.Generator().manual_seed(n)
    mask = (torch.rand(12, 6, generator=gen) > 0.3).to(dtype)
    mask[:, 0] = 1
    scores = torch.randn(12, generator=gen, dtype=dtype)
    rewards = torch.zeros(12, 6, dtype=dtype)
    rewards[torch.arange(12), mask.cumsum(-1).argmax(-1)] = scores
    mean_grouped = torch.nanmean(scores.view(-1, n), dim=1).repeat_interleave(n, dim=0)
    std_rewards = nanstd(scores).expand_as(scores)
    want = (scores - mean_grouped) / (std_rewards + 1e-4)
    adv, ret = compute_advantages(row("grpo_batch_std"), rewards, mask, group_size=n)
    torch.testing.assert_close(adv, want[:, None] * mask)
    assert torch.equal(adv, ret) and adv.dtype == dtype
    # the batch's std, not a group's: a group scaled alone is another result
    alone, _ = compute_advantages(row("grpo_batch_std"), rewards[:n], mask[:n], group_size=n)
    assert not torch.allclose(alone, adv[:n])
    constant, _ = compute_advantages(row("grpo_batch_std"), _outcome([0.3] * 4), MASK,
                                     group_size=2)
    assert (constant == 0).all()
