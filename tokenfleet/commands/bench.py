"""``tokenfleet bench``: commands that measure, print figures and write JSON."""

from __future__ import annotations

import argparse
import contextlib
import shutil
from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path

from tokenfleet.commands.arguments import (
    add_profile,
    distinct_files,
    names,
    output_file,
    plot_file,
    positive_float,
    positive_int,
    seed,
)
from tokenfleet.commands.broker import check_redis, create_topics_on
from tokenfleet.commands.errors import CliError, message_of
from tokenfleet.commands.output import as_json, save_each, write_json
from tokenfleet.commands.sim import (
    add_token_lags,
    fraction,
    levels,
    shown,
    tokenpilot_params,
    trace_help,
)


def register(commands: argparse._SubParsersAction) -> None:
    _add_bench(commands)


def _add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks that print figures and write JSON")
    sub = bench.add_subparsers(required=True, metavar="BENCHMARK")
    sim = sub.add_parser(
        "sim",
        help="simulator speed: the Mooncake trace, and scaling with instances and requests",
        description="Times the simulator on the whole Mooncake conversation trace "
        "(12,031 requests) and how run time grows with instances (16, 64, 256) and requests.",
    )
    sim.add_argument("--json", type=output_file, required=True, help="write the figures here")
    sim.set_defaults(handler=_bench_sim)
    _add_bench_routing(sub)
    _add_bench_admission(sub)
    _add_bench_fleet(sub)
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
        type=names,
        default=["tokenpilot"],
        help="comma-separated, the first the reference (default tokenpilot)",
    )
    decision.add_argument("--json", type=output_file, required=True, help="write the figures here")
    decision.set_defaults(handler=_bench_decision)
    gateway = sub.add_parser(
        "gateway",
        help="the gateway's added latency and request rate, against emulated instances",
        description="Starts emulated instances and a gateway as processes of their own, "
        "then measures added latency (P50, P99: through the gateway minus direct, requests "
        "alternating one at a time), the rate one gateway process sustains and its CPU per "
        "request; the same for the gateway admitting everything (fcfs: what SLOMax costs) "
        "and for a bare pass-through proxy on the same stack, the floor.",
    )
    gateway.add_argument(
        "--requests",
        type=positive_int,
        default=1000,
        help="latency samples each way (default: %(default)s)",
    )
    gateway.add_argument(
        "--concurrency",
        type=positive_int,
        default=32,
        help="clients in the rate run (default: %(default)s)",
    )
    gateway.add_argument(
        "--duration",
        type=positive_float,
        default=10.0,
        help="seconds of the rate run (default: %(default)g)",
    )
    litellm = gateway.add_mutually_exclusive_group()
    litellm.add_argument(
        "--litellm",
        metavar="COMMAND",
        help="LiteLLM's `litellm` command, to measure its proxy the same way, side by side "
        "(default: the one `pip install tokenfleet[litellm]` installs, if any)",
    )
    litellm.add_argument("--no-litellm", action="store_true", help="leave LiteLLM out")
    gateway.add_argument(
        "--no-redis",
        action="store_true",
        help="leave out the gateway with its state in Redis (TOKENFLEET_REDIS_URL, else a "
        "local redis-server the bench starts)",
    )
    gateway.add_argument(
        "--journal",
        action="store_true",
        help="also measure the gateway keeping its decision journal (in a file, "
        "TOKENFLEET_GATEWAY_JOURNAL_FILE): what tokenfleet audit costs",
    )
    gateway.add_argument("--json", type=output_file, required=True, help="write the figures here")
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
    streams.add_argument(
        "--requests",
        type=positive_int,
        default=20_000,
        help="requests, 3 events each (default: %(default)s)",
    )
    streams.add_argument(
        "--paced-rate",
        type=positive_float,
        default=500.0,
        help="requests/s in the lag run (default: %(default)g)",
    )
    streams.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="then measure the bulk rate again with this many workers sharing the "
        "partitions (default: 1, not again)",
    )
    streams.add_argument("--json", type=output_file, required=True, help="write the figures here")
    streams.set_defaults(handler=_bench_streams)


