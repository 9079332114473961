"""The router's pools that score a group, as the reward section declares them.

The rule workers (``[reward]`` itself: built-ins and users' functions) are the pool ``reward``.
Each ``[[reward.models]]`` entry is a served model, a pool of its own under its ``name``:
``replicas`` worker processes, each holding the model. ``ServedModel`` holds what every kind of
served model has; each kind's own options are its Struct beside its code (a one-label reward
model: ``actors/scoring/reward_model.py``; an LLM judge: ``actors/scoring/judge.py``), the kinds
a tagged union on ``kind`` (``RewardConfig.models``). ``score_targets`` is the one place that
decides which pools score a group and with what weight; the sampler sends each group to every
one of them and adds the scores.

A served model's replicas are reward processes numbered after the rule workers (``reward-COUNT``
on: ``model_replica``), so they are supervised, restarted, logged and shown like reward workers.
Torch-free: the runner and the config checks import it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from actors.runtime.config.constraints import (
    FilePath,
    Finite,
    NonNegFloat,
    PositiveInt,
    matching,
)
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

    def scorer(self, topology: Any, label: str) -> Any:
        """What a replica scores with (``actors/scoring/served.py`` loads and batches it)."""
        raise NotImplementedError


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
        out[f"reward-{i}"] = (f"reward.models[{reward.models.index(model)}].device", model.device)
    return out


def score_targets(reward: Any) -> tuple[tuple[str, float], ...]:
    """The pools that score every group, with their weights: the rule workers (weight 1)
    unless ``reward.rules`` is false, then each served model in order. The one place this is
    decided: the sampler sends each group to these and adds the weighted scores."""
    rules = ((RULES_POOL, 1.0),) if reward.rules or not reward.models else ()
    return rules + tuple((m.name, m.weight) for m in reward.models)


def check_models(topology: Any) -> None:
    """``reward.models`` and ``reward.rules``; ``need(ok, key, why)`` raises naming the key."""
    R = topology.reward
    names: set[str] = set()
    for i, m in enumerate(R.models):
        key = f"reward.models[{i}]"
        need(m.name != RULES_POOL, f"{key}.name", f"{RULES_POOL!r} is the rule workers' pool")
        need(m.name not in names, f"{key}.name", f"{m.name!r} names two pools")
        names.add(m.name)
        need(bool(m.path) and Path(m.path).is_dir(), f"{key}.path",
             f"{m.path!r} is not a model directory")
        m.check(key)
    need(R.rules or bool(R.models), "reward.rules",
         "false needs at least one [[reward.models]] to score with")
