import math

import pytest
import torch

from kernels.importance import truncated_is_weights
from kernels.is_metrics import IS_METRIC_NAMES
from kernels.offpolicy import METRIC_NAMES, mismatch_metrics
from kernels.policy_losses.vanilla import ppo_clip_loss
from kernels.rollout_options import parse_is_threshold


def test_on_policy_weights_are_one_and_metrics_neutral():
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 4, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    for level in ("token", "sequence"):
        w, m = truncated_is_weights(lp, lp.clone(), mask, level=level)
        assert torch.equal(w, mask.float())  # 1 on response tokens, 0 elsewhere
        assert set(m) == {*IS_METRIC_NAMES, "rollout_corr/is_clip_frac"}
        assert m["rollout_corr/is_clip_frac"] == m["rollout_corr/rollout_is_ratio_fraction_high"]
        assert m["rollout_corr/is_clip_frac"] == 0.0
        assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.0)
        metrics = mismatch_metrics(lp, lp.clone(), mask, w)
        assert set(metrics) == set(METRIC_NAMES)
        assert metrics["rollout_corr/ess"] == pytest.approx(1.0)
        assert metrics["rollout_corr/is_weight_mean"] == pytest.approx(1.0)
        assert metrics["rollout_corr/is_weight_std"] == pytest.approx(0.0, abs=1e-6)
        for key in ("kl", "k3_kl", "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max",
                    "log_ppl_diff_min", "chi2_token", "chi2_seq"):
            assert metrics[f"rollout_corr/{key}"] == pytest.approx(0.0, abs=1e-6)
        assert metrics["rollout_corr/training_ppl"] == metrics["rollout_corr/rollout_ppl"]
        assert metrics["rollout_corr/ppl_ratio"] == pytest.approx(1.0)


def test_token_level_cap_hand_case():
    # rho = [3, 0.5, 1.5] capped at 2 -> w = [2, 0.5, 1.5]
    behav = torch.tensor([[-1.0, -1.0, -1.0, -7.0]])
    old = behav + torch.log(torch.tensor([[3.0, 0.5, 1.5, 100.0]]))
    mask = torch.tensor([[1, 1, 1, 0]])  # the padded rho = 100 must not count
    w, m = truncated_is_weights(old, behav, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.5, 0.0]]))
    assert m["rollout_corr/is_clip_frac"] == pytest.approx(1 / 3)

    metrics = mismatch_metrics(old, behav, mask, w)
    ln225 = math.log(2.25)  # sum of log rho = ln(3 * 0.5 * 1.5)
    expected = {
        "rollout_corr/is_weight_mean": 4 / 3,
        "rollout_corr/is_weight_std": math.sqrt(3.5 / 9),  # sqrt(6.5/3 - 16/9) = 0.623610
        "rollout_corr/is_weight_min": 0.5,
        "rollout_corr/is_weight_max": 2.0,
        "rollout_corr/rho_max": 3.0,
        "rollout_corr/ess": (16 / 9) / (6.5 / 3),  # mean(w)^2 / mean(w^2) = 0.820513
        "rollout_corr/kl": -ln225 / 3,  # mean(-log rho) = -0.270310
        "rollout_corr/k3_kl": (5.0 - 3.0 - ln225) / 3,  # mean(rho - 1 - log rho) = 0.396357
        "rollout_corr/training_ppl": math.exp(1.0 - ln225 / 3),  # mean lp_old = -1 + 0.270310
        "rollout_corr/rollout_ppl": math.e,
        "rollout_corr/log_ppl_diff": -ln225 / 3,
        "rollout_corr/chi2_token": (9 + 0.25 + 2.25) / 3 - 1,  # 2.833333
        "rollout_corr/chi2_seq": 2.25**2 - 1,
        "rollout_corr/training_log_ppl": 1.0 - ln225 / 3,
        "rollout_corr/rollout_log_ppl": 1.0,
        "rollout_corr/log_ppl_abs_diff": ln225 / 3,
        "rollout_corr/log_ppl_diff_max": -ln225 / 3,
        "rollout_corr/log_ppl_diff_min": -ln225 / 3,
        "rollout_corr/ppl_ratio": math.exp(-ln225 / 3),
    }
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5), key
        assert isinstance(metrics[key], float)


def test_sequence_level_weights_broadcast_and_cap():
    behav = torch.zeros(2, 2)
    old = torch.log(torch.tensor([[2.0, 2.0], [0.5, 50.0]]))
    mask = torch.tensor([[1, 1], [1, 0]])
    w, m = truncated_is_weights(old, behav, mask, cap=2.0, level="sequence")
    # sequence 1: rho = 2 * 2 = 4 -> capped 2 on both tokens; sequence 2: rho = 0.5 (padding 50
    # ignored), and 0 on the padded token
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0], [0.5, 0.0]]))
    # a fraction of sequences, as verl's rollout_is_ratio_fraction_high (was 2/3 of tokens)
    assert m["rollout_corr/is_clip_frac"] == pytest.approx(1 / 2)
    w_uncapped, _ = truncated_is_weights(old, behav, mask, cap=10.0, level="sequence")
    torch.testing.assert_close(w_uncapped, torch.tensor([[4.0, 4.0], [0.5, 0.0]]))


