import math

import pytest
import torch

from actors.runtime.config.losses import ROWS, Custom, Reinforce, Sapo
from kernels.aggregate import AGG_MODES, aggregate
from kernels.policy_losses import policy_loss
from kernels.policy_losses.vanilla import ppo_clip_loss
from kernels.value_loss import value_loss

LOSSES = sorted(n for n, row in ROWS.items() if row is not Custom)  # a user's own: its own tests
METRIC_KEYS = {"actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"}
OPTIONS = {"dro": {"dro_beta": 0.1}}  # options without a default
# Losses that take no importance weights (bypass_mode computes its own).
UNWEIGHTED = {"bypass_mode"}
# Losses whose token selection is made per call (as in verl, per micro-batch), so micro-batch
# losses do not add up to the batch's: clip_cov drops a random budget of tokens, kl_cov
# penalises the top share of tokens by covariance.
PER_CALL_SELECTION = {"clip_cov", "kl_cov"}


def _case(seed=0, b=3, t=5):
    gen = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(b, t, generator=gen)).requires_grad_()
    old = lp.detach() + 0.05 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, 1, generator=gen).expand(b, t)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])[:b, :t]
    return lp, old, adv, mask


def _call(name, lp, old, adv, mask, **kw):
    """Loss ``name`` through its config row, built of the options in ``kw`` that are its fields;
    the others are the call's (bypass_mode's correction options, clip_cov's generator)."""
    kw.setdefault("clip_low", 0.2)
    kw.setdefault("clip_high", 0.2)
    kw.setdefault("loss_agg_mode", "token-mean")
    fields = {k: kw.pop(k) for k in list(kw) if k in ROWS[name].__struct_fields__}
    return policy_loss(ROWS[name](**OPTIONS.get(name, {}) | fields), lp, old, adv, mask, **kw)


def test_the_rows_traits():
    assert ROWS["gpg"]().load() is Reinforce().load()
    assert [n for n in LOSSES if ROWS[n].takes_correction] == ["bypass_mode"]


def test_an_option_given_by_the_row_and_the_caller_is_refused():
    lp, old, adv, mask = _case()
    with pytest.raises(ValueError, match=r"\['tau_pos'\] given by its row and by the caller"):
        policy_loss(Sapo(), lp, old, adv, mask, clip_low=0.2, clip_high=0.2,
                    loss_agg_mode="token-mean", tau_pos=2.0)


def test_vanilla_is_ppo_clip_loss():
    lp, old, adv, mask = _case()
    got, m = _call("vanilla", lp, old, adv, mask, dual_clip=3.0)
    want, m_want = ppo_clip_loss(lp, old, adv, mask, dual_clip=3.0)
    assert got.item() == want.item()
    assert {k: v.item() for k, v in m.items()} == {k: v.item() for k, v in m_want.items()}


@pytest.mark.parametrize("name", LOSSES)
def test_same_metric_keys_detached_scalars(name):
    lp, old, adv, mask = _case()
    _, metrics = _call(name, lp, old, adv, mask)
    if name == "bypass_mode":  # plus the rollout_corr/ family, as Python floats
        assert {k for k in metrics if not k.startswith("rollout_corr/")} == METRIC_KEYS
    else:
        assert set(metrics) == METRIC_KEYS
    assert all(not v.requires_grad and v.dim() == 0 for k, v in metrics.items()
               if k.startswith("actor/"))
    diff = (old - lp.detach())[mask.bool()]
    kl = (diff.abs() if name == "kl_cov" else diff).mean().item()  # kl_cov reports |kl| (verl)
    assert metrics["actor/ppo_kl"].item() == pytest.approx(kl, abs=1e-6)


def test_gspo_ratio_is_sequence_geometric_mean_and_gradient_per_token():
    lp = torch.log(torch.tensor([[1.2, 0.9, 2.0], [0.5, 1.0, 1.0]])).requires_grad_()
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # the 2.0 in padding must not count
    adv = torch.tensor([[1.0], [-2.0]]).expand(2, 3)
    s = [math.sqrt(1.2 * 0.9), 0.5 ** (1 / 3)]  # geometric means 1.03923, 0.79370
    loss, m = _call(
        "gspo", lp, old, adv, mask, clip_low=0.5, clip_high=0.5, loss_agg_mode="seq-mean-token-mean"
    )
    # nothing clipped: per-token loss -A * s_i; seq-mean-token-mean over 2 sequences
    assert loss.item() == pytest.approx((-1.0 * s[0] + 2.0 * s[1]) / 2, rel=1e-6)
    assert m["actor/pg_clipfrac"].item() == 0.0
    loss.backward()
    # d loss / d lp_t = -A_i * s_i / (L_i * 2): every token of a sequence gets the same gradient
    expected = torch.tensor(
        [
            [-s[0] / (2 * 2), -s[0] / (2 * 2), 0.0],
            [2.0 * s[1] / (3 * 2)] * 3,
        ]
    )
    torch.testing.assert_close(lp.grad, expected)