def _bench_streams(args: argparse.Namespace) -> int:
    import tempfile

    from sim.streams_bench import bench_streams
    from tokenfleet.services.kafka import LocalKafka
    from tokenfleet.settings import Settings

    with contextlib.ExitStack() as stack:
        bootstrap = Settings().kafka_bootstrap
        if bootstrap is None:
            home = stack.enter_context(tempfile.TemporaryDirectory())
            broker = LocalKafka(Path(home))
            stack.callback(broker.stop)
            bootstrap = broker.start()
        else:  # one that cannot be reached is a message, not a traceback
            create_topics_on(bootstrap, replication=1)  # as the bench makes them
        figures = bench_streams(bootstrap, args.requests, args.paced_rate, workers=args.workers)
    print(
        f"{figures['events_per_s']:.0f} events/s "
        f"(the worker's CPU: {_per_1000(figures['worker_cpu_us_per_event'])}); "
        f"lag p50 {figures['lag_p50_s']:.2f} s, "
        f"p95 {figures['lag_p95_s']:.2f} s at {figures['paced_events_per_s']:.0f} events/s; "
        f"Faust's ceiling {figures['faust_ceiling_events_per_s']:.0f} events/s"
    )
    if args.workers > 1:
        more = figures[f"{args.workers}_workers"]
        print(
            f"{args.workers} workers: {more['events_per_s']:.0f} events/s, "
            f"{more['over_one_worker']:.2f} x one worker's "
            f"(their CPU: {_per_1000(more['worker_cpu_us_per_event'])})"
        )
    write_json(args.json, figures)
    return 0


def _per_1000(us_per_event: float | None) -> str:
    """CPU time per event, as milliseconds per 1,000 events (None: not measured here)."""
    return "not measured" if us_per_event is None else f"{us_per_event:.0f} ms per 1,000 events"


def _redis_url(stack: contextlib.ExitStack) -> str:
    """TOKENFLEET_REDIS_URL, else a local redis-server, stopped when ``stack`` closes."""
    import tempfile

    from tokenfleet.services.redis import LocalRedis
    from tokenfleet.settings import Settings

    if url := Settings().redis_url:
        check_redis(url)  # else a traceback, once the measurements without it ran
        return url
    server = LocalRedis(Path(stack.enter_context(tempfile.TemporaryDirectory())))
    stack.callback(server.stop)
    return server.start()


def _bench_gateway(args: argparse.Namespace) -> int:
    from tokenfleet.gateway_bench import bench_gateway, litellm_command

    if args.litellm and shutil.which(args.litellm) is None:
        raise CliError(f"--litellm {args.litellm}: no such executable")
    litellm = None if args.no_litellm else args.litellm or litellm_command()
    if litellm is None and not args.no_litellm:
        print("LiteLLM is not installed (pip install tokenfleet[litellm]): left out")
    with contextlib.ExitStack() as stack:
        redis = None if args.no_redis else _redis_url(stack)
        figures = bench_gateway(
            args.requests,
            args.concurrency,
            args.duration,
            litellm=litellm,
            redis=redis,
            journal=args.journal,
        )
    print(
        f"added latency p50 {figures['added_latency_p50_ms']:.2f} ms, "
        f"p99 {figures['added_latency_p99_ms']:.2f} ms "
        f"(direct p50 {figures['direct_p50_ms']:.2f} ms); "
        f"{figures['max_rps']:.0f} requests/s at concurrency {args.concurrency} "
        f"(direct: {figures['direct_rps']:.0f}); {figures['gateway_cpu_ms_per_request']:.2f} "
        "ms of CPU per request"
    )
    for name, label in (
        ("gateway_fcfs", "gateway without admission (fcfs)"),
        ("gateway_redis", "gateway with its state in Redis"),
        ("gateway_journal", "gateway keeping its decision journal"),
        ("bare_proxy", "bare proxy"),
        ("litellm", "LiteLLM"),
    ):
        if name in figures:
            other = figures[name]
            calls = other.get("redis_calls_per_request")
            print(
                f"{label}: added p50 {other['added_latency_p50_ms']:.2f} ms, "
                f"p99 {other['added_latency_p99_ms']:.2f} ms; {other['max_rps']:.0f} requests/s"
                + (f"; {calls:.2f} Redis round trips per request" if calls is not None else "")
            )
    if "gateway_redis_pair" in figures:
        pair = figures["gateway_redis_pair"]
        print(
            f"two gateways sharing one Redis: {pair['max_rps']:.0f} requests/s, "
            f"{pair['rate_over_one_replica']:.2f} x one replica's; "
            f"{pair['redis_calls_per_request']:.2f} Redis round trips per request"
        )
    write_json(args.json, figures)
    return 0


