from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from sim.registry import load_trace
from sim.traces import MOONCAKE_BUCKET_S, engine_blocks, load_mooncake
from sim.workload import reusable_blocks


def test_shared_trace_blocks_become_shared_engine_blocks() -> None:
    a = engine_blocks([7, 8, 9], input_tokens=3 * 512)
    b = engine_blocks([7, 8, 10], input_tokens=2 * 512 + 100)
    assert len(a) == 96
    assert len(b) == 64 + 100 // 16
    assert a[:64] == b[:64]
    assert not set(a[64:]) & set(b[64:])


def test_engine_blocks_depend_on_position_within_the_trace_block() -> None:
    blocks = engine_blocks([1], input_tokens=512)
    assert len(set(blocks)) == 32


def test_a_partial_engine_block_gets_no_hash() -> None:
    assert engine_blocks([1], input_tokens=15) == ()
    assert len(engine_blocks([1], input_tokens=17)) == 1


def test_reusable_blocks_stop_at_the_first_miss() -> None:
    assert reusable_blocks((1, 2, 4, 5), {1, 2, 3, 4}) == 3
    assert reusable_blocks((9, 2), {2}) == 0
    assert reusable_blocks((1, 2), {1, 2}) == 2


def test_mooncake_arrivals_are_spread_inside_their_bucket_and_seeded(tmp_path: Path) -> None:
    rows = [
        {
            "timestamp": 3000 * (i // 4),
            "input_length": 600,
            "output_length": 5,
            "hash_ids": [i, i + 100],
        }
        for i in range(12)
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    requests = load_mooncake(path, seed=3)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    for r in requests:
        index = int(r.request_id.rsplit("-", 1)[1])
        bucket = 3.0 * (index // 4)
        assert bucket <= r.arrival_s < bucket + MOONCAKE_BUCKET_S
    assert load_mooncake(path, seed=3) == requests
    assert load_mooncake(path, seed=4) != requests


def test_a_jsonl_path_replays_its_timestamps_as_given(tmp_path: Path) -> None:
    rows = [
        {"timestamp": ms, "input_length": 64, "output_length": 5, "hash_ids": [n]}
        for n, ms in enumerate([0, 10, 2500, 2501])
    ]
    path = tmp_path / "exact.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    for seed in (0, 1):
        replayed = load_trace(str(path), seed=seed)
        assert [r.arrival_s for r in replayed] == [0.0, 0.01, 2.5, 2.501]


def test_blank_lines_in_a_trace_file_hold_no_row(tmp_path: Path) -> None:
    """A file ending in a blank line (as editors write one) was refused: "line 3: not
    JSON (Expecting value: line 2 column 1)"."""
    rows = [
        {"timestamp": ms, "input_length": 64, "output_length": 5, "hash_ids": [n]}
        for n, ms in enumerate([0, 10])
    ]
    path = tmp_path / "edited.jsonl"
    path.write_text("\n\n".join(json.dumps(r) for r in rows) + "\n\n")
    loaded = load_trace(str(path))
    assert [(r.request_id, r.arrival_s) for r in loaded] == [
        ("mooncake-0", 0.0),
        ("mooncake-1", 0.01),
    ]
    assert len(load_trace(str(path), limit=1)) == 1


def test_the_carried_traces_are_the_published_files() -> None:
    """Every file ``sim/data/traces/SHA256SUMS`` names, unchanged; and the loaders read
    this copy unless told otherwise."""
    root = Path(__file__).parents[2] / "sim" / "data" / "traces"
    listed = [line.split(maxsplit=1) for line in (root / "SHA256SUMS").read_text().splitlines()]
    assert len(listed) > 100
    for digest, name in listed:
        assert hashlib.sha256((root / name).read_bytes()).hexdigest() == digest, name
    for source in ("mooncake_fast25", "azure_llm_2023", "vidur_processed", "servegen"):
        assert any((root / source).glob("LICENSE*")), source


GOOD_ROW = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"input_length": 0}, "input_length"),
        ({"output_length": 0}, "output_length"),
        ({"timestamp": float("nan")}, "timestamp"),
        ({"timestamp": float("inf")}, "timestamp"),
        ({"hash_ids": [1, True]}, "hash_ids"),
        ({"deadline_s": "abc"}, "deadline_s"),
        ({"deadline_s": -5}, "deadline_s"),
        ({"tenant": ""}, "tenant"),
        ({"region": 3}, "region"),
    ],
)
def test_a_bad_row_is_refused_naming_the_file_line_and_field(
    change: dict[str, object], field: str, tmp_path: Path
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD_ROW) + "\n" + json.dumps(GOOD_ROW | change) + "\n")
    with pytest.raises(ValueError, match=f"^{path} line 2: {field} must be "):
        load_trace(str(path))


def test_a_row_with_no_deadline_written_as_null_loads(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD_ROW | {"class": "interactive", "deadline_s": None}) + "\n")
    [chat] = load_trace(str(path))
    assert chat.deadline_s is None


def test_hash_ids_short_of_the_prompt_leave_its_later_blocks_unshared(tmp_path: Path) -> None:
    assert engine_blocks([], input_tokens=2048) == ()
    assert engine_blocks([7], input_tokens=2048) == engine_blocks([7, 8], input_tokens=1024)[:32]
    path = tmp_path / "t.jsonl"
    rows = [GOOD_ROW | {"hash_ids": []}, GOOD_ROW | {"timestamp": 5, "hash_ids": [1]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    unshared, one_block = load_trace(str(path))
    assert (unshared.prefix_blocks, len(one_block.prefix_blocks)) == ((), 32)


@pytest.mark.parametrize("command", ["sim", "replay"])
def test_sim_and_replay_refuse_a_bad_row_with_exit_2_before_any_request(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenfleet.cli import main

    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD_ROW | {"timestamp": float("inf")}) + "\n")
    target = ["--target", "http://127.0.0.1:1"] if command == "replay" else []
    assert main([command, "--trace", str(path), *target]) == 2
    assert f"tokenfleet: {path} line 1: timestamp must be" in capsys.readouterr().err
