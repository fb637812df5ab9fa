"""Loaders of the public traces the repository carries in ``sim/data/traces`` (its README
gives each source, licence and paper to cite; ``SHA256SUMS`` their checksums)."""

from __future__ import annotations

import csv
import itertools
import json
import os
import random
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from sim.labels import LABEL_RULES, finite_number
from sim.workload import ENGINE_BLOCK_TOKENS, TraceRequest

T = TypeVar("T")

MOONCAKE_BLOCK_TOKENS = 512
MOONCAKE_BUCKET_S = 3.0
_MASK64 = (1 << 64) - 1


def traces_dir() -> Path:
    """``$TOKENFLEET_TRACES``, else the traces this repository carries."""
    configured = os.environ.get("TOKENFLEET_TRACES")
    if configured:
        return Path(configured)
    return Path(__file__).resolve().parent / "data" / "traces"


def load_mooncake(
    path: Path | None = None,
    *,
    limit: int | None = None,
    seed: int = 0,
    bucket_s: float = MOONCAKE_BUCKET_S,
) -> list[TraceRequest]:
    """The Mooncake FAST'25 conversation trace (Qin et al., USENIX FAST 2025), or a file in
    its format.

    The published trace's timestamps come in 3 s buckets; each request is placed uniformly
    at random (seeded) inside its ``bucket_s`` bucket so arrivals are smooth. ``bucket_s``
    0 replays the timestamps as given (a file whose timestamps are exact). Each 512-token
    ``hash_id`` becomes 32 engine blocks of 16 tokens with derived hashes; only full engine
    blocks get one.
    """
    path = path or traces_dir() / "mooncake_fast25" / "conversation_trace.jsonl"
    rng = random.Random(seed)
    requests = []
    for index, line, row in _mooncake_rows(path, limit):
        _check_mooncake_row(row, path, line)
        arrival = row["timestamp"] / 1000.0
        if bucket_s:
            arrival += rng.uniform(0.0, bucket_s)
        requests.append(
            TraceRequest(
                request_id=f"mooncake-{index}",
                arrival_s=arrival,
                input_tokens=row["input_length"],
                output_tokens=row["output_length"],
                prefix_blocks=engine_blocks(row["hash_ids"], row["input_length"]),
            )
        )
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def _mooncake_rows(path: Path, limit: int | None) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """Each row of a file in Mooncake's format, numbered from 0, with its line's number
    (from 1; blank lines hold no row); ValueError naming the file and line of one that is
    not a JSON object."""
    rows = 0
    with path.open(encoding="utf-8") as lines:
        try:
            for number, line in enumerate(lines, start=1):
                if limit is not None and rows >= limit:
                    break
                if not line.strip():  # a blank line (an editor's, at the end) holds no row
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{path} line {number}: not JSON ({exc})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path} line {number}: not a JSON object")
                yield rows, number, row
                rows += 1
        except UnicodeDecodeError as exc:  # met while reading ahead, so no line to name
            raise ValueError(f"{path}: not UTF-8 text ({exc.reason})") from None


def _moment(value: object) -> bool:
    return finite_number(value) and value >= 0


def _count(value: object) -> bool:
    return finite_number(value) and isinstance(value, int) and value >= 1


def _hash_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(h, int) and not isinstance(h, bool) for h in value
    )


_MOONCAKE_FIELDS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "timestamp": ("a finite number of milliseconds, 0 or more", _moment),
    "input_length": ("a whole number, 1 or more", _count),
    "output_length": ("a whole number, 1 or more (vLLM refuses max_tokens 0)", _count),
    "hash_ids": ("a list of integers", _hash_ids),
}


def _check_mooncake_row(row: dict[str, Any], path: Path, line: int) -> None:
    """ValueError naming the file, line and field of a row ``load_mooncake`` cannot read,
    or whose labels (``sim.labels.LABEL_RULES``) are wrong: the one check of a trace file's
    rows, which ``tokenfleet sim`` and ``tokenfleet replay`` both read through here."""
    given = {field: rule for field, rule in LABEL_RULES.items() if field in row}
    for field, (kind, valid) in (_MOONCAKE_FIELDS | given).items():
        if not valid(row.get(field)):
            raise ValueError(f"{path} line {line}: {field} must be {kind}, not {row.get(field)!r}")


def given_labels(
    path: Path, columns: Sequence[str], limit: int | None = None
) -> dict[str, dict[str, Any]]:
    """What each row of a file in Mooncake's format gives of ``columns``, by the request id
    ``load_mooncake`` gives its row."""
    return {
        f"mooncake-{index}": {c: row[c] for c in columns if c in row}
        for index, _, row in _mooncake_rows(path, limit)
    }


