"""Model pools: reward models and LLM judges served as named pools behind the router.

``[[reward.pools]]`` adds one pool per entry: ``replicas`` worker processes, each holding the
pool's model (a sequence-classification reward model, or a generative judge reading a prompt
template and answering with a score a parser reads), registered with the router under the
pool's ``name``. The rule workers (``[reward]`` itself: built-ins and users' functions) are the
pool ``reward``; ``score_targets`` is the one place that decides which pools score a group and
with what weight, and the sampler sends each group to every one of them and adds the scores.

A pool's replicas are reward processes numbered after the rule workers (``reward-COUNT`` on:
``pool_replica``), so they are supervised, restarted, logged and shown like reward workers.
Torch-free: the runner and the config checks import it.
"""

from __future__ import annotations

import string
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
from actors.runtime.config.schema_base import _Section
from actors.sampler.engines.registry import ENGINES, FALLBACK, EngineName

RULES_POOL = "reward"  # the rule workers' pool
TEMPLATE_FIELDS = ("prompt", "response", "ground_truth", "data_source", "problem", "solution")
PARSERS = ("number", "score_tag", "boxed", "yes_no", "function")
DEFAULT_TEMPLATE = """You are given a problem and a proposed solution.

Problem:
{prompt}

Solution:
{response}

Please evaluate how well the solution addresses the problem. Give a score from 1 to 10, where
1 means the solution is completely irrelevant or incorrect, 5 means it is partially correct
and 10 means it is fully correct and well reasoned.

Only output the score as a single number (integer)."""


class PoolConfig(_Section, frozen=True):
    name: Annotated[str, matching(r"[A-Za-z0-9_.-]+",
                                  "is not a pool name (letters, digits, '_', '.' or '-')")]
    """The pool's name: the router's pool its replicas serve, and the key of its score in each
    result's ``extra`` (not ``reward``: that is the rule workers' pool)."""
    kind: Literal["reward_model", "judge"] = "reward_model"
    """reward_model: a sequence-classification checkpoint (one label; its logit is the score);
    judge: a causal LM that reads ``template`` and writes an answer ``parser`` reads."""
    path: FilePath = ""
    """The local Hugging Face directory of the pool's model."""
    replicas: PositiveInt = 1
    """Worker processes of this pool; the router balances requests between them."""
    device: Annotated[str, matching(r"cpu|cuda(:\d+)?", "is not cpu, cuda or cuda:N")] = "cpu"
    """cpu, or cuda:N (the runner's GPU N, shared with whatever else it places there: each
    process gets an equal memory share, as samplers sharing a GPU do)."""
    weight: Finite = 1.0
    """This pool's weight in a response's reward (the weighted sum over the scoring pools)."""
    capacity: PositiveInt = 8
    """Requests one replica takes at once; concurrent requests share forwards (batched)."""
    threads: PositiveInt = 1
    """torch intra-op threads of each replica."""
    batch_size: PositiveInt = 32
    """Most responses in one forward (reward_model) or one engine call (judge)."""
    max_length: PositiveInt = 1024
    """reward_model: tokens kept per sequence (the start is cut, so the response's end stays)."""
    reward_mean: Finite = 0.0
    """reward_model: the score is (logit - reward_mean) / reward_std."""
    reward_std: PositiveFinite = 1.0
    """reward_model: see reward_mean."""
    engine: EngineName = FALLBACK
    """judge: the generation engine (the sampler's engines, with their sections: vllm takes
    ``sampler.vllm``'s engine arguments)."""
    template: str = DEFAULT_TEMPLATE
    """judge: the user message it reads, with {prompt}, {response}, {ground_truth} and
    {data_source} filled in (verl's {problem} and {solution} work too); literal braces doubled."""
    parser: Literal["number", "score_tag", "boxed", "yes_no", "function"] = "number"
    """judge: how its answer becomes a score: number (the last number in it), score_tag (the
    last ``[[x]]``), boxed (the last ``\\boxed{x}``), yes_no (the last yes/no word: 1 or 0), or
    function (``function_path``'s function, run in a sandboxed child). An answer it cannot read
    is a recorded score error, never a silent 0."""
    function_path: FilePath = ""
    """judge, parser = function: a Python file whose ``function_name`` takes
    ``(judge_answer, data_source, solution_str, ground_truth, extra_info)`` and returns a score
    (float or dict(score=...)); raising is an unreadable answer."""
    function_name: PythonName = "parse_score"
    """judge, parser = function: the function's name in function_path."""
    scale: Finite = 1.0
    """judge: the score is the parsed value times this (0.1 turns a 1-10 rating into 0.1-1)."""
    max_tokens: PositiveInt = 64
    """judge: the most tokens of one answer."""
    temperature: NonNegFloat = 0.0
    """judge: sampling temperature of its answers (0: greedy)."""
    sleep_idle_s: NonNegFloat = 0.0
    """Put the model to sleep once its replica has had no request for this long, freeing its
    memory (a torch model's weights moved to host memory on a GPU, dropped and read again from
    ``path`` on a CPU; a vllm judge sleeps with vLLM's sleep level 1); it wakes for the next
    request (0: never sleeps)."""


