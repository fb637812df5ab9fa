"""A workload generator driven by ServeGen's per-client statistics (Xiang et al., "ServeGen:
Workload Characterization and Generation of Large Language Model Serving in Production",
arXiv:2505.09999; Alibaba Bailian data, Apache-2.0).

Each client has, per 600 s window, a request rate and a fitted inter-arrival distribution
(Gamma or Weibull, shape and scale), and per 6 h window PMFs of input and output lengths.
Per window and client, inter-arrival times are drawn from the fitted distribution and
rescaled to the window's rate, which keeps their burstiness (CV); lengths are drawn from
the PMFs of the 6 h window the arrival falls in. The pool's data carry no prefix
information.
"""

from __future__ import annotations

import ast
import csv
import errno
import itertools
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

from sim.traces import traces_dir
from sim.workload import TraceRequest

T = TypeVar("T")

WINDOW_S = 600.0


@dataclass(frozen=True)
class _Window:
    start_s: float
    rate_rps: float
    pattern: str
    shape: float
    scale: float


CLIENT_TRACES = "chunk-*-trace.csv"
"""Each client's arrivals in a pool's folder."""


def load_servegen(
    pool: Path | None = None, *, limit: int | None = None, seed: int = 0, hours: float = 1.0
) -> list[TraceRequest]:
    """Requests of every client of ``pool`` over its first ``hours``, in arrival order."""
    pool = pool or traces_dir() / "servegen" / "reason" / "deepseek-r1"
    rng = random.Random(seed)
    requests: list[TraceRequest] = []
    traces = sorted(pool.glob(CLIENT_TRACES), key=_chunk_number)
    if not traces:  # a folder that is not there globs to nothing: the trace came out empty
        raise FileNotFoundError(errno.ENOENT, "no client traces", str(pool / CLIENT_TRACES))
    for trace in traces:
        client = trace.name.removesuffix("-trace.csv")
        lengths = _read(pool / f"{client}-dataset.json", "a ServeGen dataset", _length_pmfs)
        windows = _read(trace, "a ServeGen client trace", partial(_windows, horizon_s=hours * 3600))
        for window in windows:
            for arrival in _arrivals(window, rng):
                inputs, outputs = lengths[_pmf_key(lengths, arrival)]
                requests.append(
                    TraceRequest(
                        f"servegen-{client}-{len(requests)}",
                        arrival,
                        _draw(inputs, rng),
                        max(1, _draw(outputs, rng)),
                        (),
                        tenant=client,
                    )
                )
    requests.sort(key=lambda r: (r.arrival_s, r.request_id))
    return requests if limit is None else requests[:limit]


def _read(path: Path, what: str, read: Callable[[Path], T]) -> T:
    """``read(path)``; ValueError naming the file where it is not ``what`` (before, a
    traceback, KeyError or SyntaxError, or a ValueError without the file)."""
    try:
        return read(path)
    except (ValueError, KeyError, TypeError, AttributeError, SyntaxError, csv.Error) as exc:
        raise ValueError(f"{path}: not {what} ({exc!r})") from None


def _chunk_number(path: Path) -> int:
    return int(path.name.split("-")[1])


def _windows(trace: Path, horizon_s: float) -> list[_Window]:
    windows = []
    with trace.open(encoding="utf-8", newline="") as rows:
        for start, rate, _cv, pattern, shape, scale in csv.reader(rows):
            if float(start) >= horizon_s or not pattern or float(rate) <= 0:
                continue
            windows.append(_Window(float(start), float(rate), pattern, float(shape), float(scale)))
    return windows


def _arrivals(window: _Window, rng: random.Random) -> list[float]:
    draw: Callable[[], float]
    if window.pattern == "Gamma":
        mean = window.shape * window.scale
        draw = lambda: rng.gammavariate(window.shape, window.scale)  # noqa: E731
    elif window.pattern == "Weibull":
        mean = window.scale * math.gamma(1 + 1 / window.shape)
        draw = lambda: rng.weibullvariate(window.scale, window.shape)  # noqa: E731
    else:
        raise ValueError(f"unknown inter-arrival pattern {window.pattern!r}")
    stretch = (1 / window.rate_rps) / mean
    arrivals: list[float] = []
    now = window.start_s
    while True:
        now += draw() * stretch
        if now >= window.start_s + WINDOW_S:
            return arrivals
        arrivals.append(now)


Pmf = tuple[list[int], list[float]]


def _length_pmfs(path: Path) -> dict[float, tuple[Pmf, Pmf]]:
    document = json.loads(path.read_text(encoding="utf-8"))
    if not document:
        raise ValueError("no window of lengths")
    return {
        float(start): (_pmf(fields["input_tokens"]), _pmf(fields["output_tokens"]))
        for start, fields in document.items()
    }


def _pmf(text: str) -> Pmf:
    """Values and their cumulative weights, so each draw is a binary search."""
    table = ast.literal_eval(text)
    return list(table), list(itertools.accumulate(table.values()))


def _pmf_key(pmfs: dict[float, tuple[Pmf, Pmf]], arrival: float) -> float:
    return max((start for start in pmfs if start <= arrival), default=min(pmfs))


def _draw(pmf: Pmf, rng: random.Random) -> int:
    values, cumulative = pmf
    return int(rng.choices(values, cum_weights=cumulative)[0])
