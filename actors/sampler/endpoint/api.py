"""The OpenAI wire format: request bodies decoded (a bad one is a ``BadRequest`` naming the
field), messages rendered by the chat template (``image_url`` parts through the model's processor,
``images.py``), a completion's text read back as content and
tool calls, and the response bodies (with the token ids and policy version as extra fields,
vLLM's ``return_token_ids`` style).

Unknown request fields are ignored, as OpenAI-compatible servers do (clients send
``stream_options``, ``parallel_tool_calls``, ``user``...); known ones are type-checked.
"""

from __future__ import annotations

import json
import time
from typing import Any, TypeVar

import msgspec

from actors.data.chat import ChatTokenizer
from actors.data.vision import ImageError
from actors.sampler.agent.parsers import Hermes, Parser
from actors.sampler.endpoint.images import has_images, image_parts


class BadRequest(Exception):
    """A request the endpoint cannot serve: answered 400 with this reason."""


class ChatRequest(msgspec.Struct, kw_only=True):
    messages: list[dict[str, Any]]
    model: str = ""
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    seed: int | None = None  # the engine's sampling seed of the first choice (vllm; hf has none)


class CompletionRequest(msgspec.Struct, kw_only=True):
    prompt: str | list[int]
    model: str = ""
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    logprobs: int | None = None
    stream: bool | None = None
    seed: int | None = None


Request = TypeVar("Request", ChatRequest, CompletionRequest)


def decode_body(body: bytes, kind: type[Request]) -> Request:
    try:
        request = msgspec.json.decode(body, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        # a string that is not UTF-8 raises the last, not one of msgspec's own errors
        raise BadRequest(f"bad request body: {exc}") from None
    if not 1 <= request.n <= 16:
        raise BadRequest("n: must be 1 to 16")
    for key in ("max_tokens", "max_completion_tokens"):
        value = getattr(request, key, None)
        if value is not None and value < 1:
            raise BadRequest(f"{key}: must be at least 1")
    for key in ("temperature", "top_p"):
        value = getattr(request, key)
        if value is not None and not 0 <= value <= (2 if key == "temperature" else 1):
            raise BadRequest(f"{key}: {value} is out of range")
    if isinstance(request, ChatRequest):
        if not request.messages:
            raise BadRequest("messages: must not be empty")
        forced_tool(request)  # a tool_choice that names no tool of the request is a 400
    return request


def forced_tool(request: ChatRequest) -> str | None:
    """The function the request forces the model to call: ``tool_choice`` naming one
    (``{"type": "function", "function": {"name": ...}}``), or ``"required"`` with a single tool
    (nothing to choose). ``"required"`` among several tools is a 400: choosing one of them for
    sure needs constrained decoding, which the engines here do not do."""
    choice = request.tool_choice
    names = [t.get("function", {}).get("name") for t in request.tools or []]
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required":
        if len(names) != 1:
            raise BadRequest(f"tool_choice: 'required' is served with one tool (the request has "
                             f"{len(names)}): choosing among tools for sure needs constrained "
                             "decoding, which this endpoint does not do; name the function "
                             "(tool_choice={'type': 'function', 'function': {'name': ...}})")
        return names[0]
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or name not in names:
        raise BadRequest(f"tool_choice: {choice!r} names no tool of the request (its tools: "
                         f"{names}); expected 'auto', 'none', 'required' or "
                         "{'type': 'function', 'function': {'name': NAME}}")
    return name


def call_prefix(parser: str, name: str) -> str:
    """The opening of a call of ``name`` in ``agent.parser``'s format, written after the
    generation prompt so the model goes on with the call's arguments (vLLM and SGLang open
    a named tool choice's call the same way before constraining the rest)."""
    if parser == "hermes":
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": '
    return f"<{name}>"


def forced_message(text: str, parser: Parser, name: str, prefix: str) -> dict[str, Any]:
    """The message of a completion made after ``call_prefix``: one call of ``name`` whatever
    the model wrote. Its arguments are the parsed ones, else the model's text as written
    (OpenAI: the arguments "may not be valid JSON")."""
    calls = [c for c in parser.parse(prefix + text) if not c.error and c.name == name]
    if calls:
        arguments = json.dumps(calls[0].arguments, ensure_ascii=False)
    else:
        raw = text.split(Hermes.CLOSE if prefix.startswith(Hermes.OPEN) else f"</{name}>")[0]
        arguments = raw.strip()
        if prefix.startswith(Hermes.OPEN) and arguments.endswith("}"):
            arguments = arguments[:-1].rstrip()  # the call object's own closing brace
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_0_{time.time_ns() % 10**9}", "type": "function",
         "function": {"name": name, "arguments": arguments}}]}


def stops_of(stop: str | list[str] | None) -> tuple[str, ...]:
    return () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)


def _content(value: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(p.get("text", "") for p in value if isinstance(p, dict))
    raise BadRequest(f"a message's content is {type(value).__name__}, not text or parts")


def template_messages(messages: list[dict[str, Any]],
                      images: list[bytes] | None = None) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: text content (a message with ``image_url``
    parts keeps its parts, each image an ``{"type": "image"}`` part, and its images are
    appended to ``images``; None: a text-only policy, which refuses them), tool-call arguments
    as objects (the API sends them as JSON strings; templates write them with ``tojson``)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}].role: missing or not a string")
        content = m.get("content")
        try:
            one = {**m, "content": image_parts(content, f"messages[{i}].content", images)
                   if has_images(content) else _content(content)}
        except ImageError as exc:  # it names the message and the part
            raise BadRequest(str(exc)) from None
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"] or "{}")
                    except json.JSONDecodeError:
                        pass
                calls.append({**call, "function": fn})
            one["tool_calls"] = calls
        out.append(one)
    return out


def render(tok: ChatTokenizer, request: ChatRequest) -> tuple[str, tuple[bytes, ...]]:
    """The request's conversation as the chat template writes it, the assistant's turn opened,
    and its images in order: each image's token expanded by the model's processor as a
    dataset prompt's are (``ImageProcessor.expand``)."""
    extra: dict[str, Any] = {"tools": request.tools} \
        if request.tools and request.tool_choice != "none" else {}
    images: list[bytes] | None = [] if tok.processor is not None else None
    messages = template_messages(request.messages, images)
    hf: Any = tok.tokenizer
    try:
        text = str(hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **extra))
    except Exception as exc:  # jinja's errors: a message the template refuses
        raise BadRequest(f"the chat template refused the messages: {exc}") from None
    if not images:
        return text, ()
    assert tok.processor is not None  # images is a list only for a vision-language policy
    try:
        return tok.processor.expand(text, images), tuple(images)
    except ImageError as exc:  # a template that writes no image token for an image part
        raise BadRequest(f"messages: {exc}") from None


def assistant_message(text: str, parser: Parser | None) -> tuple[dict[str, Any], bool]:
    """The message a completion's text makes, and whether it calls tools (read by ``parser``,
    ``agent.parser``; None: the request has no tools). The content is the text before the
    first call."""
    calls = [c for c in parser.parse(text) if not c.error] if parser is not None else []
    if not calls:
        return {"role": "assistant", "content": text}, False
    opens = [i for tag in ("<tool_call>", *(f"<{c.name}>" for c in calls))
             if (i := text.find(tag)) >= 0]
    content = text[:min(opens, default=0)].strip() or None
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call_{k}_{time.time_ns() % 10**9}", "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
        for k, c in enumerate(calls)]}, True


def logprobs_content(pieces: list[str], logprobs: list[float]) -> list[dict[str, Any]]:
    return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(pieces, logprobs, strict=True)]