def test_gspo_clips_whole_sequences():
    lp = torch.log(torch.tensor([[1.5, 1.5], [1.0, 1.0]])).requires_grad_()
    old = torch.zeros(2, 2)
    adv = torch.ones(2, 2)
    loss, m = _call(
        "gspo",
        lp,
        old,
        adv,
        torch.ones(2, 2),
        clip_low=3e-4,
        clip_high=4e-4,
        loss_agg_mode="seq-mean-token-mean",
    )
    assert loss.item() == pytest.approx((-(1 + 4e-4) - 1.0) / 2)
    assert m["actor/pg_clipfrac"].item() == 0.5
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0], [-0.25, -0.25]]))


def test_cispo_gradient_is_clipped_ratio_times_advantage():
    ratios = torch.tensor([[2.0, 0.5, 1.1, 1.0]])
    lp = torch.log(ratios).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 2.0, -3.0]])
    loss, m = _call("cispo", lp, torch.zeros(1, 4), adv, torch.ones(1, 4))
    clipped = torch.tensor([[1.2, 0.8, 1.1, 1.0]])
    assert loss.item() == pytest.approx((-(clipped * adv * lp.detach()).sum() / 4).item())
    assert m["actor/pg_clipfrac"].item() == 0.5
    loss.backward()
    # clipped tokens keep a gradient, unlike PPO: -clip(ratio) * A / N
    torch.testing.assert_close(lp.grad, -clipped * adv / 4)


def test_cispo_upper_only_with_clip_low_one():
    lp = torch.log(torch.tensor([[0.01]])).requires_grad_()
    _call(
        "cispo",
        lp,
        torch.zeros(1, 1),
        torch.ones(1, 1),
        torch.ones(1, 1),
        clip_low=1.0,
        clip_high=0.28,
    )[0].backward()
    assert lp.grad.item() == pytest.approx(-0.01, rel=1e-5)  # not raised to a lower bound


@pytest.mark.parametrize("name", ["reinforce", "gpg"])
def test_reinforce_gradient_and_value(name):
    lp = torch.tensor([[-0.5, -1.0, -2.0]], requires_grad=True)
    old = lp.detach() + 5.0  # far off-policy: REINFORCE does not look at the ratio
    adv = torch.tensor([[1.0, -2.0, 3.0]])
    w = torch.tensor([[0.5, 1.0, 2.0]])
    loss, m = _call(name, lp, old, adv, torch.ones(1, 3), weights=w)
    assert loss.item() == pytest.approx((0.25 - 2.0 + 12.0) / 3)
    assert m["actor/pg_clipfrac"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv * w / 3)


