import pytest
import torch

from kernels.kl_control import AdaptiveKLController, FixedKLController


def test_fixed_controller_never_moves():
    ctrl = FixedKLController(0.05)
    ctrl.update(10.0, 256)
    assert ctrl.value == 0.05


def test_adaptive_moves_beta_towards_target():
    high = AdaptiveKLController(0.1, target=0.1, horizon=1000)
    high.update(0.11, n_steps=100)  # error +0.1 -> beta *= 1 + 0.1 * 100 / 1000
    assert high.value == pytest.approx(0.1 * 1.01)
    low = AdaptiveKLController(0.1, target=0.1, horizon=1000)
    low.update(0.05, n_steps=100)  # error -0.5, clipped to -0.2 -> beta *= 0.98
    assert low.value == pytest.approx(0.098)
    far = AdaptiveKLController(0.1, target=0.1, horizon=1000)
    far.update(torch.tensor(5.0), n_steps=1000)  # error clipped to +0.2 over a whole horizon
    assert far.value == pytest.approx(0.12)
    on_target = AdaptiveKLController(0.1, target=0.1, horizon=1000)
    on_target.update(0.1, n_steps=500)
    assert on_target.value == pytest.approx(0.1)


def test_adaptive_converges_up_and_down():
    ctrl = AdaptiveKLController(1.0, target=1.0, horizon=10)
    for _ in range(20):
        ctrl.update(2.0, n_steps=1)
    assert ctrl.value == pytest.approx(1.02**20)
    for _ in range(20):
        ctrl.update(0.0, n_steps=1)
    assert ctrl.value == pytest.approx(1.02**20 * 0.98**20)


def test_bad_settings():
    with pytest.raises(ValueError, match="-1"):
        FixedKLController(-1.0)
    with pytest.raises(ValueError, match="target KL must be finite and > 0, got 0"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError, match="horizon must be > 0, got 0"):
        AdaptiveKLController(0.1, target=0.1, horizon=0)
    ctrl = AdaptiveKLController(0.1, target=0.1, horizon=10)
    with pytest.raises(ValueError, match="nan"):
        ctrl.update(float("nan"), 1)
    with pytest.raises(ValueError, match="n_steps must be >= 0, got -1"):
        ctrl.update(0.1, -1)
