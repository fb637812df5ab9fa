"""Every workload by the name ``--trace`` takes: the one list."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from sim.labels import LABEL_COLUMNS, label, with_given
from sim.mixed import load_mixed
from sim.servegen import load_servegen
from sim.synthetic import SharedPrefixSpec, shared_prefix
from sim.traces import given_labels, load_arxiv, load_azure, load_mooncake
from sim.workload import TraceRequest


@dataclass(frozen=True)
class Source:
    load: Callable[..., list[TraceRequest]]
    """Called with ``limit`` and ``seed``."""
    description: str
    batch: bool = False
    """Offline work: labelled batch with a deadline (see sim/labels.py)."""
    labelled: bool = False
    """Its loader labels the requests itself (a mix of sources)."""


TRACES: dict[str, Source] = {
    "mooncake": Source(load_mooncake, "Mooncake FAST'25 conversation trace, with prefixes"),
    "azure-conv": Source(partial(load_azure, "conv"), "Azure LLM 2023 conversation trace"),
    "azure-code": Source(partial(load_azure, "code"), "Azure LLM 2023 code trace"),
    "arxiv": Source(load_arxiv, "arXiv summarisation lengths, Poisson at 2 req/s", batch=True),
    "servegen": Source(load_servegen, "ServeGen deepseek-r1 clients, first hour"),
    "shared-prefix": Source(
        partial(shared_prefix, SharedPrefixSpec()), "llm-d's shared-prefix benchmark workload"
    ),
    "mixed": Source(
        load_mixed,
        "interactive (Azure conv and code), long documents (Mooncake >= 16k) and batch "
        "jobs (arXiv) over 30 minutes",
        labelled=True,
    ),
    "shared-prefix-chat": Source(
        partial(shared_prefix, SharedPrefixSpec(rounds=4, rate_rps=2.0)),
        "shared-prefix groups with 4-round sessions whose history grows",
    ),
}


_TRACES_FROM = (
    "(the traces are read from $TOKENFLEET_TRACES where it is set, else from sim/data/traces)"
)


def load_trace(name_or_path: str, *, limit: int | None = None, seed: int = 0) -> list[TraceRequest]:
    """A labelled workload by name (see ``TRACES``) or a Mooncake-format JSONL path, whose
    timestamps are replayed as given (only the named ``mooncake`` trace spreads its 3 s
    buckets). ValueError for a trace that is not there or cannot be read."""
    source = TRACES.get(name_or_path)
    if source is not None:
        try:
            requests = source.load(limit=limit, seed=seed)
        except OSError as exc:  # not found, or a folder where a file should be, and back
            why = "not found" if isinstance(exc, FileNotFoundError) else f"unread: {exc.strerror}"
            where = exc.filename or "its files"
            raise ValueError(f"trace {name_or_path}: {where} {why} {_TRACES_FROM}") from None
        if not requests:  # a file of its header alone
            raise ValueError(f"trace {name_or_path}: its files hold no requests {_TRACES_FROM}")
        return requests if source.labelled else label(requests, batch=source.batch, seed=seed)
    path = Path(name_or_path)
    if path.suffix == ".jsonl" and not path.is_file():
        raise ValueError(
            f"trace file {name_or_path} {'is not a file' if path.exists() else 'not found'}"
        )
    if path.suffix == ".jsonl":
        requests = label(load_mooncake(path, limit=limit, seed=seed, bucket_s=0.0), seed=seed)
        if not requests:
            raise ValueError(f"trace file {name_or_path} holds no requests")
        return with_given(requests, given_labels(path, LABEL_COLUMNS, limit))
    raise ValueError(
        f"unknown trace {name_or_path!r}: give one of {', '.join(TRACES)} or a .jsonl path"
    )
