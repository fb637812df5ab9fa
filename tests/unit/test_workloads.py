from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from control.admission.request import LONG_DOCUMENT_TOKENS
from schemas.base import TaskClass
from sim.labels import BATCH_DEADLINE_S, label
from sim.registry import TRACES, load_trace
from sim.servegen import load_servegen
from sim.synthetic import SharedPrefixSpec, shared_prefix
from sim.traces import azure_ticks
from sim.workload import TraceRequest, segment_blocks


def test_segment_blocks_agree_exactly_as_far_as_the_prompts_do() -> None:
    a = segment_blocks([("system", 40), ("question-1", 30)])
    b = segment_blocks([("system", 40), ("question-2", 30)])
    assert len(a) == 70 // 16
    assert a[:2] == b[:2]  # the first 32 tokens are system prompt in both
    assert a[2] != b[2]  # block 2 holds tokens 32..47: system prompt end, then questions
    assert segment_blocks([("system", 40)]) == a[:2]


def test_sessions_grow_by_their_history_and_share_their_group_prompt() -> None:
    spec = SharedPrefixSpec(
        groups=2,
        users_per_group=2,
        system_prompt_tokens=64,
        question_tokens=32,
        output_tokens=16,
        rounds=3,
    )
    requests = shared_prefix(spec, seed=1)
    assert len(requests) == 2 * 2 * 3
    by_session: dict[str, list[TraceRequest]] = {}
    for request in requests:
        by_session.setdefault(request.session_id, []).append(request)
    for turns in by_session.values():
        assert [t.round for t in turns] == [0, 1, 2]
        assert [t.input_tokens for t in turns] == [96, 144, 192]
        for earlier, later in itertools.pairwise(turns):
            assert later.arrival_s > earlier.arrival_s
            assert (
                later.prefix_blocks[: len(earlier.prefix_blocks) - 2]
                == (earlier.prefix_blocks[: len(earlier.prefix_blocks) - 2])
            )
    groups = {r.prefix_group: r.prefix_blocks[:4] for r in requests if r.round == 0}
    assert len(set(groups.values())) == 2


def test_labels_follow_the_documented_rules() -> None:
    short = TraceRequest("s", 0.0, 100, 10, (), session_id="session-1")
    same_session = TraceRequest("t", 1.0, 200, 10, (), session_id="session-1")
    long = TraceRequest("l", 0.0, LONG_DOCUMENT_TOKENS, 10, ())
    interactive = label([short, same_session, long])
    assert [r.task_class for r in interactive] == [
        TaskClass.INTERACTIVE,
        TaskClass.INTERACTIVE,
        TaskClass.LONG_DOCUMENT,
    ]
    assert interactive[0].region == interactive[1].region
    assert interactive[0].tenant == interactive[1].tenant
    batch = label([short], batch=True)[0]
    assert (batch.task_class, batch.deadline_s) == (TaskClass.BATCH, BATCH_DEADLINE_S)
    assert label([short]) == interactive[:1]


def test_azure_timestamps_keep_their_seventh_fractional_digit() -> None:
    start = azure_ticks("2023-11-16 18:17:03.9799600")
    assert azure_ticks("2023-11-16 18:17:04.0000001") - start == 200_401
    assert azure_ticks("2023-11-16 18:17:04") - start == 200_400


def test_servegen_arrivals_follow_each_window_s_rate(tmp_path: Path) -> None:
    (tmp_path / "chunk-7-trace.csv").write_text(
        "0,2.0,1.5,Gamma,0.4,3.0\n600,0,0,,0,0\n1200,0.5,1.0,Weibull,1.0,2.0\n"
    )
    (tmp_path / "chunk-7-dataset.json").write_text(
        json.dumps({"0": {"input_tokens": "{100: 0.5, 300: 0.5}", "output_tokens": "{7: 1.0}"}})
    )
    requests = load_servegen(tmp_path, hours=0.5, seed=3)
    first = [r for r in requests if r.arrival_s < 600]
    last = [r for r in requests if r.arrival_s >= 1200]
    assert not [r for r in requests if 600 <= r.arrival_s < 1200]
    assert len(first) == pytest.approx(1200, rel=0.15)
    assert len(last) == pytest.approx(300, rel=0.2)
    assert {r.input_tokens for r in requests} == {100, 300}
    assert {r.output_tokens for r in requests} == {7}
    assert {r.tenant for r in requests} == {"chunk-7"}


