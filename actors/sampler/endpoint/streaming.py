"""A chat answer streamed token by token: server-sent events as a continuous engine (vllm)
samples the tokens (``GenerateRequest.stream``), then the finish events once the completion
is whole (and only then is the call part of its episode, as an unstreamed one is).

Each token event carries the choice's new ``token_ids`` (and their log-probs when asked) and
the content they add (the decoded text so far minus what was sent; a token that ends mid
character waits for the next). Streamed this way: a continuous engine, no tool parsing and no
stop strings (reading calls back, or leaving a stop string out of the content, needs the
whole text); otherwise the answer is sent as events once complete (``Calls.chunks``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import trio

from actors.sampler.endpoint.api import ChatRequest, logprobs_content
from actors.sampler.endpoint.episodes import Episode, Segment
from messages.rollout import SamplingParams

if TYPE_CHECKING:
    from actors.sampler.endpoint.server import Calls


def live_streaming(engine: Any, params: SamplingParams, parser: Any) -> bool:
    """Whether a streamed chat call is sent token by token (see the module's docstring)."""
    return bool(engine.continuous) and parser is None and not params.stop \
        and params.max_tokens > 0


def event(value: dict[str, Any]) -> str:
    return f"data: {json.dumps(value)}\n\n"


class _Generation:
    """One streamed call's generation, run in the server's nursery: the engine's token
    callbacks queued onto the trio loop as ``(choice, ids, logprobs)`` items, then ``None``
    once it ended (its completions or its error in ``done``)."""

    def __init__(self) -> None:
        self.send, self.receive = trio.open_memory_channel[Any](math.inf)  # bounded: n * max_tokens items
        self.token = trio.lowlevel.current_trio_token()
        self.scope = trio.CancelScope()  # cancelled when the client goes away
        self.done: dict[str, Any] = {}  # "gens" or "error", once the engine is done

    def put(self, item: Any) -> None:  # on the trio loop
        try:
            self.send.send_nowait(item)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the client is gone

    def on_tokens(self, k: int, ids: list[int], logprobs: list[float]) -> None:  # engine's thread
        try:
            self.token.run_sync_soon(self.put, (k, ids, logprobs))
        except trio.RunFinishedError:
            pass

    async def run(self, calls: Calls, seg: Segment, req: ChatRequest,
                  params: SamplingParams) -> None:
        with self.scope:
            try:
                self.done["gens"] = await calls.generate(seg.context, params, req.n,
                                                         self.on_tokens, req.seed, seg.images)
            except Exception as exc:  # answered as an error event
                self.done["error"] = exc
        self.put(None)  # after every token: the engine's callbacks were queued before its result


async def stream_tokens(calls: Calls, ep: Episode, seg: Segment, req: ChatRequest,
                        params: SamplingParams, raw_body: bytes, usage: bool
                        ) -> AsyncIterator[str]:
    """The call's events; its generation runs in the server's nursery and is cancelled when
    the client goes away (the call is then not part of the episode)."""
    gen = _Generation()
    calls.nursery.start_soon(gen.run, calls, seg, req, params)
    base = {"id": f"flowrl-{time.time_ns()}", "created": int(time.time()), "model": "policy",
            "object": "chat.completion.chunk"}
    ids: list[list[int]] = [[] for _ in range(req.n)]
    sent = [""] * req.n  # content sent so far, per choice
    try:
        async for item in gen.receive:
            if item is None:
                break
            yield _token_event(calls, req, base, ids, sent, item)
        if "error" in gen.done:
            calls.r.stats["bad_calls"] += 1
            yield event({"error": {"message": str(gen.done["error"]), "type": "server_error"}})
            return
        if "gens" not in gen.done:
            return
        for chunk in _finish_events(calls, ep, seg, req, params, raw_body, usage,
                                    gen.done["gens"], base, sent):
            yield chunk
    finally:
        gen.scope.cancel()
        gen.send.close()


def _token_event(calls: Calls, req: ChatRequest, base: dict[str, Any], ids: list[list[int]],
                 sent: list[str], item: tuple[int, list[int], list[float]]) -> str:
    """The event of choice k's new tokens: their ids (log-probs when asked) and the content
    they add to what was sent (none while a character is incomplete)."""
    k, new, lps = item
    ids[k] += new
    text = calls.r.tok.decode(ids[k])
    delta = text[len(sent[k]):] if text.startswith(sent[k]) else ""
    sent[k] += delta
    return event({**base, "choices": [{
        "index": k, "delta": {"role": "assistant", "content": delta},
        "finish_reason": None, "token_ids": new,
        "logprobs": {"content": logprobs_content(calls.token_pieces(new), lps)}
        if req.logprobs else None}]})


def _finish_events(calls: Calls, ep: Episode, seg: Segment, req: ChatRequest,
                   params: SamplingParams, raw_body: bytes, usage: bool, gens: Any,
                   base: dict[str, Any], sent: list[str]) -> list[str]:
    """The call made part of its episode, and its closing events: each choice's content not
    sent yet with its finish reason, the usage when asked, and ``[DONE]``."""
    body, raws = calls.chat_body(req, seg, gens, params, None)
    ep.answered(seg, gens, raws, raw_body.decode(), json.dumps(body))
    out = []
    for c in body["choices"]:
        content = c["message"]["content"] or ""
        rest = content[len(sent[c["index"]]):] if content.startswith(sent[c["index"]]) else ""
        out.append(event({**base, "policy_version": body["policy_version"], "choices": [{
            "index": c["index"], "delta": {"content": rest} if rest else {},
            "finish_reason": c["finish_reason"], "token_ids": [], "logprobs": None}]}))
    if usage:
        out.append(event({**base, "choices": [], "usage": body["usage"]}))
    out.append("data: [DONE]\n\n")
    return out
