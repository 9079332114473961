"""Scoring flow: the bodies of ``reward`` pool messages (``messages.routing`` carries them).

Sampler -> reward worker: one ``ScoreRequest`` per group, with the prompt's fields once and the
``n`` responses; reward worker -> sampler: one ``ScoreReply`` with a result per response, in
order. The router forwards both as opaque bodies and never decodes them.
"""

from __future__ import annotations

import msgspec

from messages.rollout import ChatMessage, Turn


class Response(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One completion to score."""

    solution_str: str  # verl ``compute_score``'s solution_str: the decoded response
    length: int = 0  # response tokens, for the overlong penalty (0: unknown, none applied)
    turns: list[Turn] = []  # a multi-turn response's spans (scorers get them in
    # ``extra_info["turns"]``); empty for one model turn


class ScoreRequest(msgspec.Struct, tag=True, gc=False):
    """Sampler -> reward worker: the responses of one prompt (verl ``compute_score`` arguments)."""

    data_source: str
    ground_truth: str
    responses: list[Response]
    extra_info: dict[str, str | int | float] = {}
    prompt: list[ChatMessage] = []  # the prompt's messages, for scorers that read it (reward models)
    max_response_length: int = 0  # the sampler's response budget: L_max of the overlong penalty
    images: list[bytes] = []  # the prompt's encoded images (``Prompt.images``), for a judge of a
    # vision-language model, which reads them with the prompt


class ScoreResult(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    score: float
    error: str = ""  # non-empty: scoring failed and ``score`` is the failure score
    extra: dict[str, float] = {}
    answer: str = ""  # the answer the scorer extracted (verl's ``pred``; majority votes count
    # them), "" when it extracts none
    trace: str = ""  # with an error a user's function raised: its traceback (its own frames)


class ScoreReply(msgspec.Struct, tag=True, gc=False):
    """Reward worker -> sampler: one result per response of the request, in order."""

    results: list[ScoreResult]


ToRewardWorker = ScoreRequest
ToScoringClient = ScoreReply