@pytest.mark.parametrize("name", LOSSES)
def test_masked_tokens_carry_no_gradient_and_garbage_does_not_leak(name):
    lp, old, adv, mask = _case(seed=2)
    lp_in = lp.detach().clone()
    lp_in[mask == 0] = math.nan
    lp_in.requires_grad_()
    old = old.clone()
    old[mask == 0] = math.nan
    adv = adv.clone()
    adv[mask == 0] = math.inf
    weights = None if name in UNWEIGHTED else torch.rand(mask.shape)
    loss, metrics = _call(
        name, lp_in, old, adv, mask, weights=weights, dual_clip=3.0 if name == "vanilla" else None
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.all(lp_in.grad[mask == 0] == 0)
    assert torch.all(lp_in.grad[mask == 1] != 0)
    assert all(math.isfinite(float(v)) for v in metrics.values())


@pytest.mark.parametrize("name", sorted(set(LOSSES) - UNWEIGHTED))
def test_weights_are_detached_and_scale_the_loss(name):
    lp, old, adv, mask = _case(seed=4)
    weights = torch.full(mask.shape, 2.0, requires_grad=True)
    plain, _ = _call(name, lp, old, adv, mask)
    weighted, _ = _call(name, lp, old, adv, mask, weights=weights)
    assert weighted.item() == pytest.approx(2 * plain.item(), rel=1e-6)
    weighted.backward()
    assert weights.grad is None


@pytest.mark.parametrize("name", sorted(set(LOSSES) - PER_CALL_SELECTION))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_add_up_to_the_batch(name, mode):
    lp, old, adv, mask = _case(seed=5)
    full, _ = _call(name, lp, old, adv, mask, loss_agg_mode=mode)
    (full_grad,) = torch.autograd.grad(full, lp)
    counts = dict(token_count=int(mask.sum()), seq_count=int((mask.sum(-1) > 0).sum()))
    micro = sum(
        _call(name, lp[s], old[s], adv[s], mask[s], loss_agg_mode=mode, **counts)[0]
        for s in (slice(0, 1), slice(1, 3))
    )
    (micro_grad,) = torch.autograd.grad(micro, lp)
    torch.testing.assert_close(micro, full)
    torch.testing.assert_close(micro_grad, full_grad)


def test_policy_loss_bad_inputs():
    lp, old, adv, mask = _case()
    with pytest.raises(ValueError, match="tau"):
        _call("gspo", lp, old, adv, mask, tau=1.0)
    with pytest.raises(ValueError, match=r"old_logprobs shape \(3, 4\)"):
        _call("cispo", lp, old[:, :4], adv, mask)
    with pytest.raises(ValueError, match=r"advantages shape \(2, 5\)"):
        _call("reinforce", lp, old, adv[:2], mask)
    with pytest.raises(ValueError, match="clip_low=1.5"):
        _call("gspo", lp, old, adv, mask, clip_low=1.5)
    with pytest.raises(ValueError, match="clip_high=-0.1"):
        _call("cispo", lp, old, adv, mask, clip_high=-0.1)
    with pytest.raises(ValueError, match="seq-sum"):
        _call("gspo", lp, old, adv, mask, loss_agg_mode="seq-sum")


# value_loss ----------------------------------------------------------------------------------


def test_value_loss_clipping_hand_case():
    # v_old = 0, c = 0.5
    # v = 1.0, R = 2: unclipped 1, clipped (0.5-2)^2 = 2.25 -> 2.25, clipped branch, no grad
    # v = 1.0, R = 0: unclipped 1, clipped 0.25 -> 1, gradient 2(v-R) = 2
    # v = 0.2, R = 1: inside the range, both 0.64
    values = torch.tensor([[1.0, 1.0, 0.2, 9.0]], requires_grad=True)
    old = torch.zeros(1, 4)
    returns = torch.tensor([[2.0, 0.0, 1.0, math.nan]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, m = value_loss(values, old, returns, mask, cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1.0 + 0.64) / 3)
    assert m["critic/vf_loss"].item() == pytest.approx(loss.item())
    assert m["critic/vf_clipfrac"].item() == pytest.approx(1 / 3)
    assert m["critic/vpred_mean"].item() == pytest.approx(2.2 / 3)
    loss.backward()
    # 0.5 * d/dv (v-R)^2 / 3 = (v-R)/3
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 1 / 3, -0.8 / 3, 0.0]]))


def test_value_loss_aggregation_and_errors():
    values = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    zeros = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, _ = value_loss(values, values, zeros, mask, loss_agg_mode="seq-mean-token-sum")
    per_token = values.square()
    assert loss.item() == pytest.approx(
        0.5 * aggregate(per_token, mask, "seq-mean-token-sum").item()
    )
    with pytest.raises(ValueError, match="cliprange_value must be > 0, got 0"):
        value_loss(values, values, zeros, mask, cliprange_value=0)
    with pytest.raises(ValueError, match=r"returns shape \(2,\)"):
        value_loss(values, values, zeros[0], mask)


# the further losses of verl 0.9.1 (tests/test_verl_parity.py compares them with verl) -----------


def test_sapo_aggregates_as_verl_whatever_the_mode():
    """verl's SAPO takes seq-mean-token-mean whatever loss_agg_mode says; so does ours (the
    same config gives the same loss), and the mode it was handed does not change it."""
    lp, old, adv, mask = _case()  # rows of unequal length: the modes differ
    got = {m: _call("sapo", lp, old, adv, mask, loss_agg_mode=m)[0].item() for m in AGG_MODES}
    assert len(set(got.values())) == 1, got
    tau = torch.where(adv > 0, 1.0, 1.05)  # the row's tau_pos and tau_neg
    gate = torch.sigmoid(tau * (torch.exp(lp - old) - 1.0)) * 4.0 / tau
    want = aggregate(-gate * adv, mask, "seq-mean-token-mean").item()
    assert got["token-mean"] == pytest.approx(want, rel=1e-6)
    assert aggregate(-gate * adv, mask, "token-mean").item() != pytest.approx(want, rel=1e-3)