def pool_replica(reward: Any, index: int) -> tuple[PoolConfig, int] | None:
    """The pool and replica number of reward process ``index`` (None: a rule worker)."""
    k = index - reward.count
    if k < 0:
        return None
    for pool in reward.pools:
        if k < pool.replicas:
            return pool, k
        k -= pool.replicas
    return None


def reward_processes(reward: Any) -> int:
    """Reward processes the runner starts: the rule workers, then every pool's replicas."""
    return reward.count + sum(p.replicas for p in reward.pools)


def pool_devices(reward: Any) -> dict[str, tuple[str, str]]:
    """``reward-I`` -> (its device's key, the device) of every pool replica."""
    out = {}
    for i in range(reward.count, reward_processes(reward)):
        pool, _ = pool_replica(reward, i)  # type: ignore[misc]
        out[f"reward-{i}"] = (f"reward.pools[{reward.pools.index(pool)}].device", pool.device)
    return out


def score_targets(reward: Any) -> tuple[tuple[str, float], ...]:
    """The pools that score every group, with their weights: the rule workers (weight 1)
    unless ``reward.rules`` is false, then each model pool in order. The one place this is
    decided: the sampler sends each group to these and adds the weighted scores."""
    rules = ((RULES_POOL, 1.0),) if reward.rules or not reward.pools else ()
    return rules + tuple((p.name, p.weight) for p in reward.pools)


def render(template: str, fields: dict[str, str]) -> str:
    """``template`` with its fields filled in (the names of ``TEMPLATE_FIELDS``)."""
    return template.format_map(fields)


def check_pools(topology: Any, need: Any) -> None:
    """``reward.pools`` and ``reward.rules``; ``need(ok, key, why)`` raises naming the key."""
    R = topology.reward
    names: set[str] = set()
    for i, p in enumerate(R.pools):
        key = f"reward.pools[{i}]"
        need(p.name != RULES_POOL, f"{key}.name", f"{RULES_POOL!r} is the rule workers' pool")
        need(p.name not in names, f"{key}.name", f"{p.name!r} names two pools")
        names.add(p.name)
        need(bool(p.path) and Path(p.path).is_dir(), f"{key}.path",
             f"{p.path!r} is not a model directory")
        if p.kind == "reward_model":
            need(p.engine == FALLBACK, f"{key}.engine", f"a reward_model runs on torch: {FALLBACK}")
            continue
        problem = template_problem(p.template)
        need(problem is None, f"{key}.template", str(problem))
        if p.parser == "function":
            need(Path(p.function_path).is_file(), f"{key}.function_path",
                 f"no file {p.function_path!r} (parser = function needs one)")
        else:
            need(not p.function_path, f"{key}.function_path", "only with parser = function")
        if ENGINES[p.engine].sleeps and p.sleep_idle_s > 0:
            need(p.device != "cpu", f"{key}.sleep_idle_s",
                 f"{p.engine} has no sleep mode on a CPU (device = cpu)")
    need(R.rules or bool(R.pools), "reward.rules",
         "false needs at least one [[reward.pools]] to score with")


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
