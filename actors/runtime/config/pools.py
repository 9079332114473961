"""The router's pools that score a group, as the reward section declares them.

The rule workers (``[reward]`` itself: built-ins and users' functions) are the pool ``reward``.
Each ``[[reward.models]]`` entry is a served model, a pool of its own under its ``name``:
``replicas`` worker processes, each holding the model. ``ServedModel`` holds what every kind of
served model has; each kind's own options and checks are its Struct here (``RewardModelConfig``,
``JudgeConfig``), the kinds a tagged union on ``kind`` (``RewardConfig.models``); what scores with
each is its module in ``actors/scoring`` (``reward_model.py``, ``judge.py``), chosen by
``actors/scoring/served.py``. ``score_targets`` is the one place that
decides which pools score a group and with what weight; the sampler sends each group to every
one of them and adds the scores.

A served model's replicas are reward processes numbered after the rule workers (``reward-COUNT``
on: ``model_replica``), so they are supervised, restarted, logged and shown like reward workers.
Torch-free: the runner and the config checks import it.
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from actors.runtime.config.constraints import (
    FilePath,
    Finite,
    NonNegFloat,
    PositiveFinite,
    PositiveInt,
    PythonName,
    matching,
)
from actors.runtime.config.engines import HFOptions, ServedEngine
from actors.runtime.config.names import ProcessName
from actors.runtime.config.schema_base import _Section, need

RULES_POOL = "reward"  # the rule workers' pool


class ServedModel(_Section, frozen=True, tag_field="kind"):
    """What every ``[[reward.models]]`` entry has; ``kind`` picks the entry's Struct."""

    name: Annotated[str, matching(r"[A-Za-z0-9_.-]+",
                                  "is not a pool name (letters, digits, '_', '.' or '-')")]
    """The model's pool: the router's pool its replicas serve, and the key of its score in each
    result's ``extra`` (not ``reward``: that is the rule workers' pool)."""
    path: FilePath = ""
    """The local Hugging Face directory of the model."""
    replicas: PositiveInt = 1
    """Worker processes serving this model; the router balances requests between them."""
    device: Annotated[str, matching(r"cpu|cuda(:\d+)?", "is not cpu, cuda or cuda:N")] = "cpu"
    """cpu, or cuda:N (the runner's GPU N, shared with whatever else it places there: each
    process gets an equal memory share, as samplers sharing a GPU do)."""
    weight: Finite = 1.0
    """This model's weight in a response's reward (the weighted sum over the scoring pools)."""
    capacity: PositiveInt = 8
    """Requests one replica takes at once; concurrent requests share forwards (batched)."""
    threads: PositiveInt = 1
    """torch intra-op threads of each replica."""
    batch_size: PositiveInt = 32
    """Most responses in one forward (reward_model) or one engine call (judge)."""
    sleep_idle_s: NonNegFloat = 0.0
    """Put the model to sleep once its replica has had no request for this long, freeing its
    memory (a torch model's weights moved to host memory on a GPU, dropped and read again from
    ``path`` on a CPU; a vllm judge sleeps with vLLM's sleep level 1); it wakes for the next
    request (0: never sleeps)."""

    @property
    def kind(self) -> str:
        """The entry's kind (its tag): what a replica's status names its model."""
        return str(self.__struct_config__.tag)

    def check(self, key: str) -> None:
        """The kind's own checks across its keys or of the world (``key``: the entry's path)."""


# kind = "reward_model"

class RewardModelConfig(ServedModel, frozen=True, tag="reward_model"):
    """A one-label ...ForSequenceClassification checkpoint: its logit is the score."""

    max_length: PositiveInt = 1024
    """Tokens kept per sequence (the start is cut, so the response's end stays)."""
    reward_mean: Finite = 0.0
    """The score is (logit - reward_mean) / reward_std."""
    reward_std: PositiveFinite = 1.0
    """See reward_mean."""

    def check(self, key: str) -> None:
        problem = checkpoint_problem(Path(self.path))
        need(problem is None, f"{key}.path", str(problem))


def checkpoint_problem(path: Path) -> str | None:
    """What keeps ``path`` from being a one-label sequence-classification checkpoint (read from
    its config.json, so the check needs no torch), or None."""
    config = path / "config.json"
    if not config.is_file():
        return f"{str(path)!r} is not a Hugging Face model directory (no config.json)"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        return f"{config} is not readable JSON: {exc}"
    architectures = data.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return (f"{str(path)!r} holds {', '.join(map(str, architectures)) or 'no architecture'}, "
                "not a ...ForSequenceClassification reward model")
    labels = len(data.get("id2label") or {}) or data.get("num_labels", 2)
    if labels != 1:
        return f"{str(path)!r} has {labels} labels; a reward model has one (its logit is the score)"
    return None


# kind = "judge"

TEMPLATE_FIELDS = ("prompt", "response", "ground_truth", "data_source", "problem", "solution")
DEFAULT_TEMPLATE = """You are given a problem and a proposed solution.

Problem:
{prompt}

Solution:
{response}

Please evaluate how well the solution addresses the problem. Give a score from 1 to 10, where
1 means the solution is completely irrelevant or incorrect, 5 means it is partially correct
and 10 means it is fully correct and well reasoned.

Only output the score as a single number (integer)."""


