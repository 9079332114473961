"""verl 0.9.1 as a reference for tests/test_verl_parity.py: its import, the shared random
batch with the edge cases, and the comparison that records every difference.

verl is an optional test dependency: ``bash .ci/setup.sh --tests`` installs it without its
declared dependencies into ``.venv/verl-0.9.1`` (``pip install --no-deps --target``), a folder of
its own that ``load_verl`` puts on the path, plus the ``verl-parity`` extra's packages.
``load_verl`` returns the reason when it cannot be imported.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch

VERL_VERSION = "0.9.1"
# where .ci/setup.sh --tests installs it (outside site-packages: see the module docstring)
VERL_DIR = Path(__file__).resolve().parent.parent / ".venv" / f"verl-{VERL_VERSION}"


@dataclass(frozen=True)
class Verl:
    core_algos: types.ModuleType  # verl.trainer.ppo.core_algos
    rollout_corr: types.ModuleType  # verl.trainer.ppo.rollout_corr_helper
    ActorConfig: type
    PolicyLossConfig: type
    RolloutCorrectionConfig: type


def load_verl() -> Verl | str:
    """verl's two algorithm modules, or the reason they cannot be imported."""
    if VERL_DIR.is_dir() and str(VERL_DIR) not in sys.path:
        sys.path.append(str(VERL_DIR))
    if importlib.util.find_spec("verl") is None:
        return (f"verl is not installed (bash .ci/setup.sh --tests puts it in {VERL_DIR})")
    if "ray" not in sys.modules and importlib.util.find_spec("ray") is None:
        # verl/__init__.py imports verl.protocol, which imports ray (a 79 MB distributed
        # runtime) for ``ray.ObjectRef`` annotations and remote futures. Nothing the parity
        # test calls touches ray, so a bare module with that one name stands in for it. No
        # numerical code is replaced.
        ray = types.ModuleType("ray")
        ray.ObjectRef = type("ObjectRef", (), {})
        sys.modules["ray"] = ray
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        import verl
        import verl.trainer.ppo.core_algos as core_algos
        import verl.trainer.ppo.rollout_corr_helper as rollout_corr
        from verl.trainer.config.algorithm import RolloutCorrectionConfig
        from verl.workers.config import ActorConfig
        from verl.workers.config.actor import PolicyLossConfig
    except ImportError as exc:
        return f"verl is installed but cannot be imported: {exc!r}"
    finally:
        # ``import verl`` calls logging.basicConfig; keep the rest of the test session's logging
        # as it was.
        root.handlers[:] = handlers
        root.setLevel(level)
    if verl.__version__ != VERL_VERSION:
        return f"verl {verl.__version__} is installed; the parity test is against {VERL_VERSION}"
    return Verl(core_algos, rollout_corr, ActorConfig, PolicyLossConfig, RolloutCorrectionConfig)


# The batch ----------------------------------------------------------------------------------

GROUPS, GROUP_SIZE, T = 6, 6, 10
ROWS = GROUPS * GROUP_SIZE
CONSTANT_GROUPS = slice(6, 30)  # groups 1-4: one reward value per group


@dataclass(frozen=True)
class Batch:
    """One batch of ``ROWS`` rows in ``GROUPS`` groups of ``GROUP_SIZE``, ``T`` positions.

    Group 0 (rows 0-5): random rewards; row 0 has no response token, row 1 one token. Group 1
    (rows 6-11): every reward 0.3, not representable in binary floating point (six of them are
    where float32 GRPO goes wrong). Group 2 (rows 12-17): every reward 1.0, multi-turn (tool
    tokens at positions 3-4 inside the response). Group 3 (rows 18-23): all 0 or all 1.
    Group 4 (rows 24-29): all 0.0. Group 5 (rows 30-35): normal rewards. Log-ratios of ±25 at
    the starts of rows 6-8 (rows 6 and 7 hold the issue's [+25, -20] and [-25, +10]).
    Log-probs are <= 0 (so exp() is a probability), with finite garbage in the padding.
    """

    mask: torch.Tensor  # (N, T) 0/1 in the batch dtype
    rewards: torch.Tensor  # (N, T) score on the last response token
    old: torch.Tensor  # (N, T) pi_old log-probs
    behav: torch.Tensor  # (N, T) behaviour (rollout) log-probs
    lp: torch.Tensor  # (N, T) current policy log-probs
    advantages: torch.Tensor  # (N, T) per-token advantages
    seq_advantages: torch.Tensor  # (N, T) one advantage per row on every position
    values: torch.Tensor  # (N, T) critic values
    old_values: torch.Tensor  # (N, T)
    returns: torch.Tensor  # (N, T)
    weights: torch.Tensor  # (N, T) positive IS-like weights, 0 outside the mask
    sum_pi_squared: torch.Tensor  # (N, T) in [pi_old**2, 1]
    reward_baselines: torch.Tensor  # (N,)
    components: torch.Tensor  # (2, N) two reward components per row (gdpo)


