"""reasoning-gym generators as prompt sources, scored by their own ``score_answer``.

``[[task.datasets]] reasoning_gym = { name = "leg_counting", config = { ... } }`` (and the
same in ``[[validation.datasets]]``): row ``i`` is the generator's entry ``i`` for the seed
(``run.seed`` in training, ``run.seed + 1`` in validation: held out), its question the user
message under reasoning-gym's own default system prompt (answers in ``<answer>`` tags), its
answer the ground truth. The data source is ``reasoning_gym/NAME`` and each prompt carries its
generator's spec (name, config, size, seed) in ``extra_info``, so the reward worker rebuilds
the same generator and scores a reply as reasoning-gym does: the last ``<answer>`` tag's
content (its ``extract_answer``) through the generator's ``score_answer`` against the entry.

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
    return json.dumps({"name": source.name, "config": source.config, "size": source.size,
                       "seed": seed}, sort_keys=True)


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
        self.system_prompt = system_prompt or _library().utils.SYSTEM_PROMPTS["default"]

    def row(self, index: int) -> tuple[str, str, dict[str, Any]]:
        entry = self.dataset[index]
        return entry["question"], str(entry["answer"]), {SPEC: self.spec}


def score(data_source: str, solution_str: str, ground_truth: str,
          extra_info: dict[str, Any] | None = None, **_: Any) -> float:
    """reasoning-gym's own score of a reply: the last ``<answer>`` tag's content through the
    generator's ``score_answer`` against the prompt's entry (rebuilt from its spec)."""
    info = extra_info or {}
    if SPEC not in info:
        raise ValueError(f"data_source {data_source!r}: the prompt carries no reasoning-gym "
                         f"spec (extra_info[{SPEC!r}])")
    dataset = generator(str(info[SPEC]))
    entry = dataset[int(info["index"])]
    from reasoning_gym.utils import extract_answer

    return float(dataset.score_answer(answer=extract_answer(solution_str), entry=entry))


def answer(text: str, **_: Any) -> str | None:
    """The answer reasoning-gym reads in a reply (for majority votes)."""
    from reasoning_gym.utils import extract_answer

    return extract_answer(text)
