"""The embedded main job: no Kafka, no Redis, everything in one process.

Simulates a slice of the Mooncake conversation trace on a small cluster under each routing
policy there is, side by side, on the same requests and seed.
"""

from __future__ import annotations

from control.routing import ROUTERS
from sim.run import RunConfig, simulate_run

COLUMNS = ("ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "e2e_p95_s", "goodput_tok_s", "cache_hit_rate")


def run_demo(requests: int, instances: int, seed: int) -> dict[str, dict[str, float]]:
    """The summary figures of each policy."""
    figures = {}
    for policy in ROUTERS:
        config = RunConfig("mooncake", instances, policy, requests=requests, seed=seed)
        result, _ = simulate_run(config)
        figures[policy] = {column: result["summary"][column] for column in COLUMNS}
    return figures


def main(requests: int, instances: int, seed: int) -> int:
    figures = run_demo(requests, instances, seed)
    print(
        f"Mooncake conversation trace, first {requests} requests, {instances} simulated "
        f"Llama-70B instances (4 x H100 each):"
    )
    print(f"{'policy':24}" + "".join(f"{c:>16}" for c in COLUMNS))
    for policy, row in figures.items():
        print(f"{policy:24}" + "".join(f"{row[c]:>16.3f}" for c in COLUMNS))
    return 0
