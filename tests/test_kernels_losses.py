import math

import pytest
import torch

from kernels.aggregate import aggregate
from kernels.policy_losses.vanilla import ppo_clip_loss

# aggregate ------------------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # last row is all padding


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 sequences
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
        ("seq-mean-token-sum-norm", 7 / 6),  # (3/3 + 4/3) / 2, constant defaults to T = 3
    ],
)
def test_aggregate_modes_hand_case(mode, expected):
    assert aggregate(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_aggregate_norm_constant():
    got = aggregate(LOSS, MASK, "seq-mean-token-sum-norm", norm_constant=10.0)
    assert got.item() == pytest.approx((0.3 + 0.4) / 2)


def test_token_count_makes_micro_batches_sum_to_full_batch_token_mean():
    loss_a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask_a = torch.tensor([[1, 0], [0, 0]])  # 1 token
    loss_b = torch.tensor([[5.0, 6.0], [7.0, 8.0]])
    mask_b = torch.tensor([[1, 1], [1, 1]])  # 4 tokens
    total = int(mask_a.sum() + mask_b.sum())
    summed = aggregate(loss_a, mask_a, token_count=total) + aggregate(
        loss_b, mask_b, token_count=total
    )
    full = aggregate(torch.cat([loss_a, loss_b]), torch.cat([mask_a, mask_b]))
    assert summed.item() == pytest.approx(27 / 5) == full.item()
    mean_of_means = (aggregate(loss_a, mask_a) + aggregate(loss_b, mask_b)) / 2
    assert mean_of_means.item() == pytest.approx((1 + 26 / 4) / 2)  # 3.75, not 5.4


def test_token_count_gradients_match_full_batch():
    gen = torch.Generator().manual_seed(0)
    lp = torch.randn(4, 6, generator=gen, requires_grad=True)
    mask = (torch.rand(4, 6, generator=gen) > 0.4).long()
    mask[0] = 0
    mask[0, 0] = 1  # uneven micro-batches
    full = aggregate(lp.square(), mask)
    (full_grad,) = torch.autograd.grad(full, lp)
    total = mask.sum()
    micro = sum(
        aggregate(lp[i : i + 2].square(), mask[i : i + 2], token_count=total) for i in (0, 2)
    )
    (micro_grad,) = torch.autograd.grad(micro, lp)
    torch.testing.assert_close(micro, full)
    torch.testing.assert_close(micro_grad, full_grad)


def test_seq_count_makes_micro_batches_sum_to_full_batch_seq_mean():
    seqs = int((MASK.sum(-1) > 0).sum())
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        full = aggregate(LOSS, MASK, mode)
        summed = sum(
            aggregate(LOSS[i : i + 1], MASK[i : i + 1], mode, seq_count=seqs, norm_constant=3)
            for i in range(3)
        )
        assert summed.item() == pytest.approx(full.item()), mode


def test_aggregate_empty_mask_is_zero_not_nan():
    zeros = torch.zeros(2, 3)
    for mode in ("token-mean", "seq-mean-token-mean"):
        assert aggregate(LOSS[:2], zeros, mode).item() == 0.0


def test_aggregate_ignores_garbage_under_mask():
    loss = torch.tensor([[1.0, float("nan")], [float("inf"), 3.0]])
    mask = torch.tensor([[1, 0], [0, 1]])
    assert aggregate(loss, mask).item() == 2.0


def test_aggregate_unknown_mode():
    with pytest.raises(ValueError, match="seq-mean"):
        aggregate(LOSS, MASK, "seq-sum")


# ppo_clip_loss --------------------------------------------------------------------------------


def _ppo_case(ratios, advantages):
    lp = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)  # (1, T)
    old = torch.zeros_like(lp)
    adv = torch.tensor([advantages])
    return lp, old, adv, torch.ones_like(adv)


