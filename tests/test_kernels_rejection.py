import math

import pytest
import torch

from kernels.importance import normalize_weights
from kernels.rejection import rejection_mask
from kernels.rollout_options import RejectionRule, parse_rs_preset

# Three sequences; rho per token, padding (mask 0) holds wild values that must not count.
RHO = torch.tensor(
    [
        [1.0, 3.0, 1.0, 100.0],  # one token far above 1
        [0.5, 0.5, 1e-6, 1.0],  # low, padding very low
        [1.1, 0.9, 1.0, 1.0],  # close to on-policy
    ]
)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
BEHAV = torch.full(RHO.shape, -2.0)
OLD = BEHAV + RHO.log()


def _keep(*rules, mask=MASK):
    return rejection_mask(OLD, BEHAV, mask, list(rules))


def test_token_ratio_rule():
    keep, m = _keep(RejectionRule("ratio", "token", 0.6, 2.0))
    expected = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert torch.equal(keep, expected) and keep.dtype == MASK.dtype
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(3 / 9)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 3)
    assert m["rollout_corr/rollout_rs_ratio_token_fraction_low"] == pytest.approx(2 / 9)
    assert m["rollout_corr/rollout_rs_ratio_token_fraction_high"] == pytest.approx(1 / 9)
    assert m["rollout_corr/rollout_rs_ratio_token_masked_fraction"] == pytest.approx(3 / 9)
    assert m["rollout_corr/rollout_rs_ratio_token_max"] == pytest.approx(math.log(3.0))


def test_sequence_ratio_and_geometric_mean():
    # sequence ratios 3, 0.25, 0.99; geometric means 3^(1/3) = 1.442, 0.5, 0.99^(1/4)
    keep, m = _keep(RejectionRule("ratio", "sequence", 0.5, 2.0))
    assert torch.equal(keep, torch.tensor([[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]))
    assert m["rollout_corr/rollout_rs_ratio_sequence_fraction_low"] == pytest.approx(1 / 3)
    assert m["rollout_corr/rollout_rs_ratio_sequence_fraction_high"] == pytest.approx(1 / 3)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(5 / 9)
    keep, m = _keep(RejectionRule("geo_mean", "sequence", 0.45, 1.5))
    assert torch.equal(keep, MASK)
    keep, m = _keep(RejectionRule("geo_mean", "sequence", None, 1.4))
    assert torch.equal(keep, torch.tensor([[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]))
    assert m["rollout_corr/rollout_rs_geo_mean_sequence_fraction_high"] == pytest.approx(1 / 3)
    assert m["rollout_corr/rollout_rs_geo_mean_sequence_fraction_low"] == 0.0


def test_kl_statistics_token_and_sequence():
    log_rho = RHO.log()
    k3 = torch.expm1(log_rho) - log_rho  # rho - 1 - log rho
    # token k1 = -log rho in [-0.5, 0.5]: rho in [0.607, 1.649]
    keep, _ = _keep(RejectionRule("k1", "token", -0.5, 0.5))
    assert torch.equal(keep, torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]))
    # token k2 = (log rho)^2 / 2 <= 0.2 keeps |log rho| <= 0.632: same tokens
    keep, _ = _keep(RejectionRule("k2", "token", None, 0.2))
    assert torch.equal(keep, torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]))
    # token k3 <= 0.2: rho = 0.5 gives 0.193 (kept), rho = 3 gives 0.901 (dropped)
    keep, m = _keep(RejectionRule("k3", "token", None, 0.2))
    assert torch.equal(keep, torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]))
    assert m["rollout_corr/rollout_rs_token_k3_fraction_high"] == pytest.approx(1 / 9)
    # sequence k3: means 0.300, 0.193, 0.0026
    seq_k3 = [(k3[i] * MASK[i]).sum().item() / MASK[i].sum().item() for i in range(3)]
    assert seq_k3[0] == pytest.approx(0.9014 / 3, abs=1e-4)
    keep, m = _keep(RejectionRule("k3", "sequence", None, 0.25))
    assert torch.equal(keep, torch.tensor([[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]))
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 3)
    assert m["rollout_corr/rollout_rs_seq_mean_k3_seq_max"] == pytest.approx(seq_k3[0])
    # sequence k1: means -log(3)/3 = -0.366, log 2 = 0.693, ~0.0025
    keep, _ = _keep(RejectionRule("k1", "sequence", -0.4, 0.5))
    assert torch.equal(keep, torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]))


