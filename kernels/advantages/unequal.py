"""Groups of unequal size: an estimator whose advantages depend only on the rows of one group
run group by group, and an estimator that uses no group run once on the whole batch.

verl groups rows by ``index`` (the prompt's uid) with any count per uid
(``core_algos.compute_grpo_outcome_advantage`` and the others build ``id2score`` from
``index``); an endpoint episode that branched yields several samples of one group, so its
group has more rows than the others. The kernels here take ``(G, n)`` views, so a batch of
unequal groups is cut into its groups, each of which is a batch of one group. Estimators that
whiten or scale over the whole batch after the group step (reinforce_plus_plus_baseline, gdpo,
gpg) are not split: they need equal groups (the config check names them). Which is which is
said by the estimator's row (``grouped``, ``unequal_groups``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kernels.advantages._common import AdvantageParams

if TYPE_CHECKING:
    from kernels.advantages import EstimatorRow

_PER_ROW = ("values", "reward_baselines", "old_logprobs", "sum_pi_squared", "is_weights")


def group_sizes(sizes: Sequence[int], rows: int) -> list[int]:
    """``sizes`` checked: ints >= 1 adding up to ``rows``."""
    out = list(sizes)
    if not out or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in out):
        raise ValueError(f"group sizes must be ints >= 1, got {out!r}")
    if sum(out) != rows:
        raise ValueError(f"group sizes add up to {sum(out)}, the batch has {rows} rows")
    return out


def by_group(estimator: EstimatorRow, fn: Callable, token_level_rewards: torch.Tensor,
             response_mask: torch.Tensor, params: AdvantageParams, sizes: list[int]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn``, the function of ``estimator``, over groups of the given ``sizes`` (rows group by
    group): once on the whole batch when it uses no group, group by group when each group's
    advantages depend only on its own rows."""
    if not estimator.grouped:
        return fn(token_level_rewards, response_mask, dataclasses.replace(params, group_size=1))
    if not estimator.unequal_groups:
        raise ValueError(
            f"{estimator.name} needs groups of equal size (it whitens or scales over the whole "
            f"batch); got sizes {sizes}")
    advantages, returns = [], []
    lo = 0
    for n in sizes:
        rows = slice(lo, lo + n)
        cut = {k: v[rows] for k in _PER_ROW if (v := getattr(params, k)) is not None}
        a, r = fn(token_level_rewards[rows], response_mask[rows],
                  dataclasses.replace(params, group_size=n, **cut))
        advantages.append(a)
        returns.append(r)
        lo += n
    return torch.cat(advantages), torch.cat(returns)