def test_ppo_clip_hand_case_both_signs():
    # A=+1 r=1.5: max(-1.5, -1.2) = -1.2 clipped     A=-1 r=0.5: max(0.5, 0.8) = 0.8 clipped
    # A=+1 r=0.5: max(-0.5, -0.8) = -0.5             A=-1 r=1.5: max(1.5, 1.2) = 1.5
    lp, old, adv, mask = _ppo_case([1.5, 0.5, 0.5, 1.5], [1.0, -1.0, 1.0, -1.0])
    loss, metrics = ppo_clip_loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 0.5 + 1.5) / 4)  # 0.15
    assert metrics["actor/pg_loss"].item() == pytest.approx(0.15)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(0.5)
    assert metrics["actor/pg_clipfrac_lower"].item() == 0.0
    assert metrics["actor/ppo_kl"].item() == pytest.approx(-0.5 * math.log(0.75))  # 0.143841
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())
    loss.backward()
    # clipped tokens have no gradient; unclipped ones d(-A r)/d lp / 4 = -A r / 4
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, -0.5 / 4, 1.5 / 4]]))


def test_clip_higher():
    lp, old, adv, mask = _ppo_case([1.25], [1.0])
    loss_sym, m_sym = ppo_clip_loss(lp, old, adv, mask)
    loss_dapo, m_dapo = ppo_clip_loss(lp, old, adv, mask, clip_high=0.28)
    assert loss_sym.item() == pytest.approx(-1.2) and m_sym["actor/pg_clipfrac"].item() == 1.0
    assert loss_dapo.item() == pytest.approx(-1.25) and m_dapo["actor/pg_clipfrac"].item() == 0.0


def test_dual_clip():
    # A=-1 r=5: max(5, 1.2) = 5 -> min(5, 3) = 3 (dual active)
    # A=-1 r=2: max(2, 1.2) = 2 < 3 (dual inactive)
    # A=+1 r=5: max(-5, -1.2) = -1.2 (clipped; dual clip applies only to A < 0)
    lp, old, adv, mask = _ppo_case([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0])
    loss, metrics = ppo_clip_loss(lp, old, adv, mask, dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(1 / 3)
    assert metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 2.0 / 3, 0.0]]))
    no_dual, _ = ppo_clip_loss(lp, old, adv, mask)
    assert no_dual.item() == pytest.approx((5.0 + 2.0 - 1.2) / 3)


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_dual_clip_must_exceed_one(c):
    lp, old, adv, mask = _ppo_case([1.0], [1.0])
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(lp, old, adv, mask, dual_clip=c)


def test_weights_scale_per_token_loss_and_stay_detached():
    lp, old, adv, mask = _ppo_case([1.0, 1.0], [1.0, -2.0])  # per-token loss [-1, 2]
    weights = torch.tensor([[2.0, 0.5]], requires_grad=True)
    loss, metrics = ppo_clip_loss(lp, old, adv, mask, weights=weights)
    assert loss.item() == pytest.approx((-2.0 + 1.0) / 2)
    assert metrics["actor/pg_loss"].item() == pytest.approx(-0.5)
    loss.backward()
    assert weights.grad is None
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, 0.5]]))  # -A * w * r / 2


def test_masked_tokens_get_zero_gradient():
    gen = torch.Generator().manual_seed(0)
    lp = (-torch.rand(3, 5, generator=gen)).requires_grad_()
    old = lp.detach() + 0.01 * torch.randn(3, 5, generator=gen)  # ratios inside the clip range
    adv = torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 0, 0], [0, 0, 0, 0, 0]])
    old[mask == 0] = -1e6  # garbage outside the mask must not leak
    loss, metrics = ppo_clip_loss(lp, old, adv, mask, dual_clip=3.0, weights=torch.rand(3, 5))
    loss.backward()
    assert torch.all(lp.grad[mask == 0] == 0)
    assert torch.all(lp.grad[mask == 1] != 0)
    assert all(torch.isfinite(v) for v in metrics.values())


def test_ppo_token_count_over_micro_batches():
    gen = torch.Generator().manual_seed(1)
    lp = (-torch.rand(4, 6, generator=gen)).requires_grad_()
    old = lp.detach() + 0.3 * torch.randn(4, 6, generator=gen)
    adv = torch.randn(4, 1, generator=gen).expand(4, 6)  # per-sample advantage, broadcast
    mask = torch.ones(4, 6)
    mask[:2, 1:] = 0  # uneven: 2 tokens in the first micro-batch, 12 in the second
    full, _ = ppo_clip_loss(lp, old, adv, mask)
    total = int(mask.sum())
    micro = sum(
        ppo_clip_loss(lp[s], old[s], adv[s], mask[s], token_count=total)[0]
        for s in (slice(0, 2), slice(2, 4))
    )
    torch.testing.assert_close(micro, full)
