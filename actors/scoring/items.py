"""What a scoring function is called on: one response with its prompt's fields, and the
keyword arguments of verl's ``compute_score`` convention built from such items."""

from __future__ import annotations

from typing import Any

import msgspec

from messages.reward import ScoreRequest
from messages.rollout import ChatMessage


class ScoreItem(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One completion to score (verl ``compute_score`` arguments)."""

    data_source: str
    solution_str: str
    ground_truth: str
    extra_info: dict[str, str | int | float] = {}
    response_length: int = 0  # response tokens, for the overlong penalty (0: unknown, none applied)
    prompt: list[ChatMessage] = []  # the prompt's messages, for scorers that read it (reward models)


def items_of(request: ScoreRequest) -> list[ScoreItem]:
    """The items of a group's request: its responses, each with the prompt's fields."""
    return [ScoreItem(request.data_source, r.solution_str, request.ground_truth,
                      request.extra_info, r.length, request.prompt) for r in request.responses]


def verl_arguments(items: list[ScoreItem], batch: bool) -> list[dict[str, Any]]:
    """Keyword arguments of verl's convention: ``(data_source, solution_str, ground_truth,
    extra_info)`` per item, or one set of lists (``data_sources, solution_strs, ...``) for a
    batch function."""
    if batch:
        return [{"data_sources": [i.data_source for i in items],
                 "solution_strs": [i.solution_str for i in items],
                 "ground_truths": [i.ground_truth for i in items],
                 "extra_infos": [dict(i.extra_info) for i in items]}]
    return [{"data_source": i.data_source, "solution_str": i.solution_str,
             "ground_truth": i.ground_truth, "extra_info": dict(i.extra_info)} for i in items]
