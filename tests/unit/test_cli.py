from __future__ import annotations

import hashlib
import importlib.abc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

import tokenfleet.__main__
import tokenfleet.cli
from schemas import MESSAGES
from tests.conftest import unavailable
from tokenfleet.cli import main
from tokenfleet.services import kafka
from tokenfleet.services.process import ServiceError


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("schemas", "topics", "kafka", "redis"):
        assert command in out


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    """``tokenfleet topics list | head -1`` printed a BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader left before the command wrote
    # buffered, as in a shell: the output meets the pipe at the flush, not at each print
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tokenfleet.cli", "topics", "list"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            env=environment,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 128 + signal.SIGPIPE
    assert done.stderr == ""


class _InterruptedImport(importlib.abc.MetaPathFinder):
    """Ctrl-C arriving while ``module`` is imported."""

    def __init__(self, module: str) -> None:
        self.module = module

    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name == self.module:
            raise KeyboardInterrupt


def test_ctrl_c_while_the_command_imports_its_modules_prints_no_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The modules take about a second to import; Ctrl-C then printed Python's traceback."""
    monkeypatch.delitem(sys.modules, "tokenfleet.cli")
    monkeypatch.setattr(sys, "meta_path", [_InterruptedImport("tokenfleet.cli"), *sys.meta_path])
    assert tokenfleet.__main__.run() == 128 + signal.SIGINT
    assert capsys.readouterr().err == "tokenfleet: interrupted\n"


def test_ctrl_c_while_the_parser_imports_the_commands_prints_no_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The parser imports the commands' modules, half of the start's imports."""

    def interrupted_build() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(tokenfleet.cli, "build_parser", interrupted_build)
    assert tokenfleet.__main__.run() == 128 + signal.SIGINT
    assert capsys.readouterr().err == "tokenfleet: interrupted\n"


def test_the_installed_command_is_the_entry_that_answers_ctrl_c() -> None:
    scripts = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert scripts["project"]["scripts"]["tokenfleet"] == "tokenfleet.__main__:run"


@pytest.mark.parametrize("option", ["--admission", "--policy", "--dc-policy"])
def test_a_gateway_with_an_unknown_policy_says_so_without_quoting_the_sentence(
    option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = Path(__file__).parents[2] / "examples" / "fleet.toml"
    assert main(["gateway", "--fleet", str(fleet), option, "nope", "--port", "0"]) == 2
    error = capsys.readouterr().err
    assert "the gateway cannot start: unknown " in error  # a KeyError's text, not its repr
    assert "policy 'nope'; known: " in error


def test_the_command_s_metrics_have_no_created_series(tmp_path: Path) -> None:
    """Each counter's ``_created`` twin is one more series per child that nobody reads."""
    assert main(["schemas", "export", str(tmp_path)]) == 0
    registry = CollectorRegistry()
    Counter("tokenfleet_probe", "A counter.", registry=registry).inc()
    assert b"tokenfleet_probe_total 1.0" in generate_latest(registry)
    assert b"_created" not in generate_latest(registry)


