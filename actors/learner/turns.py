"""Per-step metrics of multi-turn samples, read from the turns each sample records.

Computed from the batch alone, so an offline rerun reproduces them. A batch without multi-turn
samples has none of these metrics. An environment's steps count as its tool calls.
"""

from __future__ import annotations

import math

from messages.rollout import ScoredGroup, Turn


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 100] of ``values`` (not empty)."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)]


def answers(turns: list[Turn]) -> list[Turn]:
    """The turns that answer a model turn: one per tool call or environment step (an
    environment's first observation, before the model's first turn, answers nothing)."""
    first = next((i for i, t in enumerate(turns) if t.role == "assistant"), len(turns))
    return [t for t in turns[first:] if t.role != "assistant"]


def agent_metrics(groups: list[ScoredGroup]) -> dict[str, float]:
    """``agent/*``: the model's turns per sample (mean, max), tool calls, failed calls,
    timeouts, the share of samples that called a tool, the share of response tokens that are
    tool or environment tokens, and the latency of the calls that reached a tool."""
    samples = [s for g in groups for s in g.samples]
    if not any(s.turns for s in samples):
        return {}
    turns = [max(sum(t.role == "assistant" for t in s.turns), 1) for s in samples]
    calls = [answers(s.turns) for s in samples]
    every = [c for per in calls for c in per]
    latencies = [c.latency_s for c in every if c.latency_s > 0]
    tokens = sum(s.response_ids.shape[0] for s in samples)
    observed = sum(t.end - t.start for s in samples for t in s.turns if t.role != "assistant")
    out = {
        "agent/num_turns/mean": sum(turns) / len(turns),
        "agent/num_turns/max": float(max(turns)),
        "agent/tool_calls": float(len(every)),
        "agent/tool_errors": float(sum(bool(c.error) for c in every)),
        "agent/tool_timeouts": float(sum(c.failure == "timeout" for c in every)),
        "agent/tool_call_share": sum(bool(per) for per in calls) / len(samples),
        "agent/tool_token_share": observed / tokens if tokens else 0.0,
    }
    if latencies:
        out["agent/tool_latency_s/p50"] = percentile(latencies, 50)
        out["agent/tool_latency_s/p99"] = percentile(latencies, 99)
    return out
