"""Options that could not do what they say are refused while the command line is read,
and a URL as the commands print it is taken as it is printed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.local_fleet import LOCAL_FLEET
from tokenfleet.cli import build_parser, main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["calibrate", "--profile", "llama3-70b-4xh100", "--iterations", "-5"], "0 or more"),
        (["bench", "gateway", "--json", "g.json", "--litellm", "x", "--no-litellm"], "not allowed"),
        (["emulate", "--warmup", "-1"], "a finite number of seconds, 0 or more, not -1"),
        # "not negative" for a NaN
        (["sim", "--trace", "mixed", "--host-token-lag", "nan"], "0 or more, not nan"),
        # " is a folder: give a file to write"
        (["sim", "--trace", "mixed", "--json", ""], "an empty name: give a file to write"),
        # the current folder: schemas export wrote its 23 files there
        (["schemas", "export", ""], "an empty name: give a folder"),
        (["demo", "--out", ""], "an empty name: give a folder"),
        # it served the default model name; bench admission said "unknown routers: "
        (["emulate", "--model", " "], "an empty name"),
        (["bench", "admission", "--json", "a.json", "--router", ""], "invalid choice: ''"),
        # numpy refuses a negative seed, once the run has started: demo with a traceback
        (["demo", "--seed", "-5"], "a seed is 0 or more, not -5"),
        (["sim", "--trace", "mixed", "--seed", "-1"], "a seed is 0 or more"),
        (["workload", "export", "--trace", "mixed", "--out", "w.csv", "--seed", "-1"], "0 or more"),
        (["bench", "fleet", "--json", "f.json", "--seed", "-1"], "a seed is 0 or more"),
        (["bench", "routing", "--trace", "mixed", "--json", "r.json", "--seed", "-1"], "0 or more"),
        (["bench", "admission", "--trace", "mixed", "--json", "a.json", "--seed", "x"], "whole"),
        # nan ran every step in no time: every request "completed", every latency null
        (["sim", "--trace", "mooncake", "--blackbox", "nan,0,0,0,0,0"], "finite non-negative"),
        (["sim", "--trace", "mooncake", "--blackbox", "1,inf,0,0,0,0"], "finite non-negative"),
        # aiokafka answered "invalid literal for int() with base 10: 'notaport'"
        (["topics", "create", "--bootstrap", "127.0.0.1:notaport"], "host[:port], not"),
        (["topics", "create", "--bootstrap", "a:9092,b:0"], "host[:port], not 'b:0'"),
        (["topics", "create", "--bootstrap", "a:9092,"], "host[:port], not ''"),
        # a repeated policy ran twice; an empty one was "unknown policies: "
        (["bench", "fleet", "--json", "f.json", "--policies", "fleetmind,fleetmind"], "more than"),
        (["bench", "decision", "--json", "d.json", "--policies", "tokenpilot,"], "an empty name"),
        (["bench", "routing", "--trace", "mixed", "--json", "r.json", "--policies", ""], "empty"),
        # named only once the recorded arrivals had been read from Kafka
        (["whatif", "--dc-policy", "nope"], "invalid choice: 'nope'"),
    ],
)
def test_contradictory_or_negative_options_are_refused_at_parse_time(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(argv)
    assert refused.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--weights-per-region"], ["--weights-min-outcomes", "5"]])
def test_the_controller_refuses_weights_flags_without_a_fleet(
    flags: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """They were ignored: no fleet, no weights controller."""
    monkeypatch.delenv("TOKENFLEET_KAFKA_BOOTSTRAP", raising=False)
    assert main(["controller", *flags]) == 2
    assert f"tokenfleet: {flags[0]}: without --fleet" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--region", "eu-west"], "--region"),
        (["--dc", "dc-a", "--warmup", "0"], "--dc, --warmup"),
    ],
)
def test_emulate_refuses_fleet_options_without_a_fleet(
    options: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["emulate", *options]) == 2
    assert f"tokenfleet: without --fleet, {named} would do nothing" in capsys.readouterr().err


def test_emulate_refuses_a_dc_whose_instances_all_wait_on_standby_without_placement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It ran for good, serving nothing and saying nothing."""
    serving = 'url = "http://127.0.0.1:8110"\nmodel = "emulated"\n'
    text = LOCAL_FLEET.read_text().replace(serving, f"{serving}standby = true\n")
    assert text.count("standby = true") == 2  # dc-b's two instances
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(text)
    assert main(["emulate", "--fleet", str(fleet), "--dc", "dc-b"]) == 2
    assert "every instance here is on standby: --placement starts them" in capsys.readouterr().err


@pytest.mark.parametrize("printed", ["http://127.0.0.1:8100/v1", "http://127.0.0.1:8100/v1/"])
def test_replay_takes_the_url_emulate_and_gateway_print(printed: str) -> None:
    args = build_parser().parse_args(["replay", "--trace", "mooncake", "--target", printed])
    plain = build_parser().parse_args(["replay", "--trace", "mooncake", "--target", printed[:-3]])
    assert args.target.rstrip("/") == plain.target.rstrip("/")  # so /v1/completions, once


@pytest.mark.parametrize(
    ("variable", "value", "argv", "message"),
    [
        ("TOKENFLEET_REDIS_URL", "redis://127.0.0.1:1", ["gateway", "--no-litellm"], "answer"),
        ("TOKENFLEET_REDIS_URL", "notaurl", ["gateway", "--no-litellm"], "REDIS_URL: Redis URL"),
        ("TOKENFLEET_KAFKA_BOOTSTRAP", "127.0.0.1:1", ["streams"], "cannot create the topics"),
    ],
)
def test_a_bench_refuses_a_service_it_cannot_reach_before_it_measures(
    variable: str,
    value: str,
    argv: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each was a traceback: the gateway's Redis once the measurements without it had run
    (about 18 s), the streams bench's broker at its start."""
    monkeypatch.setenv(variable, value)
    assert main(["bench", *argv, "--json", str(tmp_path / "b.json")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


def test_a_broker_address_in_the_environment_is_checked_and_its_variable_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOKENFLEET_KAFKA_BOOTSTRAP", "127.0.0.1:notaport")
    assert main(["topics", "create"]) == 2
    error = capsys.readouterr().err
    assert "TOKENFLEET_KAFKA_BOOTSTRAP" in error
    assert "host[:port], not '127.0.0.1:notaport'" in error


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read {path}: No such file or directory (TOKENFLEET_CALIBRATION)"),
        ("experiment,n_failures\nx,zero\n", "{path}, line 2: not a measured stage"),
        ("experiment,n_failures\n", "{path} has no measured stage of"),
    ],
)
def test_calibrate_names_calibration_data_it_cannot_use(
    content: str | None,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A missing or malformed file printed a traceback; one without rows, an empty table."""
    path = tmp_path / "inference_perf_stages.csv"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv("TOKENFLEET_CALIBRATION", str(tmp_path))
    argv = ["calibrate", "--profile", "llama3-70b-4xh100", "--iterations", "0"]
    assert main(argv) == 2
    assert message.format(path=path) in capsys.readouterr().err


def test_a_rate_scale_that_spreads_arrivals_past_any_time_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """1e-310 passed as a positive rate: each arrival divided by it was infinite, and the
    run printed figures and exited 0."""
    argv = ["sim", "--trace", "azure-conv", "--requests", "20", "--rate-scale", "1e-310"]
    assert main(argv) == 2
    assert "rate scale 1e-310 spreads the arrivals past any time" in capsys.readouterr().err