def test_weights_are_detached_and_give_no_gradient():
    old = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    behav = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    mask = torch.ones(1, 2)
    w, _ = truncated_is_weights(old, behav, mask)
    assert not w.requires_grad
    lp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    loss, _ = ppo_clip_loss(lp, old.detach(), torch.ones(1, 2), mask, weights=w)
    loss.backward()
    assert old.grad is None and behav.grad is None
    # per-token d loss / d lp = -A * w * ratio / 2, ratio = 1, w = [e^0.5, 1]
    torch.testing.assert_close(lp.grad, torch.tensor([[-math.exp(0.5) / 2, -0.5]]))


def test_extreme_ratios_stay_finite():
    old = torch.tensor([[0.0, -100.0]])
    behav = torch.tensor([[-100.0, 0.0]])
    mask = torch.ones(1, 2)
    for level in ("token", "sequence"):
        w, _ = truncated_is_weights(old, behav, mask, cap=5.0, level=level)
        metrics = mismatch_metrics(old, behav, mask, w)
        assert torch.isfinite(w).all()
        # k3_kl takes exp of the raw log-ratio as verl does: e^100 overflows float32
        assert metrics.pop("rollout_corr/k3_kl") == math.inf
        assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["rollout_corr/rho_max"] == pytest.approx(math.exp(20.0), rel=1e-5)


def test_sequence_weight_sums_raw_log_ratios_before_clamping():
    """Token log-ratios [-25, +10] give e^-15 (not e^-20 * e^10), and
    [+25, -20] with cap 2 give 2 (not min(e^0, 2) = 1)."""
    old = torch.tensor([[-25.5, -0.5], [-0.5, -25.5]], dtype=torch.float64)
    behav = torch.tensor([[-0.5, -10.5], [-25.5, -5.5]], dtype=torch.float64)
    mask = torch.ones(2, 2)
    w, m = truncated_is_weights(old, behav, mask, cap=2.0, level="sequence")
    torch.testing.assert_close(w, torch.tensor([[math.exp(-15)] * 2, [2.0, 2.0]],
                                               dtype=torch.float64))
    assert m["rollout_corr/is_clip_frac"] == 0.5  # one of two sequences above the cap
    metrics = mismatch_metrics(old, behav, mask, w)
    # chi2_seq and kl from raw log-ratios too (point 4): sums -15 and +5
    assert metrics["rollout_corr/chi2_seq"] == pytest.approx(
        (math.exp(-30) + math.exp(10)) / 2 - 1)
    assert metrics["rollout_corr/kl"] == pytest.approx(-(-15 + 5) / 4)
    assert metrics["rollout_corr/k3_kl"] == pytest.approx(
        sum(math.exp(x) - 1 - x for x in (-25, 10, 25, -20)) / 4)


def test_icepop_band_zeroes_weights_outside_it():
    behav = torch.zeros(1, 4)
    old = torch.log(torch.tensor([[0.2, 0.6, 1.5, 7.0]]))
    mask = torch.tensor([[1, 1, 1, 1]])
    w, m = truncated_is_weights(old, behav, mask, cap=5.0, lower=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.6, 1.5, 0.0]]))
    assert m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(0.25)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(0.25)
    w, m = truncated_is_weights(old, behav, mask, cap=5.0, lower=0.5, normalize=True)
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(2.1 / 4)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.6, 1.5, 0.0]]) * 4 / 2.1)
    with pytest.raises(ValueError, match="lower must be in"):
        truncated_is_weights(old, behav, mask, cap=5.0, lower=6.0)


def test_parse_is_threshold():
    assert parse_is_threshold(2.0) == (2.0, None)
    assert parse_is_threshold("2") == (2.0, None)
    assert parse_is_threshold("0.5_5.0") == (5.0, 0.5)
    for bad in ("a", "0_1", "2_1", -1.0, True):
        with pytest.raises(ValueError, match="rollout_is_threshold"):
            parse_is_threshold(bad)


def test_empty_rows_count_in_sequence_averages_as_in_verl():
    """A row without a response token counts as ppl 1 and difference 0."""
    lp = torch.tensor([[-1.0, -1.0], [-3.0, -3.0]])
    behav = lp - 0.5
    mask = torch.tensor([[1, 1], [0, 0]])
    metrics = mismatch_metrics(lp, behav, mask, mask.float())
    assert metrics["rollout_corr/training_ppl"] == pytest.approx((math.e + 1) / 2)
    assert metrics["rollout_corr/rollout_ppl"] == pytest.approx((math.exp(1.5) + 1) / 2)
    assert metrics["rollout_corr/log_ppl_diff"] == pytest.approx(-0.5 / 2)
    assert metrics["rollout_corr/chi2_seq"] == pytest.approx((math.exp(2.0) + 1) / 2 - 1)


def test_empty_mask_gives_nan_metrics():
    lp = torch.zeros(2, 3)
    mask = torch.zeros(2, 3)
    w, m = truncated_is_weights(lp, lp, mask)
    assert torch.equal(w, torch.zeros(2, 3))
    assert m["rollout_corr/is_clip_frac"] == 0.0
    assert all(math.isnan(v) for v in mismatch_metrics(lp, lp, mask, w).values())


@pytest.mark.parametrize("cap", [0.0, -1.0])
def test_bad_cap(cap):
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=f"cap must be > 0, got {cap}"):
        truncated_is_weights(lp, lp, torch.ones(1, 2), cap=cap)


def test_bad_level():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="'seq'"):
        truncated_is_weights(lp, lp, torch.ones(1, 2), level="seq")