@pytest.mark.parametrize("name", sorted(TRACES))
def test_every_named_trace_loads_labelled_requests_in_arrival_order(name: str) -> None:
    requests = load_trace(name, limit=50)
    assert 0 < len(requests) <= 50
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    assert all(r.region in {"eu-west", "us-east", "ap-south"} for r in requests)
    assert statistics.mean(r.input_tokens for r in requests) > 0


def test_an_unknown_trace_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="give one of mooncake, azure-conv"):
        load_trace("nope")


def test_the_mixed_workload_labels_each_source_as_its_class() -> None:
    from sim.mixed import BATCH_JOB_REQUESTS, WINDOW_S

    mixed = load_trace("mixed")
    assert len({r.request_id for r in mixed}) == len(mixed)
    assert [r.arrival_s for r in mixed] == sorted(r.arrival_s for r in mixed)
    assert max(r.arrival_s for r in mixed) < WINDOW_S
    by_class = {c: [r for r in mixed if r.task_class is c] for c in TaskClass}
    assert all(r.request_id.startswith("azure-") for r in by_class[TaskClass.INTERACTIVE])
    documents = by_class[TaskClass.LONG_DOCUMENT]
    assert documents
    assert all(r.input_tokens >= LONG_DOCUMENT_TOKENS for r in documents)
    assert all(r.prefix_blocks for r in documents if r.request_id.startswith("mooncake"))
    batch = by_class[TaskClass.BATCH]
    assert all(
        r.request_id.startswith("arxiv-") and r.deadline_s == BATCH_DEADLINE_S for r in batch
    )
    jobs = [len(list(group)) for _, group in itertools.groupby(r.arrival_s for r in batch)]
    assert set(jobs) == {BATCH_JOB_REQUESTS}  # submitted a job at a time
    assert load_trace("mixed", limit=100) == mixed[:100]


def test_a_trace_file_s_own_labels_win_over_the_rules(tmp_path: Path) -> None:
    rows = [
        {"class": "batch", "tenant": "acme"},
        {"deadline_s": 30.0, "region": "us-east"},
        {},
        {"class": "interactive"},
    ]
    path = tmp_path / "labelled.jsonl"
    with path.open("w") as out:
        for n, given in enumerate(rows):
            row = {
                "timestamp": 1000 * n,
                "input_length": 20_000,
                "output_length": 5,
                "hash_ids": list(range(100 * n, 100 * n + 40)),  # 40 blocks of 512 tokens
            }
            out.write(json.dumps(row | given) + "\n")
    batch, late, plain, chat = load_trace(str(path))
    assert (batch.task_class, batch.tenant, batch.deadline_s) == (
        TaskClass.BATCH,
        "acme",
        BATCH_DEADLINE_S,
    )
    assert (late.deadline_s, late.region) == (30.0, "us-east")
    assert late.task_class is TaskClass.LONG_DOCUMENT  # the rules: 20,000 tokens
    assert (plain.task_class, plain.deadline_s) == (TaskClass.LONG_DOCUMENT, None)
    assert chat.task_class is TaskClass.INTERACTIVE  # what the row says, though long
    path.write_text(
        json.dumps(
            {
                "timestamp": 0,
                "input_length": 9,
                "output_length": 1,
                "hash_ids": [],
                "class": "urgent",
            }
        )
        + "\n"
    )
    with pytest.raises(ValueError, match=r"line 1: class must be one of interactive.*not 'urgent'"):
        load_trace(str(path))
    row = {"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": []}
    path.write_text(json.dumps(row | {"class": ["batch"]}) + "\n")  # not a name: no TypeError
    with pytest.raises(ValueError, match=r"line 1: class must be one of interactive.*\['batch'\]"):
        load_trace(str(path))
