"""The deployment ``tokenfleet up`` starts, and docker-compose.yml saying the same.

No Docker engine runs here: the compose file is checked by reading it (every TokenFleet
part is ``tokenfleet up``'s, with the same command line and service settings), and each
part's command line by parsing it with the CLI's own parser."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Sequence
from dataclasses import asdict, replace
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from schemas.fleet import load_fleet
from tests.local_fleet import LOCAL_FLEET, up_on_free_ports
from tokenfleet import deployment as deployment_module
from tokenfleet.cli import build_parser, main
from tokenfleet.commands.broker import broker
from tokenfleet.commands.errors import CliError
from tokenfleet.deployment import (
    GATEWAY_STOP_MARGIN_S,
    SERVICE_SETTINGS,
    Deployment,
    Part,
    plan,
)
from tokenfleet.services import kafka
from tokenfleet.services.kafka import KAFKA_VERSION
from tokenfleet.services.process import STOP_TIMEOUT_S, ServiceError, free_port
from tokenfleet.services.redis import LocalRedis

ROOT = Path(__file__).parents[2]
COMPOSE = ROOT / "docker-compose.yml"
SERVICES = {"kafka", "redis", "topics"}
"""The compose file's services that are not parts: the two services and topic creation."""
PACKAGES = ("schemas", "streams", "control", "gateway", "sim", "tokenfleet")
"""The repository's Python packages, each of which the image copies and installs."""


def local_plan(**changes: Any) -> tuple[Part, ...]:
    """What ``tokenfleet up`` starts with its defaults, run from the repository's root."""
    up = build_parser().parse_args(["up"])
    defaults = {"gateway_port": up.gateway_port, "period_s": up.period, "ttl_s": up.ttl}
    return plan(load_fleet(ROOT / up.fleet), str(up.fleet), **(defaults | changes))


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return loaded


def test_the_local_fleet_runs_an_emulator_and_a_gateway_per_dc_around_the_loop() -> None:
    names = [part.name for part in local_plan()]
    assert names == [
        "emulate-dc-a",
        "emulate-dc-b",
        "emulate-dc-c",
        "collector",
        "worker",
        "controller",
        "gateway-dc-a",
        "gateway-dc-b",
        "gateway-dc-c",
    ]
    gateways = [part.url for part in local_plan(gateway_port=9000) if part.name[:8] == "gateway-"]
    assert gateways == [f"http://127.0.0.1:{port}" for port in (9000, 9001, 9002)]
    emulators = {part.name: part.url for part in local_plan() if part.name[:8] == "emulate-"}
    assert emulators["emulate-dc-b"] == "http://127.0.0.1:8110"  # its DC's first instance


def test_every_part_serving_a_url_is_ready_by_it_and_the_worker_and_collector_by_metrics() -> None:
    """Before, the worker and the collector counted as ready once started, and an emulator
    once its first instance answered: ``up`` reported started a worker that had exited.
    Then the collector counted as ready once it had run 3 s, though it could not reach
    Kafka or died later; it serves ``/metrics`` once its bus is connected."""
    parts = {part.name: part for part in local_plan(worker_port=9191, collector_port=9194)}
    assert parts["worker"].ready_urls == ("http://127.0.0.1:9191/metrics",)
    assert parts["collector"].ready_urls == ("http://127.0.0.1:9194/metrics",)
    assert "--metrics-port" in parts["collector"].args
    assert parts["controller"].ready_urls == ("http://127.0.0.1:9090/health",)
    assert parts["gateway-dc-a"].ready_urls == ("http://127.0.0.1:8080/health",)
    fleet = load_fleet(ROOT / "examples" / "fleet-local.toml")
    for dc in fleet.dcs:
        local = fleet.local_instances(dc.name)
        serving = [f"{str(i.url).rstrip('/')}/health" for i in local if not i.standby]
        assert parts[f"emulate-{dc.name}"].ready_urls == tuple(serving)


