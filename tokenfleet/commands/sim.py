"""Simulation commands: demo, sim, calibrate, workload, bench."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from control.step_time import Blackbox
from tokenfleet.commands.errors import CliError

if TYPE_CHECKING:
    from control.routing.tokenpilot import TokenPilotParams


def register(commands: argparse._SubParsersAction) -> None:
    for add in (_add_demo, _add_sim, _add_calibrate, _add_validate, _add_workload, _add_bench):
        add(commands)


def _add_demo(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser(
        "demo",
        help="the embedded main job: no Kafka or Redis needed",
        description="Simulates the first requests of the Mooncake conversation trace on a "
        "small cluster under each routing policy, side by side.",
    )
    demo.add_argument("--requests", type=int, default=2000, help="trace rows (default: 2000)")
    demo.add_argument("--instances", type=int, default=8, help="instances (default: 8)")
    demo.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    demo.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace) -> int:
    from tokenfleet.demo import main as demo_main

    if args.requests < 1 or args.instances < 1:
        raise CliError("--requests and --instances must be at least 1")
    return demo_main(args.requests, args.instances, args.seed)


def _add_sim(commands: argparse._SubParsersAction) -> None:
    from control.admission.registry import ADMISSIONS
    from control.routing import ROUTERS
    from sim.profiles import PROFILES

    sim = commands.add_parser(
        "sim",
        help="simulate a trace on a cluster under one routing policy",
        description="Runs a discrete-event simulation in virtual time and writes its summary.",
    )
    sim.add_argument(
        "--trace",
        required=True,
        help=_trace_help(),
    )
    sim.add_argument("--instances", type=int, default=16, help="instances (default: 16)")
    sim.add_argument("--policy", default="round_robin", choices=sorted(ROUTERS))
    sim.add_argument(
        "--admission",
        default="fcfs",
        choices=sorted(ADMISSIONS),
        help="admission in front of the router: fcfs admits everything (the engines' own "
        "queues decide); slomax holds, reserves and rejects by class (default: %(default)s)",
    )
    sim.add_argument(
        "--profile",
        default="llama3-70b-4xh100",
        choices=sorted(PROFILES),
        help="model and hardware of every instance (default: %(default)s)",
    )
    sim.add_argument("--requests", type=int, help="only the first N requests of the trace")
    load = sim.add_mutually_exclusive_group()
    load.add_argument(
        "--rate-scale", type=float, default=1.0, help="arrivals this many times as dense"
    )
    load.add_argument(
        "--ladder",
        type=_levels,
        metavar="L1,L2,...",
        help="one run at each share of measured capacity, e.g. 0.5,0.8,1,1.2",
    )
    sim.add_argument("--seed", type=int, default=0, help="seed of every random choice")
    _add_token_lags(sim)
    sim.add_argument(
        "--blackbox",
        type=_blackbox,
        metavar="B0,B1,B2,A0,A1,A2",
        help="BLIS blackbox coefficients in microseconds (step = b0 + b1*uncached prefill "
        "tokens + b2*decode tokens; queueing a0 + a1*input; a2 per output token), "
        "replacing the profile's step times",
    )
    sim.add_argument("--json", type=Path, help="write the result here")
    sim.add_argument("--records", type=Path, help="write one CSV row per request here")
    sim.set_defaults(handler=_sim)


def _sim(args: argparse.Namespace) -> int:
    import json

    from sim.run import RunConfig, simulate_ladder, simulate_run, write_records

    if args.instances < 1 or (args.requests is not None and args.requests < 1):
        raise CliError("--instances and --requests must be at least 1")
    if args.rate_scale <= 0:
        raise CliError("--rate-scale must be positive")
    config = RunConfig(
        trace=args.trace,
        instances=args.instances,
        policy=args.policy,
        admission=args.admission,
        profile=args.profile,
        requests=args.requests,
        rate_scale=args.rate_scale,
        seed=args.seed,
        blackbox=args.blackbox,
        host_token_lag_s=args.host_token_lag,
        tokenpilot=_tokenpilot_params(args),
    )
    progress = sys.stderr.isatty()
    try:
        if args.ladder:
            result, records = simulate_ladder(config, args.ladder, progress=progress)
            runs = result["levels"]
        else:
            result, records = simulate_run(config, progress=progress)
            runs = [result]
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.records:
        write_records(records, args.records)
    for run in runs:
        _print_summary(run)
    return 0


def _blackbox(text: str) -> Blackbox:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if len(values) != 6 or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError("give six non-negative numbers: b0,b1,b2,a0,a1,a2")
    b0, b1, b2, a0, a1, a2 = values
    return Blackbox(b0, b1, b2, a0, a1, a2)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"a fraction from 0 to below 1 is expected, not {text!r}")
    return value


def _add_token_lags(parser: argparse.ArgumentParser) -> None:
    from control.routing.tokenpilot import TokenPilotParams
    from sim.simulator import HOST_TOKEN_LAG_S

    parser.add_argument(
        "--host-token-lag",
        type=_seconds,
        default=HOST_TOKEN_LAG_S,
        metavar="S",
        help="how late the simulated host sees each step's streamed tokens, in seconds "
        f"(default {HOST_TOKEN_LAG_S:g}); TokenPilot assumes its own, --assumed-token-lag",
    )
    assumed = TokenPilotParams().token_lag_s
    parser.add_argument(
        "--assumed-token-lag",
        type=_seconds,
        default=assumed,
        metavar="S",
        help=f"the least lag TokenPilot assumes, in seconds (default {assumed:g}); it "
        "assumes more when first tokens show the host later (a gateway takes it from "
        "TOKENFLEET_GATEWAY_TOKEN_LAG_S)",
    )


def _tokenpilot_params(args: argparse.Namespace) -> TokenPilotParams:
    from control.routing.tokenpilot import TokenPilotParams

    return TokenPilotParams(token_lag_s=args.assumed_token_lag)


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError("must be a finite number of seconds, not negative")
    return seconds


def _levels(text: str) -> list[float]:
    try:
        levels = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not levels or any(level <= 0 for level in levels):
        raise argparse.ArgumentTypeError("levels must be positive")
    return levels


def _print_summary(result: dict) -> None:
    summary = result["summary"]
    level = f" at {result['level']:g} x capacity" if "level" in result else ""
    print(
        f"{result['trace']}{level}: {summary['completed']} of {summary['requests']} requests "
        f"on {result['instances']} x {result['profile']}, policy {result['policy']}"
    )
    for name in ("ttft", "tpot", "e2e"):
        p50, p95, p99 = (summary[f"{name}_p{q}_s"] for q in (50, 95, 99))
        print(f"  {name:5} p50 {p50:.3f} s   p95 {p95:.3f} s   p99 {p99:.3f} s")
    print(
        f"  throughput {summary['throughput_tok_s']:.0f} tok/s   goodput "
        f"{summary['goodput_tok_s']:.0f} tok/s   cache hit rate {summary['cache_hit_rate']:.1%}"
    )
    print(
        f"  simulated in {result['wall_s']:.1f} s "
        f"({result['simulated_requests_per_s']:.0f} requests/s)"
    )


def _add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks that print figures and write JSON")
    sub = bench.add_subparsers(required=True, metavar="BENCHMARK")
    sim = sub.add_parser(
        "sim",
        help="simulator speed: the Mooncake trace, and scaling with instances and requests",
        description="Times the simulator on the whole Mooncake conversation trace "
        "(12,031 requests) and how run time grows with instances (16, 64, 256) and requests.",
    )
    sim.add_argument("--json", type=Path, required=True, help="write the figures here")
    sim.set_defaults(handler=_bench_sim)
    _add_bench_routing(sub)
    _add_bench_admission(sub)
    decision = sub.add_parser(
        "decision",
        help="time one routing decision at 16 to 4,096 instances (16k-token prompt)",
        description="Times routers' decisions (prefix matching included) on fleets of "
        "16, 256, 1024 and 4096 instances; prints P50 and P99 in microseconds. Several "
        "policies decide each request in turn, and each is also given as a ratio to the "
        "first: a noisy machine moves the microseconds, less the ratios.",
    )
    decision.add_argument(
        "--policies",
        type=lambda t: t.split(","),
        default=["tokenpilot"],
        help="comma-separated, the first the reference (default tokenpilot)",
    )
    decision.add_argument("--json", type=Path, required=True, help="write the figures here")
    decision.set_defaults(handler=_bench_decision)
    gateway = sub.add_parser(
        "gateway",
        help="the gateway's added latency and request rate, against emulated instances",
        description="Starts emulated instances and a gateway as processes of their own, "
        "then measures added latency (P50, P99: through the gateway minus direct, requests "
        "alternating one at a time), the rate one gateway process sustains and its CPU per "
        "request; the same for a bare pass-through proxy on the same stack, the floor.",
    )
    gateway.add_argument("--requests", type=int, default=1000, help="latency samples each way")
    gateway.add_argument("--concurrency", type=int, default=32, help="clients in the rate run")
    gateway.add_argument("--duration", type=float, default=10.0, help="seconds of the rate run")
    gateway.add_argument(
        "--litellm",
        metavar="COMMAND",
        help="LiteLLM's `litellm` command: measure its proxy the same way, side by side",
    )
    gateway.add_argument("--json", type=Path, required=True, help="write the figures here")
    gateway.set_defaults(handler=_bench_gateway)
    streams = sub.add_parser(
        "streams",
        help="events per second one table worker sustains, and event-to-table lag",
        description="Publishes request lifecycles to the broker in TOKENFLEET_KAFKA_BOOTSTRAP "
        "(unset: a local broker it starts and stops), runs one `tokenfleet worker`, and "
        "measures the events it consumes per second and, at a steady pace, the lag from "
        "an event's publication to its effect in a published table (P50, P95); then, for "
        "scale, the rate of a Faust agent that only counts the same events.",
    )
    streams.add_argument("--requests", type=int, default=20_000, help="requests (3 events each)")
    streams.add_argument(
        "--paced-rate", type=float, default=500.0, help="requests/s in the lag run"
    )
    streams.add_argument("--json", type=Path, required=True, help="write the figures here")
    streams.set_defaults(handler=_bench_streams)


def _bench_streams(args: argparse.Namespace) -> int:
    import contextlib
    import json
    import tempfile

    from sim.streams_bench import bench_streams
    from tokenfleet.services.kafka import LocalKafka
    from tokenfleet.settings import Settings

    if args.requests < 1 or args.paced_rate <= 0:
        raise CliError("--requests must be at least 1 and --paced-rate positive")
    with contextlib.ExitStack() as stack:
        bootstrap = Settings().kafka_bootstrap
        if bootstrap is None:
            home = stack.enter_context(tempfile.TemporaryDirectory())
            broker = LocalKafka(Path(home))
            stack.callback(broker.stop)
            bootstrap = broker.start()
        figures = bench_streams(bootstrap, args.requests, args.paced_rate)
    print(
        f"{figures['events_per_s']:.0f} events/s; lag p50 {figures['lag_p50_s']:.2f} s, "
        f"p95 {figures['lag_p95_s']:.2f} s at {figures['paced_events_per_s']:.0f} events/s; "
        f"Faust's ceiling {figures['faust_ceiling_events_per_s']:.0f} events/s"
    )
    args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def _bench_gateway(args: argparse.Namespace) -> int:
    import json

    from tokenfleet.gateway_bench import bench_gateway

    if args.requests < 1 or args.concurrency < 1 or args.duration <= 0:
        raise CliError("--requests and --concurrency must be at least 1, --duration positive")
    figures = bench_gateway(args.requests, args.concurrency, args.duration, litellm=args.litellm)
    print(
        f"added latency p50 {figures['added_latency_p50_ms']:.2f} ms, "
        f"p99 {figures['added_latency_p99_ms']:.2f} ms "
        f"(direct p50 {figures['direct_p50_ms']:.2f} ms); "
        f"{figures['max_rps']:.0f} requests/s at concurrency {args.concurrency} "
        f"(direct: {figures['direct_rps']:.0f}); {figures['gateway_cpu_ms_per_request']:.2f} "
        "ms of CPU per request"
    )
    for name, label in (("bare_proxy", "bare proxy"), ("litellm", "LiteLLM")):
        if name in figures:
            other = figures[name]
            print(
                f"{label}: added p50 {other['added_latency_p50_ms']:.2f} ms, "
                f"p99 {other['added_latency_p99_ms']:.2f} ms; {other['max_rps']:.0f} requests/s"
            )
    args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def _bench_decision(args: argparse.Namespace) -> int:
    import json

    from tqdm import tqdm

    from control.routing import ROUTERS
    from sim.decision_bench import SIZES, time_decisions

    policies = _known(args.policies, ROUTERS)
    figures = [
        row
        for size in tqdm(SIZES, desc="fleet sizes", unit="size", leave=False)
        for row in time_decisions(policies, size)
    ]
    for row in figures:
        print(
            f"{row['instances']:>5} instances  {row['policy']:<22} p50 {row['p50_us']:8.1f} us"
            f"  p99 {row['p99_us']:8.1f} us  ({row['p50_ratio']:.2f} / {row['p99_ratio']:.2f}"
            f" x {policies[0]})"
        )
    document = {"policies": policies, "results": figures}
    args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


def _known(names: Sequence[str], known: Iterable[str], what: str = "policies") -> list[str]:
    """``names`` as given; a CliError naming any that ``known`` lacks."""
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise CliError(f"unknown {what}: {', '.join(unknown)}")
    return list(names)


def _add_bench_admission(sub: argparse._SubParsersAction) -> None:
    from sim.admission_bench import ADMISSION_LADDER, BENCHED

    admission = sub.add_parser(
        "admission",
        help="every admission policy in front of one router, across a ladder past capacity",
        description="Runs each admission policy in front of the same router on the same "
        "workload, cluster and seed at each ladder level (shares of the cluster's measured "
        "capacity), with clients that give up and retry (sim/clients.py); writes goodput, "
        "compliance, waste and rejections per policy, pooled and per level and per class.",
    )
    admission.add_argument("--trace", default="mixed", help="default: mixed. " + _trace_help())
    _add_ladder_options(admission, ADMISSION_LADDER, BENCHED)
    admission.add_argument("--router", default="tokenpilot", help="the router behind every policy")
    admission.add_argument("--plot", type=Path, help="write goodput and compliance per level here")
    admission.add_argument(
        "--step-change",
        type=Path,
        metavar="PNG",
        help="also run SLOMax on a load stepping from 0.8 to 1.5 x capacity halfway, and plot "
        "its controller's limit and the attainments it read over time here (the passes go "
        "into the JSON as step_change)",
    )
    admission.set_defaults(handler=_bench_admission)


def _bench_admission(args: argparse.Namespace) -> int:
    import json

    from tqdm import tqdm

    from control.routing import ROUTERS
    from sim.admission_bench import (
        BENCHED,
        bench_admission,
        plot_levels,
        plot_step_change,
        step_change,
    )

    policies = _known(args.policies or list(BENCHED), BENCHED, "admission policies")
    _known([args.router], ROUTERS, "routers")
    with tqdm(total=len(policies) * len(args.ladder), desc="runs", unit="run") as bar:
        try:
            document = bench_admission(
                args.trace,
                instances=args.instances,
                profile_name=args.profile,
                ladder=args.ladder,
                requests=args.requests,
                seed=args.seed,
                policies=policies,
                router=args.router,
                jobs=args.jobs,
                progress=lambda label: (bar.set_postfix_str(label), bar.update()),
            )
        except (ValueError, KeyError) as exc:
            raise CliError(str(exc)) from None
    if args.step_change:
        document["step_change"] = step_change(
            args.trace,
            instances=args.instances,
            profile_name=args.profile,
            requests=args.requests,
            seed=args.seed,
        )
        plot_step_change(document["step_change"], args.step_change)
    args.json.write_text(json.dumps(document, indent=2) + "\n")
    if args.plot:
        plot_levels(document, args.plot)
    print(
        f"{'policy':22}{'goodput':>10}{'total':>10}{'comply':>8}{'chat':>8}{'reject':>8}"
        f"{'wasted':>10}{'cap@90%':>9}"
    )
    for policy, result in document["policies"].items():
        chat = result["per_class"].get("interactive", {}).get("compliance", float("nan"))
        capacity = result["capacity_at_90_rps"]
        print(
            f"{policy:22}{result['goodput_tok_s']:>10.0f}{result['total_tok_s']:>10.0f}"
            f"{result['compliance']:>8.1%}{chat:>8.1%}{result['rejected_share']:>8.1%}"
            f"{result['wasted_tok']:>10,}{'-' if capacity is None else f'{capacity:.1f}':>9}"
        )
    return 0


def _add_bench_routing(sub: argparse._SubParsersAction) -> None:
    from control.routing import ROUTERS
    from sim.ladder import DEFAULT_LADDER

    routing = sub.add_parser(
        "routing",
        help="every routing policy on one trace and cluster across a load ladder",
        description="Runs each policy on the same trace, cluster and seed at each ladder level "
        "(shares of the cluster's measured capacity); writes pooled and per-level figures "
        "and the lower bound no router can beat.",
    )
    routing.add_argument(
        "--trace",
        required=True,
        help=_trace_help(),
    )
    _add_ladder_options(routing, DEFAULT_LADDER, ROUTERS)
    _add_token_lags(routing)
    routing.add_argument(
        "--step-model-error",
        type=_fraction,
        default=0.0,
        metavar="F",
        help="give the routers that use a step model (TokenPilot) one whose every term is off "
        "by this fraction, up or down at random per term (e.g. 0.15), while the simulated "
        "engines step with the true one (default 0: the engines' own model)",
    )
    routing.add_argument("--plot", type=Path, help="write TTFT CDFs per policy here (PNG)")
    routing.set_defaults(handler=_bench_routing)


def _add_ladder_options(
    parser: argparse.ArgumentParser, ladder: Sequence[float], policies: Iterable[str]
) -> None:
    """The options every ladder benchmark takes: cluster, ladder, sample, policies, jobs."""
    from sim.profiles import PROFILES

    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--profile", default="llama3-70b-4xh100", choices=sorted(PROFILES))
    parser.add_argument(
        "--ladder",
        type=_levels,
        default=list(ladder),
        metavar="L1,L2,...",
        help="default: " + ",".join(f"{level:g}" for level in ladder),
    )
    parser.add_argument("--requests", type=int, help="only the first N requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--policies",
        type=lambda t: t.split(","),
        default=None,
        help=f"comma-separated subset of: {', '.join(policies)}",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at once, each in its own process (default 1); figures do not depend on it",
    )
    parser.add_argument("--json", type=Path, required=True, help="write the figures here")


def _bench_routing(args: argparse.Namespace) -> int:
    import json

    from tqdm import tqdm

    from control.routing import ROUTERS
    from sim.routing_bench import bench_routing, plot_ttft_cdfs

    policies = _known(args.policies or list(ROUTERS), ROUTERS)
    with tqdm(total=len(policies) * len(args.ladder), desc="runs", unit="run") as bar:
        try:
            document, records = bench_routing(
                args.trace,
                instances=args.instances,
                profile_name=args.profile,
                ladder=args.ladder,
                requests=args.requests,
                seed=args.seed,
                policies=policies,
                jobs=args.jobs,
                progress=lambda label: (bar.set_postfix_str(label), bar.update()),
                host_token_lag_s=args.host_token_lag,
                tokenpilot=_tokenpilot_params(args),
                step_model_error=args.step_model_error,
            )
        except (ValueError, KeyError) as exc:
            raise CliError(str(exc)) from None
    args.json.write_text(json.dumps(document, indent=2) + "\n")
    if args.plot:
        plot_ttft_cdfs(
            records, f"{args.trace}, {args.instances} instances, pooled ladder", args.plot
        )
    print(f"{'policy':24}{'TTFT p50':>10}{'TTFT p95':>10}{'E2E p95':>10}{'cache hit':>11}")
    for policy, figures in document["policies"].items():
        print(
            f"{policy:24}{figures['ttft_p50_s']:>10.3f}{figures['ttft_p95_s']:>10.3f}"
            f"{figures['e2e_p95_s']:>10.2f}{figures['cache_hit_rate']:>11.1%}"
        )
    for label, name in (
        ("lower bound", "lower_bound"),
        ("fleet-cache ref.", "fleet_cache_reference"),
    ):
        bound = document[name]
        print(
            f"{label:24}{bound['ttft_p50_s']:>10.3f}{bound['ttft_p95_s']:>10.3f}{'':>10}"
            f"{bound['cache_hit_rate']:>11.1%}"
        )
    return 0


def _bench_sim(args: argparse.Namespace) -> int:
    import json

    from sim.bench import bench_sim

    def report(label: str, figures: dict[str, float]) -> None:
        print(
            f"{label:28} {figures['requests']:>6} requests on {figures['instances']:>3} "
            f"instances: {figures['wall_s']:6.1f} s "
            f"({figures['simulated_requests_per_s']:.0f} requests/s)",
            flush=True,
        )

    result = bench_sim(report=report)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _add_workload(commands: argparse._SubParsersAction) -> None:
    from sim.registry import TRACES

    workload = commands.add_parser("workload", help="workloads: list or export them")
    sub = workload.add_subparsers(required=True, metavar="ACTION")
    listing = sub.add_parser("list", help="the named workloads")
    listing.set_defaults(
        handler=lambda _: _print_lines(
            f"{name:20} {source.description}" for name, source in TRACES.items()
        )
    )
    export = sub.add_parser("export", help="write a labelled workload as CSV for other tools")
    export.add_argument(
        "--trace",
        required=True,
        help=_trace_help(),
    )
    export.add_argument("--out", type=Path, required=True, help="the CSV file to write")
    export.add_argument("--requests", type=int, help="only the first N requests")
    export.add_argument("--seed", type=int, default=0)
    export.set_defaults(handler=_workload_export)


def _workload_export(args: argparse.Namespace) -> int:
    from sim.export import export_csv
    from sim.registry import load_trace

    try:
        requests = load_trace(args.trace, limit=args.requests, seed=args.seed)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    export_csv(requests, args.out)
    print(f"wrote {len(requests)} requests to {args.out}")
    return 0


def _print_lines(lines: Iterable[str]) -> int:
    for line in lines:
        print(line)
    return 0


def _add_calibrate(commands: argparse._SubParsersAction) -> None:
    from sim.profiles import CALIBRATED

    calibrate = commands.add_parser(
        "calibrate",
        help="fit a profile's step times to real vLLM measurements and validate them",
        description="Fits a, b, n0, c and the TTFT overhead of a profile by simulating the "
        "measured stages (see sim/calibration.py), starting from the profile's coefficients, "
        "then prints the validation table over every stage, fitted and held out.",
    )
    calibrate.add_argument("--profile", required=True, choices=sorted(CALIBRATED))
    calibrate.add_argument(
        "--iterations", type=int, default=80, help="Nelder-Mead steps (default: 80; 0: validate)"
    )
    calibrate.add_argument("--json", type=Path, help="write coefficients and rows here")
    calibrate.set_defaults(handler=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict, replace

    from tqdm import tqdm

    from sim import calibration
    from sim.profiles import CALIBRATED, TRAINING_STAGES

    chosen = CALIBRATED[args.profile]
    stages = [s for s in calibration.load_stages() if chosen.measured_model in s.experiment]
    training = [s for s in stages if calibration.is_training(s, TRAINING_STAGES)]
    profile = chosen.profile
    if args.iterations > 0:
        with tqdm(total=args.iterations, desc="fitting", unit="it", leave=False) as bar:

            def progress(_: int, loss: float) -> None:
                bar.set_postfix(loss=f"{loss:.4f}")
                bar.update()

            fitted = calibration.fit(
                training, profile, iterations=args.iterations, progress=progress
            )
        profile = replace(profile, step_time=fitted)
    rows = calibration.validate(stages, TRAINING_STAGES, profile)
    print(f"{args.profile}: {profile.step_time}")
    print(calibration.markdown_table(rows))
    if args.json:
        document = {
            "profile": args.profile,
            "step_time": asdict(profile.step_time),
            "rows": [row.as_dict() for row in rows],
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


def _add_validate(commands: argparse._SubParsersAction) -> None:
    validate = commands.add_parser(
        "validate",
        help="the 70B profile against real vLLM runs: tails, and past saturation",
        description="Simulates every measured Llama-3.1-70B TP4 stage (means, P90 and P99 of "
        "TTFT and E2E, per-token time) and an overloaded 70B run, with the profile "
        "llama3-70b-4xh100, none of them used in its fit (see sim/validation.py and "
        "docs/validation.md). Needs no data beside the repository.",
    )
    validate.add_argument("--json", type=Path, help="write the rows here")
    validate.set_defaults(handler=_validate)


def _validate(args: argparse.Namespace) -> int:
    import json

    from sim import validation
    from sim.profiles import PROFILES

    rows = validation.validate_regime(PROFILES[validation.PROFILE])
    print(validation.markdown_table(rows))
    if args.json:
        document = {"profile": validation.PROFILE, "rows": [row.as_dict() for row in rows]}
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


def _trace_help() -> str:
    from sim.registry import TRACES

    return (
        f"{', '.join(TRACES)}, or a .jsonl path in Mooncake's format (its timestamps replayed "
        "as given; the named mooncake trace places each request at random in its 3 s bucket), "
        "whose rows may carry class, tenant, deadline_s and region (the label rules of "
        "sim/labels.py fill in the rest)"
    )
