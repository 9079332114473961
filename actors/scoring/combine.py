"""One response's reward from the pools that scored it: the weighted sum.

``score_targets`` (``actors/runtime/config/pools.py``) names the pools and weights; the sampler
sends each group to every one and adds the replies here. With one pool of weight 1 (no model
pools: the rule workers alone) the reply is passed on as it came, so nothing changes for a job
without pools. Otherwise each pool's score is kept in ``extra`` under its name (and its own
extras as ``NAME/KEY``), the answer is the first pool's that extracted one, and a response any
pool failed on is a failure (score 0.0, the errors joined, each named by its pool).
"""

from __future__ import annotations

from collections.abc import Sequence

from messages.reward import ScoreReply, ScoreResult


def combine(targets: Sequence[tuple[str, float]], replies: Sequence[ScoreReply]) -> ScoreReply:
    """The replies of ``targets`` (in order, each with one result per response) as one."""
    if len(targets) == 1 and targets[0][1] == 1.0:
        return replies[0]
    results = []
    for per_pool in zip(*(r.results for r in replies), strict=True):
        errors = [f"{name}: {r.error}" for (name, _), r in zip(targets, per_pool, strict=True)
                  if r.error]
        if errors:
            trace = next((r.trace for r in per_pool if r.trace), "")
            results.append(ScoreResult(0.0, error="; ".join(errors), trace=trace))
            continue
        extra: dict[str, float] = {}
        for (name, _), r in zip(targets, per_pool, strict=True):
            extra[name] = r.score
            extra.update({f"{name}/{k}": v for k, v in r.extra.items()})
        total = sum(w * r.score for (_, w), r in zip(targets, per_pool, strict=True))
        answer = next((r.answer for r in per_pool if r.answer), "")
        results.append(ScoreResult(total, extra=extra, answer=answer))
    return ScoreReply(results)
