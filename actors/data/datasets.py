"""Prompts from dataset files, and several sources mixed by weight.

``[[task.datasets]]`` entries name a parquet or jsonl file in verl's row layout (``prompt`` = a
list of chat messages, ``data_source``, ``reward_model.ground_truth``, ``extra_info``; other
columns through ``prompt_key`` / ``answer_key``, e.g. a plain ``question``/``answer`` file) or a
built-in task, each with a weight.

Mixing is deterministic: the source of draw ``i`` is a function of ``(run.seed, i)`` alone (a
hash of both against the cumulative weights), and each source is read in order, so the row a
draw takes is the number of earlier draws of the same source. Both are recorded with every
prompt issued (``prompts.row``, ``prompts.dataset``); ``Mixture.index_after`` turns the recorded
``{dataset: next row}`` back into the next draw, which is all a resume needs. A file's rows are
visited in a seeded random order per pass (``shuffle``), a fresh order each pass.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from actors.data.files import DataFileError, PassOrder, jsonl_rows
from actors.data.tasks import TASKS, Task
from actors.data.vision import PLACEHOLDER, ImageError, check_images
from actors.runtime.config import DatasetConfig, TaskConfig
from messages.rollout import ChatMessage, Prompt

_MASK = (1 << 64) - 1


def uniform(seed: int, index: int) -> float:
    """A number in [0, 1) that depends on ``seed`` and ``index`` only (splitmix64 of both)."""
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


def _field(row: dict[str, Any], dotted: str) -> Any:
    """``row["a"]["b"]`` for ``"a.b"``; KeyError when any part is missing."""
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def _scalar(value: Any) -> str | int | float:
    """An extra_info value as the wire allows it (nested values become JSON text)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, str | int | float):
        return value
    return json.dumps(value, default=str)


class FileDataset(Task):
    """The rows of one parquet or jsonl file, read whole at start."""

    def __init__(self, config: DatasetConfig, seed: int, key: str) -> None:
        self.cfg = config
        self.seed = seed
        self.key = key  # the config key path, for errors
        self.name = config.label
        self.data_source = config.data_source
        self.system_prompt = config.system_prompt
        path = Path(config.path)
        if not path.is_file():
            raise ValueError(f"{key}.path: no file {config.path!r}")
        if path.suffix == ".parquet":
            self.table = pq.read_table(path)
            self.size = self.table.num_rows
            self.lines: list[dict[str, Any]] = []
        else:
            self.table = None
            try:
                self.lines = list(jsonl_rows(path))
            except DataFileError as exc:
                raise ValueError(f"{key}.path: {exc}") from None
            self.size = len(self.lines)
        if self.size == 0:
            raise ValueError(f"{key}.path: {path} holds no rows")
        self.folder = path.parent  # relative image paths are read from here
        columns = set(self.table.column_names) if self.table is not None else set(self.lines[0])
        self.image_key = config.image_key or next(
            (c for c in ("images", "image") if c in columns), "")
        self.file_row = PassOrder(self.size, self.cfg.shuffle, f"{self.seed}:{self.name}")
        """Which row of the file the dataset's ``row``-th draw reads."""

    def read(self, file_row: int) -> dict[str, Any]:
        if self.table is not None:
            return self.table.slice(file_row, 1).to_pylist()[0]
        return self.lines[file_row]

    def prompt_at(self, dataset: str, row: int, prompt_id: int) -> Prompt:
        if dataset != self.name:
            raise ValueError(f"dataset {self.name!r} is not {dataset!r}")
        at = self.file_row(row)
        data = self.read(at)
        where = f"{self.key} ({self.cfg.path} row {at})"
        try:
            raw = _field(data, self.cfg.prompt_key)
            truth = _field(data, self.cfg.answer_key)
        except KeyError as exc:
            raise ValueError(f"{where}: no field {exc.args[0]!r} (fields: {sorted(data)})") from None
        if isinstance(raw, str):
            messages = [ChatMessage("user", raw)]
        elif isinstance(raw, list) and raw and all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and _text(m.get("content")) is not None for m in raw):
            messages = [ChatMessage(m["role"], str(_text(m["content"]))) for m in raw]
        else:
            raise ValueError(f"{where}: {self.cfg.prompt_key} must be a string or a non-empty list "
                             f"of {{role, content}} messages, not {str(raw)[:80]!r}")
        if self.system_prompt and all(m.role != "system" for m in messages):
            messages.insert(0, ChatMessage("system", self.system_prompt))
        source = self.data_source or data.get("data_source")
        if not isinstance(source, str) or not source:
            raise ValueError(f"{where}: no data_source (set {self.key}.data_source)")
        extra = data.get("extra_info")
        extra_info: dict[str, str | int | float] = {
            "index": at, **{str(k): _scalar(v) for k, v in extra.items()}} \
            if isinstance(extra, dict) else {"index": at}
        images: list[bytes] = []
        if self.image_key:
            key = f"{where} column {self.image_key!r}"
            images = self.row_images(data.get(self.image_key), key)
            if images and not any(PLACEHOLDER in m.content for m in messages):
                messages = _images_first(messages, len(images))
            try:
                check_images(messages, images)
            except ImageError as exc:
                raise ValueError(f"{key}: {exc}") from None
        return Prompt(prompt_id=prompt_id, messages=messages, data_source=source,
                      ground_truth=truth if isinstance(truth, str) else json.dumps(truth),
                      extra_info=extra_info, images=images)

    def row_images(self, value: Any, key: str) -> list[bytes]:
        """A row's images as encoded bytes: ``value`` is one image or a list of them, each
        bytes, a ``{bytes, path}`` record (verl's and Hugging Face datasets' Image feature) or
        a path."""
        if value is None:
            return []
        items = value if isinstance(value, list) else [value]
        out = []
        for k, item in enumerate(items):
            if isinstance(item, dict):
                item = item.get("bytes") or item.get("path")
            if isinstance(item, bytes):
                out.append(item)
            elif isinstance(item, str) and item:
                path = Path(item) if Path(item).is_absolute() else self.folder / item
                if not path.is_file():
                    raise ValueError(f"{key}: image {k}: no file {item[:200]!r}")
                out.append(path.read_bytes())
            else:
                raise ValueError(f"{key}: image {k} is neither bytes, a {{bytes}} or {{path}} "
                                 f"record nor a path: {str(item)[:80]!r}")
        return out