def load_azure(
    kind: str, path: Path | None = None, *, limit: int | None = None, seed: int = 0
) -> list[TraceRequest]:
    """The Azure LLM inference trace 2023, ``code`` or ``conv`` (Patel et al., "Splitwise",
    ISCA 2024; CC-BY-4.0). Arrival times are kept (100 ns resolution), relative to the
    first row; the trace has no prefix information."""
    path = path or traces_dir() / "azure_llm_2023" / f"AzureLLMInferenceTrace_{kind}.csv"
    rows = _csv_values(path, _AZURE_COLUMNS, limit, _azure_row)
    first = rows[0][0] if rows else 0
    return [
        TraceRequest(f"azure-{kind}-{index}", (ticks - first) / 1e7, prompt, max(1, output), ())
        for index, (ticks, prompt, output) in enumerate(rows)
    ]


_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _azure_row(row: dict[str, str]) -> tuple[int, int, int]:
    """An Azure row's arrival (in 100 ns ticks), prompt and output tokens."""
    return azure_ticks(row["TIMESTAMP"]), int(row["ContextTokens"]), int(row["GeneratedTokens"])


def _csv_values(
    path: Path, columns: Sequence[str], limit: int | None, read: Callable[[dict[str, str]], T]
) -> list[T]:
    """What ``read`` makes of each of the first ``limit`` rows of a CSV file (UTF-8) with
    ``columns`` among its own; ValueError naming the file where it is not such a file
    (not text, a column missing, a field past the csv module's limit), and the line where
    a row is cut short or ``read`` refuses a value (each was a traceback: KeyError,
    TypeError, or ValueError without the file)."""
    try:
        with path.open(encoding="utf-8", newline="") as lines:
            return _read_rows(path, csv.DictReader(lines), columns, limit, read)
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"{path}: not a CSV file of text ({exc})") from None


def _read_rows(
    path: Path,
    rows: csv.DictReader[str],
    columns: Sequence[str],
    limit: int | None,
    read: Callable[[dict[str, str]], T],
) -> list[T]:
    missing = [column for column in columns if column not in (rows.fieldnames or ())]
    if missing:
        found = ", ".join(rows.fieldnames or ()) or "no header"
        raise ValueError(f"{path}: no column {', '.join(missing)} (it has {found})")
    values = []
    for row in itertools.islice(rows, limit):
        try:
            if any(row[column] is None for column in columns):
                raise ValueError("a row cut short")
            values.append(read(row))
        except ValueError as exc:
            raise ValueError(f"{path} line {rows.line_num}: {exc}") from None
    return values


def azure_ticks(stamp: str) -> int:
    """``2023-11-16 18:17:03.9799600`` (7 fractional digits, no zone) in 100 ns ticks since
    the epoch: integers, since a float of epoch seconds cannot hold 100 ns."""
    whole, _, fraction = stamp.partition(".")
    moment = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    return int(moment.timestamp()) * 10_000_000 + int(fraction.ljust(7, "0")[:7])


_ARXIV_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")


def _arxiv_row(row: dict[str, str]) -> tuple[int, int]:
    """An arXiv row's prompt and output tokens."""
    return int(row["num_prefill_tokens"]), int(row["num_decode_tokens"])


def load_arxiv(
    path: Path | None = None, *, limit: int | None = None, seed: int = 0, rate_rps: float = 2.0
) -> list[TraceRequest]:
    """Lengths of arXiv summarisation requests (Llama-2 tokenizer) from Vidur's processed
    traces (Agrawal et al., MLSys 2024). They carry no times: arrivals are Poisson at
    ``rate_rps``, seeded."""
    path = path or traces_dir() / "vidur_processed" / (
        "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"
    )
    lengths = _csv_values(path, _ARXIV_COLUMNS, limit, _arxiv_row)
    rng = random.Random(seed)
    requests, now = [], 0.0
    for index, (prompt, output) in enumerate(lengths):
        now += rng.expovariate(rate_rps)
        requests.append(TraceRequest(f"arxiv-{index}", now, prompt, max(1, output), ()))
    return requests


def engine_blocks(hash_ids: list[int], input_tokens: int) -> tuple[int, ...]:
    """Map 512-token trace blocks onto the hashes of the 16-token engine blocks they hold.

    Mooncake's format gives one hash id per 512-token block of the prompt, the last
    partial one included. A row with fewer (``[]``: a trace without prefix information)
    has its prompt's later blocks unshared: they get no hash, so no other request's cache
    serves them, as a prompt's unique part is not. Ids past the prompt are ignored."""
    per_block = MOONCAKE_BLOCK_TOKENS // ENGINE_BLOCK_TOKENS
    full_engine_blocks = min(input_tokens // ENGINE_BLOCK_TOKENS, len(hash_ids) * per_block)
    hashes = []
    for position in range(full_engine_blocks):
        trace_id = hash_ids[position // per_block]
        hashes.append(_mix(trace_id * per_block + position % per_block))
    return tuple(hashes)


def _mix(value: int) -> int:
    """SplitMix64 finaliser, folded to a non-negative 63-bit integer."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1
