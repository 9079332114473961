"""Reading dataset files row by row (jsonl here; parquet through pyarrow where it is read)."""

from __future__ import annotations

import json
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
