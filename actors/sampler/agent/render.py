"""Tokens that a rollout appends after the model's turn: what the chat template puts there.

The rollout never re-templates or re-tokenizes what came before (the model's tokens are the
engine's, exactly). What follows a model turn is rendered from the template once, at start,
with placeholder messages: the text between the end of an assistant message's content and the
start of a tool (or user) message's content, between two such messages, and from the end of
the last one to the opening of the next assistant turn. Each piece is tokenized once and cached;
a tool's result is tokenized once, on its own, cut in the middle when too long, and spliced in
between. Every one of these tokens has loss mask 0: it is not the model's.

When the model's turn ended with an end-of-turn token (EOS), the template's closing of the
assistant message starts with that token's text, which is then left out; when it ended at a
stop string (a tool call's closing tag), the closing is added, as tool tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actors.data.chat import ChatTokenizer, as_dicts
from actors.sampler.agent.parsers import Parser
from messages.rollout import ChatMessage

_A, _O1, _O2 = "\x11ASSISTANT\x11", "\x11OBSERVATION1\x11", "\x11OBSERVATION2\x11"


def cut_middle(ids: list[int], limit: int, marker: list[int]) -> list[int]:
    """``ids`` when at most ``limit`` long; else its first and last tokens around ``marker``,
    ``limit`` tokens in all (the marker counts)."""
    if len(ids) <= limit:
        return ids
    keep = max(limit - len(marker), 0)
    head = (keep + 1) // 2
    return (ids[:head] + marker + ids[len(ids) - (keep - head):])[:limit]


class Renderer:
    """The template's pieces around observations of ``role`` (``tool`` for tool results,
    ``user`` for an environment's observations), tokenized once."""

    def __init__(self, tokenizer: ChatTokenizer, role: str, max_tokens: int) -> None:
        self.tok = tokenizer
        self.max_tokens = max_tokens  # an observation's content is cut in the middle to this
        self.role = role
        hf = tokenizer.tokenizer
        base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": _A}]
        try:
            one = self._text(base + [{"role": role, "content": _O1}], generation=True)
        except Exception:  # a template that knows no "tool" role: results come as the user's
            if role == "user":
                raise
            self.role = role = "user"
            one = self._text(base + [{"role": role, "content": _O1}], generation=True)
        self.after_model = one[one.index(_A) + len(_A):one.index(_O1)]
        self.after_observation = one[one.index(_O1) + len(_O1):]
        try:
            two = self._text(base + [{"role": role, "content": _O1},
                                     {"role": role, "content": _O2}], generation=True)
            between = two[two.index(_O1) + len(_O1):two.index(_O2)]
        except Exception:  # no two in a row: several results share one message
            between = "\n\n"
        self.eos = tokenizer.eos_token_id
        eos_text = str(hf.decode([self.eos]))
        closing = self.after_model
        self._after_model = {True: self.encode(closing[len(eos_text):] if closing.startswith(
            eos_text) else closing), False: self.encode(closing)}  # keyed by "ended with EOS"
        self._between = self.encode(between)
        self._after_observation = self.encode(self.after_observation)
        self._marker = self.encode("\n…\n")

    def _text(self, messages: list[dict[str, str]], generation: bool) -> str:
        return str(self.tok.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def content(self, text: str) -> tuple[list[int], str]:
        """A result's tokens, cut in the middle to ``max_tokens``, and the text they show."""
        ids = self.encode(text)
        if len(ids) <= self.max_tokens:
            return ids, text
        kept = cut_middle(ids, self.max_tokens, self._marker)
        return kept, str(self.tok.tokenizer.decode(kept))

    def observations(self, contents: Sequence[list[int]], last_token: int) -> list[list[int]]:
        """The tokens after a model turn whose last token is ``last_token``: one list per
        observation (the template's glue before it, its content; the last one also the opening
        of the model's next turn)."""
        out = []
        for i, ids in enumerate(contents):
            before = self._after_model[last_token == self.eos] if i == 0 else self._between
            out.append(before + ids)
        if out:
            out[-1] = out[-1] + self._after_observation
        return out


def prompt_ids(tok: ChatTokenizer, messages: Sequence[ChatMessage],
               schemas: list[dict[str, Any]], parser: Parser | None, hermes: bool,
               images: Sequence[bytes] = ()) -> list[int]:
    """The prompt's tokens with the tools described: by the chat template when it renders
    ``tools`` and the parser is hermes (the format such templates teach), else by the parser's
    instructions at the end of the system message (one is added when there is none). With
    ``images``, each image's tokens are expanded by the model's processor, as a single turn's."""
    if not schemas or parser is None:
        return tok.prompt_ids(messages, images=images)
    if hermes and renders_tools(tok):
        return tok.prompt_ids(messages, schemas, images)
    text = parser.instructions(schemas)
    first = messages[0] if messages else None
    if first is not None and first.role == "system":
        head = [ChatMessage("system", f"{first.content}\n\n{text}")]
        return tok.prompt_ids(head + list(messages[1:]), images=images)
    return tok.prompt_ids([ChatMessage("system", text), *messages], images=images)


def renders_tools(tok: ChatTokenizer) -> bool:
    """Whether the chat template shows the model tool schemas it is given."""
    probe = [ChatMessage("user", "U")]
    schema = {"type": "function", "function": {"name": "probe_tool_name", "description": "",
                                                "parameters": {"type": "object"}}}
    try:
        with_tools = tok.tokenizer.apply_chat_template(
            as_dicts(probe), tools=[schema], tokenize=False, add_generation_prompt=True)
    except Exception:
        return False
    return "probe_tool_name" in str(with_tools)
