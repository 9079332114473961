"""Built-in rule scorers, all with verl's ``compute_score`` signature.

Each takes ``(data_source, solution_str, ground_truth, extra_info)`` plus keyword options set
in ``[[reward.functions]] kwargs`` and returns a float. The pure-regex ones run in the reward
worker's thread; ``math`` (math-verify, whose timeouts use ``signal.alarm`` and so only work on
a main thread) runs in a child process, like user code.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

_SOLUTION_CLIP_CHARS = 300  # verl: the final answer is near the end; long regex scans are slow
_STRICT = re.compile("#### (\\-?[0-9\\.\\,]+)")
_FLEXIBLE = re.compile("(\\-?[0-9\\.\\,]+)")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_INT = re.compile(r"-?\d+")


def gsm8k_extract(solution_str: str, method: str = "strict") -> str | None:
    """verl's GSM8K answer extraction, rule for rule (quirks included: flexible keeps commas)."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', not {method!r}")
    solution_str = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(solution_str)
        return found[-1].replace(",", "").replace("$", "") if found else None
    final = None
    for final in reversed(_FLEXIBLE.findall(solution_str)):
        if final not in ("", "."):
            break
    return final


def gsm8k(data_source: str, solution_str: str, ground_truth: str,
          extra_info: dict[str, Any] | None = None, *, method: str = "strict",
          format_score: float = 0.0, score: float = 1.0) -> float:
    """``score`` when the extracted answer equals the ground truth, ``format_score`` when an
    answer was extracted but differs, 0.0 when none was found (verl ``gsm8k.compute_score``)."""
    answer = gsm8k_extract(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)


def exact_match(data_source: str, solution_str: str, ground_truth: str,
                extra_info: dict[str, Any] | None = None) -> float:
    """1.0 when the reply, stripped of surrounding whitespace, is the ground truth."""
    return float(solution_str.strip() == ground_truth.strip())


def answer_tag(data_source: str, solution_str: str, ground_truth: str,
               extra_info: dict[str, Any] | None = None, *, format_score: float = 0.0) -> float:
    """1.0 when the text inside the last ``<answer>...</answer>`` is the ground truth (both
    stripped), ``format_score`` for a well-formed tag with a wrong answer, 0.0 with no tag."""
    tags = _ANSWER_TAG.findall(solution_str)
    if not tags:
        return 0.0
    return 1.0 if tags[-1].strip() == ground_truth.strip() else float(format_score)


def math(data_source: str, solution_str: str, ground_truth: str,
         extra_info: dict[str, Any] | None = None) -> float:
    """1.0 when math-verify finds the answer equivalent to the ground truth (verl's
    ``math_verify.compute_score``: the ground truth is wrapped in ``\\boxed{}``, the reply is
    searched for a LaTeX or plain expression). Call it in a child process: see the module doc."""
    from math_verify.metric import math_metric
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    verify = math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                         pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))
    value, _ = verify(["\\boxed{" + ground_truth + "}"], [solution_str])
    return float(value)