def _text(content: Any) -> str | None:
    """A message's content as text: a string, or structured parts (TRL's conversational
    rows: ``{"type": "image"}`` parts become ``<image>`` placeholders); None for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        parts = [PLACEHOLDER if p.get("type") == "image" else p.get("text") for p in content]
        if all(isinstance(p, str) for p in parts):
            return "".join(str(p) for p in parts)
    return None


def _images_first(messages: list[ChatMessage], count: int) -> list[ChatMessage]:
    """The messages with ``count`` placeholders before the first user message's text (TRL puts
    a row's images there when its prompt does not place them)."""
    out, placed = [], False
    for m in messages:
        if m.role == "user" and not placed:
            m, placed = ChatMessage(m.role, PLACEHOLDER * count + m.content), True
        out.append(m)
    return out


class Mixture(Task):
    """Several datasets, draw ``i`` from source ``k`` with probability ``weight_k / Σ weights``."""

    def __init__(self, sources: list[Task], weights: list[float], seed: int) -> None:
        self.seed = seed
        self.sources = {s.name: s for s in sources}
        self.names = [s.name for s in sources]
        self.name = "+".join(self.names)
        self.size = sum(s.size for s in sources)
        total = float(sum(weights))
        self.cumulative = [sum(weights[: k + 1]) / total for k in range(len(weights))]
        # draws are located in order; this cursor makes that O(1) per draw:
        # counts[k] = draws of source k among draws [0, cursor)
        self._cursor = 0
        self._counts = [0] * len(sources)

    def source_of(self, index: int) -> int:
        """The source of draw ``index`` (a function of the seed and ``index`` only)."""
        return min(bisect.bisect_right(self.cumulative, uniform(self.seed, index)),
                   len(self.cumulative) - 1)

    def locate(self, index: int) -> tuple[str, int]:
        if index < self._cursor:
            self._cursor, self._counts = 0, [0] * len(self.names)
        while self._cursor < index:
            self._counts[self.source_of(self._cursor)] += 1
            self._cursor += 1
        k = self.source_of(index)
        return self.names[k], self._counts[k]

    def prompt_at(self, dataset: str, row: int, prompt_id: int) -> Prompt:
        if dataset not in self.sources:
            raise ValueError(f"no dataset {dataset!r} in task.datasets ({', '.join(self.names)})")
        return self.sources[dataset].prompt_at(dataset, row, prompt_id)

    def index_after(self, next_rows: dict[str, int]) -> int:
        unknown = set(next_rows) - set(self.sources)
        if unknown:
            raise ValueError(f"no dataset {sorted(unknown)} in task.datasets ({', '.join(self.names)})")
        want = [next_rows.get(name, 0) for name in self.names]
        counts = [0] * len(self.names)
        index = 0
        while any(c < w for c, w in zip(counts, want, strict=True)):
            counts[self.source_of(index)] += 1
            index += 1
        return index


def make_mixture(config: TaskConfig, seed: int) -> Mixture:
    """The sources of ``config.datasets`` (validated by the config) mixed by their weights."""
    sources: list[Task] = []
    for i, d in enumerate(config.datasets):
        source: Task
        if d.builtin:
            source = TASKS[d.builtin](config, seed)
            source.name = d.label
        elif d.reasoning_gym is not None:
            from actors.data.reasoning_gym import ReasoningGymTask

            source = ReasoningGymTask(d.reasoning_gym, seed, d.label, f"task.datasets[{i}]",
                                      d.system_prompt)
        elif d.verifiers is not None:
            from actors.data.verifiers_env import VerifiersTask

            source = VerifiersTask(d, seed, f"task.datasets[{i}]")
        else:
            source = FileDataset(d, seed, f"task.datasets[{i}]")
        sources.append(source)
    return Mixture(sources, [d.weight for d in config.datasets], seed)