def test_a_part_with_no_url_that_exits_at_startup_fails_the_start_by_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(deployment_module, "STARTUP_GRACE_S", 120.0)  # however slow the exit
    deployment = Deployment(tmp_path / "up")
    with pytest.raises(ServiceError, match=r"^collector exited early"):
        deployment.start([Part("collector", ("no-such-command",))], {})
    assert "invalid choice" in (tmp_path / "up" / "collector" / "server.log").read_text()
    assert not deployment.record_path.exists()


def test_every_part_is_a_command_line_the_cli_accepts() -> None:
    parser = build_parser()
    for part in local_plan(ttl_s=12.5, period_s=0.5):
        args = parser.parse_args(list(part.args))
        assert args.handler is not None, part.name
    controller = next(part for part in local_plan(ttl_s=12.5) if part.name == "controller")
    assert controller.args[-4:] == ("--ttl", "12.5", "--port", "9090")
    assert controller.url == "http://127.0.0.1:9090"  # ready once its view answers
    tuned = local_plan(long_cycle_s=30, weights_min_outcomes=5)
    controller_args = parser.parse_args(list(next(p for p in tuned if p.name == "controller").args))
    assert (controller_args.long_cycle, controller_args.weights_min_outcomes) == (30.0, 5)


def test_a_dc_with_standby_gpus_follows_placements_and_is_ready_by_a_serving_instance() -> None:
    fleet = load_fleet(ROOT / "examples" / "fleet-local.toml")
    b0 = next(i for i in fleet.instances if i.id == "b-0")
    spare = b0.model_copy(update={"id": "b-1", "standby": True})
    fleet = fleet.model_copy(update={"instances": (spare, *fleet.instances)})
    emulators = {p.name: p for p in plan(fleet, "fleet.toml") if p.name[:8] == "emulate-"}
    assert "--placement" in emulators["emulate-dc-b"].args
    assert "--placement" not in emulators["emulate-dc-a"].args
    assert emulators["emulate-dc-b"].url == str(b0.url).rstrip("/")  # not the standby one
    args = build_parser().parse_args(list(emulators["emulate-dc-b"].args))
    assert (args.placement, args.warmup) == (True, None)  # None: the default, WARMUP_S


def test_the_compose_file_runs_the_same_parts_with_the_same_settings() -> None:
    services = compose()["services"]
    parts = local_plan()
    assert [name for name in services if name not in SERVICES] == [p.name for p in parts]
    for part in parts:
        service = services[part.name]
        assert service["command"] == list(part.args), part.name
        assert set(SERVICE_SETTINGS) <= set(service["environment"]), part.name
        assert service["network_mode"] == "host", part.name  # the fleet's 127.0.0.1 URLs
        assert service["init"] is True, part.name  # SIGTERM reaches the part
        assert service["image"] == "tokenfleet:local", part.name
        assert "topics" in service["depends_on"], part.name
    settings = services["collector"]["environment"]
    kafka = services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    assert kafka == "PLAINTEXT://" + settings["TOKENFLEET_KAFKA_BOOTSTRAP"]
    assert "6379" in services["redis"]["command"]
    assert settings["TOKENFLEET_REDIS_URL"] == "redis://127.0.0.1:6379/0"


def test_every_compose_part_is_healthy_by_the_urls_up_waits_on() -> None:
    """Only Kafka and Redis had a health check: ``docker compose ps`` showed a worker that
    could not reach Kafka, or a gateway that never bound its port, as running."""
    services = compose()["services"]
    for part in local_plan():
        check = services[part.name]["healthcheck"]["test"]
        assert check == ["CMD", "python", "-c", compose()["x-probe"], *part.ready_urls], part.name


def test_the_compose_health_probe_fails_until_every_url_answers() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    answers = f"http://127.0.0.1:{server.server_address[1]}/health"
    probe = [sys.executable, "-c", compose()["x-probe"]]
    try:
        assert subprocess.run([*probe, answers], timeout=30).returncode == 0
        closed = f"http://127.0.0.1:{free_port()}/health"
        failed = subprocess.run([*probe, answers, closed], capture_output=True, timeout=30)
        assert failed.returncode != 0
    finally:
        server.shutdown()
        server.server_close()


