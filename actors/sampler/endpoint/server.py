"""The HTTP side: a small Starlette app served by Hypercorn's trio worker on the sampler's own
event loop (no thread, no bridge: a call awaits the engine like any rollout does).

Routes, under each episode's ``/episodes/ID/v1``: ``POST /chat/completions`` (tools through
the chat template, hermes tool calls read back; ``n``, ``temperature``, ``top_p``,
``max_tokens``, ``stop``, ``logprobs``, ``stream``; ``tool_choice`` auto, none, a named
function or required with one tool: the call is opened in the prompt, ``api.call_prefix``),
``POST /completions`` (a text prompt, or
token ids: token in, token out) and ``GET /models``. A streamed chat answer on a continuous
engine (vllm) is sent token by token as the engine samples them (``streaming.py``; with tools
or stop strings, and on the batch engine (hf), whose completions arrive whole, it is sent once
complete).
Every choice carries ``token_ids`` and every response ``prompt_token_ids`` and
``policy_version``. Each call's request and response bodies are kept on the model turn it
produced (``Turn.request`` / ``response``: recorded, shown by ``inspect``). A bad body, an
unknown episode or a call past ``max_calls`` is a 4xx with the reason; nothing a request holds
can stop the sampler.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio
import torch
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from actors.sampler.agent.parsers import make_parser
from actors.sampler.endpoint.api import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    assistant_message,
    call_prefix,
    decode_body,
    forced_message,
    forced_tool,
    logprobs_content,
    render,
    stops_of,
)
from actors.sampler.endpoint.episodes import Episode, Segment
from actors.sampler.endpoint.streaming import live_streaming, stream_tokens
from actors.sampler.engines.base import Rejected, full_generation
from messages.rollout import SamplingParams

if TYPE_CHECKING:
    from actors.sampler.endpoint.strategy import EndpointRollout

MODEL = "policy"  # the one model served; any name a client sends is taken to mean it


def error(status: int, reason: str) -> JSONResponse:
    return JSONResponse({"error": {"message": reason, "type": "invalid_request_error",
                                   "code": status}}, status_code=status)


class Calls:
    """Serves one episode's calls on the strategy's engine."""

    def __init__(self, rollout: EndpointRollout, nursery: Any = None) -> None:
        self.r = rollout
        self.nursery = nursery  # where a streamed call's generation runs beside its events

    def episode(self, request: Request) -> Episode:
        ep = self.r.episodes.get(request.path_params["eid"])
        if ep is None:
            raise LookupError(f"no open episode {request.path_params['eid']!r} on this sampler")
        ep.calls += 1
        self.r.stats["calls"] += 1
        if ep.calls > ep.max_calls:
            raise BadRequest(f"this episode made more than agent.rollout.max_calls = "
                             f"{ep.max_calls} calls")
        return ep

    def params(self, ep: Episode, req: Any, seg: Segment) -> SamplingParams:
        """The call's sampling: the request's, else the rollout's; at most what is left of the
        segment's budget."""
        d, room = ep.params, ep.room(seg)
        asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
        return SamplingParams(
            temperature=d.temperature if req.temperature is None else req.temperature,
            top_p=d.top_p if req.top_p is None else req.top_p, top_k=d.top_k,
            max_tokens=min(asked, room) if asked else room, stop=stops_of(req.stop))

    def texts(self, gens, stop: tuple[str, ...]) -> tuple[list[str], list[str], list[str]]:
        """Each choice's text with special tokens (what the next call must extend), its content
        (EOS and a closing stop string left out, as OpenAI does) and its finish reason."""
        hf = self.r.tok.tokenizer
        raws, contents, finishes = [], [], []
        for g in gens:
            ids = g.token_ids.tolist()
            raws.append(str(hf.decode(ids, skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False)))
            content = self.r.tok.decode(ids)
            for s in stop:
                if content.endswith(s):
                    content = content[:-len(s)]
                    break
            contents.append(content)
            finishes.append(g.finish_reason)
        return raws, contents, finishes

    async def chat(self, request: Request) -> Response:
        ep = self.episode(request)
        raw_body = await request.body()
        req: ChatRequest = decode_body(raw_body, ChatRequest)
        text, images = render(self.r.tok, req)
        forced = forced_tool(req)
        prefix = call_prefix(self.r.cfg.parser, forced) if forced else ""
        text += prefix  # the forced call opened: its tokens are the prompt's, mask 0
        role = "tool" if req.messages[-1].get("role") == "tool" else "user"
        seg = ep.base(text, self.encode, role, images)
        params = self.params(ep, req, seg)
        parser = make_parser(self.r.cfg.parser, req.tools) if req.tools and \
            req.tool_choice != "none" else None
        usage = bool(req.stream_options and req.stream_options.get("include_usage"))
        if req.stream and self.nursery is not None and live_streaming(self.r.engine, params,
                                                                        parser):
            return StreamingResponse(stream_tokens(self, ep, seg, req, params, raw_body, usage),
                                     media_type="text/event-stream")
        gens = await self.generate(seg.context, params, req.n, seed=req.seed,
                                   images=seg.images)
        body, raws = self.chat_body(req, seg, gens, params, parser, forced, prefix)
        ep.answered(seg, gens, raws, raw_body.decode(), json.dumps(body))
        if req.stream:  # a batch engine's (hf) completions arrive whole: sent whole
            return StreamingResponse(self.chunks(body, usage), media_type="text/event-stream")
        return JSONResponse(body)

    def chat_body(self, req: ChatRequest, seg: Segment, gens, params: SamplingParams,
                  parser, forced: str | None = None, prefix: str = ""
                  ) -> tuple[dict[str, Any], list[str]]:
        """The chat completion of ``gens``, and each choice's text with special tokens."""
        raws, contents, finishes = self.texts(gens, params.stop)
        choices = []
        for k, (g, content, finish) in enumerate(zip(gens, contents, finishes, strict=True)):
            if forced and parser is not None:  # OpenAI: finish "stop" on a forced function
                message, called = forced_message(content, parser, forced, prefix), False
            else:
                message, called = assistant_message(content, parser)
            choice: dict[str, Any] = {
                "index": k, "message": message, "token_ids": g.token_ids.tolist(),
                "finish_reason": "tool_calls" if called and finish == "stop" else finish,
                "logprobs": {"content": logprobs_content(self.pieces(g), g.logprobs.tolist())}
                if req.logprobs else None}
            choices.append(choice)
        return self.envelope("chat.completion", seg.context, gens, choices), raws

    async def complete(self, request: Request) -> Response:
        ep = self.episode(request)
        raw_body = await request.body()
        req: CompletionRequest = decode_body(raw_body, CompletionRequest)
        if isinstance(req.prompt, str):
            seg = ep.base(req.prompt, self.encode, "user")
        else:
            vocab = len(self.r.tok.tokenizer)
            if not req.prompt or not all(0 <= t < vocab for t in req.prompt):
                raise BadRequest(f"prompt: token ids must be 0 to {vocab - 1}, at least one")
            seg = ep.base_ids(req.prompt, self.r.tok.tokenizer.decode(
                req.prompt, skip_special_tokens=False, clean_up_tokenization_spaces=False))
        params = self.params(ep, req, seg)
        gens = await self.generate(seg.context, params, req.n, seed=req.seed,
                                   images=seg.images)
        raws, contents, finishes = self.texts(gens, params.stop)
        choices = [{"index": k, "text": c, "finish_reason": f, "token_ids": g.token_ids.tolist(),
                    "logprobs": {"tokens": self.pieces(g), "token_logprobs": g.logprobs.tolist()}
                    if req.logprobs is not None else None}
                   for k, (g, c, f) in enumerate(zip(gens, contents, finishes, strict=True))]
        body = self.envelope("text_completion", seg.context, gens, choices)
        ep.answered(seg, gens, raws, raw_body.decode(), json.dumps(body))
        if req.stream:
            return StreamingResponse(self.text_chunks(body), media_type="text/event-stream")
        return JSONResponse(body)

    def encode(self, text: str) -> list[int]:
        return list(self.r.tok.tokenizer.encode(text, add_special_tokens=False))

    def pieces(self, g) -> list[str]:
        return self.token_pieces(g.token_ids.tolist())

    def token_pieces(self, ids: list[int]) -> list[str]:
        hf = self.r.tok.tokenizer
        return [str(hf.decode([t], skip_special_tokens=False)) for t in ids]

    async def generate(self, context: list[int], params: SamplingParams, n: int, stream=None,
                       seed: int | None = None, images: tuple[bytes, ...] = ()):
        if params.max_tokens <= 0:  # the sample's budget is spent: an empty, cut answer
            return [full_generation(torch.zeros(0, dtype=torch.int32), torch.zeros(0),
                                    self.r.engine.version, "length") for _ in range(n)]
        try:
            return await self.r.call_engine(context, params, n, stream, seed, images)
        except (ValueError, ExceptionGroup) as exc:  # a setting the engine cannot take (hf: a
            # stop string its tokenizer cannot spell: transformers' StopStringCriteria, raised
            # in the compute thread's task group)
            leaf = _only(exc, ValueError)
            if leaf is None:
                raise
            raise BadRequest(f"the engine refuses these settings: {leaf}") from None

    def envelope(self, obj: str, context: list[int], gens, choices) -> dict[str, Any]:
        completion = sum(len(g.token_ids) for g in gens)
        return {"id": f"flowrl-{time.time_ns()}", "object": obj, "created": int(time.time()),
                "model": MODEL, "choices": choices, "prompt_token_ids": context,
                "policy_version": min((g.version for g in gens), default=self.r.engine.version),
                "usage": {"prompt_tokens": len(context), "completion_tokens": completion,
                          "total_tokens": len(context) + completion}}

    async def chunks(self, body: dict[str, Any], usage: bool) -> AsyncIterator[str]:
        """A chat completion as ``chat.completion.chunk`` events: the role, the content (and
        tool calls), then the finish reason."""
        base = {k: body[k] for k in ("id", "created", "model", "policy_version")}
        for c in body["choices"]:
            m = c["message"]
            delta: dict[str, Any] = {"role": "assistant", "content": m.get("content") or ""}
            if m.get("tool_calls"):
                delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(m["tool_calls"])]
            for d, finish in ((delta, None), ({}, c["finish_reason"])):
                yield self.event({**base, "object": "chat.completion.chunk", "choices": [{
                    "index": c["index"], "delta": d, "finish_reason": finish,
                    "logprobs": c["logprobs"] if finish is None else None,
                    "token_ids": c["token_ids"] if finish is None else []}]})
        if usage:
            yield self.event({**base, "object": "chat.completion.chunk", "choices": [],
                              "usage": body["usage"]})
        yield "data: [DONE]\n\n"

    async def text_chunks(self, body: dict[str, Any]) -> AsyncIterator[str]:
        for c in body["choices"]:
            yield self.event({**body, "choices": [c]})
        yield "data: [DONE]\n\n"

    @staticmethod
    def event(value: dict[str, Any]) -> str:
        return f"data: {json.dumps(value)}\n\n"