def test_rules_combine_with_and():
    token_rule = RejectionRule("ratio", "token", None, 2.0)  # drops the 3.0 token
    seq_rule = RejectionRule("geo_mean", "sequence", 0.6, None)  # drops sequence 2
    keep, m = _keep(token_rule, seq_rule)
    assert torch.equal(keep, torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]))
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(3 / 9)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 3)
    assert {
        "rollout_corr/rollout_rs_ratio_token_fraction_high",
        "rollout_corr/rollout_rs_geo_mean_sequence_fraction_low",
    } < set(m)


def test_on_policy_keeps_everything_and_weights_stay_one():
    lp = -torch.rand(3, 4, generator=torch.Generator().manual_seed(0))
    rules = [RejectionRule(s, "sequence", None, 1e-9) for s in ("k2", "k3")]
    rules += [
        RejectionRule("ratio", "token", 1.0, 1.0),
        RejectionRule("geo_mean", "sequence", 1, 1),
    ]
    keep, m = rejection_mask(lp, lp.clone(), MASK, rules)
    assert torch.equal(keep, MASK)
    assert all(v == 0.0 for v in m.values())
    torch.testing.assert_close(normalize_weights(MASK.float(), MASK), MASK.float())


def test_never_adds_tokens_and_nan_is_rejected():
    old = OLD.clone()
    old[2, 0] = math.nan
    keep, _ = rejection_mask(old, BEHAV, MASK, [RejectionRule("k3", "token", None, 1e9)])
    assert torch.equal(keep, torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 1, 1, 1]]))
    keep, m = rejection_mask(
        OLD, BEHAV, torch.zeros_like(MASK), [RejectionRule("k1", "token", 0, 1)]
    )
    assert not keep.any() and all(v == 0.0 for v in m.values())


def test_no_rules_is_identity():
    keep, m = _keep()
    assert torch.equal(keep, MASK)
    assert m == {"rollout_corr/rollout_rs_masked_fraction": 0.0,
                 "rollout_corr/rollout_rs_seq_masked_fraction": 0.0}


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("kl", "token", 0, 1), "'kl'"),
        (("k1", "seq", 0, 1), "'seq'"),
        (("geo_mean", "token", 0, 1), "geo_mean is a sequence statistic"),
        (("k2", "token", None, None), "needs low or high"),
        (("k1", "token", 2.0, 1.0), "low 2.0 > high 1.0"),
        (("ratio", "token", -1.0, 2.0), "got -1.0"),
        (("k3", "token", None, math.nan), "NaN"),
    ],
)
def test_bad_rules(args, match):
    with pytest.raises(ValueError, match=match):
        RejectionRule(*args)


def test_duplicate_rules_and_shapes():
    rule = RejectionRule("k3", "token", None, 1.0)
    with pytest.raises(ValueError, match="two rejection rules for token_k3"):
        _keep(rule, RejectionRule("k3", "token", None, 2.0))
    with pytest.raises(ValueError, match="share a shape"):
        rejection_mask(OLD[:, :3], BEHAV, MASK, [rule])
    with pytest.raises(ValueError, match="RejectionRule"):
        rejection_mask(OLD, BEHAV, MASK, [("k3", "token", None, 1.0)])