def test_the_compose_gateways_publish_under_names_of_their_own() -> None:
    """On the host's network the default name, gateway-<host>-<pid>, is the same in each
    container: ``status`` and the operators' page would count three gateways as one."""
    services = compose()["services"]
    for part in local_plan():
        if part.is_gateway:
            assert services[part.name]["environment"]["TOKENFLEET_GATEWAY_NAME"] == part.name


def test_the_compose_broker_keeps_its_data_on_a_volume() -> None:
    """Outside a volume, a new container of the broker starts empty: the compacted controls,
    the tables' changelogs and the journals gone."""
    kafka = compose()["services"]["kafka"]
    data = kafka["environment"]["KAFKA_LOG_DIRS"]
    assert any(volume.endswith(f":{data}") for volume in kafka["volumes"])
    assert kafka["environment"]["CLUSTER_ID"]  # the same cluster whatever container reads it


def test_the_compose_file_runs_the_kafka_the_tests_run() -> None:
    """Apache publishes an image for each Kafka release (kafka.apache.org, "Docker"); the
    tests' local broker is the same release, from Maven Central's jars."""
    assert compose()["services"]["kafka"]["image"] == f"apache/kafka:{KAFKA_VERSION}"


def test_the_dockerfile_installs_every_package_the_parts_import() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in PACKAGES:
        assert f"COPY {package} {package}" in dockerfile
    assert 'ENTRYPOINT ["tokenfleet"]' in dockerfile
    assert "COPY examples examples" in dockerfile  # the fleet file the commands name
    users = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")]
    assert users, "the parts run unprivileged"
    assert users[-1] not in {"root", "0"}


