"""What a scoring function is called on: one response with its prompt's fields, and the
keyword arguments of verl's ``compute_score`` convention built from such items."""

from __future__ import annotations

from typing import Any

import msgspec

from messages.reward import ScoreRequest
from messages.rollout import ChatMessage, Turn


class ScoreItem(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One completion to score (verl ``compute_score`` arguments)."""

    data_source: str
    solution_str: str
    ground_truth: str
    extra_info: dict[str, Any] = {}  # the prompt's, plus a multi-turn sample's ``turns`` and
    # ``num_turns`` (``with_turns``)
    response_length: int = 0  # response tokens, for the overlong penalty (0: unknown, none applied)
    prompt: list[ChatMessage] = []  # the prompt's messages, for scorers that read it (reward models)
    images: list[bytes] = []  # the prompt's images (one per ``<image>`` in its messages), for a
    # judge of a vision-language model


def turn_dict(turn: Turn) -> dict[str, Any]:
    """A turn as a scorer reads it: ``role`` and ``content``, and for a tool's turn the call's
    ``name``, ``arguments`` (JSON text) and ``error`` ("" when it succeeded); an environment's
    reward on the model's turn it rewarded."""
    out: dict[str, Any] = {"role": turn.role, "content": turn.content}
    if turn.role == "tool":
        out.update(name=turn.name, arguments=turn.arguments, error=turn.error)
    elif turn.role == "user" and turn.error:
        out["error"] = turn.error
    if turn.reward is not None:
        out["reward"] = turn.reward
    return out


def with_turns(extra_info: dict[str, Any], turns: list[Turn]) -> dict[str, Any]:
    """``extra_info`` of one response: a multi-turn one adds its ``turns`` (``turn_dict``, in
    order) and ``num_turns`` (the model's turns); a single-turn one is the prompt's as is."""
    if not turns:
        return extra_info
    return {**extra_info, "turns": [turn_dict(t) for t in turns],
            "num_turns": sum(t.role == "assistant" for t in turns)}


def items_of(request: ScoreRequest) -> list[ScoreItem]:
    """The items of a group's request: its responses, each with the prompt's fields (and its
    own turns, for a multi-turn response)."""
    return [ScoreItem(request.data_source, r.solution_str, request.ground_truth,
                      with_turns(request.extra_info, r.turns), r.length, request.prompt,
                      request.images)
            for r in request.responses]


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
