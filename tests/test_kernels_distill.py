"""The on-policy distillation advantage (``kernels/distill.py``) against its references.

- verl 0.9.1 (PR 5041), ``verl/trainer/distillation/losses.py``: ``distillation_loss`` computes
  ``kl_penalty(student, teacher, loss_mode)`` (``compute_distillation_loss_reverse_kl_estimator``),
  clamps it to ``±loss_max_clamp`` and, with ``use_policy_gradient``, hands
  ``advantages=-distillation_losses.detach()`` to the PPO loss. Checked by calling verl's own
  ``kl_penalty`` when verl imports (the verl-parity extra), for every KL kind verl accepts there.
- slime, ``slime/backends/megatron_utils/loss.py`` ``apply_opd_kl_to_advantages``: per sample,
  ``advantages[i] = adv - args.opd_kl_coef * (student_log_probs[i] - teacher_log_probs[i])``
  (no clamp), written out below as that loop over ragged samples.
"""

from __future__ import annotations

import pytest
import torch

from kernels.distill import DISTILL_KL_KINDS, distill_advantages, reverse_kl_metrics
from tests.verl_reference import load_verl


def batch(seed: int = 0, N: int = 6, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    student = -torch.rand(N, T, generator=g) * 4
    teacher = -torch.rand(N, T, generator=g) * 30  # some beyond the clamp: d up to +30
    mask = torch.zeros(N, T)
    lengths = [9, 5, 1, 7, 0, 3]
    for i, n in enumerate(lengths):
        mask[i, 9 - n if i % 2 else 0:(9 - n if i % 2 else 0) + n] = 1  # left and right aligned
    task = torch.randn(N, T, generator=g)
    return student, teacher, mask, task


def test_k1_alone_is_the_negative_sampled_reverse_kl_on_response_tokens():
    s, t, m, _ = batch()
    adv = distill_advantages(s, t, m, kl_clamp=0.0)
    assert torch.equal(adv, torch.where(m.bool(), t - s, torch.zeros(())))  # = teacher - student


def test_slime_apply_opd_kl_to_advantages():
    s, t, m, task = batch(1)
    coef = 0.7
    ours = distill_advantages(s, t, m, weight=coef, kl_clamp=0.0, task_advantages=task * m)
    for i in range(s.shape[0]):  # slime's loop, over each sample's response tokens only
        at = m[i].bool()
        adv = (task[i] * m[i])[at]
        reverse_kl = s[i][at] - t[i][at]
        expected = adv - coef * reverse_kl
        torch.testing.assert_close(ours[i][at], expected, rtol=0, atol=1e-6)
        assert torch.all(ours[i][~at] == 0)


VERL = load_verl()


@pytest.mark.skipif(isinstance(VERL, str), reason=f"verl parity not checked: {VERL}")
@pytest.mark.parametrize("kind", DISTILL_KL_KINDS)
@pytest.mark.parametrize("clamp", [10.0, 2.0])
def test_verl_distillation_advantage(kind, clamp):
    s, t, m, _ = batch(2)
    losses = VERL.core_algos.kl_penalty(logprob=s, ref_logprob=t, kl_penalty=kind)
    losses = losses.clamp(min=-clamp, max=clamp)  # distillation_loss's loss_max_clamp
    expected = -losses.detach()  # use_policy_gradient: the PPO advantage
    ours = distill_advantages(s, t, m, kind=kind, kl_clamp=clamp)
    at = m.bool()
    diff = (ours[at] - expected[at]).abs()
    assert float(diff.max()) <= 1e-6, f"max {float(diff.max()):.3g} mean {float(diff.mean()):.3g}"
    assert torch.all(ours[~at] == 0)


def test_weight_scales_the_term_and_clamp_bounds_it():
    s, t, m, task = batch(3)
    one = distill_advantages(s, t, m, kl_clamp=5.0)
    three = distill_advantages(s, t, m, weight=3.0, kl_clamp=5.0)
    torch.testing.assert_close(three, 3 * one)
    assert float(one.abs().max()) == 5.0  # d reaches 30: clamped
    both = distill_advantages(s, t, m, kl_clamp=5.0, task_advantages=task)
    torch.testing.assert_close(both, one + task * m)


def test_no_gradient_and_bad_input():
    s, t, m, _ = batch(4)
    s.requires_grad_(True)
    assert not distill_advantages(s, t, m).requires_grad
    with pytest.raises(ValueError, match="unknown distillation KL kind 'k9'"):
        distill_advantages(s, t, m, kind="k9")
    with pytest.raises(ValueError, match="shapes differ"):
        distill_advantages(s, t[:, 1:], m)


def test_reverse_kl_metrics_average_over_response_tokens():
    s, t, m, _ = batch(5)
    got = reverse_kl_metrics(s, t, m)
    d = (s - t)[m.bool()]
    assert got["distill/reverse_kl/mean"] == pytest.approx(float(d.mean()))
    assert got["distill/reverse_kl/max"] == pytest.approx(float(d.max()))
    assert got["distill/teacher_logprob/mean"] == pytest.approx(float(t[m.bool()].mean()))
    assert got["distill/reverse_kl/k3"] >= 0
    empty = reverse_kl_metrics(s, t, torch.zeros_like(m))
    assert empty["distill/reverse_kl/mean"] == 0.0