def _bench_decision(args: argparse.Namespace) -> int:
    from control.routing import ROUTERS
    from sim.decision_bench import SIZES, time_decisions
    from sim.progress import progress_bar

    policies = _known(args.policies, ROUTERS)
    figures = [
        row
        for size in progress_bar(SIZES, desc="fleet sizes", unit="size", leave=False)
        for row in time_decisions(policies, size)
    ]
    for row in figures:
        print(
            f"{row['instances']:>5} instances  {row['policy']:<22} p50 {row['p50_us']:8.1f} us"
            f"  p99 {row['p99_us']:8.1f} us  ({row['p50_ratio']:.2f} / {row['p99_ratio']:.2f}"
            f" x {policies[0]})"
        )
    document = {"policies": policies, "results": figures}
    write_json(args.json, document)
    return 0


def _known(names: Sequence[str], known: Iterable[str], what: str = "policies") -> list[str]:
    """``names`` as given; a CliError naming any that ``known`` lacks."""
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise CliError(f"unknown {what}: {', '.join(unknown)}")
    return list(names)


def _add_bench_admission(sub: argparse._SubParsersAction) -> None:
    from control.routing import ROUTERS
    from sim.admission_bench import ABLATED, ADMISSION_LADDER, BENCHED

    admission = sub.add_parser(
        "admission",
        help="every admission policy in front of one router, across a ladder past capacity",
        description="Runs each admission policy in front of the same router on the same "
        "workload, cluster and seed at each ladder level (shares of the cluster's measured "
        "capacity), with clients that give up and retry (sim/clients.py); writes goodput, "
        "compliance, waste and rejections per policy, pooled and per level and per class.",
    )
    admission.add_argument("--trace", default="mixed", help="default: mixed. " + trace_help())
    _add_ladder_options(admission, ADMISSION_LADDER, (*BENCHED, *ABLATED))
    admission.add_argument(
        "--router",
        default="tokenpilot",
        choices=sorted(ROUTERS),
        help="the router behind every policy (default: tokenpilot)",
    )
    admission.add_argument(
        "--plot", type=plot_file, help="write goodput and compliance per level here"
    )
    admission.add_argument(
        "--step-change",
        type=plot_file,
        metavar="PNG",
        help="also run SLOMax on a load stepping from 0.8 to 1.5 x capacity halfway, and plot "
        "its controller's limit and the attainments it read over time here (the passes go "
        "into the JSON as step_change)",
    )
    admission.set_defaults(handler=_bench_admission)


