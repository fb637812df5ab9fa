"""The live gateway's decision journal: ``tokenfleet audit`` makes every decision again
from the journal alone, and reports the one whose record was changed."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import httpx
import pytest

from tests.gateway_harness import (
    KEY,
    chat,
    emulated,
    fleet_for,
    gateway,
    http_server,
    until_ready,
)
from tests.integration.test_gateway_admission import BATCH, Load, depth, scripted, until
from tokenfleet.cli import main


async def _mixed_traffic(http: httpx.AsyncClient) -> None:
    """Chats whole and streamed on shared prefixes, long prompts, and a client that
    leaves mid-answer."""

    async def one(n: int) -> None:
        prompt = f"shared system prompt {n % 3} " * (20 + 200 * (n % 7 == 0)) + f"question {n}"
        body = chat(prompt, max_tokens=8 + n % 5, stream=n % 2 == 0)
        answer = await http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200

    async def leaves() -> None:
        """Leaves once its answer began: a client that left after a fixed 0.3 s could, on
        a loaded machine, leave before the gateway read it (40 DC choices of 41 in CI)."""
        body = chat("a long answer I will not wait for", max_tokens=400, stream=True)
        async with http.stream("POST", "/v1/chat/completions", json=body) as answer:
            async for _ in answer.aiter_bytes():
                break

    await asyncio.gather(*(one(n) for n in range(40)), leaves())


def _audit(*args: str) -> tuple[int, list[dict[str, object]]]:
    return main(["audit", *args[:-1], "--json", args[-1]]), json.loads(Path(args[-1]).read_text())


async def test_a_gateway_s_journal_replays_to_every_decision_it_made(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    async with emulated(2) as instances:
        fleet = fleet_for([i.url for i in instances])
        async with gateway(fleet, admission="slomax", journal_file=journal) as front:
            await until_ready(front)
            async with front.client() as http:
                await _mixed_traffic(http)
            await asyncio.sleep(0.5)  # the departed client's end reaches the books
    code, audits = _audit("--from", str(journal), str(tmp_path / "audit.json"))
    assert code == 0
    by_kind = {str(a["journal"]).split("/")[1]: a for a in audits}
    assert set(by_kind) == {"emulated@dc-a", "dc-choices"}
    assert by_kind["dc-choices"]["decisions"] == 41
    records = [json.loads(line)["payload"]["record"] for line in journal.read_text().splitlines()]
    arrivals = [r for r in records if r["call"] == "arrive"]
    assert len(arrivals) == 41
    assert by_kind["emulated@dc-a"]["decisions"] >= 41  # reroutes and release passes too
    calls = {r["call"] for r in records}
    assert {"arrive", "first_token", "finished"} <= calls
    learned = [r for r in records if r["call"] == "finished" and r["observation"] is not None]
    assert len(learned) >= 20  # streamed answers teach TokenPilot, and it is replayed

    # The same journal with one decision's snapshot changed: that decision is reported.
    lines = journal.read_text().splitlines()
    row = next(
        n
        for n, line in enumerate(lines)
        if (r := json.loads(line)["payload"]["record"])["call"] == "arrive" and r["seq"] > 10
    )
    envelope = json.loads(lines[row])
    fleet_seen = envelope["payload"]["record"]["fleet"]
    fleet_seen["kv_blocks_used"] = [used + 5_000 for used in fleet_seen["kv_blocks_used"]]
    lines[row] = json.dumps(envelope)
    changed = tmp_path / "changed.jsonl"
    changed.write_text("\n".join(lines) + "\n")
    code, audits = _audit("--from", str(changed), str(tmp_path / "changed.json"))
    assert code == 1
    [pool] = [a for a in audits if "emulated@" in str(a["journal"])]
    differences = pool["differences"]
    assert isinstance(differences, list)
    assert differences[0]["seq"] == envelope["payload"]["record"]["seq"]

    # A DC choice lost from its journal, and a record without its number: both reported.
    choices = [n for n, line in enumerate(lines) if "/dc-choices/" in line]
    garbled = json.loads(lines[0])
    del garbled["payload"]["record"]["seq"]
    lines = [line for n, line in enumerate(journal.read_text().splitlines()) if n != choices[5]]
    changed.write_text("\n".join([*lines, json.dumps(garbled)]) + "\n")
    code, audits = _audit("--from", str(changed), str(tmp_path / "lost.json"))
    assert code == 1
    [dc_choices] = [a for a in audits if "/dc-choices/" in str(a["journal"])]
    assert dc_choices["problem"] == "record 5 is missing (the next is 6)"


def test_audit_refuses_what_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", "--from", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["audit", "--from", str(tmp_path / "nowhere.jsonl")]) == 2
    assert "no such file or topic" in capsys.readouterr().err


async def test_a_held_and_released_request_replays_through_its_release_pass(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "journal.jsonl"
    load = Load(waiting=3)
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(http_server(scripted(load))) for _ in range(2)]
        front = await stack.enter_async_context(
            gateway(fleet_for(urls), admission="slomax", journal_file=journal)
        )
        await until_ready(front)
        async with httpx.AsyncClient(
            base_url=front.url, headers={"authorization": f"Bearer {KEY}"}, timeout=30
        ) as http:
            batch = asyncio.create_task(
                http.post("/v1/chat/completions", json=chat("hi"), headers=BATCH)
            )

            async def held() -> bool:
                return await depth(front, "batch") == 1

            await until(held)
            load.waiting = 0
            assert (await asyncio.wait_for(batch, 5)).status_code == 200
    code, audits = _audit("--from", str(journal), str(tmp_path / "audit.json"))
    assert code == 0
    records = [json.loads(line)["payload"]["record"] for line in journal.read_text().splitlines()]
    arrivals = [r for r in records if r["call"] == "arrive"]
    assert [a["outcome"]["admission"]["verdict"] for a in arrivals] == ["hold"]
    released = [o for r in records if r["call"] == "release" for o in r["outcomes"]]
    assert [o["admission"]["verdict"] for o in released] == ["dispatch"]
    assert all(a["differences"] == [] for a in audits)


def test_a_journal_on_the_bus_needs_kafka(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the in-process bus nobody could read the journal, and it would grow until exit."""
    monkeypatch.delenv("TOKENFLEET_KAFKA_BOOTSTRAP", raising=False)
    fleet = tmp_path / "fleet.json"
    fleet.write_text(fleet_for(["http://127.0.0.1:1"]).model_dump_json())
    assert main(["gateway", "--fleet", str(fleet), "--port", "0", "--journal"]) == 2
    assert "TOKENFLEET_GATEWAY_JOURNAL_FILE" in capsys.readouterr().err
