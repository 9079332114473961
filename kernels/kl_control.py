"""Controllers of the coefficient beta of a KL penalty in the reward (verl ``kl_ctrl``).

The learner subtracts ``beta * KL(pi || pi_ref)`` per token from the reward, reads ``beta`` from
``.value`` and, after each step, calls ``.update(current_kl, n_steps)`` with the step's mean KL
and the number of samples (verl passes the batch size) it covered.
"""

from __future__ import annotations

import math


class FixedKLController:
    """A constant ``beta``; ``update`` does nothing."""

    def __init__(self, coef: float) -> None:
        if not (math.isfinite(coef) and coef >= 0):
            raise ValueError(f"KL coefficient must be finite and >= 0, got {coef}")
        self.value = float(coef)  # beta, constant

    def update(self, current_kl: float, n_steps: int) -> None:
        """Ignore the observed KL; the coefficient is fixed."""


class AdaptiveKLController:
    """Proportional control of ``beta`` towards a target KL (Ziegler et al. 2019, verl).

    ``update`` applies ``beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon``: a
    KL above target raises beta, one below lowers it, by at most 20% per ``horizon`` steps.
    """

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if not (math.isfinite(init_coef) and init_coef >= 0):
            raise ValueError(f"init_coef must be finite and >= 0, got {init_coef}")
        if not (math.isfinite(target) and target > 0):
            raise ValueError(f"target KL must be finite and > 0, got {target}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_coef)  # beta, always >= 0
        self.target = float(target)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``beta`` by the clipped proportional error of ``current_kl`` (a float)."""
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(f"current_kl must be finite, got {current_kl}")
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