def _bench_admission(args: argparse.Namespace) -> int:
    from sim.admission_bench import (
        ABLATED,
        BENCHED,
        bench_admission,
        plot_levels,
        plot_step_change,
        step_change,
    )
    from sim.progress import progress_bar

    outputs = {"--json": args.json, "--plot": args.plot, "--step-change": args.step_change}
    distinct_files(outputs, {"--trace": args.trace})
    policies = _known(args.policies or list(BENCHED), (*BENCHED, *ABLATED), "admission policies")
    with progress_bar(total=len(policies) * len(args.ladder), desc="runs", unit="run") as bar:
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
            raise CliError(message_of(exc)) from None
    if args.step_change:
        document["step_change"] = step_change(
            args.trace,
            instances=args.instances,
            profile_name=args.profile,
            requests=args.requests,
            seed=args.seed,
        )
    print(
        f"{'policy':22}{'goodput':>10}{'total':>10}{'comply':>8}{'chat':>8}{'reject':>8}"
        f"{'lost work':>12}{'cap@90%':>9}"
    )
    for policy, result in document["policies"].items():
        chat = result["per_class"].get("interactive", {}).get("compliance", float("nan"))
        capacity = result["capacity_at_90_rps"]
        print(
            f"{policy:22}{result['goodput_tok_s']:>10.0f}{result['total_tok_s']:>10.0f}"
            f"{result['compliance']:>8.1%}{chat:>8.1%}{result['rejected_share']:>8.1%}"
            f"{result['lost_work_tok']:>12,}{'-' if capacity is None else f'{capacity:.1f}':>9}"
        )
    save_each(
        (args.json, as_json(document)),
        (args.plot, partial(plot_levels, document)),
        (args.step_change, partial(plot_step_change, document.get("step_change"))),
    )
    return 0


def _add_bench_fleet(sub: argparse._SubParsersAction) -> None:
    from sim.fleet_bench import STACKS, VARIANTS

    fleet = sub.add_parser(
        "fleet",
        help="every DC policy on a hotspot in a three-DC layout (an entry region without GPUs)",
        description="Runs each DC policy at the edge of the same fleet (entry region A "
        "without GPUs; B, its home, the existing cluster; C and D extension DCs, D warming "
        "up for its first 90 s), each DC running TokenPilot behind SLOMax, on the same "
        "arrivals: A's traffic at 0.6 x B's capacity, 2 x for the hotspot (60 to 240 s), "
        "C's and D's own at 0.3 x; 30 % of A's requests must stay in the EU, one tenant "
        "may use B and C only. Writes goodput per region and class, TTFT, cross-DC share, "
        "violations of residency and permission, capacity mismatch and time to react.",
    )
    fleet.add_argument(
        "--trace",
        default="mixed",
        help="a labelled workload whose region is the entry (default: mixed). " + trace_help(),
    )
    add_profile(fleet, "the instances' calibrated model and GPUs")
    fleet.add_argument("--seed", type=seed, default=0, help="seed of the workload (default: 0)")
    fleet.add_argument(
        "--policies",
        type=names,
        default=None,
        help=f"comma-separated subset of: {', '.join(STACKS)} (default: all of them); "
        f"also, when named: {', '.join(VARIANTS)}",
    )
    fleet.add_argument("--jobs", type=positive_int, default=1, help="runs at once (default 1)")
    fleet.add_argument("--json", type=output_file, required=True, help="write the figures here")
    fleet.add_argument(
        "--plot", type=plot_file, help="write A's traffic by DC over time here (PNG)"
    )
    fleet.set_defaults(handler=_bench_fleet)


