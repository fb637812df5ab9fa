"""``mixed``: the three task classes in one workload, from the public traces, for the
admission benchmark.

Which rows become which class, and why:

- **interactive**: every request of the Azure LLM 2023 conversation and code traces in the
  window, at their own arrival times (chat and code completion behind a product API:
  short prompts, people waiting; bursts as the traces have them);
- **long_document**: the Mooncake conversation trace's requests with prompts of
  ``LONG_DOCUMENT_TOKENS`` or more in the window, at their own times and with their
  prefix blocks (long contexts that later turns reuse);
- **batch**: arXiv summarisation lengths (Vidur's processed set) submitted as jobs of
  ``BATCH_JOB_REQUESTS`` requests at once, jobs arriving at random (Poisson, one every
  ``BATCH_JOB_EVERY_S`` on average), each request due ``BATCH_DEADLINE_S`` after its
  job's submission: offline work arrives in bulk, not one request at a time.

Each source contributes its first ``WINDOW_S`` seconds; request ids carry the source's
name, so they stay unique.
"""

from __future__ import annotations

import random
from dataclasses import replace

from control.admission.request import LONG_DOCUMENT_TOKENS
from sim.labels import label
from sim.traces import load_arxiv, load_azure, load_mooncake
from sim.workload import TraceRequest

WINDOW_S = 1800.0
BATCH_JOB_REQUESTS = 50
BATCH_JOB_EVERY_S = 30.0


def load_mixed(*, limit: int | None = None, seed: int = 0) -> list[TraceRequest]:
    """The labelled mix, in arrival order; ``limit`` keeps the first requests."""
    chats = [r for kind in ("conv", "code") for r in _window(load_azure(kind))]
    documents = [
        r for r in _window(load_mooncake(seed=seed)) if r.input_tokens >= LONG_DOCUMENT_TOKENS
    ]
    mixed = label(chats + documents, seed=seed) + label(_batch_jobs(seed), batch=True, seed=seed)
    mixed.sort(key=lambda r: (r.arrival_s, r.request_id))
    return mixed[:limit]


def _window(requests: list[TraceRequest]) -> list[TraceRequest]:
    return [r for r in requests if r.arrival_s < WINDOW_S]


def _batch_jobs(seed: int) -> list[TraceRequest]:
    """arXiv summarisation requests, submitted ``BATCH_JOB_REQUESTS`` at a time."""
    rng = random.Random(f"batch-jobs:{seed}")
    jobs, now = [], rng.expovariate(1 / BATCH_JOB_EVERY_S)
    while now < WINDOW_S:
        jobs.append(now)
        now += rng.expovariate(1 / BATCH_JOB_EVERY_S)
    rows = load_arxiv(limit=len(jobs) * BATCH_JOB_REQUESTS, seed=seed)
    return [
        replace(row, arrival_s=jobs[index // BATCH_JOB_REQUESTS]) for index, row in enumerate(rows)
    ]
