"""A generative judge: an LLM reads a prompt template filled with the prompt, the response and
the ground truth, and a parser turns its answer into a score.

The template follows verl's GenRM examples (``{problem}``/``{solution}`` are accepted beside
``{prompt}``/``{response}``); the built-in parsers read the conventions judges are prompted
with: a bare number (verl's GenRM rates 1-10 and reads the last line's integer), MT-Bench's
``[[rating]]``, a ``\\boxed{x}``, or a yes/no verdict. A user's parser is a function run in a
sandboxed child, like reward code. An answer no parser can read is an error outcome (recorded
with the answer's start), never a silent 0.

The judge generates through the sampler's engine protocol (``actors/sampler/engines``: hf or
vllm from the registry), all the items of a batch in one ``generate`` call.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from actors.runtime.config.pools import PoolConfig, render
from actors.sandbox.protocol import Outcome
from actors.scoring.items import ScoreItem

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
NUMBER = re.compile(_NUMBER)
SCORE_TAG = re.compile(r"\[\[\s*(" + _NUMBER + r")\s*\]\]")
BOXED = re.compile(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}")
YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def parse_number(answer: str) -> float | None:
    """The last number in the answer."""
    found = NUMBER.findall(answer)
    return float(found[-1]) if found else None


def parse_score_tag(answer: str) -> float | None:
    """The last ``[[x]]`` (MT-Bench's judge: "Rating: [[7]]")."""
    found = SCORE_TAG.findall(answer)
    return float(found[-1]) if found else None


def parse_boxed(answer: str) -> float | None:
    """The last ``\\boxed{x}`` holding a number."""
    found = BOXED.findall(answer)
    return float(found[-1]) if found else None


def parse_yes_no(answer: str) -> float | None:
    """The last yes or no word: 1.0 or 0.0."""
    found = YES_NO.findall(answer)
    return (1.0 if found[-1].lower() == "yes" else 0.0) if found else None


PARSE: dict[str, Callable[[str], float | None]] = {
    "number": parse_number, "score_tag": parse_score_tag, "boxed": parse_boxed,
    "yes_no": parse_yes_no}


def judge_fields(item: ScoreItem) -> dict[str, str]:
    """What a template may name, for one item (the prompt: its non-system messages' text)."""
    prompt = "\n".join(m.content for m in item.prompt if m.role != "system")
    return {"prompt": prompt, "response": item.solution_str, "ground_truth": item.ground_truth,
            "data_source": item.data_source, "problem": prompt, "solution": item.solution_str}


def read_answer(pool: PoolConfig, answer: str) -> Outcome:
    """A built-in parser's reading of one answer: its score times ``scale``, or an error."""
    value = PARSE[pool.parser](answer)
    if value is None:
        return Outcome(error=f"judge {pool.name}: parser {pool.parser} read no score in its "
                             f"answer {answer[:120]!r}")
    return Outcome(score=value * pool.scale, extra={"judge_raw": value})


def parser_arguments(item: ScoreItem, answer: str) -> dict[str, Any]:
    """A user parser's keyword arguments for one answer."""
    return {"judge_answer": answer, "data_source": item.data_source,
            "solution_str": item.solution_str, "ground_truth": item.ground_truth,
            "extra_info": dict(item.extra_info)}


class Judge:
    """Renders items into judge prompts, generates the answers in one engine call, parses."""

    def __init__(self, pool: PoolConfig, engine: Any, tokenizer: Any,
                 user_parser: Callable[[list[dict[str, Any]]], Any] | None = None) -> None:
        self.pool, self.engine, self.tokenizer = pool, engine, tokenizer
        self.user_parser = user_parser  # parser = function: outcomes of parser_arguments lists
        self.answers = 0  # answers generated
        self.unreadable = 0  # answers the parser could not read

    def prompt_ids(self, item: ScoreItem) -> list[int]:
        from actors.data.chat import chat_ids
        from messages.rollout import ChatMessage

        text = render(self.pool.template, judge_fields(item))
        if self.tokenizer.chat_template:
            return chat_ids(self.tokenizer, [ChatMessage("user", text)])
        return list(self.tokenizer(text)["input_ids"])

    async def generate(self, items: list[ScoreItem]) -> list[str]:
        """The judge's answer to each item, generated together."""
        from actors.sampler.engines.base import GenerateRequest
        from messages.rollout import SamplingParams

        params = SamplingParams(temperature=self.pool.temperature, max_tokens=self.pool.max_tokens)
        requests = [GenerateRequest(self.prompt_ids(item), params) for item in items]
        out = await self.engine.generate(requests)  # continuous engines run them at once
        return [self.tokenizer.decode(gens[0].token_ids.tolist(), skip_special_tokens=True)
                for gens in out]

    async def score(self, items: list[ScoreItem]) -> list[Outcome]:
        """One outcome per item; a failure of the engine is every item's error."""
        if not items:
            return []
        try:
            answers = await self.generate(items)
        except Exception as exc:  # a judge's fault is a recorded error, never a dead worker
            return [Outcome(error=f"judge {self.pool.name}: {type(exc).__name__}: {exc}"[:500])
                    ] * len(items)
        self.answers += len(answers)
        if self.user_parser is not None:
            outcomes = list(await self.user_parser(
                [parser_arguments(i, a) for i, a in zip(items, answers, strict=True)]))
            outcomes = [Outcome(score=o.score * self.pool.scale, extra=o.extra) if not o.error
                        else Outcome(error=f"judge {self.pool.name}: parser function: {o.error} "
                                           f"(answer {a[:80]!r})", trace=o.trace)
                        for o, a in zip(outcomes, answers, strict=True)]
        else:
            outcomes = [read_answer(self.pool, a) for a in answers]
        self.unreadable += sum(1 for o in outcomes if o.error)
        return outcomes