def _bench_fleet(args: argparse.Namespace) -> int:
    from sim.fleet_bench import RUNNABLE, STACKS, bench_fleet, plot_fleet
    from sim.progress import progress_bar

    distinct_files({"--json": args.json, "--plot": args.plot}, {"--trace": args.trace})
    policies = _known(args.policies or list(STACKS), RUNNABLE, "DC policies")
    with progress_bar(total=len(policies), desc="policies", unit="run") as bar:
        try:
            document = bench_fleet(
                args.trace,
                seed=args.seed,
                profile_name=args.profile,
                policies=policies,
                jobs=args.jobs,
                progress=lambda name: (bar.set_postfix_str(name), bar.update()),
            )
        except (ValueError, KeyError) as exc:
            raise CliError(message_of(exc)) from None
    # Written first: the table below is a view of them, and a run takes minutes.
    save_each((args.json, as_json(document)), (args.plot, partial(plot_fleet, document)))
    print(
        f"{'policy':36}{'goodput':>9}{'comply':>8}{'hot P95':>9}{'chats':>7}{'cross-DC':>9}"
        f"{'mismatch':>10}{'react':>7}{'violations':>11}"
    )
    for policy, result in document["policies"].items():
        violations = result["residency_violations"] + result["permission_violations"]
        hotspot = result["hotspot"]
        chats = hotspot["per_class"].get("interactive", {}).get("ttft_p95_s")
        # "-" where the run has no figure: nothing of the kind completed, or to react to
        print(
            f"{policy:36}{shown(result['goodput_tok_s'], '.0f', '', '-'):>9}"
            f"{shown(result['compliance'], '.1%', '', '-'):>8}"
            f"{shown(hotspot['ttft_p95_s'], '.2f', 's', '-'):>9}"
            f"{shown(chats, '.2f', 's', '-'):>7}"
            f"{shown(result['cross_dc_share'], '.1%', '', '-'):>9}"
            f"{shown(result['capacity_mismatch_request_s'], '.0f', '', '-'):>10}"
            f"{shown(result['react_s'], '.0f', 's', '-'):>7}{violations:>11}"
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
        help=trace_help(),
    )
    _add_ladder_options(routing, DEFAULT_LADDER, ROUTERS)
    add_token_lags(routing)
    routing.add_argument(
        "--step-model-error",
        type=fraction,
        default=0.0,
        metavar="F",
        help="give the routers that use a step model (TokenPilot) one whose every term is off "
        "by this fraction, up or down at random per term (e.g. 0.15), while the simulated "
        "engines step with the true one (default 0: the engines' own model)",
    )
    routing.add_argument("--plot", type=plot_file, help="write TTFT CDFs per policy here (PNG)")
    routing.set_defaults(handler=_bench_routing)


def _add_ladder_options(
    parser: argparse.ArgumentParser, ladder: Sequence[float], policies: Iterable[str]
) -> None:
    """The options every ladder benchmark takes: cluster, ladder, sample, policies, jobs."""
    parser.add_argument(
        "--instances", type=positive_int, default=16, help="simulated instances (default: 16)"
    )
    add_profile(parser, "the instances' calibrated model and GPUs")
    parser.add_argument(
        "--ladder",
        type=levels,
        default=list(ladder),
        metavar="L1,L2,...",
        help="default: " + ",".join(f"{level:g}" for level in ladder),
    )
    parser.add_argument("--requests", type=positive_int, help="only the first N requests")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the workload (default: 0)")
    parser.add_argument(
        "--policies",
        type=names,
        default=None,
        help=f"comma-separated subset of: {', '.join(policies)} (default: all)",
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="runs at once, each in its own process (default 1); figures do not depend on it",
    )
    parser.add_argument("--json", type=output_file, required=True, help="write the figures here")


def _bench_routing(args: argparse.Namespace) -> int:
    from control.routing import ROUTERS
    from sim.progress import progress_bar
    from sim.routing_bench import bench_routing, plot_ttft_cdfs

    distinct_files({"--json": args.json, "--plot": args.plot}, {"--trace": args.trace})
    policies = _known(args.policies or list(ROUTERS), ROUTERS)
    with progress_bar(total=len(policies) * len(args.ladder), desc="runs", unit="run") as bar:
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
                tokenpilot=tokenpilot_params(args),
                step_model_error=args.step_model_error,
            )
        except (ValueError, KeyError) as exc:
            raise CliError(message_of(exc)) from None
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
    title = f"{args.trace}, {args.instances} instances, pooled ladder"
    save_each((args.json, as_json(document)), (args.plot, partial(plot_ttft_cdfs, records, title)))
    return 0


def _bench_sim(args: argparse.Namespace) -> int:
    from sim.bench import bench_sim

    def report(label: str, figures: dict[str, float]) -> None:
        print(
            f"{label:28} {figures['requests']:>6} requests on {figures['instances']:>3} "
            f"instances: {figures['wall_s']:6.1f} s "
            f"({figures['simulated_requests_per_s']:.0f} requests/s)",
            flush=True,
        )

    result = bench_sim(report=report)
    write_json(args.json, result)
    return 0