class JudgeConfig(ServedModel, frozen=True, tag="judge"):
    """A causal LM that reads ``template`` and writes an answer ``parser`` reads."""

    engine: ServedEngine = HFOptions()
    """The generation engine, by name, with its own options (the sampler's engines:
    ``engine = "vllm"``, or ``engine = {name = "vllm", max_model_len = 4096}``)."""
    template: str = DEFAULT_TEMPLATE
    """The user message it reads, with {prompt}, {response}, {ground_truth} and {data_source}
    filled in (verl's {problem} and {solution} work too); literal braces doubled."""
    parser: Literal["number", "score_tag", "boxed", "yes_no", "function"] = "number"
    """How its answer becomes a score: number (the last number in it), score_tag (the last
    ``[[x]]``), boxed (the last ``\\boxed{x}``), yes_no (the last yes/no word: 1 or 0), or
    function (``function_path``'s function, run in a sandboxed child). An answer it cannot read
    is a recorded score error, never a silent 0."""
    function_path: FilePath = ""
    """parser = function: a Python file whose ``function_name`` takes
    ``(judge_answer, data_source, solution_str, ground_truth, extra_info)`` and returns a score
    (float or dict(score=...)); raising is an unreadable answer."""
    function_name: PythonName = "parse_score"
    """parser = function: the function's name in function_path."""
    scale: Finite = 1.0
    """The score is the parsed value times this (0.1 turns a 1-10 rating into 0.1-1)."""
    max_tokens: PositiveInt = 64
    """The most tokens of one answer."""
    temperature: NonNegFloat = 0.0
    """Sampling temperature of its answers (0: greedy)."""

    def check(self, key: str) -> None:
        problem = template_problem(self.template)
        need(problem is None, f"{key}.template", str(problem))
        if self.parser == "function":
            need(Path(self.function_path).is_file(), f"{key}.function_path",
                 f"no file {self.function_path!r} (parser = function needs one)")
        else:
            need(not self.function_path, f"{key}.function_path", "only with parser = function")
        if self.engine.sleeps and self.sleep_idle_s > 0:
            need(self.device != "cpu", f"{key}.sleep_idle_s",
                 f"{self.engine.name} has no sleep mode on a CPU (device = cpu)")


def template_problem(template: str) -> str | None:
    """Why ``template`` cannot be filled in (an unknown field, a stray brace), or None."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        return f"{exc} (literal braces are written {{{{ and }}}})"
    unknown = [f for f in fields if f not in TEMPLATE_FIELDS]
    if unknown:
        return f"unknown field {{{unknown[0]}}}: the fields are {', '.join(TEMPLATE_FIELDS)}"
    if not fields:
        return "names no field: the judge would not see the response ({response})"
    return None


def model_replica(reward: Any, index: int) -> tuple[ServedModel, int] | None:
    """The served model and replica number of reward process ``index`` (None: a rule worker)."""
    k = index - reward.count
    if k < 0:
        return None
    for model in reward.models:
        if k < model.replicas:
            return model, k
        k -= model.replicas
    return None


def reward_processes(reward: Any) -> int:
    """Reward processes the runner starts: the rule workers, then every model's replicas."""
    return reward.count + sum(m.replicas for m in reward.models)


def served_devices(reward: Any) -> dict[str, tuple[str, str]]:
    """``reward-I`` -> (its device's key, the device) of every served model's replica."""
    out = {}
    for i in range(reward.count, reward_processes(reward)):
        model, _ = model_replica(reward, i)  # type: ignore[misc]
        key = f"reward.models[{reward.models.index(model)}].device"
        out[str(ProcessName("reward", i))] = (key, model.device)
    return out


def score_targets(reward: Any) -> tuple[tuple[str, float], ...]:
    """The pools that score every group, with their weights: the rule workers (weight 1)
    unless ``reward.rules`` is false, then each served model in order. The one place this is
    decided: the sampler sends each group to these and adds the weighted scores."""
    rules = ((RULES_POOL, 1.0),) if reward.rules or not reward.models else ()
    return rules + tuple((m.name, m.weight) for m in reward.models)


def check_models(models: Sequence[ServedModel]) -> None:
    """The pools' names of ``reward.models`` (``RewardConfig`` checks them as it is decoded);
    ``need(ok, key, why)`` raises naming the key within the section."""
    names: set[str] = set()
    for i, m in enumerate(models):
        need(m.name != RULES_POOL, f"models[{i}].name", f"{RULES_POOL!r} is the rule workers' pool")
        need(m.name not in names, f"models[{i}].name", f"{m.name!r} names two pools")
        names.add(m.name)


def check_served(topology: Any) -> None:
    """What ``reward.models`` name in the world: each model's directory, and its kind's own
    checks (a judge's template and parser file, a reward model's checkpoint)."""
    for i, m in enumerate(topology.reward.models):
        key = f"reward.models[{i}]"
        need(bool(m.path) and Path(m.path).is_dir(), f"{key}.path",
             f"{m.path!r} is not a model directory")
        m.check(key)
