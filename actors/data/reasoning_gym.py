"""reasoning-gym generators as prompt sources, scored by their own ``score_answer``.

``[[task.datasets]] reasoning_gym = { name = "leg_counting", config = { ... } }`` (and the
same in ``[[validation.datasets]]``): row ``i`` is the generator's entry ``i`` for the seed
(``run.seed`` in training, ``run.seed + 1`` in validation: held out), its question the user
message under reasoning-gym's own default system prompt (answers in ``<answer>`` tags), its
answer the ground truth. The data source is ``reasoning_gym/NAME`` and each prompt carries its
generator's spec (name, config, size, seed) in ``extra_info``, so the reward worker rebuilds
the same generator and scores a reply as reasoning-gym does: the last ``<answer>`` tag's
content (its ``extract_answer``) through the generator's ``score_answer`` against the entry.
With ``answer = "reply"`` the whole reply, stripped, is the answer instead, under a system
prompt asking for the answer alone (the spec then carries ``answer``, so the scorer reads it
the same way).

reasoning-gym is an optional extra (``pip install 'flowrl[envs]'``), imported only when a
topology names a generator.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from actors.data.tasks import Task
from actors.runtime.config import ReasoningGymSource

INSTALL = "pip install 'flowrl[envs]' (reasoning-gym==0.1.25)"
PREFIX = "reasoning_gym/"  # the data sources of its prompts
REPLY_PROMPT = "Reply with the answer alone."  # the system prompt of answer = "reply"
SPEC = "reasoning_gym"  # the extra_info key of a prompt's generator spec


def _library() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"reasoning-gym is not installed: {INSTALL}") from None
    return reasoning_gym


@functools.lru_cache(maxsize=32)
def generator(spec: str) -> Any:
    """The reasoning-gym dataset of a spec (JSON: name, config, size, seed), made once per
    process. ValueError names what is wrong: the package, the name or an option."""
    rg = _library()
    fields = json.loads(spec)
    from reasoning_gym.factory import DATASETS

    if fields["name"] not in DATASETS:
        raise ValueError(f"no reasoning-gym dataset {fields['name']!r} (it has "
                         f"{len(DATASETS)}: {', '.join(sorted(DATASETS)[:12])}, ...)")
    try:
        return rg.create_dataset(fields["name"], size=fields["size"], seed=fields["seed"],
                                 **fields["config"])
    except (TypeError, ValueError, AssertionError) as exc:
        raise ValueError(f"reasoning-gym dataset {fields['name']!r} refused its config "
                         f"{fields['config']}: {exc}") from None


def spec_of(source: ReasoningGymSource, seed: int) -> str:
    fields = {"name": source.name, "config": source.config, "size": source.size, "seed": seed}
    if source.answer != "tags":  # (the tags' specs as they were: recorded runs resume on them)
        fields["answer"] = source.answer
    return json.dumps(fields, sort_keys=True)


def read_answer(text: str, spec: str | None) -> str | None:
    """The answer a reply gives under its prompt's spec: the whole reply stripped for
    ``answer = "reply"``, else the last ``<answer>`` tag's content (reasoning-gym's own)."""
    if spec is not None and json.loads(spec).get("answer") == "reply":
        return text.strip()
    from reasoning_gym.utils import extract_answer

    return extract_answer(text)


class ReasoningGymTask(Task):
    """The rows of one reasoning-gym generator."""

    def __init__(self, source: ReasoningGymSource, seed: int, label: str, key: str,
                 system_prompt: str = "") -> None:
        self.seed = seed
        self.size = source.size
        self.name = label
        self.data_source = PREFIX + source.name
        self.spec = spec_of(source, seed)
        try:
            self.dataset = generator(self.spec)
        except ValueError as exc:
            raise ValueError(f"{key}.reasoning_gym: {exc}") from None
        self.system_prompt = system_prompt or (REPLY_PROMPT if source.answer == "reply" else
                                               _library().utils.SYSTEM_PROMPTS["default"])

    def row(self, index: int) -> tuple[str, str, dict[str, Any]]:
        entry = self.dataset[index]
        return entry["question"], str(entry["answer"]), {SPEC: self.spec}


def score(data_source: str, solution_str: str, ground_truth: str,
          extra_info: dict[str, Any] | None = None, **_: Any) -> float:
    """reasoning-gym's own score of a reply: its answer (``read_answer``) through the
    generator's ``score_answer`` against the prompt's entry (rebuilt from its spec)."""
    info = extra_info or {}
    if SPEC not in info:
        raise ValueError(f"data_source {data_source!r}: the prompt carries no reasoning-gym "
                         f"spec (extra_info[{SPEC!r}])")
    spec = str(info[SPEC])
    dataset = generator(spec)
    entry = dataset[int(info["index"])]
    return float(dataset.score_answer(answer=read_answer(solution_str, spec), entry=entry))


def answer(text: str, extra_info: dict[str, Any] | None = None, **_: Any) -> str | None:
    """The answer a reply gives (for majority votes), read as its prompt's spec says."""
    spec = (extra_info or {}).get(SPEC)
    return read_answer(text, None if spec is None else str(spec))
