"""Simulation commands: demo, sim, calibrate, workload, bench."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING

from control.step_time import Blackbox
from tokenfleet.commands.arguments import (
    add_profile,
    count,
    distinct_files,
    output_dir,
    output_file,
    positive_float,
    positive_int,
    seconds,
    seed,
)
from tokenfleet.commands.errors import CliError
from tokenfleet.commands.output import as_json, save, save_each, write_json

if TYPE_CHECKING:
    from control.routing.tokenpilot import TokenPilotParams


def register(commands: argparse._SubParsersAction) -> None:
    for add in (_add_demo, _add_sim, _add_calibrate, _add_validate, _add_workload):
        add(commands)


def _add_demo(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser(
        "demo",
        help="the embedded main job: the whole stack against a baseline, no Kafka or Redis",
        description="Simulates a multi-DC layout (an entry region without GPUs, "
        "its home DC taking a hotspot at twice its capacity, two extension DCs, one "
        "warming up) on the mixed workload of chats, long documents and batch jobs, under "
        "TokenFleet (FleetMind, SLOMax and TokenPilot, with their controllers) and under "
        "a baseline stack (llm-d's default routing, first come first served, each request "
        "in its home DC), on the same arrivals. Shows TokenFleet's DCs live, then a "
        "report; writes the figures (demo.json) and a plot (demo.png) to --out. About a "
        "minute on two idle cores, two on busy ones.",
    )
    demo.add_argument("--seed", type=seed, default=0, help="seed (default: 0)")
    demo.add_argument(
        "--instances-per-dc", type=positive_int, default=4, help="instances in each DC (default: 4)"
    )
    demo.add_argument(
        "--out",
        type=output_dir,
        default="out/demo",  # a string, which argparse passes through output_dir, making it
        help="where the figures and the plot go (default: out/demo)",
    )
    demo.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace) -> int:
    from tokenfleet.demo import main as demo_main

    return demo_main(args.seed, args.instances_per_dc, args.out)


def _add_sim(commands: argparse._SubParsersAction) -> None:
    from control.admission.registry import ADMISSIONS
    from control.routing import ROUTERS

    sim = commands.add_parser(
        "sim",
        help="simulate a trace on a cluster under one routing policy",
        description="Runs a discrete-event simulation in virtual time and writes its summary.",
    )
    sim.add_argument(
        "--trace",
        required=True,
        help=trace_help(),
    )
    sim.add_argument("--instances", type=positive_int, default=16, help="instances (default: 16)")
    sim.add_argument(
        "--policy",
        default="round_robin",
        choices=sorted(ROUTERS),
        help="the router (default: round_robin; the gateway's default is the fleet file's "
        "routing profile)",
    )
    sim.add_argument(
        "--admission",
        default="fcfs",
        choices=sorted(ADMISSIONS),
        help="admission in front of the router: fcfs admits everything (the engines' own "
        "queues decide); slomax holds, reserves and rejects by class (default: %(default)s)",
    )
    add_profile(sim, "model and hardware of every instance")
    sim.add_argument("--requests", type=positive_int, help="only the first N requests of the trace")
    load = sim.add_mutually_exclusive_group()
    load.add_argument(
        "--rate-scale",
        type=positive_float,
        default=1.0,
        help="arrivals this many times as dense (default: 1)",
    )
    load.add_argument(
        "--ladder",
        type=levels,
        metavar="L1,L2,...",
        help="one run at each share of measured capacity, e.g. 0.5,0.8,1,1.2",
    )
    sim.add_argument(
        "--seed", type=seed, default=0, help="seed of every random choice (default: 0)"
    )
    add_token_lags(sim)
    sim.add_argument(
        "--blackbox",
        type=_blackbox,
        metavar="B0,B1,B2,A0,A1,A2",
        help="BLIS blackbox coefficients in microseconds (step = b0 + b1*uncached prefill "
        "tokens + b2*decode tokens; queueing a0 + a1*input; a2 per output token), "
        "replacing the profile's step times",
    )
    sim.add_argument("--json", type=output_file, help="write the result here")
    sim.add_argument("--records", type=output_file, help="write one CSV row per request here")
    sim.set_defaults(handler=_sim)


def _sim(args: argparse.Namespace) -> int:
    from sim.run import RunConfig, check_policies, simulate_ladder, simulate_run, write_records

    distinct_files({"--json": args.json, "--records": args.records}, {"--trace": args.trace})
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
        tokenpilot=tokenpilot_params(args),
    )
    try:
        check_policies(config.policy, config.admission, config.profile)
        if args.ladder:
            result, rows = simulate_ladder(config, args.ladder, progress=True)
            runs = result["levels"]
        else:
            result, records = simulate_run(config, progress=True)  # drawn on a terminal only
            runs, rows = [result], [record.as_dict() for record in records]
    except ValueError as exc:
        raise CliError(str(exc)) from None
    for run in runs:
        _print_summary(run)
    save_each((args.json, as_json(result)), (args.records, partial(write_records, rows)))
    return 0


def _blackbox(text: str) -> Blackbox:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if len(values) != 6 or not all(0 <= v < math.inf for v in values):  # nan is neither
        raise argparse.ArgumentTypeError("give six finite non-negative numbers: b0,b1,b2,a0,a1,a2")
    b0, b1, b2, a0, a1, a2 = values
    return Blackbox(b0, b1, b2, a0, a1, a2)


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"a fraction from 0 to below 1 is expected, not {text!r}")
    return value


def add_token_lags(parser: argparse.ArgumentParser) -> None:
    from control.routing.tokenpilot import TokenPilotParams
    from sim.simulator import HOST_TOKEN_LAG_S

    parser.add_argument(
        "--host-token-lag",
        type=seconds,
        default=HOST_TOKEN_LAG_S,
        metavar="S",
        help="how late the simulated host sees each step's streamed tokens, in seconds "
        f"(default {HOST_TOKEN_LAG_S:g}); TokenPilot assumes its own, --assumed-token-lag",
    )
    assumed = TokenPilotParams().token_lag_s
    parser.add_argument(
        "--assumed-token-lag",
        type=seconds,
        default=assumed,
        metavar="S",
        help=f"the least lag TokenPilot assumes, in seconds (default {assumed:g}); it "
        "assumes more when first tokens show the host later (a gateway takes it from "
        "TOKENFLEET_GATEWAY_TOKEN_LAG_S)",
    )


def tokenpilot_params(args: argparse.Namespace) -> TokenPilotParams:
    from control.routing.tokenpilot import TokenPilotParams

    return TokenPilotParams(token_lag_s=args.assumed_token_lag)


def levels(text: str) -> list[float]:
    """Load levels, as multiples of capacity: finite numbers above 0, comma-separated."""
    return [positive_float(part) for part in text.split(",")]


def _print_summary(result: dict) -> None:
    summary = result["summary"]
    level = f" at {result['level']:g} x capacity" if "level" in result else ""
    print(
        f"{result['trace']}{level}: {summary['completed']} of {summary['requests']} requests "
        f"completed ({summary['rejected']} rejected, {summary['cancelled']} cancelled) "
        f"on {result['instances']} x {result['profile']}, policy {result['policy']}"
    )
    for name in ("ttft", "tpot", "e2e"):
        p50, p95, p99 = (shown(summary[f"{name}_p{q}_s"], ".3f", " s") for q in (50, 95, 99))
        print(f"  {name:5} p50 {p50}   p95 {p95}   p99 {p99}")
    print(
        f"  throughput {summary['throughput_tok_s']:.0f} tok/s   goodput "
        f"{summary['goodput_tok_s']:.0f} tok/s   cache hit rate {summary['cache_hit_rate']:.1%}"
    )
    print(
        f"  simulated in {result['wall_s']:.1f} s "
        f"({result['simulated_requests_per_s']:.0f} requests/s)"
    )


def shown(value: float | None, spec: str, unit: str = "", missing: str = "n/a") -> str:
    """A figure of a printed summary, formatted by ``spec``; ``missing`` where the run has
    none (NaN in the run, null in its JSON: no request of the kind completed)."""
    if value is None or math.isnan(value):
        return missing
    return f"{value:{spec}}{unit}"


def _add_workload(commands: argparse._SubParsersAction) -> None:
    from sim.export import DESCRIPTION
    from sim.registry import TRACES

    workload = commands.add_parser("workload", help="workloads: list or export them")
    sub = workload.add_subparsers(required=True, metavar="ACTION")
    listing = sub.add_parser("list", help="the named workloads")
    listing.set_defaults(
        handler=lambda _: _print_lines(
            f"{name:20} {source.description}" for name, source in TRACES.items()
        )
    )
    export = sub.add_parser(
        "export", help="write a labelled workload as CSV for other tools", description=DESCRIPTION
    )
    export.add_argument(
        "--trace",
        required=True,
        help=trace_help(),
    )
    export.add_argument("--out", type=output_file, required=True, help="the CSV file to write")
    export.add_argument("--requests", type=positive_int, help="only the first N requests")
    export.add_argument(
        "--seed",
        type=seed,
        default=0,
        help="seed of what the workload draws: its labels, and arrivals or sampled rows where "
        "it draws them (default: 0)",
    )
    export.set_defaults(handler=_workload_export)


def _workload_export(args: argparse.Namespace) -> int:
    from sim.export import export_csv
    from sim.registry import load_trace

    distinct_files({"--out": args.out}, {"--trace": args.trace})
    try:
        requests = load_trace(args.trace, limit=args.requests, seed=args.seed)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    save(args.out, partial(export_csv, requests))
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
    calibrate.add_argument(
        "--profile", required=True, choices=sorted(CALIBRATED), help="the profile to fit"
    )
    calibrate.add_argument(
        "--iterations", type=count, default=80, help="Nelder-Mead steps (default: 80; 0: validate)"
    )
    calibrate.add_argument("--json", type=output_file, help="write coefficients and rows here")
    calibrate.set_defaults(handler=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    from dataclasses import asdict, replace

    from sim import calibration
    from sim.profiles import CALIBRATED, TRAINING_STAGES
    from sim.progress import progress_bar, with_progress

    chosen = CALIBRATED[args.profile]
    where = calibration.calibration_dir() / calibration.STAGES_FILE
    try:
        measured = calibration.load_stages(str(where))
        stages = [s for s in measured if chosen.measured_model in s.experiment]
    except OSError as exc:
        raise CliError(f"cannot read {where}: {exc.strerror} (TOKENFLEET_CALIBRATION)") from None
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if not stages:
        raise CliError(f"{where} has no measured stage of {chosen.measured_model}")
    training = [s for s in stages if calibration.is_training(s, TRAINING_STAGES)]
    profile = chosen.profile
    if args.iterations > 0:
        with progress_bar(total=args.iterations, desc="fitting", unit="it", leave=False) as bar:

            def fitted_one(_: int, loss: float) -> None:
                bar.set_postfix(loss=f"{loss:.4f}")
                bar.update()

            fitted = calibration.fit(
                training, profile, iterations=args.iterations, progress=fitted_one
            )
        profile = replace(profile, step_time=fitted)
    checked = with_progress(stages, True, "checking", unit="stage")  # 15 s and more
    rows = calibration.validate(checked, TRAINING_STAGES, profile)
    print(f"{args.profile}: {profile.step_time}")
    print(calibration.markdown_table(rows))
    if args.json:
        document = {
            "profile": args.profile,
            "step_time": asdict(profile.step_time),
            "rows": [row.as_dict() for row in rows],
        }
        write_json(args.json, document)
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
    validate.add_argument("--json", type=output_file, help="write the rows here")
    validate.set_defaults(handler=_validate)


def _validate(args: argparse.Namespace) -> int:
    from sim import validation
    from sim.profiles import PROFILES

    rows = validation.validate_regime(PROFILES[validation.PROFILE], progress=True)
    print(validation.markdown_table(rows))
    if args.json:
        document = {"profile": validation.PROFILE, "rows": [row.as_dict() for row in rows]}
        write_json(args.json, document)
    return 0


def trace_help() -> str:
    from sim.registry import TRACES

    return (
        f"{', '.join(TRACES)}, or a .jsonl path in Mooncake's format (timestamp in "
        "milliseconds, input_length, output_length, hash_ids: one per 512-token block, "
        "fewer leaving the later blocks unshared; timestamps replayed as given, while the "
        "named mooncake trace places each request at random in its 3 s bucket), whose rows "
        "may carry class, tenant, deadline_s and region (the label rules of sim/labels.py "
        "fill in the rest)"
    )
