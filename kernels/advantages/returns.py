"""Discounted sums backwards in time over a sequence's response tokens.

Positions outside the mask (padding, or tool / user tokens inside a multi-turn response) are
skipped: they add nothing and do not count as a step of discounting, as verl's GAE skips
observation tokens. Rows are independent, so a sum never crosses from one sequence into
another ("reset at EOS").
"""

from __future__ import annotations

import torch


def discounted_cumsum(x: torch.Tensor, mask: torch.Tensor, discount: float) -> torch.Tensor:
    """``y_t = x_t + discount * y_{t'}`` with ``t'`` the next masked position of the row.

    ``x`` and ``mask`` are ``(N, T)``; the result is ``(N, T)`` and 0 outside the mask. With
    ``discount == 1`` this is one reversed cumulative sum; otherwise a loop over ``T`` with
    ``(N,)``-sized steps, as in verl.
    """
    keep = mask.bool()  # (N, T)
    x = torch.where(keep, x, torch.zeros_like(x))  # (N, T)
    if discount == 1.0:
        out = x.flip(-1).cumsum(-1).flip(-1)  # (N, T)
    else:
        out = torch.empty_like(x)  # (N, T)
        running = torch.zeros_like(x[:, 0])  # (N,) y at the next masked position
        for t in range(x.shape[-1] - 1, -1, -1):
            running = torch.where(keep[:, t], x[:, t] + discount * running, running)
            out[:, t] = running
    return torch.where(keep, out, torch.zeros_like(out))


def next_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` at the next masked position after ``t`` in the same row, 0 past the last. ``(N, T)``

    For GAE's ``V_{t+1}``: the value of the next response token, skipping tool tokens, and 0
    after the last response token (the episode ends there).
    """
    n, t = mask.shape
    keep = mask.bool()  # (N, T)
    positions = torch.arange(t, device=mask.device).expand(n, t)  # (N, T)
    own = torch.where(keep, positions, torch.full_like(positions, t))  # (N, T) t if unmasked
    after = torch.cat([own[:, 1:], torch.full_like(own[:, :1], t)], dim=1)  # (N, T)
    nxt = after.flip(-1).cummin(-1).values.flip(-1)  # (N, T) in [0, T]; T means none
    padded = torch.cat([torch.where(keep, x, torch.zeros_like(x)), torch.zeros_like(x[:, :1])], 1)
    return padded.gather(1, nxt)  # (N, T)
