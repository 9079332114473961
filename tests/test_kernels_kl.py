import math

import pytest
import torch

from kernels.kl import kl_estimate

LN2 = math.log(2.0)
LP = torch.tensor([[0.0, 0.0]])
REF = torch.tensor([[LN2, 0.0]])  # d = lp - ref = [-ln 2, 0]


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (("k1", "kl"), [-0.6931472, 0.0]),
        (("abs",), [0.6931472, 0.0]),
        (("k2", "mse"), [0.2402265, 0.0]),  # (ln 2)^2 / 2
        (("k3", "low_var_kl"), [0.3068528, 0.0]),  # exp(ln 2) - ln 2 - 1
    ],
)
def test_hand_values(kinds, expected):
    for kind in kinds:
        torch.testing.assert_close(kl_estimate(LP, REF, kind), torch.tensor([expected]))


def test_k3_clamps():
    lp = torch.tensor([[-100.0, 100.0]])
    out = kl_estimate(lp, torch.zeros_like(lp), "k3")
    # d = -100: inner clamp gives exp(20) - 21, then the output clamp 10
    # d = +100: inner clamp gives exp(-20) + 20 - 1 ~ 19, then 10
    torch.testing.assert_close(out, torch.tensor([[10.0, 10.0]]))


def test_unknown_kind():
    with pytest.raises(ValueError, match="'k4'"):
        kl_estimate(LP, REF, "k4")


@pytest.mark.parametrize("kind", ["k1", "abs", "k3", "low_var_kl", "k2", "kl", "mse"])
def test_straight_through_variants_take_k2_gradient(kind):
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.5])
    value = kl_estimate(lp, ref, kind + "+")
    torch.testing.assert_close(value, kl_estimate(lp, ref, kind))
    value.sum().backward()
    torch.testing.assert_close(lp.grad, (lp - ref).detach())  # d/dlp of (lp - ref)^2 / 2
