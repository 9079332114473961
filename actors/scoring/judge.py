"""A served generative judge: an LLM reads a prompt template filled with the prompt, the
response and the ground truth, and a parser turns its answer into a score.

``[[reward.models]] kind = "judge"``: its scorer (``Judge``; its options, ``JudgeConfig``, with
the template's check, are the config's: ``actors/runtime/config/pools.py``).
The template follows verl's GenRM examples (``{problem}``/``{solution}`` are accepted beside
``{prompt}``/``{response}``); the built-in parsers read the conventions judges are prompted
with: a bare number (verl's GenRM rates 1-10 and reads the last line's integer), MT-Bench's
``[[rating]]``, a ``\\boxed{x}``, or a yes/no verdict. A user's parser is a function run in a
sandboxed child, like reward code. An answer no parser can read is an error outcome (recorded
with the answer's start), never a silent 0.

The judge generates through the sampler's engine protocol (``actors/sampler/engines``: hf or
vllm from the registry), all the items of a batch in one ``generate`` call. Torch-free until a
replica loads it.

Images: a judge that is a vision-language model reads the prompt's images with it (the filled
template is its user message, each ``<image>`` of ``{prompt}`` an image part, expanded by the
judge's own processor as the sampler expands a dataset prompt's; a template without
``{prompt}`` gets the images before its text). A text-only judge reads the prompt's text, where
each image stays a literal ``<image>``, as a verl reward model reads a multimodal prompt's text;
it counts the items it judged without their images (``judge_images_unseen``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from actors.runtime.config import JudgeConfig
from actors.sandbox.children import Children
from actors.sandbox.protocol import Call, FunctionSpec, Outcome
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


def read_answer(cfg: JudgeConfig, answer: str) -> Outcome:
    """A built-in parser's reading of one answer: its score times ``scale``, or an error."""
    value = PARSE[cfg.parser](answer)
    if value is None:
        return Outcome(error=f"judge {cfg.name}: parser {cfg.parser} read no score in its "
                             f"answer {answer[:120]!r}")
    return Outcome(score=value * cfg.scale, extra={"judge_raw": value})


def parser_arguments(item: ScoreItem, answer: str) -> dict[str, Any]:
    """A user parser's keyword arguments for one answer."""
    return {"judge_answer": answer, "data_source": item.data_source,
            "solution_str": item.solution_str, "ground_truth": item.ground_truth,
            "extra_info": dict(item.extra_info)}


class Judge:
    """Renders items into judge prompts, generates the answers in one engine call, parses."""

    def __init__(self, cfg: JudgeConfig, topology: Any, label: str = "") -> None:
        self.cfg, self.topology, self.label = cfg, topology, label
        self.engine: Any = None  # started by load
        self.tokenizer: Any = None
        self.children: Children | None = None  # parser = function: the user's parser runs here
        if cfg.parser == "function":
            R = topology.reward
            self.children = Children(
                [FunctionSpec(path=cfg.function_path, name=cfg.function_name)], size=1,
                timeout_s=R.timeout_s, memory_mb=R.memory_mb, cpu_s=R.cpu_s, limits_key="reward")
        self.processor: Any = None  # a vision-language judge's ImageProcessor (set by load)
        self.answers = 0  # answers generated
        self.unreadable = 0  # answers the parser could not read
        self.images_unseen = 0  # items with images a text-only judge read without them

    async def load(self, device: Any) -> None:
        """Start the judge's engine on ``device`` (a broken one fails the replica at start)."""
        from actors.runtime.devices import resolve_dtype
        from actors.sampler.engines.base import EngineSpec
        dtype = str(resolve_dtype("auto", device, self.topology.model.dtype))
        sampler = msgspec.structs.replace(
            self.topology.sampler, engine=self.cfg.engine, threads=self.cfg.threads,
            sleep_idle_s=self.cfg.sleep_idle_s if self.cfg.engine.sleeps else 0.0)
        self.engine = await self.cfg.engine.start(EngineSpec(
            Path(self.cfg.path), dtype.removeprefix("torch."), self.topology.run.seed,
            device, sampler, label=self.label))
        from actors.data.vision import ImageProcessor, is_vision_model

        self.processor = ImageProcessor(self.cfg.path) if is_vision_model(self.cfg.path) else None
        self.tokenizer = getattr(self.engine, "tokenizer", None)
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.path)

    @property
    def module(self) -> Any:
        """The engine's torch model, which sleeps as one (hf), or None (vllm sleeps itself)."""
        return getattr(self.engine, "model", None)

    def prompt_ids(self, item: ScoreItem) -> list[int]:
        from actors.data.chat import chat_ids
        from actors.data.vision import PLACEHOLDER
        from messages.rollout import ChatMessage

        text = self.cfg.template.format_map(judge_fields(item))
        if item.images and self.processor is not None:
            if PLACEHOLDER not in text:  # the template shows no prompt: the images go first
                text = PLACEHOLDER * len(item.images) + text
            return self.processor.prompt_ids([ChatMessage("user", text)], item.images)
        if self.tokenizer.chat_template:
            return chat_ids(self.tokenizer, [ChatMessage("user", text)])
        return list(self.tokenizer(text)["input_ids"])

    async def generate(self, items: list[ScoreItem]) -> list[str]:
        """The judge's answer to each item, generated together."""
        from actors.sampler.engines.base import GenerateRequest
        from messages.rollout import SamplingParams

        params = SamplingParams(temperature=self.cfg.temperature, max_tokens=self.cfg.max_tokens)
        vision = self.processor is not None
        requests = [GenerateRequest(self.prompt_ids(item), params,
                                    images=tuple(item.images) if vision else ())
                    for item in items]
        if not vision:
            self.images_unseen += sum(1 for item in items if item.images)
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
            return [Outcome(error=f"judge {self.cfg.name}: {type(exc).__name__}: {exc}"[:500])
                    ] * len(items)
        self.answers += len(answers)
        if self.children is not None:
            arguments = [parser_arguments(i, a) for i, a in zip(items, answers, strict=True)]
            outcomes = await self.children.call(Call(0, arguments, len(arguments)))
            outcomes = [Outcome(score=o.score * self.cfg.scale, extra=o.extra) if not o.error
                        else Outcome(error=f"judge {self.cfg.name}: parser function: {o.error} "
                                           f"(answer {a[:80]!r})", trace=o.trace)
                        for o, a in zip(outcomes, answers, strict=True)]
        else:
            outcomes = [read_answer(self.cfg, a) for a in answers]
        self.unreadable += sum(1 for o in outcomes if o.error)
        return outcomes

    def status(self) -> dict[str, Any]:
        """The judge's counts, and a vllm engine's own sleep (an hf one sleeps as a module)."""
        out: dict[str, Any] = {"judge_answers": self.answers, "judge_unreadable": self.unreadable,
                               "judge_images_unseen": self.images_unseen}
        if self.engine is not None and self.module is None and self.cfg.sleep_idle_s > 0:
            out.update(self.engine.sleep.clock.statistics().status())
        return out

    async def aclose(self) -> None:
        if self.children is not None:
            await self.children.aclose()
        if self.engine is not None:
            await self.engine.aclose()