def test_schemas_export_writes_one_schema_per_message(tmp_path: Path) -> None:
    assert main(["schemas", "export", str(tmp_path)]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == len(MESSAGES) + 1
    routed = json.loads((tmp_path / "tf.request.routed.v1.schema.json").read_text())
    assert routed["$id"] == "tf.request.routed/1"
    assert "candidates" in routed["required"]
    envelope = json.loads((tmp_path / "envelope.schema.json").read_text())
    assert {"schema", "event_id", "ts", "source", "payload"} <= set(envelope["properties"])


def test_topics_create_without_a_broker_says_how_to_get_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TOKENFLEET_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.setattr("tokenfleet.services.kafka.DEFAULT_HOME", tmp_path)
    assert main(["topics", "create"]) == 2
    assert "TOKENFLEET_KAFKA_BOOTSTRAP" in capsys.readouterr().err


def test_an_unknown_command_exits_non_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["launch-rockets"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


_GATEWAY_SETTINGS = "tokenfleet: invalid GatewaySettings (from TOKENFLEET_* environment variables)"


@pytest.mark.parametrize(
    ("setting", "value", "said"),
    [
        (
            "TOKENFLEET_GATEWAY_TOKEN_LAG_S",
            "-1",
            f"{_GATEWAY_SETTINGS}: TOKENFLEET_GATEWAY_TOKEN_LAG_S='-1'",
        ),
        # taken, though a kept answer's write to Redis raised (int(inf * 1000))
        (
            "TOKENFLEET_GATEWAY_IDEMPOTENCY_TTL_S",
            "inf",
            f"{_GATEWAY_SETTINGS}: TOKENFLEET_GATEWAY_IDEMPOTENCY_TTL_S='inf': Input should be a "
            "finite number",
        ),
        # two settings that disagree: a live replica's share would lapse between rewrites
        (
            "TOKENFLEET_GATEWAY_SHARE_TTL_S",
            "3",
            f"{_GATEWAY_SETTINGS}: Value error, share_ttl_s (3.0) must be at",
        ),
        # pydantic's text under "the gateway cannot start" (read as it started)
        (
            "TOKENFLEET_KAFKA_REPLICATION",
            "0",
            "tokenfleet: invalid Settings (from TOKENFLEET_* environment variables): "
            "TOKENFLEET_KAFKA_REPLICATION='0': Input should be greater than or equal to 1",
        ),
        # the OS's error alone
        (
            "TOKENFLEET_GATEWAY_JOURNAL_FILE",
            "/proc/nosuch/journal",
            "tokenfleet: the gateway cannot start: TOKENFLEET_GATEWAY_JOURNAL_FILE "
            "/proc/nosuch/journal: No such file or directory",
        ),
    ],
)
def test_a_gateway_setting_it_cannot_use_is_named_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    setting: str,
    value: str,
    said: str,
) -> None:
    monkeypatch.setenv(setting, value)
    fleet = Path(__file__).parents[2] / "examples" / "fleet.toml"
    assert main(["gateway", "--fleet", str(fleet), "--port", "0"]) == 2
    assert capsys.readouterr().err.startswith(said)


def test_a_list_setting_not_written_in_json_is_named_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOKENFLEET_GATEWAY_CORS_ALLOW_ORIGINS", "https://a.example")
    fleet = Path(__file__).parents[2] / "examples" / "fleet.toml"
    assert main(["gateway", "--fleet", str(fleet), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert '"cors_allow_origins"' in err
    assert "written in JSON" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("without", "said"),
    [("profile", "has no `profile` in the fleet file"), ("tenants", "names no tenant")],
)
def test_a_fleet_file_the_gateway_cannot_serve_is_refused_saying_what_to_add(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], without: str, said: str
) -> None:
    """Without a model's profile the default policy cannot start; without a tenant every
    request would get 401."""
    example = (Path(__file__).parents[2] / "examples" / "fleet.toml").read_text()
    if without == "profile":
        example = example.replace('profile = "llama3-70b-4xh100"', "")
    else:  # the tenants and what follows them
        example = example[: example.index("[[tenants]]")]
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(example)
    assert main(["gateway", "--fleet", str(fleet), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert said in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["collect", "worker", "controller"])
def test_a_fleet_file_that_cannot_be_read_is_named_before_the_missing_broker(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    """Errors came one at a time: the broker first, then, once it was set, the file."""
    monkeypatch.delenv("TOKENFLEET_KAFKA_BOOTSTRAP", raising=False)
    assert main([command, "--fleet", str(tmp_path / "missing.toml")]) == 2
    assert "cannot read fleet file" in capsys.readouterr().err


def test_a_controller_told_to_judge_a_dc_on_no_requests_is_refused_before_it_needs_a_broker(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TOKENFLEET_KAFKA_BOOTSTRAP", raising=False)
    assert main(["controller", "--weights-min-outcomes", "0"]) == 2
    assert "--weights-min-outcomes must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["recount", "whatif", "status"])
def test_a_dc_the_fleet_file_lacks_is_refused_before_a_broker_is_needed(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """recount went to Kafka first (and said there was none), as whatif did not; status
    said the DC had no table yet, as if the loop had not reached it."""
    monkeypatch.delenv("TOKENFLEET_KAFKA_BOOTSTRAP", raising=False)
    fleet = str(Path(__file__).parents[2] / "examples" / "fleet-local.toml")
    assert main([command, "--fleet", fleet, "--dc", "nosuch"]) == 2
    assert "--dc nosuch: the fleet file has no such DC" in capsys.readouterr().err


def test_an_unknown_dc_policy_is_named_with_the_known_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    fleet = Path(__file__).parents[2] / "examples" / "fleet.toml"
    assert main(["gateway", "--fleet", str(fleet), "--port", "0", "--dc-policy", "nearest"]) == 2
    err = capsys.readouterr().err
    assert "unknown DC policy 'nearest'" in err
    assert "gcp_waterfall" in err
    assert "Traceback" not in err


def test_a_litellm_command_that_is_not_there_is_named_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "bin" / "litellm")
    argv = ["bench", "gateway", "--litellm", missing, "--json", str(tmp_path / "g.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--litellm {missing}: no such executable" in err
    assert "Traceback" not in err


def test_a_server_that_exits_at_once_is_reported_and_forgotten(tmp_path: Path) -> None:
    from tokenfleet.services.process import ServerProcess, ServiceError, read_address

    server = ServerProcess(tmp_path, "127.0.0.1:1")
    with pytest.raises(ServiceError, match="exited early"):
        server.launch(["false"], ready=lambda: False, timeout_s=10)
    assert read_address(tmp_path) is None
    assert not (tmp_path / "pid").exists()


def test_a_failed_launch_reports_its_own_log_not_an_earlier_runs(tmp_path: Path) -> None:
    """The log is appended to run after run: a launch that failed at once used to show
    the end of the whole file, an earlier run's lines for its own."""
    from tokenfleet.services.process import ServerProcess, ServiceError

    server = ServerProcess(tmp_path, "failing")
    for run in ("first", "second"):
        with pytest.raises(ServiceError) as failed:
            server.launch(
                ["sh", "-c", f"echo {run} run; exit 1"], ready=lambda: False, timeout_s=10
            )
    tail = str(failed.value).partition("log tail:\n")[2]
    assert "first run" not in tail
    assert re.search(r"^--- started \S+ pid \d+: sh -c 'echo second run; exit 1' ---$", tail, re.M)
    assert "second run\n" in tail
    assert "first run" in (tmp_path / "server.log").read_text()  # the log keeps both


def test_a_recorded_pid_that_now_names_another_process_is_not_taken_for_the_server(
    tmp_path: Path,
) -> None:
    """After a reboot, or once the system reuses the id, the pid file names a process the
    server never was: ``down`` must not stop it."""
    from tokenfleet.services.process import ServerProcess, read_pid

    server = ServerProcess(tmp_path, "sleeper")
    server.launch(["sleep", "30"], ready=lambda: True, timeout_s=10)
    try:
        pid, started = (tmp_path / "pid").read_text().split()
        assert read_pid(tmp_path) == int(pid)
        (tmp_path / "pid").write_text(f"{pid} {int(started) - 100}")  # another start: reused
        assert read_pid(tmp_path) is None
        (tmp_path / "pid").write_text(pid)  # as written before start times were recorded
        assert read_pid(tmp_path) == int(pid)
    finally:
        server.terminate()
    assert read_pid(tmp_path) is None


def test_kafka_cluster_ids_never_look_like_an_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """The storage tool parses ``-t -abc`` as a missing value; one CI run drew such an id."""
    # 0xf8 encodes to "-" as the first base64 character; the second draw does not.
    draws = iter([uuid.UUID(bytes=b"\xf8" + b"\x00" * 15), uuid.UUID(int=7)])
    monkeypatch.setattr(kafka.uuid, "uuid4", lambda: next(draws))
    cluster_id = kafka._cluster_id()
    assert not cluster_id.startswith("-")
    assert len(cluster_id) == 22


def test_kafka_jars_that_differ_from_the_pinned_checksums_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    for name in ("kept.jar", "tampered.jar", "extra.jar"):
        (lib / name).write_bytes(name.encode())
    pins = tmp_path / "pins.sha256"
    kept = hashlib.sha256(b"kept.jar").hexdigest()
    pins.write_text(f"{kept}  kept.jar\n{'0' * 64}  tampered.jar\n{'1' * 64}  gone.jar\n")
    monkeypatch.setattr(kafka, "JARS_SHA256", pins)
    tampered = hashlib.sha256(b"tampered.jar").hexdigest()
    assert kafka._unpinned(lib) == [
        "gone.jar missing",
        "extra.jar not pinned",
        f"tampered.jar has SHA-256 {tampered}, not {'0' * 64}",
    ]


def test_the_fetched_kafka_jars_are_the_pinned_ones() -> None:
    """``./dev test`` fetched them (Maven Central, strict checksums) before the tests."""
    lib = kafka.jars_dir()
    if not (lib.parent / "complete").exists():  # under CI=true, a failure
        unavailable("Kafka's jars are not fetched here (tokenfleet kafka fetch)")
    assert kafka._unpinned(lib) == []


def test_status_gives_up_on_a_broker_that_never_answers(
    taken_port: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A listener that accepts and never answers: aiokafka would wait its own timeouts."""
    monkeypatch.setenv("TOKENFLEET_KAFKA_BOOTSTRAP", f"127.0.0.1:{taken_port}")
    assert main(["status", "--timeout", "1", "--home", "/nonexistent"]) == 2
    assert "did not give the topics within 1 s" in capsys.readouterr().err


def test_status_reads_its_dcs_from_a_fleet_file(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("TOKENFLEET_KAFKA_BOOTSTRAP", "127.0.0.1:1")  # never reached
    assert main(["status", "--fleet", str(tmp_path / "none.toml")]) == 2
    assert "cannot read fleet file" in capsys.readouterr().err


def test_down_on_a_folder_that_does_not_exist_makes_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "never" / "deployed"
    assert main(["down", "--home", str(home)]) == 0
    assert f"no deployment in {home}" in capsys.readouterr().out
    assert not (tmp_path / "never").exists()


def test_kafka_jars_that_differ_from_the_pins_are_removed_with_the_maven_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad jar kept in ``~/.m2`` failed every fetch: Maven checks downloads, not what it
    holds. The fetch has a repository of its own, removed with the jars on a mismatch."""
    monkeypatch.setattr(kafka, "CACHE", tmp_path)
    lib, repository = kafka.jars_dir(), kafka.maven_repository()
    assert repository.parent == lib.parent  # in the cache, not ~/.m2
    bad = repository / "org" / "apache" / "kafka" / "kafka-clients.jar"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not the pinned bytes")
    lib.mkdir()
    shutil.copy(bad, lib)
    with pytest.raises(ServiceError, match=re.escape("kafka-clients.jar not pinned")) as raised:
        kafka.check_pinned(lib)
    assert str(lib) in str(raised.value)
    assert str(repository) in str(raised.value)
    assert not lib.exists()
    assert not repository.exists()


def test_the_kafka_fetch_uses_its_own_maven_repository_and_a_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kafka, "CACHE", tmp_path)
    monkeypatch.setattr(kafka.shutil, "which", lambda name: f"/usr/bin/{name}")
    ran: dict[str, Any] = {}

    def stalled(command: list[str], **options: Any) -> None:
        ran.update(command=command, **options)
        raise subprocess.TimeoutExpired(command, options["timeout"])

    monkeypatch.setattr(kafka.subprocess, "run", stalled)
    with pytest.raises(ServiceError, match=f"within {kafka.FETCH_TIMEOUT_S:g} s"):
        kafka.fetch_jars()
    assert f"-Dmaven.repo.local={kafka.maven_repository()}" in ran["command"]
    assert ran["timeout"] == kafka.FETCH_TIMEOUT_S