def test_verl_presets():
    # k1 options bound exp(k1) = 1/rho, as verl's code does: k1 in [log lower, log upper]
    assert parse_rs_preset("seq_sum_k1", "0.5_2.0") == [
        RejectionRule("k1", "sequence", math.log(0.5), math.log(2.0), "sum")
    ]
    assert parse_rs_preset("seq_mean_k1", "0.999_1.001") == [
        RejectionRule("k1", "sequence", math.log(0.999), math.log(1.001))
    ]
    assert parse_rs_preset("seq_mean_k3", 0.01) == [RejectionRule("k3", "sequence", None, 0.01)]
    assert parse_rs_preset("token_k1", 2.0) == [
        RejectionRule("k1", "token", math.log(0.5), math.log(2.0))
    ]
    assert parse_rs_preset("token_k1, token_k3, token_k1", "0.5_1.5,0.2") == [
        RejectionRule("k1", "token", math.log(0.5), math.log(1.5)),
        RejectionRule("k3", "token", None, 0.2),
    ]  # repeats dropped, as verl does
    assert parse_rs_preset("seq_max_k3,seq_sum_k2", "0.1,2") == [
        RejectionRule("k3", "sequence", None, 0.1, "max"),
        RejectionRule("k2", "sequence", None, 2.0, "sum"),
    ]
    assert [r.name for r in parse_rs_preset("seq_max_k2,seq_sum_k1,token_k3", "1,2,3")] == [
        "seq_max_k2", "seq_sum_k1", "token_k3"]
    with pytest.raises(ValueError, match="'seq_max_k1'"):
        parse_rs_preset("seq_max_k1", 0.1)
    with pytest.raises(ValueError, match="'a_b'"):
        parse_rs_preset("seq_sum_k1", "a_b")
    with pytest.raises(ValueError, match="2 entries for 3 options"):
        parse_rs_preset("token_k1,token_k2,token_k3", "2.0,0.1")
    with pytest.raises(ValueError, match="must be > 0"):
        parse_rs_preset("seq_mean_k2", "0")
    with pytest.raises(ValueError, match="single upper bound"):
        parse_rs_preset("seq_mean_k2", "0.1_0.2")
    with pytest.raises(ValueError, match="lower <= upper"):
        parse_rs_preset("token_k1", "2_1")


def test_k1_preset_bounds_the_inverse_ratio_as_verl_does():
    # token_k1 "0.5_1.5" keeps 0.5 <= 1/rho <= 1.5, i.e. rho in [0.667, 2]: 3.0 and 0.5 go
    keep, _ = _keep(*parse_rs_preset("token_k1", "0.5_1.5"))
    assert torch.equal(keep, torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]))
    keep, _ = _keep(*parse_rs_preset("token_k1", "0.6_2.1"))  # rho in [0.476, 1.667]
    assert torch.equal(keep, torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]))


def test_sequence_sum_and_max_reductions():
    log_rho = RHO.log()
    k2 = 0.5 * log_rho.square()
    seq_sum = [(k2[i] * MASK[i]).sum().item() for i in range(3)]
    seq_max = [k2[i][MASK[i].bool()].max().item() for i in range(3)]
    keep, m = _keep(RejectionRule("k2", "sequence", None, 0.5, "sum"))
    expected = [s <= 0.5 for s in seq_sum]  # 0.603, 0.480, 0.009
    assert keep.bool().any(-1).tolist() == expected == [False, True, True]
    assert m["rollout_corr/rollout_rs_seq_sum_k2_seq_max"] == pytest.approx(max(seq_sum))
    keep, m = _keep(RejectionRule("k2", "sequence", None, 0.25, "max"))
    assert keep.bool().any(-1).tolist() == [s <= 0.25 for s in seq_max] == [False, True, True]
    assert m["rollout_corr/rollout_rs_seq_max_k2_masked_fraction"] == pytest.approx(3 / 9)
    with pytest.raises(ValueError, match="reduce='sum' applies to k1/k2/k3 at sequence level"):
        RejectionRule("k2", "token", None, 1.0, "sum")
    with pytest.raises(ValueError, match="reduce='max' applies"):
        RejectionRule("ratio", "sequence", None, 1.0, "max")


def test_normalize_weights_token_and_sequence():
    w = torch.tensor([[1.0, 3.0, 9.0], [2.0, 2.0, 2.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    tok = normalize_weights(w, mask)  # token mean (1 + 3 + 6) / 5 = 2
    torch.testing.assert_close(tok, torch.tensor([[0.5, 1.5, 0.0], [1.0, 1.0, 1.0]]))
    assert not tok.requires_grad
    seq = normalize_weights(w, mask, level="sequence")  # sequence means 2, 2
    torch.testing.assert_close(seq, torch.tensor([[0.5, 1.5, 0.0], [1.0, 1.0, 1.0]]))
    uneven = normalize_weights(
        torch.tensor([[4.0, 4.0, 4.0], [1.0, 1.0, 1.0]]), mask, level="sequence"
    )
    torch.testing.assert_close(uneven[mask.bool()], torch.tensor([1.6, 1.6, 0.4, 0.4, 0.4]))
    zeros = normalize_weights(torch.zeros(2, 3), mask)
    assert torch.equal(zeros, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="'batch'"):
        normalize_weights(w, mask, level="batch")