def overlong_penalty(length: int, max_length: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_length - buffer_len`` tokens, then falling
    linearly to ``-factor`` at ``max_length`` (and below it past that)."""
    expected = max_length - buffer_len
    return min(-(length - expected) / buffer_len * factor, 0.0)


# the built-in tasks' scorers (actors/data/tasks.py makes their prompts)
def arithmetic_score(data_source: str, solution_str: str, ground_truth: str,
                     extra_info: dict[str, Any] | None = None) -> float:
    """1.0 when the sum appears and every number in the reply is an operand or the sum."""
    numbers = [int(x) for x in _INT.findall(solution_str)]
    allowed = {int(ground_truth)}
    if extra_info:
        allowed |= {int(extra_info[k]) for k in ("a", "b") if k in extra_info}
    return float(int(ground_truth) in numbers and all(x in allowed for x in numbers))


def repeat_letter_score(data_source: str, solution_str: str, ground_truth: str,
                        extra_info: dict[str, Any] | None = None) -> float:
    """Fraction of the reply's non-space characters that are the asked letter."""
    chars = [c for c in solution_str if not c.isspace()]
    return sum(c == ground_truth for c in chars) / len(chars) if chars else 0.0


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_turn(solution_str: str, extra_info: dict[str, Any] | None) -> str:
    """The text of the model's last turn: from ``extra_info["turns"]`` of a multi-turn sample
    (the transcript in ``solution_str`` also holds the tools' output), else the whole reply."""
    turns = (extra_info or {}).get("turns") or []
    own = [t.get("content", "") for t in turns if t.get("role") == "assistant"]
    return own[-1] if own else solution_str


def calculator_score(data_source: str, solution_str: str, ground_truth: str,
                     extra_info: dict[str, Any] | None = None, *, call_score: float = 0.0) -> float:
    """1.0 when the last number of the model's last turn is the ground truth (``12,345`` reads
    as 12345); plus ``call_score`` (a format shaping term, default 0) when the sample made a
    tool call that succeeded."""
    numbers = _NUMBER.findall(final_turn(solution_str, extra_info))
    correct = bool(numbers) and numbers[-1].replace(",", "") == ground_truth.strip()
    turns = (extra_info or {}).get("turns") or []
    called = any(t.get("role") == "tool" and not t.get("error") for t in turns)
    return float(correct) + (float(call_score) if called else 0.0)


def reasoning_gym(data_source: str, solution_str: str, ground_truth: str,
                        extra_info: dict | None = None, **_: Any) -> float:
    """A reasoning-gym prompt's reward: its generator's own ``score_answer``
    (``actors/data/reasoning_gym.py``; the package is an optional extra)."""
    from actors.data.reasoning_gym import score

    return score(data_source, solution_str, ground_truth, extra_info)


def verifiers(data_source: str, solution_str: str, ground_truth: str,
              extra_info: dict | None = None, **_: Any) -> Any:
    """A verifiers prompt's reward: its environment's own rubric, each reward's value under
    its name (``actors/data/verifiers_env.py``; the package is an optional extra). Returns the
    scoring coroutine, which the sandbox runs to completion."""
    from actors.data.verifiers_env import score

    return score(data_source, solution_str, ground_truth, extra_info)


def _reasoning_gym_answer(text: str, extra_info: dict | None = None, **_: Any) -> str | None:
    from actors.data.reasoning_gym import answer

    return answer(text, extra_info)


# the answers the built-ins read, for majority votes (verl's ``pred``): what each compares with
# the ground truth; INVALID when a reply holds none (it still votes, as in verl's math_dapo)
INVALID = "[INVALID]"


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip()
    return None


def _last_int(text: str) -> str | None:
    found = _INT.findall(text)
    return found[-1] if found else None


def _tag(text: str) -> str | None:
    tags = _ANSWER_TAG.findall(text)
    return tags[-1].strip() if tags else None


ANSWERS: dict[str, Callable[..., str | None]] = {
    "gsm8k": lambda text, method="strict", **_: gsm8k_extract(text, method),
    "math": lambda text, **_: last_boxed(text),
    "exact_match": lambda text, **_: text.strip(),
    "answer_tag": lambda text, **_: _tag(text),
    "arithmetic": lambda text, **_: _last_int(text),
    "repeat_letter": lambda text, **_: text.strip()[:1] or None,
    "reasoning_gym": _reasoning_gym_answer,
}


def extract_answer(builtin: str, solution_str: str, **kwargs: Any) -> str:
    """The answer built-in ``builtin`` reads in ``solution_str`` ("" when it reads none at all,
    INVALID when the reply holds none)."""
    extract = ANSWERS.get(builtin)
    if extract is None:
        return ""
    found = extract(solution_str, **kwargs)
    return INVALID if found is None or found == "" else found


Rule = Callable[..., float]
BUILTINS: dict[str, Rule] = {
    "gsm8k": gsm8k, "math": math, "exact_match": exact_match, "answer_tag": answer_tag,
    "arithmetic": arithmetic_score, "repeat_letter": repeat_letter_score,
    "calculator": calculator_score, "reasoning_gym": reasoning_gym, "verifiers": verifiers,
}
# built-ins that must not run on the worker's threads (a library's scorer may hang)
IN_CHILD = frozenset({"math", "reasoning_gym", "verifiers"})
PRELOAD = {"math": ("math_verify.metric", "math_verify.parser"),  # imported when a child starts,
           "reasoning_gym": ("reasoning_gym",), "verifiers": ("verifiers.v1",)}
# so the first call's timeout does not pay for the import

# verl ``default_compute_score`` data sources, so verl parquet rows score with no config
DATA_SOURCES: dict[str, str] = {
    **{name: name for name in BUILTINS},
    "openai/gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
}
REASONING_GYM = "reasoning_gym/"  # the data sources of reasoning-gym prompts: reasoning_gym/NAME
VERIFIERS = "verifiers/"  # the data sources of verifiers prompts: verifiers/NAME


def scorer_of(data_source: str) -> str | None:
    """The built-in that scores a data source with no ``[[reward.functions]]``, or None."""
    if data_source.startswith(REASONING_GYM):
        return "reasoning_gym"
    if data_source.startswith(VERIFIERS):
        return "verifiers"
    return DATA_SOURCES.get(data_source)
