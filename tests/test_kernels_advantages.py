import pytest
import torch

from kernels.advantages.grpo import grpo_advantages


def test_hand_case_two_groups_of_two():
    # group [1, 0]: mean 0.5, unbiased std sqrt(0.5) = 0.7071068 -> +-0.5 / 0.7071068
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2)
    expected = torch.tensor([0.7071063, -0.7071063, -0.7071063, 0.7071063])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)


def test_hand_case_group_of_three():
    # [1, 2, 3]: mean 2, unbiased std 1
    adv = grpo_advantages(torch.tensor([1.0, 2.0, 3.0]), group_size=3)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0]), rtol=1e-5, atol=0)


def test_dr_grpo_is_centred_only():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5]))


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_group_of_one_keeps_reward(norm_by_std):
    rewards = torch.tensor([3.0, -2.0, 0.0])
    adv = grpo_advantages(rewards, group_size=1, norm_by_std=norm_by_std)
    torch.testing.assert_close(adv, rewards, rtol=1e-5, atol=0)


def test_constant_group_gives_zeros():
    adv = grpo_advantages(torch.tensor([0.5, 0.5, 0.5, 0.5, 1.0, 1.0]), group_size=2)
    assert torch.equal(adv, torch.zeros(6))


def test_group_mean_zero_and_unit_std():
    rewards = torch.rand(8 * 5, generator=torch.Generator().manual_seed(0))
    adv = grpo_advantages(rewards, group_size=8).view(5, 8)
    torch.testing.assert_close(adv.mean(-1), torch.zeros(5), rtol=0, atol=1e-6)
    torch.testing.assert_close(adv.std(-1), torch.ones(5), rtol=0, atol=1e-4)


def test_integer_rewards_give_float32():
    adv = grpo_advantages(torch.tensor([1, 0]), group_size=2)
    assert adv.dtype == torch.float32


def test_bad_shapes():
    with pytest.raises(ValueError, match="multiple of group_size"):
        grpo_advantages(torch.zeros(5), group_size=2)
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 2), group_size=2)
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.zeros(2), group_size=0)


def test_unequal_groups_are_each_normalised_over_their_own_samples():
    """GRPO over groups of 3 and 1 and 2: each group's mean and std over its own rows (verl's
    index with any count per uid; compared with verl itself in tests/test_verl_parity.py)."""
    from actors.runtime.config.estimators import Gpg, Grpo
    from kernels.advantages import compute_advantages

    r = torch.tensor([1.0, 0.0, 0.5, 2.0, 1.0, 3.0])
    mask = torch.ones(6, 2)
    rewards = torch.zeros(6, 2)
    rewards[:, -1] = r
    adv, _ = compute_advantages(Grpo(), rewards, mask, group_size=[3, 1, 2])
    want = torch.cat([(r[:3] - r[:3].mean()) / (r[:3].std() + 1e-6), r[3:4] / (1 + 1e-6),
                      (r[4:] - r[4:].mean()) / (r[4:].std() + 1e-6)])
    assert torch.allclose(adv[:, 0], want)
    with pytest.raises(ValueError, match="add up to 5"):
        compute_advantages(Grpo(), rewards, mask, group_size=[3, 2])
    with pytest.raises(ValueError, match=r"gpg needs groups of equal size .* sizes \[3, 1, 2\]"):
        compute_advantages(Gpg(), rewards, mask, group_size=[3, 1, 2])
