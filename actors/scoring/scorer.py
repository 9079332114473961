"""``Scoring``: what the reward worker calls to turn ``ScoreItem``s into ``ScoreResult``s.

With ``[[reward.functions]]`` configured, every item is scored by every function and the
scores are summed with their weights; without, each item goes to the built-in named by its
``data_source`` (verl's default data sources included). Built-in rules run on a worker thread;
user functions and math-verify run in sandboxed children. An item any function failed on scores
0.0 with the errors joined in ``ScoreResult.error``; the rest may get DAPO's overlong penalty.
(A reward model is a served model, not a function: ``actors/scoring/served.py``.)
``score`` never raises for a scorer's fault and never blocks the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec

from actors.runtime.config import RewardConfig, RewardFunction, Topology
from actors.sandbox.children import Children
from actors.sandbox.protocol import Call, FunctionSpec, Outcome, run_call
from actors.scoring.items import ScoreItem, verl_arguments
from actors.scoring.rules import (
    BUILTINS,
    IN_CHILD,
    PRELOAD,
    extract_answer,
    overlong_penalty,
    scorer_of,
)
from messages.reward import ScoreResult


@dataclass(frozen=True)
class ScoringStatistics:
    items: int
    """Items scored since start."""
    errors: int
    """Items whose score is a failure score (0.0 with an error)."""
    timeouts: int
    """Child calls killed at reward.timeout_s."""
    crashes: int
    """Child calls whose process died (segfault, exit, signal)."""
    children: int
    """Scoring child processes alive now."""
    children_started: int
    """Scoring child processes started (replacements included)."""


@dataclass(frozen=True)
class _Component:
    label: str  # names this function's score in ScoreResult.extra
    weight: float
    spec: FunctionSpec
    child_index: int  # index into the children's functions, or -1: runs on a worker thread


def builtin_spec(name: str, **fields) -> FunctionSpec:
    """The sandbox's handle on built-in rule ``name`` (actors/scoring/rules.py)."""
    return FunctionSpec(module="actors.scoring.rules", name=name,
                        preload=PRELOAD.get(name, ()), **fields)


def _label(fn: RewardFunction) -> str:
    return fn.builtin or f"{Path(fn.path).stem}.{fn.name}"


def job_rules(topology: Topology) -> frozenset[str]:
    """The child built-ins whose libraries a job's prompts may call for: ``math`` (a file's rows
    name their own data source), and ``reasoning_gym`` and ``verifiers`` only where a dataset
    is one of theirs. A scoring child imports these at its start; the others only if called
    (verifiers' import alone takes seconds, paid again by every restarted child)."""
    datasets = [*topology.task.datasets, *topology.validation.datasets]
    return frozenset({"math"} | {name for name in ("reasoning_gym", "verifiers")
                                 for d in datasets if getattr(d, name) is not None})


