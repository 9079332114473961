"""Tool-call parsers: the text of one model turn in, the calls it makes out.

A parser also says how the model is told about the tools (``instructions``, for chat templates
that do not render tool schemas themselves) and which strings close a call (``stop``: the
engine ends the turn there when ``agent.stop_at_call`` is on).

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format of
  Qwen, Hermes and most instruction-tuned models. ``arguments`` may also arrive as a JSON string
  of an object. An opening tag whose turn ended before its closing tag is parsed to the end of
  the turn (as vLLM's hermes parser does).
- ``xml``: ``<NAME>text</NAME>`` per tool, the text (stripped) as the tool's first parameter:
  Search-R1's ``<search>query</search>``; an unclosed tag reads to the end of the turn too.

A call that does not parse is still a call: it comes back with an ``error`` that the model
will read, and counts as a failed call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    """The tool called ("" when the call does not say)."""
    arguments: dict[str, Any]
    """Keyword arguments of the call ({} when it did not parse)."""
    raw: str
    """The call's text as the model wrote it (between the tags)."""
    error: str = ""
    """Why the call could not be parsed ("" when it parsed)."""

    @property
    def arguments_text(self) -> str:
        """The arguments as JSON, or the raw text when they did not parse (for the recording)."""
        return self.raw if self.error else json.dumps(self.arguments, ensure_ascii=False)


class Parser(Protocol):
    stop: tuple[str, ...]
    """Strings that close a call."""

    def parse(self, text: str) -> list[ToolCall]:
        """Every call in ``text``, in order."""
        ...

    def instructions(self, schemas: list[dict[str, Any]]) -> str:
        """How to call ``schemas``' tools, for a system message."""
        ...


class Hermes:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    stop: tuple[str, ...] = (CLOSE,)
    _CALLS = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        return [self._one(body.strip()) for body in self._CALLS.findall(text)]

    def _one(self, body: str) -> ToolCall:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            return ToolCall("", {}, body, f"the tool call is not valid JSON ({exc})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ToolCall("", {}, body, 'a tool call is a JSON object {"name": "TOOL", '
                                          '"arguments": {...}}')
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            return ToolCall(call["name"], {}, body, "the call's arguments must be a JSON object")
        return ToolCall(call["name"], arguments, body)

    def instructions(self, schemas: list[dict[str, Any]]) -> str:
        listing = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
        return ("# Tools\n\nYou can call these functions (JSON schemas):\n<tools>\n"
                f"{listing}\n</tools>\n\nTo call one, write a JSON object with its name and "
                "arguments between tags, then stop and wait for the result:\n<tool_call>\n"
                '{"name": "FUNCTION_NAME", "arguments": {"ARGUMENT": "VALUE"}}\n</tool_call>')


class Xml:
    """One tag per tool; the text inside is the tool's first parameter."""

    def __init__(self, schemas: list[dict[str, Any]]) -> None:
        self.first: dict[str, str] = {}  # tool name -> its first parameter
        for s in schemas:
            fn = s["function"]
            params = list(fn["parameters"].get("properties", {}))
            self.first[fn["name"]] = params[0] if params else ""
        self.stop = tuple(f"</{name}>" for name in self.first)
        names = "|".join(re.escape(n) for n in self.first) or "(?!)"
        self._calls = re.compile(rf"<({names})>(.*?)(?:</\1>|\Z)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for name, body in self._calls.findall(text):
            param = self.first[name]
            calls.append(ToolCall(name, {param: body.strip()} if param else {}, body))
        return calls

    def instructions(self, schemas: list[dict[str, Any]]) -> str:
        lines = []
        for s in schemas:
            fn = s["function"]
            param = self.first[fn["name"]]
            lines.append(f"<{fn['name']}>{param.upper() or ''}</{fn['name']}>: {fn['description']}")
        return ("# Tools\n\nTo use a tool, write its tag with the input inside, then stop and "
                "wait for the result:\n" + "\n".join(lines))


def make_parser(name: str, schemas: list[dict[str, Any]]) -> Parser:
    if name == "hermes":
        return Hermes()
    if name == "xml":
        return Xml(schemas)
    raise ValueError(f"unknown tool-call parser {name!r}")