def test_an_installed_copy_carries_the_data_its_jobs_read(tmp_path: Path) -> None:
    """The image installs the project with ``pip install .``, not from the source tree: the
    wheel must carry every trace and measurement file, and the loaders must find them in
    the installed copy (before, the wheel held none, so an installed ``tokenfleet demo``
    could not find its trace)."""
    source = tmp_path / "source"  # what the Dockerfile copies, without a build's left-overs
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__py*"))
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    built = subprocess.run(
        [*build, "-w", str(tmp_path), str(source)], capture_output=True, text=True
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("tokenfleet-*.whl")
    installed = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(installed)
    data = ROOT / "sim" / "data"
    for path in [*data.rglob("*"), kafka.JARS_SHA256]:
        if path.is_file():
            assert (installed / path.relative_to(ROOT)).is_file(), path
    check = (
        "from sim import calibration, traces; "
        "print(traces.traces_dir(), calibration.calibration_dir(), sep='\\n'); "
        "print(len(traces.load_mooncake(limit=5)), len(calibration.load_stages()))"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TOKENFLEET_")}
    ran = subprocess.run(
        [sys.executable, "-c", check],
        cwd=tmp_path,
        env=clean | {"PYTHONPATH": str(installed)},
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 0, ran.stderr
    traces_dir, calibration_dir, counts = ran.stdout.splitlines()
    assert Path(traces_dir).resolve() == (installed / "sim" / "data" / "traces").resolve()
    assert Path(calibration_dir).resolve() == (installed / "sim" / "data" / "calibration").resolve()
    mooncake, stages = map(int, counts.split())
    assert mooncake == 5
    assert stages > 0


def test_up_refuses_a_missing_fleet_file_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "up"
    assert main(["up", "--home", str(home), "--fleet", str(tmp_path / "none.toml")]) == 2
    assert "cannot read fleet file" in capsys.readouterr().err
    assert Deployment(home).parts() == []
    assert main(["down", "--home", str(home)]) == 0  # nothing to stop is no error


def test_up_refuses_a_fleet_file_naming_an_unknown_profile_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It started Kafka and Redis, then an emulator exited with a KeyError's traceback."""
    fleet = tmp_path / "fleet.toml"
    text = (ROOT / "examples" / "fleet-local.toml").read_text()
    fleet.write_text(text.replace('profile = "', 'profile = "nosuch-', 1))
    home = tmp_path / "up"
    assert main(["up", "--home", str(home), "--fleet", str(fleet)]) == 2
    assert "unknown profile 'nosuch-" in capsys.readouterr().err
    assert Deployment(home).parts() == []
    assert main(["emulate", "--fleet", str(fleet)]) == 2
    assert "unknown profile 'nosuch-" in capsys.readouterr().err


def test_up_refuses_a_redis_that_does_not_answer_and_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It started every part, whose gateways each ran on state of their own, warning in
    their logs only; up said Redis was there and status that the loop was closed."""
    monkeypatch.setenv("TOKENFLEET_KAFKA_BOOTSTRAP", "127.0.0.1:1")  # not reached before
    monkeypatch.setenv("TOKENFLEET_REDIS_URL", f"redis://:secret@127.0.0.1:{free_port()}/0")
    home = tmp_path / "up"
    assert main(["up", "--home", str(home), *up_on_free_ports(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "Redis at redis://:***@127.0.0.1:" in error
    assert "does not answer, or refuses" in error
    assert "secret" not in error
    assert Deployment(home).parts() == []


@pytest.mark.parametrize("command", ["up", "down", "status"])
def test_a_home_that_cannot_be_a_folder_is_named_not_a_traceback(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """status said the deployment recorded there might still run."""
    taken = tmp_path / "a-file"
    taken.write_text("")
    assert main([command, "--home", str(taken)]) == 2
    assert f"--home {taken}: not a folder to keep a deployment in" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("setting", "error"),
    [
        (["--weights-min-outcomes", "0"], "--weights-min-outcomes must be at least 1"),
        (["--long-cycle", "0"], "--long-cycle must be a positive number of seconds"),
        (["--period", "5", "--ttl", "10"], "--ttl finite and at least three periods"),
        (["--ttl", "inf"], "--ttl finite"),
        (["--ttl", "nan"], "--ttl finite"),
    ],
)
def test_up_refuses_controllers_that_cannot_run_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setting: list[str], error: str
) -> None:
    home = tmp_path / "up"
    assert main(["up", "--home", str(home), *setting]) == 2
    assert error in capsys.readouterr().err
    assert Deployment(home).parts() == []


def test_up_stops_the_broker_it_started_when_redis_then_fails_to_start(
    tmp_path: Path,
    taken_port: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Kafka is recorded as the deployment's own before it starts, so a failure after it
    (here a real redis-server that cannot bind its port) stops it rather than leaving a
    broker that ``down`` cannot find. The broker is a stand-in: what is checked is the
    order of the records, not Kafka."""
    calls = []

    class Broker:
        def __init__(self, home: Path) -> None:
            self.home = home

        def start(self, *, detach: bool) -> str:
            assert Deployment(home).record()["own_services"] == ["kafka"]
            calls.append("started")
            return "127.0.0.1:1"

        def stop(self) -> None:
            calls.append("stopped")

    monkeypatch.setattr("tokenfleet.deployment.LocalKafka", Broker)
    monkeypatch.setattr("tokenfleet.deployment.running_bootstrap", lambda home: None)
    monkeypatch.setattr("tokenfleet.deployment.LocalRedis", partial(LocalRedis, port=taken_port))
    home = tmp_path / "up"
    assert main(["up", "--home", str(home), *up_on_free_ports(tmp_path)]) == 2
    assert "the deployment did not start" in capsys.readouterr().err
    assert calls == ["started", "stopped"]
    assert not Deployment(home).record_path.exists()


def test_an_own_service_left_running_is_stopped_when_up_is_given_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parts killed, Redis left running, then up with TOKENFLEET_REDIS_URL set: the first
    Redis ran on, named by no record, and down never stopped it."""
    stopped = []

    class Server:
        def __init__(self, home: Path) -> None:
            self.home = home

        def stop(self) -> None:
            stopped.append(self.home.name)

    monkeypatch.setattr("tokenfleet.deployment.LocalRedis", Server)
    monkeypatch.setattr("tokenfleet.deployment.running_url", lambda home: "redis://own")
    deployment = Deployment(tmp_path / "up")
    monkeypatch.setattr(Deployment, "service_pids", lambda self: {"redis": 4242})
    env = {"TOKENFLEET_KAFKA_BOOTSTRAP": "127.0.0.1:1", "TOKENFLEET_REDIS_URL": "redis://own"}
    deployment.with_own_services(env)  # named as up printed it: still this deployment's
    assert stopped == []
    _, started = deployment.with_own_services(env | {"TOKENFLEET_REDIS_URL": "redis://x"})
    assert (stopped, started) == (["redis"], [])


def test_a_part_whose_port_already_answers_is_refused_before_it_starts(tmp_path: Path) -> None:
    """Another server on the port would answer the new part's health check while the new
    part failed to bind: ``up`` would report started a part that had exited."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    deployment = Deployment(tmp_path / "up")
    try:
        with pytest.raises(ServiceError, match="already answers"):
            deployment.start([Part("gateway-dc-a", ("gateway",), url, (f"{url}/health",))], {})
    finally:
        server.shutdown()
        server.server_close()
    assert not (tmp_path / "up" / "gateway-dc-a" / "pid").exists()
    assert not deployment.record_path.exists()


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_the_controller_refuses_a_taken_view_port_before_it_starts(
    taken_port: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENFLEET_KAFKA_BOOTSTRAP", "127.0.0.1:1")  # never reached
    assert main(["controller", "--port", str(taken_port)]) == 2
    assert f"cannot listen on 127.0.0.1:{taken_port}" in capsys.readouterr().err
    assert main(["controller", "--period", "5", "--ttl", "10"]) == 2  # renewed too late


def test_a_truncated_record_is_named_by_up_down_and_status_and_skipped_by_an_env_broker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record cut short used to make every command that reads it traceback, the Kafka
    commands too, though ``TOKENFLEET_KAFKA_BOOTSTRAP`` named their broker."""
    home = tmp_path / "up"
    home.mkdir()
    (home / "deployment.json").write_text('{"parts": [{"name": "collector", "ar')
    for command in (["up"], ["down"], ["status"]):
        assert main([*command, "--home", str(home)]) == 2, command
        err = capsys.readouterr().err
        assert f"cannot read {home / 'deployment.json'}" in err, command
        assert "then remove" in err, command
    monkeypatch.setenv("TOKENFLEET_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    assert broker(home) == "127.0.0.1:1"


def test_a_record_whose_part_lacks_its_arguments_is_named_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Edited by hand: up and down ended in KeyError: 'args' (exit 1)."""
    home = tmp_path / "up"
    home.mkdir()
    record = {"parts": [{"name": "collector", "url": "x"}], "settings": {}, "own_services": []}
    (home / "deployment.json").write_text(json.dumps(record))
    for command in (["up"], ["down"]):
        assert main([*command, "--home", str(home)]) == 2, command
        err = capsys.readouterr().err
        assert "a part without 'args'" in err, command


def test_status_reads_the_dcs_of_the_fleet_file_up_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --fleet, a deployment up had run before with another fleet file left its
    DCs' last controls on the topics: status read the loop open for good."""
    home = tmp_path / "up"
    home.mkdir()
    fleet = tmp_path / "gone.toml"
    part = {"name": "gateway", "args": ["gateway", "--fleet", str(fleet)], "url": "x"}
    settings = {"TOKENFLEET_KAFKA_BOOTSTRAP": "127.0.0.1:1"}
    record = {"parts": [part], "settings": settings, "own_services": []}
    (home / "deployment.json").write_text(json.dumps(record))
    assert main(["status", "--home", str(home), "--timeout", "1"]) == 2  # the broker is away
    err = capsys.readouterr().err  # read, and gone since: every DC is judged, as before
    assert f"cannot read fleet file {fleet}" in err
    assert "every DC on the topics is judged" in err
    fleet.write_text(LOCAL_FLEET.read_text())  # back, without dc-z: named, as no --fleet did
    assert main(["status", "--home", str(home), "--dc", "dc-z", "--timeout", "1"]) == 2
    assert f"--dc dc-z: the fleet file has no such DC ({fleet})" in capsys.readouterr().err


def test_a_record_whose_write_fails_midway_is_left_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deployment = Deployment(tmp_path / "up")
    deployment.start([], {"TOKENFLEET_KAFKA_BOOTSTRAP": "127.0.0.1:1"})
    write_text = Path.write_text

    def disk_full(path: Path, text: str) -> int:
        write_text(path, text[: len(text) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(CliError, match="No space left"):
        deployment.start([], {"TOKENFLEET_KAFKA_BOOTSTRAP": "127.0.0.1:2"})
    monkeypatch.undo()
    assert deployment.record()["settings"] == {"TOKENFLEET_KAFKA_BOOTSTRAP": "127.0.0.1:1"}


def test_a_part_imports_the_project_not_a_package_of_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m`` put the working folder first on the child's path: an operator's own
    ``schemas/`` there was imported in place of the project's, and every part failed."""
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "__init__.py").write_text("raise ImportError('the folder shadows')")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(deployment_module, "STARTUP_GRACE_S", 120.0)  # however slow the exit
    with pytest.raises(ServiceError, match="exited early"):
        Deployment(tmp_path / "up").start([Part("collector", ("no-such-command",))], {})
    log = (tmp_path / "up" / "collector" / "server.log").read_text()
    assert "invalid choice" in log  # the CLI's own parser ran


def test_up_and_down_refuse_at_once_a_folder_another_up_or_down_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing kept two at once apart: ``down`` during ``up`` stopped what was recorded
    while ``up`` went on starting parts that no record then named."""
    home = tmp_path / "up"
    home.mkdir()
    (home / "deployment.json").write_text('{"parts": [], "settings": {}, "own_services": []}')
    missing = str(tmp_path / "none.toml")  # an up let through would start nothing
    with (home / "up.lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another up, say
        for command in (["down"], ["up", "--fleet", missing]):
            assert main([*command, "--home", str(home)]) == 2, command
            err = capsys.readouterr().err
            assert f"another tokenfleet up/down is running on {home}" in err, command
        assert (home / "deployment.json").exists()  # down stopped nothing
    assert main(["down", "--home", str(home)]) == 0
    assert not (home / "deployment.json").exists()


def test_the_gateways_stop_timeout_follows_their_drain_and_is_recorded(tmp_path: Path) -> None:
    """``down`` killed every part 30 s after its SIGTERM, whatever the gateways' drain: with
    ``TOKENFLEET_GATEWAY_DRAIN_S=60`` a gateway was killed halfway through draining."""
    parts = local_plan(gateway_drain_s=60)
    timeouts = {part.name: part.stop_timeout_s for part in parts}
    assert timeouts["gateway-dc-c"] == 60 + GATEWAY_STOP_MARGIN_S
    assert timeouts["controller"] == STOP_TIMEOUT_S
    assert local_plan()[-1].stop_timeout_s == 25 + GATEWAY_STOP_MARGIN_S  # the gateway's default
    deployment = Deployment(tmp_path / "up")
    _record(deployment, parts)
    assert deployment.parts() == list(parts)  # down, from another process, reads them back


def test_down_kills_a_part_still_running_its_recorded_stop_timeout_after_sigterm(
    tmp_path: Path,
) -> None:
    home = tmp_path / "up"
    part = replace(_draining(home, "gateway-dc-a", drain_s=120), stop_timeout_s=1)
    _record(Deployment(home), [part])
    started = time.monotonic()
    Deployment(home).stop()
    assert time.monotonic() - started < 10  # not the fixed 30 s
    assert Deployment(home).pids() == {}
    assert not (home / part.name / "pid").exists()


def test_down_never_kills_a_process_that_took_over_a_stopping_part_s_id(tmp_path: Path) -> None:
    """While ``down`` waits out a part's stop, the part's id may come to name another
    process (it exited, and the system reused the id): its pid file's start time then no
    longer matches, and that process is not killed. Here the file is changed under the
    wait, as a reused id would read."""
    home = tmp_path / "up"
    part = replace(_draining(home, "gateway-dc-a", drain_s=120), stop_timeout_s=2)
    pid_file = home / part.name / "pid"
    pid = int(pid_file.read_text().split()[0])
    _record(Deployment(home), [part])
    taken_over = threading.Timer(0.5, lambda: pid_file.write_text(f"{pid} 0"))
    taken_over.start()
    try:
        Deployment(home).stop()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state != "Z"  # still runs: not killed as the part it no longer is
    finally:
        taken_over.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_down_signals_every_gateway_before_waiting_for_any(tmp_path: Path) -> None:
    """One at a time, ``down`` took as many drains as there are gateways: each now hears
    its SIGTERM before any has finished draining, and none is killed."""
    home = tmp_path / "up"
    parts = [_draining(home, f"gateway-dc-{dc}", drain_s=2) for dc in "abc"]
    pids = [(home / part.name / "pid").read_text().split()[0] for part in parts]
    _record(Deployment(home), parts)
    Deployment(home).stop()
    heard, drained = [], []
    for part, pid in zip(parts, pids, strict=True):
        at_signal, at_end, by = (home / part.name / "drained").read_text().split()
        assert by == pid, part.name  # not killed
        heard.append(float(at_signal))
        drained.append(float(at_end))
    assert max(heard) < min(drained)


_DRAINS = """
import os, pathlib, signal, sys, time
folder, drain_s = pathlib.Path(sys.argv[1]), float(sys.argv[2])
def drain(*_):
    heard = time.time()
    time.sleep(drain_s)
    (folder / "drained").write_text(f"{heard} {time.time()} {os.getpid()}")
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
(folder / "ready").touch()
while True:
    time.sleep(1)
"""
"""A process that, on SIGTERM, takes ``drain_s`` to exit, then says when it heard the signal,
when it ended and its pid, as a gateway drains."""


def _draining(home: Path, name: str, drain_s: float) -> Part:
    """A part that takes ``drain_s`` to exit after SIGTERM, running from ``home/name`` as
    one that another process (``up``) started: not this one's child."""
    folder = home / name
    folder.mkdir(parents=True)
    detached = '"$@" >/dev/null 2>&1 & echo $! >pid'
    argv = [sys.executable, "-c", _DRAINS, str(folder), str(drain_s)]
    subprocess.run(["sh", "-c", detached, "sh", *argv], cwd=folder, check=True)
    deadline = time.monotonic() + 30
    while not (folder / "ready").exists():
        assert time.monotonic() < deadline, f"{name} did not start"
        time.sleep(0.05)
    return Part(name, ("gateway",), stop_timeout_s=drain_s + 10)


def _record(
    deployment: Deployment,
    parts: Sequence[Part],
    own_services: Sequence[str] = (),
    kafka: str | None = None,
) -> None:
    """Record ``parts`` (on the broker at ``kafka``) as ``up`` does, without starting them."""
    deployment.home.mkdir(parents=True, exist_ok=True)
    settings = {} if kafka is None else {"TOKENFLEET_KAFKA_BOOTSTRAP": kafka}
    parts_recorded = [asdict(part) for part in parts]
    record = {"parts": parts_recorded, "settings": settings, "own_services": [*own_services]}
    deployment.record_path.write_text(json.dumps(record))


def test_a_recorded_broker_counts_only_while_the_deployments_own_kafka_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a reboot the record stayed: ``tokenfleet kafka start`` then ``topics create``
    targeted the dead address the record named, not the broker that ran."""
    monkeypatch.delenv("TOKENFLEET_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.setattr("tokenfleet.services.kafka.DEFAULT_HOME", tmp_path / "kafka")
    _running_as(tmp_path / "kafka", "127.0.0.1:2")  # tokenfleet kafka start's
    home = tmp_path / "up"
    _record(Deployment(home), [], own_services=["kafka"], kafka="127.0.0.1:1")
    assert broker(home) == "127.0.0.1:2"
    _running_as(home / "kafka", "127.0.0.1:1")
    assert broker(home) == "127.0.0.1:1"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A deployment's folder for ``status``, no broker named in the environment."""
    monkeypatch.delenv("TOKENFLEET_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.setattr("tokenfleet.services.kafka.DEFAULT_HOME", tmp_path / "kafka")
    return tmp_path / "up"


def test_status_says_which_parts_and_services_run_before_failing_on_a_dead_own_broker(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It failed at once with "cannot read the topics", saying nothing of the processes."""
    own = ["kafka", "redis"]
    _record(Deployment(home), [Part("collector", ())], own_services=own, kafka="127.0.0.1:1")
    _running_as(home / "redis", "redis://127.0.0.1:3/0")
    assert main(["status", "--home", str(home), "--timeout", "5"]) == 2
    printed = capsys.readouterr()
    lines = [line.split() for line in printed.out.splitlines()]
    assert ["NO", "process", "collector", "not", "running"] in lines
    assert ["NO", "process", "kafka", "not", "running"] in lines
    assert ["ok", "process", "redis", "pid", str(os.getpid())] in lines
    assert "Kafka broker (127.0.0.1:1) is not running" in printed.err
    # up refuses while a part runs: down first (the advice was up, which then refused)
    assert f"tokenfleet down --home {home} stops what remains, then tokenfleet up" in printed.err


def test_status_names_a_running_part_that_does_not_answer(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A frozen gateway (SIGSTOP) still runs: status said ok, and the loop closed."""
    frozen = socket.create_server(("127.0.0.1", 0))  # takes connections, never answers
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    silent, alive = (f"http://127.0.0.1:{s.getsockname()[1]}" for s in (frozen, server.socket))
    parts = [Part(name, (), url, (f"{url}/health",)) for name, url in (("a", silent), ("b", alive))]
    try:
        _record(Deployment(home), parts, own_services=["kafka"], kafka="127.0.0.1:1")
        for part in parts:
            _running_as(home / part.name, part.url or "")
        assert main(["status", "--home", str(home), "--timeout", "5"]) == 2  # its broker is gone
    finally:
        frozen.close()
        server.shutdown()
        server.server_close()
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    pid = str(os.getpid())
    assert [
        "NO",
        "process",
        "a",
        "pid",
        f"{pid},",
        "not",
        "answering",
        "at",
        f"{silent}/health",
    ] in lines
    assert ["ok", "process", "b", "pid", pid] in lines


def _running_as(folder: Path, address: str) -> None:
    """Make ``folder`` name a running server at ``address``: this process."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pid").write_text(str(os.getpid()))
    (folder / "address").write_text(address)


@pytest.mark.parametrize(
    ("ports", "users"),
    [
        (["--gateway-port", "9089"], ("controller", "gateway-dc-b")),  # 9089, 9090, 9091
        (["--worker-port", "9090"], ("worker", "controller")),
        (["--collector-port", "9091"], ("collector", "worker")),
        (["--controller-port", "8111"], ("emulate-dc-b (instance b-1)", "controller")),
        (["--gateway-port", "8099"], ("emulate-dc-a (instance a-0)", "gateway-dc-b")),
    ],
)
def test_up_refuses_two_servers_of_its_plan_on_one_port_before_starting_anything(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    ports: list[str],
    users: tuple[str, str],
) -> None:
    """Found when the second started, after Kafka, Redis, the emulators, the worker and
    the controller, a clash named the plan's own controller as "another server"."""

    def started(*args: object) -> None:
        raise AssertionError("started the services")

    monkeypatch.setattr(Deployment, "with_own_services", started)
    home = tmp_path / "up"
    assert (
        main(
            ["up", "--home", str(home), "--fleet", str(ROOT / "examples/fleet-local.toml"), *ports]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"is both {users[0]}'s and {users[1]}'s" in err
    assert not Deployment(home).record_path.exists()


def test_up_refuses_a_port_another_server_holds_before_starting_anything(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    taken_port: int,
) -> None:
    """Found as its part started (about 25 s in, after Kafka, Redis and the parts before
    it), then everything started was stopped again. A listener that never answers HTTP
    counts too: the check at each part's start asks for an answer."""

    def started(*args: object) -> None:
        raise AssertionError("started the services")

    monkeypatch.setattr(Deployment, "with_own_services", started)
    home = tmp_path / "up"
    ports = [*up_on_free_ports(tmp_path), "--collector-port", str(taken_port)]
    assert main(["up", "--home", str(home), *ports]) == 2
    err = capsys.readouterr().err
    assert f"collector: another server holds 127.0.0.1:{taken_port}; stop it" in err
    assert not Deployment(home).record_path.exists()