class Scoring:
    """Scores items as ``cfg`` says; ``rules``: the child built-ins whose libraries a child
    imports at its start when ``cfg`` lists no functions (``job_rules``)."""

    def __init__(self, cfg: RewardConfig, rules: frozenset[str] = IN_CHILD) -> None:
        self.cfg = cfg
        child_specs: list[FunctionSpec] = []
        self._components: list[_Component] = []
        labels: set[str] = set()
        for i, fn in enumerate(cfg.functions):
            spec = (builtin_spec(fn.builtin, kwargs=dict(fn.kwargs)) if fn.builtin else
                    FunctionSpec(path=str(Path(fn.path).resolve()), name=fn.name, batch=fn.batch,
                                 kwargs=dict(fn.kwargs)))
            in_child = not fn.builtin or fn.builtin in IN_CHILD
            label = _label(fn) if _label(fn) not in labels else f"{_label(fn)}#{i}"
            labels.add(label)
            self._components.append(_Component(label, fn.weight, spec,
                                               len(child_specs) if in_child else -1))
            if in_child:
                child_specs.append(spec)
        self._by_source_child: dict[str, int] = {}  # default mode: child built-in -> function index
        if not cfg.functions:
            for name in sorted(IN_CHILD):
                self._by_source_child[name] = len(child_specs)
                child_specs.append(builtin_spec(name) if name in rules else
                                   FunctionSpec(module="actors.scoring.rules", name=name))
        self.children = Children(child_specs, size=cfg.processes, timeout_s=cfg.timeout_s,
                              memory_mb=cfg.memory_mb, cpu_s=cfg.cpu_s, limits_key="reward")
        self._items = self._errors = 0

    def statistics(self) -> ScoringStatistics:
        c = self.children.statistics()
        return ScoringStatistics(self._items, self._errors, c.timeouts, c.crashes, c.children,
                                 c.started)

    async def load(self) -> None:
        """Nothing to load: the rules' children start on their first call."""

    async def aclose(self) -> None:
        await self.children.aclose()

    async def score(self, items: list[ScoreItem],
                    max_response_length: int = 0) -> list[ScoreResult]:
        """One result per item, in order. ``max_response_length`` is the overlong penalty's
        L_max when ``reward.max_response_length`` is 0 (the request's: the sampler's budget)."""
        if self._components:
            per_function = [[Outcome()] * len(items) for _ in self._components]

            async def run(k: int) -> None:
                c = self._components[k]
                per_function[k] = await self._run(c.spec, c.child_index, items)

            async with anyio.create_task_group() as tg:
                for k in range(len(self._components)):
                    tg.start_soon(run, k)
            results = [self._combine([per_function[k][i] for k in range(len(self._components))])
                       for i in range(len(items))]
        else:
            results = [ScoreResult(o.score, o.error, o.extra, o.answer, o.trace)
                       for o in await self._by_source(items)]
        max_length = self.cfg.max_response_length or max_response_length
        for item, result in zip(items, results, strict=True):
            if result.error:
                result.score, result.extra = 0.0, {}
            elif self.cfg.overlong_buffer_len and item.response_length and max_length:
                penalty = overlong_penalty(item.response_length, max_length,
                                           self.cfg.overlong_buffer_len,
                                           self.cfg.overlong_penalty_factor)
                result.score += penalty
                result.extra = {**result.extra, "overlong_penalty": penalty}
        self._items += len(items)
        self._errors += sum(1 for r in results if r.error)
        return results

    def _combine(self, outcomes: list[Outcome]) -> ScoreResult:
        errors = [f"{c.label}: {o.error}" for c, o in zip(self._components, outcomes, strict=True)
                  if o.error]
        if errors:
            trace = next((o.trace for o in outcomes if o.trace), "")
            return ScoreResult(0.0, error="; ".join(errors), trace=trace)
        total = sum(c.weight * o.score for c, o in zip(self._components, outcomes, strict=True))
        answer = next((o.answer for o in outcomes if o.answer), "")  # the first function's
        if len(self._components) == 1:
            return ScoreResult(total, extra=outcomes[0].extra, answer=answer)
        extra: dict[str, float] = {}
        for c, o in zip(self._components, outcomes, strict=True):
            extra[c.label] = o.score
            extra.update({f"{c.label}/{k}": v for k, v in o.extra.items()})
        return ScoreResult(total, extra=extra, answer=answer)

    async def _run(self, spec: FunctionSpec, child_index: int,
                   items: list[ScoreItem]) -> list[Outcome]:
        """One function over the items (a built-in's outcomes carry the answer it read)."""
        outcomes = await self._call(spec, child_index, items)
        if spec.module == "actors.scoring.rules":
            outcomes = [o if o.error or o.answer else msgspec.structs.replace(
                o, answer=extract_answer(spec.name, item.solution_str, **spec.kwargs,
                                         extra_info=item.extra_info))
                for item, o in zip(items, outcomes, strict=True)]
        return outcomes

    async def _call(self, spec: FunctionSpec, child_index: int,
                    items: list[ScoreItem]) -> list[Outcome]:
        """One function over the items: on a thread, or in children (one call per item, or
        one call for all when batch)."""
        if not items:
            return []
        if child_index < 0:
            return await anyio.to_thread.run_sync(
                run_call, BUILTINS[spec.name], spec,
                Call(-1, verl_arguments(items, batch=False), len(items)))
        if spec.batch:
            return await self.children.call(Call(child_index, verl_arguments(items, batch=True),
                                             len(items)))
        outcomes = [Outcome()] * len(items)

        async def one(i: int) -> None:
            (outcomes[i],) = await self.children.call(
                Call(child_index, verl_arguments(items[i:i + 1], batch=False), 1))

        async with anyio.create_task_group() as tg:
            for i in range(len(items)):
                tg.start_soon(one, i)
        return outcomes

    async def _by_source(self, items: list[ScoreItem]) -> list[Outcome]:
        """Default mode: each item by the built-in its data_source names."""
        outcomes = [Outcome()] * len(items)
        groups: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            name = scorer_of(item.data_source)
            if name is None:
                outcomes[i] = Outcome(error=f"no scorer for data_source {item.data_source!r} "
                                            "(configure [[reward.functions]])")
            else:
                groups.setdefault(name, []).append(i)

        async def group(name: str, indices: list[int]) -> None:
            scored = await self._run(builtin_spec(name), self._by_source_child.get(name, -1),
                                     [items[i] for i in indices])
            for i, outcome in zip(indices, scored, strict=True):
                outcomes[i] = outcome

        async with anyio.create_task_group() as tg:
            for name, indices in groups.items():
                tg.start_soon(group, name, indices)
        return outcomes
