from __future__ import annotations

import csv
import json
from dataclasses import fields, replace
from pathlib import Path

import pytest

from control.routing import make_router
from sim.cluster import Cluster
from sim.decision_bench import time_decisions
from sim.export import export_csv
from sim.ladder import instance_capacity_rps, offered_rate_rps
from sim.profiles import profile
from sim.run import misjudged
from sim.simulator import Simulation
from sim.workload import TraceRequest
from tokenfleet.cli import main


def test_sim_writes_its_summary_and_one_record_per_request(tmp_path: Path) -> None:
    out, records = tmp_path / "run.json", tmp_path / "records.csv"
    code = main(
        [
            "sim",
            "--trace",
            "azure-conv",
            "--requests",
            "200",
            "--instances",
            "2",
            "--policy",
            "least_requests",
            "--json",
            str(out),
            "--records",
            str(records),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["summary"]["requests"] == 200
    assert result["policy"] == "least_requests"
    assert 0 < result["summary"]["ttft_p50_s"] <= result["summary"]["ttft_p99_s"]
    with records.open() as rows:
        assert len(list(csv.DictReader(rows))) == 200


def test_a_ladder_runs_each_level_with_more_load(tmp_path: Path) -> None:
    out, records = tmp_path / "ladder.json", tmp_path / "ladder.csv"
    assert (
        main(
            [
                "sim",
                "--trace",
                "azure-code",
                "--requests",
                "300",
                "--instances",
                "2",
                "--ladder",
                "0.3,1.5",
                "--json",
                str(out),
                "--records",
                str(records),
            ]
        )
        == 0
    )
    low, high = json.loads(out.read_text())["levels"]
    assert (low["level"], high["level"]) == (0.3, 1.5)
    assert high["rate_scale"] == pytest.approx(5 * low["rate_scale"])
    assert high["summary"]["e2e_p95_s"] > low["summary"]["e2e_p95_s"]
    # each request once per level, the level saying which (the rows were mixed)
    rows = list(csv.DictReader(records.read_text().splitlines()))
    assert [float(r["level"]) for r in rows] == [0.3] * 300 + [1.5] * 300
    assert float(rows[-1]["rate_scale"]) == pytest.approx(high["rate_scale"])


BROKEN_TRACE = '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n{bad\n'
WRONG_TYPE = '{"timestamp": 0, "input_length": "x", "output_length": 5, "hash_ids": [1]}\n'
BEFORE_ITS_START = '{"timestamp": -5, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n'


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trace", "nope"], "unknown trace 'nope'"),
        (["--trace", "{tmp}/missing.jsonl"], "trace file {tmp}/missing.jsonl not found"),
        (["--trace", "{tmp}/broken.jsonl"], "{tmp}/broken.jsonl line 2: not JSON"),
        (["--trace", "{tmp}/latin1.jsonl"], "{tmp}/latin1.jsonl: not UTF-8 text"),
        (
            ["--trace", "{tmp}/typed.jsonl"],
            "line 1: input_length must be a whole number, 1 or more, not 'x'",
        ),
        # workload export wrote the negative arrival into its CSV
        (["--trace", "{tmp}/negative.jsonl"], "line 1: timestamp must be a finite number of"),
        # the line after a blank one is named by its own number
        (["--trace", "{tmp}/gap.jsonl"], "{tmp}/gap.jsonl line 3: not JSON"),
        (["--trace", "mooncake", "--instances", "0"], "must be at least 1, not 0"),
        (
            ["--trace", "mooncake", "--admission", "mooncake_early_reject"],
            "'mooncake_early_reject' needs a router that predicts TTFT, as tokenpilot does; "
            "behind 'round_robin' it would refuse every request",
        ),
        (["--trace", "mooncake", "--rate-scale", "-1"], "must be a finite number above 0"),
        (["--trace", "mooncake", "--rate-scale", "nan"], "must be a finite number above 0"),
        (["--trace", "mooncake", "--ladder", "1,nan"], "must be a finite number above 0, not nan"),
        (["--trace", "mooncake", "--json", "{tmp}"], "is a folder: give a file to write"),
    ],
)
def test_bad_sim_arguments_exit_2_with_a_message_before_any_work(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "broken.jsonl").write_text(BROKEN_TRACE)
    (tmp_path / "typed.jsonl").write_text(WRONG_TYPE)
    (tmp_path / "negative.jsonl").write_text(BEFORE_ITS_START)
    (tmp_path / "gap.jsonl").write_text(BROKEN_TRACE.replace("\n", "\n\n", 1))
    latin1 = BROKEN_TRACE.replace("bad", "caf\u00e9").encode("latin-1")
    (tmp_path / "latin1.jsonl").write_bytes(latin1)
    try:
        code = main(["sim", *(a.format(tmp=tmp_path) for a in argv)])
    except SystemExit as exc:  # refused while the command line is read
        code = exc.code
    assert code == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["sim", "--trace", "{trace}", "--json", "{trace}"],
            "--trace and --json both name {trace}",
        ),
        (
            ["sim", "--trace", "mooncake", "--json", "{tmp}/a", "--records", "{tmp}/a"],
            "--json and --records both name {tmp}/a",
        ),
        (
            ["workload", "export", "--trace", "{trace}", "--out", "{trace}"],
            "--trace and --out both name {trace}",
        ),
        (
            ["bench", "routing", "--trace", "{trace}", "--json", "{trace}"],
            "--trace and --json both name {trace}",
        ),
        (
            ["replay", "--trace", "{trace}", "--target", "http://127.0.0.1:9", "--json", "{trace}"],
            "--trace and --json both name {trace}",
        ),
        (["audit", "--from", "{trace}", "--json", "{trace}"], "--from {trace} and --json both"),
        (["whatif", "--fleet", "{trace}", "--json", "{trace}"], "--fleet and --json both name"),
    ],
)
def test_an_output_that_would_replace_an_input_or_another_output_is_refused(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It replaced the trace (or one output the other) and the run ended with 0."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(BROKEN_TRACE.splitlines()[0] + "\n")
    names = {"tmp": tmp_path, "trace": trace}
    assert main([a.format(**names) for a in argv]) == 2
    assert message.format(**names) in capsys.readouterr().err
    assert trace.read_text() == BROKEN_TRACE.splitlines()[0] + "\n"


def test_a_burst_measures_capacity_and_a_trace_its_offered_rate() -> None:
    requests = [TraceRequest(f"r{n}", n * 0.5, 500, 50, ()) for n in range(600)]
    assert offered_rate_rps(requests) == pytest.approx(600 / 299.5)
    llama = profile("llama3-70b-4xh100")
    capacity = instance_capacity_rps(llama, requests, sample=600)
    burst = [replace(r, arrival_s=0.0) for r in requests]
    records = Simulation(Cluster.single(llama, 1), make_router("round_robin")).run(burst)
    makespan = max(r.e2e_s or 0.0 for r in records)
    # more than the burst over its makespan, which counts the drain as time unused; less
    # than 256 sequences at once (the engine's limit), each holding its place for 50 steps
    # of at least the weights' read
    assert 600 / makespan < capacity < 256 / (50 * llama.step_time.a_s)
    longer = [replace(r, input_tokens=5000) for r in requests]
    assert instance_capacity_rps(llama, longer, sample=600) < capacity  # fewer per second


def test_a_trace_a_ladder_cannot_scale_is_refused_saying_why() -> None:
    at_once = [TraceRequest(f"r{n}", 0.0, 500, 50, ()) for n in range(3)]
    with pytest.raises(ValueError, match="3 arrivals span no time"):
        offered_rate_rps(at_once)
    too_long = [TraceRequest(f"r{n}", n, 10**6, 50, ()) for n in range(3)]
    with pytest.raises(ValueError, match="none of the 3 requests sampled"):
        instance_capacity_rps(profile("llama3-70b-4xh100"), too_long)


def test_a_straggler_s_long_decode_barely_moves_the_measured_capacity() -> None:
    """The burst's drain is not capacity unused: one request decoding 8,000 tokens alone
    after 600 short ones makes the burst last 32 times longer, and a capacity read from
    its makespan (requests over it) 32 times lower."""
    short = [TraceRequest(f"r{n}", 0.0, 100, 50, ()) for n in range(600)]
    straggler = TraceRequest("long", 0.0, 100, 8_000, ())
    chosen = profile("llama3-70b-4xh100")
    alone = instance_capacity_rps(chosen, short)
    assert instance_capacity_rps(chosen, [*short, straggler]) > 0.8 * alone


def test_export_writes_prefix_groups_and_reusable_prefixes(tmp_path: Path) -> None:
    requests = [
        TraceRequest("a", 0.0, 64, 4, (1, 2, 3, 4)),
        TraceRequest("b", 0.5, 64, 4, (1, 2, 9, 9)),
        TraceRequest(
            "c", 1.0, 32, 4, (), session_id="s", round=1, prefix_group="g", prefix_tokens=16
        ),
        TraceRequest("d", 1.5, 32, 4, (), deadline_s=601.5),
    ]
    path = tmp_path / "w.csv"
    export_csv(requests, path)
    with path.open() as rows:
        a, b, c, d = csv.DictReader(rows)
    assert (a["deadline_s"], d["deadline_s"]) == ("", "601.5")  # the CSV lost it
    assert (a["prefix_group"], a["prefix_tokens"]) == ("a", "0")
    assert (b["prefix_group"], b["prefix_tokens"], b["arrival_us"]) == ("a", "32", "500000")
    assert (c["prefix_group"], c["prefix_tokens"], c["session_id"], c["round"]) == (
        "g",
        "16",
        "s",
        "1",
    )


def test_blackbox_coefficients_replace_the_profile_s_step_times(tmp_path: Path) -> None:
    """BLIS's llama-3.3-70b TP4 H100 coefficients (defaults.yaml at b563c440): a TTFT is at
    least the a2 overhead, the queueing delay a0 + a1 * input and a prefill step b0 + b1 *
    input; the first request, on an idle instance, takes exactly that."""
    b0, b1, _, a0, a1, a2 = coefficients = (12601.3, 76.4228, 66.844, 2597.32, 9.95091, 11511.4)
    records = tmp_path / "records.csv"
    argv = ["sim", "--trace", "azure-conv", "--requests", "100", "--instances", "2"]
    argv += ["--blackbox", ",".join(map(str, coefficients)), "--records", str(records)]
    assert main(argv) == 0
    with records.open() as rows:
        served = [row for row in csv.DictReader(rows) if row["outcome"] == "completed"]
    assert len(served) == 100

    def floor_s(row: dict[str, str]) -> float:
        tokens = int(row["input_tokens"])
        return (a2 + a0 + a1 * tokens + b0 + b1 * tokens) * 1e-6

    assert all(float(row["ttft_s"]) >= floor_s(row) - 1e-9 for row in served)
    first = min(served, key=lambda row: float(row["arrival_s"]))
    assert float(first["ttft_s"]) == pytest.approx(floor_s(first), abs=1e-9)


def test_bad_blackbox_coefficients_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sim", "--trace", "mooncake", "--blackbox", "1,2,3"])
    assert "six finite non-negative numbers" in capsys.readouterr().err


def test_engine_state_becomes_instance_telemetry() -> None:
    from sim.engine import Engine, Sequence
    from sim.telemetry import instance_telemetry

    engine = Engine(profile("llama3-70b-4xh100").engine, profile("llama3-70b-4xh100").step_time)
    engine.add(Sequence(TraceRequest("r", 0.0, 100, 10, ()), 0.0))
    engine.finish_step(engine.plan_step(0.0), 0.1)
    telemetry = instance_telemetry(engine, "dc/0", "dc", "llama", "v1")
    assert (telemetry.running, telemetry.waiting) == (1, 0)
    assert telemetry.kv_blocks_used == 7
    assert telemetry.inflight_tokens == 100 + 10 - 1
    assert telemetry.kv_blocks_total == engine.pool.num_blocks
    assert telemetry.prefix_cache_queries == 100


def test_the_routing_benchmark_writes_every_policy_and_the_lower_bound(tmp_path: Path) -> None:
    out, plot = tmp_path / "routing.json", tmp_path / "ttft.png"
    assert (
        main(
            [
                "bench",
                "routing",
                "--trace",
                "shared-prefix",
                "--requests",
                "120",
                "--instances",
                "2",
                "--ladder",
                "0.5,1",
                "--policies",
                "tokenpilot,round_robin,llmd_default",
                "--json",
                str(out),
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    document = json.loads(out.read_text())
    assert set(document["policies"]) == {"tokenpilot", "round_robin", "llmd_default"}
    assert document["ladder"] == [0.5, 1.0]
    bound, reference = document["lower_bound"], document["fleet_cache_reference"]
    assert reference["ttft_p50_s"] >= bound["ttft_p50_s"]
    assert reference["cache_hit_rate"] <= bound["cache_hit_rate"]
    for figures in document["policies"].values():
        assert len(figures["per_level"]) == 2
        assert figures["ttft_p50_s"] >= bound["ttft_p50_s"]
        assert figures["ttft_p95_s"] >= bound["ttft_p95_s"]
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_the_fleet_cache_reference_forgets_what_its_capacity_cannot_hold() -> None:
    from sim.routing_bench import lower_bound

    def request(name: str, arrival_s: float, blocks: range) -> TraceRequest:
        return TraceRequest(name, arrival_s, 16 * len(blocks) + 1, 8, tuple(blocks))

    # the third request repeats the first's prompt, after another prompt as long as the cache
    workload = [request("a", 0, range(10)), request("b", 1, range(10, 20))]
    workload.append(request("c", 2, range(10)))
    chosen = profile("llama3-70b-4xh100")
    unbounded, small = lower_bound(workload, chosen), lower_bound(workload, chosen, 10)
    assert unbounded["cache_hit_rate"] == pytest.approx(160 / (3 * 161))
    assert small["cache_hit_rate"] == 0.0
    assert lower_bound(workload, chosen, 20) == unbounded


def test_runs_in_worker_processes_give_the_same_figures() -> None:
    from sim.routing_bench import bench_routing

    options = dict(
        instances=2, ladder=(0.5, 1.0), requests=60, policies=["tokenpilot", "dynamo_kv"]
    )
    alone, _ = bench_routing("shared-prefix", **options)
    shared, _ = bench_routing("shared-prefix", jobs=2, **options)
    assert shared == alone


def test_the_simulated_host_s_token_lag_reaches_tokenpilot_and_the_json(tmp_path: Path) -> None:
    """TokenPilot places candidates in their steps from when the host saw them end: a
    host that sees tokens a whole step later moves where it places them, and the figures
    change. (Not in one direction on so small a run: a 30 ms lag came out 3 % lower on
    mean TTFT on 2026-12-02.)"""
    runs = {}
    for lag in ("0", "0.03"):
        out = tmp_path / f"routing-{lag}.json"
        argv = ["bench", "routing", "--trace", "shared-prefix", "--requests", "150"]
        argv += ["--instances", "4", "--ladder", "1", "--policies", "tokenpilot"]
        assert main([*argv, "--host-token-lag", lag, "--json", str(out)]) == 0
        runs[lag] = json.loads(out.read_text())
    assert runs["0.03"]["host_token_lag_s"] == 0.03
    fast, late = (runs[lag]["policies"]["tokenpilot"] for lag in ("0", "0.03"))
    assert fast["ttft_mean_s"] != late["ttft_mean_s"]


def test_the_lag_tokenpilot_assumes_reaches_it_and_the_json(tmp_path: Path) -> None:
    """The same host, TokenPilot told two different lags: it places candidates in their
    steps differently, and each run's JSON says what it assumed."""
    runs = {}
    for lag in ("0", "0.03"):
        out = tmp_path / f"sim-{lag}.json"
        argv = ["sim", "--trace", "shared-prefix", "--requests", "150", "--instances", "4"]
        argv += ["--policy", "tokenpilot"]
        assert main([*argv, "--assumed-token-lag", lag, "--json", str(out)]) == 0
        runs[lag] = json.loads(out.read_text())
    assert runs["0.03"]["tokenpilot_params"]["token_lag_s"] == 0.03
    assert runs["0.03"]["host_token_lag_s"] == runs["0"]["host_token_lag_s"]
    fast, slow = (runs[lag]["summary"]["ttft_mean_s"] for lag in ("0", "0.03"))
    assert fast != slow


@pytest.mark.parametrize("option", ["--host-token-lag", "--assumed-token-lag"])
@pytest.mark.parametrize("command", [["sim"], ["bench", "routing", "--json", "out.json"]])
def test_a_negative_token_lag_is_refused(
    command: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--trace", "shared-prefix", option, "-0.001"])
    assert exit_info.value.code == 2
    assert f"{option}: must be a finite number of seconds" in capsys.readouterr().err


def test_the_decision_bench_times_each_policy_beside_the_first() -> None:
    rows = time_decisions(["tokenpilot", "llmd_default", "round_robin"], size=16, decisions=60)
    assert [row["policy"] for row in rows] == ["tokenpilot", "llmd_default", "round_robin"]
    assert rows[0]["p50_ratio"] == rows[0]["p99_ratio"] == 1.0
    for row in rows:
        assert 0 < row["p50_us"] <= row["p99_us"]
        assert row["p50_ratio"] == pytest.approx(row["p50_us"] / rows[0]["p50_us"])


def test_the_decision_bench_refuses_an_unknown_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "decision.json"
    assert main(["bench", "decision", "--policies", "tokenpilot,fastest", "--json", str(out)]) == 2
    assert "unknown policies: fastest" in capsys.readouterr().err
    assert not out.exists()


def test_a_misjudged_step_model_is_off_by_the_fraction_on_every_term() -> None:
    true = profile("llama3-70b-4xh100").step_time
    wrong = misjudged(true, 0.15, seed=3)
    terms = [f.name for f in fields(true) if getattr(true, f.name)]  # 0 stays 0
    ratios = [getattr(wrong, name) / getattr(true, name) for name in terms]
    assert all(ratio == pytest.approx(0.85) or ratio == pytest.approx(1.15) for ratio in ratios)
    assert {round(r, 2) for r in ratios} == {0.85, 1.15}
    assert misjudged(true, 0.15, seed=3) == wrong


def test_the_bench_hands_tokenpilot_the_misjudged_model_and_says_so(tmp_path: Path) -> None:
    runs = {}
    for error in ("0", "0.3"):
        out = tmp_path / f"routing-{error}.json"
        argv = ["bench", "routing", "--trace", "shared-prefix", "--requests", "120"]
        argv += ["--instances", "4", "--ladder", "1", "--policies", "tokenpilot,round_robin"]
        assert main([*argv, "--step-model-error", error, "--json", str(out)]) == 0
        runs[error] = json.loads(out.read_text())
    assert runs["0.3"]["step_model_error"] == 0.3
    exact, wrong = (runs[e]["policies"] for e in ("0", "0.3"))
    assert exact["round_robin"] == wrong["round_robin"]  # no step model: unchanged
    assert exact["tokenpilot"] != wrong["tokenpilot"]


def test_the_admission_benchmark_writes_every_policy_per_level_and_class(tmp_path: Path) -> None:
    from sim.admission_bench import BENCHED

    out, plot = tmp_path / "admission.json", tmp_path / "levels.png"
    arguments = ["bench", "admission", "--requests", "400", "--instances", "2"]
    arguments += ["--ladder", "0.8,1.5", "--json", str(out), "--plot", str(plot)]
    assert main(arguments) == 0
    document = json.loads(out.read_text())
    assert (document["trace"], document["router"], document["requests"]) == (
        "mixed",
        "tokenpilot",
        400,
    )
    assert set(document["policies"]) == set(BENCHED)
    fcfs = document["policies"]["fcfs"]
    assert fcfs["rejected_share"] == 0.0  # it admits everything
    for figures in document["policies"].values():
        assert [level["level"] for level in figures["per_level"]] == [0.8, 1.5]
        for level in figures["per_level"]:
            assert level["arrivals"] >= 400  # second attempts are arrivals too
            assert level["goodput_tok_s"] <= level["total_tok_s"]
            assert set(level["per_class"]) == {"interactive", "long_document", "batch"}
        assert 0.0 <= figures["compliance"] <= 1.0
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_the_admission_benchmark_refuses_a_policy_its_router_cannot_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arguments = ["bench", "admission", "--router", "round_robin", "--requests", "50"]
    arguments += ["--policies", "fcfs,mooncake_early_reject", "--ladder", "1"]
    arguments += ["--json", str(tmp_path / "admission.json")]
    assert main(arguments) == 2
    assert "behind 'round_robin' it would refuse every request" in capsys.readouterr().err


def test_capacity_at_90_percent_is_read_where_compliance_falls_through() -> None:
    from sim.admission_bench import capacity_at

    def ladder(*compliance: float) -> list[dict[str, float]]:
        return [{"rate_rps": 10.0 * (n + 1), "compliance": c} for n, c in enumerate(compliance)]

    assert capacity_at(ladder(0.95, 0.92, 0.80)) == pytest.approx(20 + 10 * 0.02 / 0.12)
    assert capacity_at(ladder(0.99, 0.95, 0.91)) == 30.0  # never falls through: the top
    assert capacity_at(ladder(0.85, 0.80)) is None  # misses it from the start
    assert capacity_at(ladder(0.95, 0.85, 0.93)) == pytest.approx(10 + 10 * 0.05 / 0.10)


def test_figures_that_do_not_exist_are_written_as_null_in_strict_json(tmp_path: Path) -> None:
    from tokenfleet.commands.output import write_json

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    out = tmp_path / "figures.json"
    nan, inf = float("nan"), float("inf")
    write_json(out, {"p95_s": nan, "rates": [1.5, inf, (2.0, -inf)], "per_class": {"n": 3}})
    assert json.loads(out.read_text(), parse_constant=refuse) == {
        "p95_s": None,
        "rates": [1.5, None, [2.0, None]],
        "per_class": {"n": 3},
    }


def test_the_summary_counts_the_requests_refused_and_says_n_a_for_no_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run whose one request no instance could hold printed "0 of 1 requests" and nan."""
    trace = tmp_path / "huge.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 500000, "output_length": 5, "hash_ids": [1]}\n'
    )
    assert main(["sim", "--trace", str(trace), "--instances", "1"]) == 0
    out = capsys.readouterr().out
    assert "0 of 1 requests completed (1 rejected, 0 cancelled)" in out
    assert "ttft  p50 n/a" in out
    assert "nan" not in out
