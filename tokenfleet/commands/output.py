"""The files the commands write for readers other than Python."""

from __future__ import annotations

import json
import math
from pathlib import Path


def write_json(path: Path, document: object) -> None:
    """``document`` as strict JSON (RFC 8259), indented. A figure that does not exist (NaN:
    a quantile of a class with no completions) or is unbounded is written as null: Python
    writes them as ``NaN`` and ``Infinity`` by default, which jq, JavaScript's
    ``JSON.parse`` and most other readers refuse."""
    path.write_text(json.dumps(_finite(document), indent=2, allow_nan=False) + "\n")


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value
