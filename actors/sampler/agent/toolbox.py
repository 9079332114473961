"""The tools of a sampler: their schemas, their sandboxed children, and one call at a time.

Tools run in the sandbox that runs user reward code (``actors/sandbox``): child
processes with memory and CPU limits and a per-call timeout (``[agent]`` limits). The schemas
the model is shown are built in a child too (``actors.sandbox.tools.describe``), so a user's
tool file is never imported into the sampler. A call never raises: an unknown tool, arguments
that do not fit the schema, an exception, a hang (the child is killed at
``agent.tool_timeout_s``) or a crash each come back as a ``ToolResult`` with an error, which
the model reads as the tool's answer.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from actors.runtime.config import AgentConfig
from actors.sampler.agent.parsers import ToolCall
from actors.sandbox.children import Children
from actors.sandbox.protocol import Call, FunctionSpec

TOOLS_MODULE = "actors.sandbox.tools"
_JSON_CHECKS = {"string": str, "integer": int, "number": int | float, "boolean": bool,
                "array": list, "object": dict}


@dataclass(frozen=True)
class ToolResult:
    text: str
    """What the model reads: the tool's output, or ``Error: ...``."""
    error: str = ""
    """Non-empty when the call failed."""
    failure: str = ""
    """The kind of failure: parse, unknown_tool, arguments, raised, timeout, crash."""
    latency_s: float = 0.0
    """Seconds from sending the call to its answer (0 when it never reached a child)."""


@dataclass(frozen=True)
class ToolStatistics:
    calls: int
    """Tool calls the model made (failed ones included)."""
    errors: int
    """Calls that failed, whatever the reason (timeouts included)."""
    timeouts: int
    """Calls killed at agent.tool_timeout_s."""
    crashes: int
    """Calls whose child died under them."""


def failed(error: str, failure: str, latency_s: float = 0.0) -> ToolResult:
    return ToolResult(f"Error: {error}", error, failure, latency_s)


def argument_problem(arguments: dict[str, Any], schema: dict[str, Any]) -> str:
    """What is wrong with ``arguments`` for a tool's JSON schema ("" when they fit)."""
    params = schema["function"]["parameters"]
    properties = params.get("properties", {})
    missing = [p for p in params.get("required", []) if p not in arguments]
    if missing:
        return f"missing argument(s) {', '.join(missing)}"
    unknown = [a for a in arguments if a not in properties]
    if unknown:
        return (f"unknown argument(s) {', '.join(unknown)}; the tool takes "
                f"{', '.join(properties) or 'none'}")
    for name, value in arguments.items():
        kind = properties[name].get("type")
        expected = _JSON_CHECKS.get(kind)
        if expected is not None and (not isinstance(value, expected)
                                     or isinstance(value, bool) and kind != "boolean"):
            return f"argument {name} must be a JSON {kind}, not {json.dumps(value)[:40]}"
        if "enum" in properties[name] and value not in properties[name]["enum"]:
            return f"argument {name} must be one of {properties[name]['enum']}"
    return ""


class ToolBox:
    """``cfg.tools`` behind one set of sandboxed children."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.names: list[str] = []
        specs: list[FunctionSpec] = [FunctionSpec(module=TOOLS_MODULE, name="describe",
                                                  returns="text")]
        self._describe: list[dict[str, str]] = []
        for tool in cfg.tools:
            name = tool.name or tool.builtin
            module, function = (TOOLS_MODULE, tool.builtin) if tool.builtin else ("", tool.name)
            specs.append(FunctionSpec(path=tool.path, module=module, name=function,
                                      kwargs=dict(tool.kwargs), returns="text"))
            self.names.append(name)
            self._describe.append({"path": tool.path, "module": module, "name": function,
                                   "tool": name})
        self.children = Children(specs, size=cfg.processes, timeout_s=cfg.tool_timeout_s,
                              memory_mb=cfg.memory_mb, cpu_s=cfg.cpu_s, limits_key="agent",
                              timeout_key="tool_timeout_s")
        self.schemas: list[dict[str, Any]] = []
        self._calls = self._errors = 0
        self.max_failures = cfg.max_tool_failures
        self._in_a_row = [0] * len(self.names)  # per tool: failures since its last success
        self.broken = ""  # set once a tool failed max_failures calls in a row: the job stops

    async def start(self) -> None:
        """Build every tool's schema in a child; a tool that does not load stops the sampler
        here, with the child's error, rather than failing every call later."""
        outcomes = await self.children.call(Call(0, self._describe, len(self._describe)))
        problems = [f"agent.tools[{i}] ({self.names[i]}): {o.error}"
                    for i, o in enumerate(outcomes) if o.error]
        if problems:
            raise RuntimeError("; ".join(problems))
        self.schemas = [json.loads(o.text) for o in outcomes]

    def statistics(self) -> ToolStatistics:
        c = self.children.statistics()
        return ToolStatistics(self._calls, self._errors, c.timeouts, c.crashes)

    async def call(self, call: ToolCall) -> ToolResult:
        self._calls += 1
        result = await self._call(call)
        self._errors += bool(result.error)
        if result.failure in ("raised", "timeout", "crash", "") and call.name in self.names:
            self.note(self.names.index(call.name), result)
        return result

    def note(self, index: int, result: ToolResult) -> None:
        """Count a call that reached tool ``index``'s code: its failures in a row, past
        ``agent.max_tool_failures`` a broken tool (``broken`` says which and why)."""
        self._in_a_row[index] = self._in_a_row[index] + 1 if result.error else 0
        if self.max_failures and self._in_a_row[index] >= self.max_failures and not self.broken:
            self.broken = (f"tool agent.tools[{index}] ({self.names[index]}) failed on "
                           f"{self._in_a_row[index]} calls in a row (agent.max_tool_failures = "
                           f"{self.max_failures}); last: {result.error}")

    async def _call(self, call: ToolCall) -> ToolResult:
        if call.error:
            return failed(call.error, "parse")
        if call.name not in self.names:
            return failed(f"unknown tool {call.name!r}; the tools are "
                                f"{', '.join(self.names)}", "unknown_tool")
        index = self.names.index(call.name)
        problem = argument_problem(call.arguments, self.schemas[index])
        if problem:
            return failed(f"{call.name}: {problem}", "arguments")
        started = time.monotonic()
        (outcome,) = await self.children.call(Call(index + 1, [call.arguments], 1))
        latency = time.monotonic() - started
        if outcome.error:
            return failed(outcome.error, outcome.failure or "raised", latency)
        return ToolResult(outcome.text, latency_s=latency)

    async def aclose(self) -> None:
        await self.children.aclose()