def app(rollout: EndpointRollout, nursery: Any = None) -> Starlette:
    """The routes; ``nursery`` (trio's, the server's) runs streamed calls' generation."""
    calls = Calls(rollout, nursery)

    def guarded(handler):
        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except BadRequest as exc:
                rollout.stats["bad_calls"] += 1
                return error(400, str(exc))
            except LookupError as exc:
                return error(404, str(exc))
            except Rejected as exc:  # the engine refuses the context for good (too long)
                rollout.stats["bad_calls"] += 1
                return error(400, f"the engine refuses this prompt: {exc}")
        return route

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "flowrl",
             "policy_version": rollout.engine.version}]})

    return Starlette(routes=[
        Route("/episodes/{eid}/v1/chat/completions", guarded(calls.chat), methods=["POST"]),
        Route("/episodes/{eid}/v1/completions", guarded(calls.complete), methods=["POST"]),
        Route("/episodes/{eid}/v1/models", models, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"])])


async def serve(rollout: EndpointRollout, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
    """Listen on ``agent.rollout.host:port`` until cancelled; ``rollout.base_url`` is set and
    ``rollout.serving`` fired once bound."""
    R = rollout.cfg.rollout
    config = Config()
    config.bind = [f"{R.host}:{R.port}"]
    config.accesslog = config.errorlog = None
    config.keep_alive_timeout = 600

    import trio  # hypercorn's trio worker: the sampler's loop is trio's (the default backend)

    async with trio.open_nursery() as nursery:
        try:
            urls = await nursery.start(hypercorn_serve, app(rollout, nursery), config)
        except BaseException as exc:  # hypercorn's bind error arrives in an exception group
            bind = _leaf_oserror(exc)
            if bind is None:
                raise
            raise OSError(f"agent.rollout: cannot listen on {R.host}:{R.port} "
                          f"(agent.rollout.host / port): {bind}") from None
        rollout.base_url = urls[0].rstrip("/")
        rollout.serving.set()
        task_status.started(rollout.base_url)



def _only(exc: BaseException, kind: type[Exception]) -> Exception | None:
    """``exc`` when it is a ``kind``, or the one ``kind`` a group holds and nothing else."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return _only(exc.exceptions[0], kind)
    return None


def _leaf_oserror(exc: BaseException) -> OSError | None:
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        return next((e for e in map(_leaf_oserror, exc.exceptions) if e is not None), None)
    return None