def test_sapo_gate_is_ppo_at_ratio_one_and_fades_away_from_it():
    lp = torch.zeros(1, 2, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]])
    loss, m = _call("sapo", lp, lp.detach(), adv, torch.ones(1, 2))
    # gate(1) = sigmoid(0) * 4 / tau = 2 / tau; tau = 1 for A > 0, 1.05 for A < 0
    assert loss.item() == pytest.approx((-2.0 + 2.0 / 1.05) / 2, rel=1e-5)
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv / 2)  # slope 1 at r = 1: PPO's gradient
    far = torch.full((1, 2), 3.0, requires_grad=True)  # ratio e^3
    _call("sapo", far, torch.zeros(1, 2), adv, torch.ones(1, 2))[0].backward()
    assert far.grad.abs().max() < 0.1
    with pytest.raises(ValueError, match="tau_pos > 0"):
        _call("sapo", lp, lp.detach(), adv, torch.ones(1, 2), tau_pos=0.0)


def test_geo_mean_clips_one_side_by_the_advantage_sign():
    old = torch.zeros(2, 2)
    lp = torch.tensor([[0.1, 0.5], [-0.5, 0.1]], requires_grad=True)
    adv = torch.tensor([[2.0], [-1.0]]).expand(2, 2)
    loss, m = _call("geo_mean", lp, old, adv, torch.ones(2, 2), clip_low=0.4, clip_high=0.4)
    # row 0 (A > 0): [0.1, min(0.5, 0.4)] -> exp(0.25); row 1 (A < 0): [max(-0.5, -0.4), 0.1]
    expected = (-2.0 * math.exp(0.25) + math.exp(-0.15)) / 2
    assert loss.item() == pytest.approx(expected)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(1 / 4)
    assert m["actor/pg_clipfrac_lower"].item() == pytest.approx(1 / 4)
    loss.backward()
    assert lp.grad[0, 1].item() == 0.0 and lp.grad[1, 0].item() == 0.0  # clipped tokens


def test_dro_gradient_pulls_back_towards_old():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0]])
    adv = torch.tensor([[1.0, 1.0]])
    loss, _ = _call("dro", lp, old, adv, torch.ones(1, 2), dro_beta=0.4)
    loss.backward()
    # d/dlp -(A lp - beta/2 (lp - old)^2) = -A + beta (lp - old), halved by token-mean
    torch.testing.assert_close(lp.grad, torch.tensor([[(-1 + 0.4 * 0.5) / 2, -0.5]]))
    with pytest.raises(ValueError, match="dro_beta > 0"):
        _call("dro", lp, old, adv, torch.ones(1, 2), dro_beta=0.0)


