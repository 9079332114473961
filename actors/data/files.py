"""Reading dataset files row by row (jsonl here; parquet through pyarrow where it is read)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class DataFileError(ValueError):
    """A dataset file that cannot be read; the message names the file and the line."""


def jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a jsonl file, one JSON object per non-blank line; a line that is not one is
    a ``DataFileError`` naming the file and the line."""
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataFileError(f"{path}: line {n} is not JSON: {exc}") from None
                if not isinstance(row, dict):
                    raise DataFileError(f"{path}: line {n} is not a JSON object")
                yield row


class PassOrder:
    """Which of a dataset's ``size`` items its ``row``-th draw takes: in order, or, with
    ``shuffle``, each pass over them in an order of its own, drawn from ``seed`` and the pass's
    number (so a resumed or rerun job draws the same)."""

    def __init__(self, size: int, shuffle: bool, seed: str) -> None:
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self._order: tuple[int, list[int]] = (-1, [])  # (pass, item order of that pass)

    def __call__(self, row: int) -> int:
        epoch, i = divmod(row, self.size)
        if not self.shuffle:
            return i
        if self._order[0] != epoch:
            order = list(range(self.size))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1][i]