def make_batch(seed: int, dtype: torch.dtype, constant: float = 0.3) -> Batch:
    """The batch of ``seed`` in ``dtype``; ``constant`` is group 1's reward."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    n = GROUP_SIZE
    lengths = torch.randint(2, T + 1, (ROWS,), generator=gen)
    lengths[0], lengths[1] = 0, 1
    lengths[n:3 * n] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (N, T)
    mask[2 * n:3 * n, 3:5] = False  # tool tokens inside multi-turn responses
    scores = torch.cat([
        rand(n),
        torch.full((n,), constant, dtype=torch.float64),
        torch.ones(n, dtype=torch.float64),
        torch.full((n,), float(rand(1).item() > 0.5), dtype=torch.float64),
        torch.zeros(n, dtype=torch.float64),
        randn(n),
    ])
    last = T - 1 - mask.flip(-1).long().argmax(-1)  # (N,) last response position
    rewards = torch.zeros(ROWS, T, dtype=torch.float64)
    has = mask.any(-1)
    rewards[has.nonzero()[:, 0], last[has]] = scores[has]

    old = -(rand(ROWS, T) * 4 + 0.01)
    behav = (old + 0.3 * randn(ROWS, T)).clamp(max=-1e-3)
    lp = (old + 0.2 * randn(ROWS, T)).clamp(max=-1e-3)
    # log rho = old - behav of +25 / -20 (row 6) and -25 / +10 (row 7); lp - old of ±25 (row 8)
    old[n, :2], behav[n, :2] = torch.tensor([-0.5, -25.5]), torch.tensor([-25.5, -5.5])
    old[n + 1, :2], behav[n + 1, :2] = torch.tensor([-25.5, -0.5]), torch.tensor([-0.5, -10.5])
    old[n + 2, :2], lp[n + 2, :2] = torch.tensor([-25.5, -0.5]), torch.tensor([-0.5, -25.5])
    garbage = ~mask
    for t in (old, behav, lp):
        t[garbage] = -50.0 * rand(int(garbage.sum())) - 0.1

    values = randn(ROWS, T)
    pi = old.exp()
    w = torch.where(mask, torch.exp(0.4 * randn(ROWS, T)), torch.zeros(()))
    batch = Batch(
        mask=mask.double(),
        rewards=rewards,
        old=old,
        behav=behav,
        lp=lp,
        advantages=randn(ROWS, T),
        seq_advantages=randn(ROWS, 1).expand(ROWS, T).clone(),
        values=values,
        old_values=values + 0.4 * randn(ROWS, T),
        returns=randn(ROWS, T),
        weights=w,
        sum_pi_squared=pi.square() + rand(ROWS, T) * (1 - pi.square()) * 0.5,
        reward_baselines=rand(ROWS),
        # float32-representable, as verl builds gdpo components in float32
        components=torch.stack([(rand(ROWS) > 0.5).double(), rand(ROWS).float().double()]),
    )
    return Batch(**{k: v.to(dtype) for k, v in vars(batch).items()})


# Comparison ---------------------------------------------------------------------------------

TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-5}


class Recorder:
    """Every comparison made, for the summary the module prints at its end."""

    def __init__(self) -> None:
        self.checks = 0
        self.values = 0
        self.max_diff: dict[torch.dtype, float] = {torch.float64: 0.0, torch.float32: 0.0}
        self.worst: dict[torch.dtype, str] = {}

    def check(self, what: str, ours, theirs, dtype: torch.dtype) -> None:
        """Assert ``|ours - theirs| <= tol * max(1, |theirs|)`` elementwise (NaN matches NaN,
        inf matches the same inf); tol is 1e-6 for float64 inputs, 1e-5 for float32."""
        o = torch.as_tensor(ours).detach().double().cpu()
        t = torch.as_tensor(theirs).detach().double().cpu()
        assert o.shape == t.shape, f"{what}: shape {tuple(o.shape)} vs verl {tuple(t.shape)}"
        same = (o.isnan() & t.isnan()) | (o.isinf() & (o == t))
        diff = ((o - t).abs() / t.abs().clamp_min(1.0)).nan_to_num(nan=math.inf)
        diff = torch.where(same, torch.zeros_like(diff), diff)
        worst = diff.max().item() if diff.numel() else 0.0
        self.checks += 1
        self.values += diff.numel()
        if worst > self.max_diff[dtype]:
            self.max_diff[dtype], self.worst[dtype] = worst, what
        assert worst <= TOLERANCE[dtype], (
            f"{what} ({dtype}): max relative difference {worst:.3g} from verl "
            f"(ours {o.flatten()[diff.flatten().argmax()].item()!r}, "
            f"verl {t.flatten()[diff.flatten().argmax()].item()!r})"
        )

    def summary(self) -> str:
        parts = [f"verl {VERL_VERSION} parity: {self.checks} comparisons of {self.values} values"]
        for dtype, diff in self.max_diff.items():
            parts.append(f"max relative difference {diff:.3g} in {dtype} "
                         f"({self.worst.get(dtype, '-')})")
        return "; ".join(parts)