def test_dppo_drops_tokens_whose_probability_moved_too_far():
    old = torch.log(torch.tensor([[0.2, 0.2, 0.9]]))
    lp = torch.log(torch.tensor([[0.3, 0.6, 0.5]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, m = _call("dppo_tv", lp, old, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.2)
    # p - p_old: +0.1 (kept), +0.4 (> 0.2 with A > 0: dropped), -0.4 (< -0.2 with A < 0: dropped)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(2 / 3)
    loss.backward()
    assert lp.grad[0, 1].item() == 0.0 and lp.grad[0, 2].item() == 0.0
    assert lp.grad[0, 0].item() == pytest.approx(-1.5 / 3)  # -A * sg(r) / 3, r = 1.5


def test_clip_cov_drops_a_budget_of_high_covariance_tokens():
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(8, 16, generator=gen)
    adv = 4 * torch.randn(8, 16, generator=gen)
    mask = torch.ones(8, 16)
    kw = dict(clip_cov_ratio=0.02, clip_cov_lb=0.1, clip_cov_ub=10.0)
    a, m = _call("clip_cov", lp, lp, adv, mask, generator=torch.Generator().manual_seed(1), **kw)
    b, _ = _call("clip_cov", lp, lp, adv, mask, generator=torch.Generator().manual_seed(1), **kw)
    assert a.item() == b.item()
    assert m["actor/pg_clipfrac"].item() == pytest.approx(2 / 128)  # int(0.02 * 128) = 2
    plain, _ = _call("vanilla", lp, lp, adv, mask)
    assert a.item() != plain.item()


def test_kl_cov_penalises_the_largest_covariance_tokens():
    lp = torch.tensor([[-1.0, -2.0, -3.0, -4.0]], requires_grad=True)
    old = lp.detach() - 0.5
    adv = torch.tensor([[2.0, 0.0, 0.0, -2.0]])
    # covariance (A - 0) * (lp + 2.5): 3, 0, 0, 3 -> ratio 0.5 picks two tokens: 0 and 3
    loss, m = _call("kl_cov", lp, old, adv, torch.ones(1, 4), kl_cov_ratio=0.5, ppo_kl_coef=1.0)
    surrogate = (-adv * math.exp(0.5)).sum().item()
    assert loss.item() == pytest.approx((surrogate + 2 * 0.5) / 4)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(0.5)
    assert m["actor/ppo_kl"].item() == pytest.approx(0.5)  # |kl|, as verl reports it


def test_bypass_mode_is_ppo_or_reinforce_on_behaviour_logprobs():
    lp, behav, adv, mask = _case(seed=6)
    got, m = _call("bypass_mode", lp, behav, adv, mask, dual_clip=3.0)
    want, _ = ppo_clip_loss(lp, behav, adv, mask, dual_clip=3.0)
    assert got.item() == want.item()
    assert "rollout_corr/kl" in m and "rollout_corr/rollout_is_mean" not in m
    got, m = _call("bypass_mode", lp, behav, adv, mask, loss_type="reinforce", rollout_is="token",
                   rollout_is_threshold=1.01)
    w = torch.exp(lp.detach() - behav).clamp(max=1.01) * mask
    want, _ = _call("reinforce", lp, behav, adv, mask, weights=w)
    assert got.item() == pytest.approx(want.item())
    assert m["rollout_corr/rollout_is_max"] <= 1.01
    with pytest.raises(ValueError, match="weights=None"):
        _call("bypass_mode", lp, behav, adv, mask, weights=torch.ones(mask.shape))
    with pytest.raises(ValueError, match="'ppo'"):
        _call("bypass_mode", lp, behav, adv, mask, loss_type="ppo")


def test_token_sum_has_no_normaliser():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate(loss, mask, "token-sum").item() == 7.0
    assert aggregate(loss, mask, "token-sum", token_count=100).item() == 7.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("options", [{}, {"vespo_k_pos": 1.0, "vespo_lambda_pos": 0.5,
                                          "vespo_k_neg": 4.0, "vespo_lambda_neg": 6.0}])
def test_vespo_is_trls(options, dtype):
    """TRL 1.16's VESPO: its own gamma weights (``GRPOTrainer.get_gamma_weights``, no sampler
    correction) in its per-token loss ``-φ · A · lp``, token-summed over the batch's tokens
    (its "dapo" normaliser: token-mean); the gradient too."""
    trainer = pytest.importorskip("trl.trainer.grpo_trainer").GRPOTrainer
    gen = torch.Generator().manual_seed(7)
    mask = (torch.rand(6, 9, generator=gen) > 0.25).to(dtype)
    mask[:, 0] = 1
    lp = (-torch.rand(6, 9, generator=gen, dtype=dtype) * 2).requires_grad_()
    old = lp.detach() + 0.1 * torch.randn(6, 9, generator=gen, dtype=dtype)
    old[0] = lp[0].detach() + 0.5  # a sequence far off-policy: w = exp(-0.5 * its length)
    adv = torch.randn(6, 1, generator=gen, dtype=dtype)
    phi = trainer.get_gamma_weights(adv, lp.detach() - old, mask, None,
                                    **{k.removeprefix("vespo_"): v for k, v in options.items()})
    want = (-phi * adv * lp * mask).sum() / mask.sum()
    (want_grad,) = torch.autograd.grad(want, lp)
    got, m = _call("vespo", lp, old, adv.expand(6, 9), mask, **options)
    (got_grad,) = torch.autograd.grad(got, lp)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)
    assert m["actor/pg_clipfrac"].item() == 0.0
    assert phi[0].item() < 0.5 * phi[1:].max().item()  # the far one weighs less
    on_policy, _ = _call("vespo", lp, lp.detach(), adv.expand(6, 9), mask, **options)
    reinforce, _ = _call("reinforce", lp, lp.detach(), adv.expand(6, 9), mask)
    torch.testing.assert_close(on_policy, reinforce)  # φ(1) = 1
