"""The fleet file, and the collector's reading of vLLM's and SGLang's metrics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gateway.fleet_view import TABLES_STALE_S, FleetView, LastKnown
from gateway.state import SharedView
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas
from schemas.fleet import FleetFileError, load_fleet
from schemas.tables import GoodputTable
from schemas.telemetry import KvAllCleared, KvBlocksRemoved, KvBlocksStored
from streams.collector import (
    NOMINAL_KV_BLOCKS,
    NoEngineMetrics,
    kv_messages,
    parse_metrics,
    telemetry_of,
)
from streams.tables.goodput import GoodputCounts

EXAMPLE = Path(__file__).parents[2] / "examples" / "fleet.toml"

VLLM = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 5.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{model_name="m"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{model_name="m"} 400.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="2000"} 1.0
"""

MLA = VLLM.replace('block_size="16"', 'block_size="64"')
"""A vLLM server paging KV in FlashMLA's blocks of 64 tokens."""

SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 2.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 7.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.5
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m"} 0.3
"""


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("fleet.toml", b"\x95\xff binary", "is not text"),
        ("fleet.json", b"\x95\xff binary", "is not text"),
        ("fleet.json", b"[" * 100_000 + b"]" * 100_000, "is nested too deep"),
    ],
)
def test_a_fleet_file_that_is_no_text_or_nested_without_end_is_named(
    tmp_path: Path, name: str, content: bytes, message: str
) -> None:
    """Each was a traceback (UnicodeDecodeError, RecursionError) in every command."""
    odd = tmp_path / name
    odd.write_bytes(content)
    with pytest.raises(FleetFileError, match=f"fleet file {odd} {message}"):
        load_fleet(odd)


def test_the_example_fleet_file_loads_with_default_objectives_kept() -> None:
    fleet = load_fleet(EXAMPLE)
    assert [i.id for i in fleet.instances] == ["a-0", "a-1"]
    assert fleet.objectives[TaskClass.INTERACTIVE].ttft_s == 2.0
    assert fleet.objectives[TaskClass.BATCH].use_deadline  # not named there: the default


def test_a_fleet_file_naming_an_unknown_dc_is_refused(tmp_path: Path) -> None:
    broken = tmp_path / "fleet.toml"
    broken.write_text(EXAMPLE.read_text().replace('dc = "dc-a"', 'dc = "dc-z"', 1))
    with pytest.raises(FleetFileError, match="unknown dc 'dc-z'"):
        load_fleet(broken)
    with pytest.raises(FleetFileError, match="cannot read"):
        load_fleet(tmp_path / "missing.toml")
    kept_out = tmp_path / "tenant.toml"
    kept_out.write_text(EXAMPLE.read_text().replace('dcs = ["dc-a"]', 'dcs = ["dc-y"]'))
    with pytest.raises(FleetFileError, match=r"tenant 'reports' names unknown dcs \['dc-y'\]"):
        load_fleet(kept_out)


def test_a_tenant_s_keys_may_come_from_the_environment(tmp_path: Path) -> None:
    """Fleet files are shared and committed: a tenant's keys may stay in the gateways'
    environment; a variable unset refuses the start, and a tenant with no keys at all is
    refused as one nobody could use."""
    example = EXAMPLE.read_text()
    keyed = tmp_path / "keyed.toml"
    keyed.write_text(example.replace('api_keys = ["sk-demo"]', 'api_keys_env = ["DEMO_KEY"]'))
    fleet = load_fleet(keyed)
    assert fleet.tenants[0].api_keys == ()
    served = fleet.with_tenant_keys({"DEMO_KEY": " sk-from-env\n"})
    assert served.tenants[0].api_keys == ("sk-from-env",)
    assert served.tenants[1] == fleet.tenants[1]
    for environ in ({}, {"DEMO_KEY": "two words"}):
        with pytest.raises(ValueError, match=r"tenant demo: DEMO_KEY \(in its api_keys_env\)"):
            fleet.with_tenant_keys(environ)
    with pytest.raises(ValueError, match="API key appears twice, counting the keys of"):
        fleet.with_tenant_keys({"DEMO_KEY": "sk-reports"})  # the other tenant's
    keyless = tmp_path / "keyless.toml"
    keyless.write_text(example.replace('api_keys = ["sk-demo"]', ""))
    with pytest.raises(FleetFileError, match="neither api_keys nor api_keys_env"):
        load_fleet(keyless)


def test_a_typo_in_a_model_s_key_is_the_one_problem_named(tmp_path: Path) -> None:
    """Pydantic also counted the models without the failed one: "models: Tuple should
    have at least 1 item after validation, not 0", beside the typo."""
    typo = tmp_path / "fleet.toml"
    typo.write_text(EXAMPLE.read_text().replace("max_num_seqs = ", "max_num_seqz = ", 1))
    with pytest.raises(FleetFileError) as refused:
        load_fleet(typo)
    assert str(refused.value).endswith(": models.0.max_num_seqz: Extra inputs are not permitted")


def test_an_empty_api_key_is_refused(tmp_path: Path) -> None:
    """It would match a header of ``Bearer`` and a space: anyone would be that tenant."""
    blank = tmp_path / "fleet.toml"
    blank.write_text(EXAMPLE.read_text().replace('api_keys = ["sk-demo"]', 'api_keys = [""]'))
    with pytest.raises(FleetFileError, match="api_keys"):
        load_fleet(blank)


def test_an_instance_url_of_the_openai_api_is_refused(tmp_path: Path) -> None:
    """A client's base URL (``.../v1``): the gateway called ``/v1/v1/...``, the collector
    scraped ``/v1/metrics`` (404), and the instance read not ready, with no word why."""
    example = EXAMPLE.read_text()
    first = example[example.index('url = "') :].split('"')[1]
    api = tmp_path / "fleet.toml"
    api.write_text(example.replace(f'url = "{first}"', f'url = "{first}/v1/"', 1))
    with pytest.raises(FleetFileError, match="the OpenAI API's URL: give the server's"):
        load_fleet(api)
    prefixed = tmp_path / "prefixed.toml"  # a proxy's prefix is a server's base
    prefixed.write_text(example.replace(f'url = "{first}"', f'url = "{first}/llama"', 1))
    assert str(load_fleet(prefixed).instances[0].url).endswith("/llama")


def test_the_snapshot_carries_each_engine_s_block_size_as_scraped() -> None:
    """One instance reported blocks of 64 tokens, the other nothing yet: vLLM's 16."""
    fleet = load_fleet(EXAMPLE)
    view = FleetView(fleet)
    first, second = fleet.instances[0], fleet.instances[1]
    view.observe(telemetry_of(first, parse_metrics(MLA, "vllm")))
    pool = view.pool(first.model, first.dc)
    assert pool is not None
    assert pool.ids == (first.id, second.id)
    zeros = np.zeros(2)
    snapshot = view.snapshot(pool, SharedView(zeros, zeros, zeros.astype(int)))
    assert list(snapshot.kv_block_size) == [64, 16]
    assert view.prefix_capacity(first.id) == 8_000  # 2,000 blocks of 64: of 16 tokens each


def test_instances_of_a_version_their_model_is_not_pinned_to_are_never_ready() -> None:
    """A rolling upgrade: dc-a runs version 1 and 2 side by side, the model is pinned to
    2; the version-1 replica is kept out of every decision, however ready it reports."""
    fleet = load_fleet(EXAMPLE)
    pinned = fleet.model_copy(
        update={
            "models": tuple(m.model_copy(update={"version": "2"}) for m in fleet.models),
            "instances": (
                fleet.instances[0],
                fleet.instances[1].model_copy(update={"version": "2"}),
            ),
        }
    )
    view = FleetView(pinned)
    zeros = np.zeros(2)
    pool = view.pool(fleet.instances[0].model, "dc-a")
    assert pool is not None
    assert [view.ready(i) for i in pool.ids] == [False, True]
    assert list(view.snapshot(pool, SharedView(zeros, zeros, zeros.astype(int))).ready) == [
        False,
        True,
    ]
    assert all(FleetView(fleet).ready(i.id) for i in fleet.instances)  # unpinned: any version


def test_last_known_takes_newer_live_snapshots_and_any_live_one_once_its_own_expired() -> None:
    """A replayed old snapshot never displaces a live one; a controller that starts again
    on a new topic, from version 1, is heard once the last snapshot it sent has expired."""

    def quotas(version: int, issued_at: float) -> AdmissionQuotas:
        return AdmissionQuotas(
            scope="dc", version=version, issued_at=issued_at, ttl_s=60, quotas=()
        )

    known: LastKnown[AdmissionQuotas] = LastKnown()
    assert known.offer(quotas(50, 1_000.0), now=1_010.0)
    assert not known.offer(quotas(1, 1_020.0), now=1_020.0)  # older, while 50 lives
    assert not known.offer(quotas(49, 900.0), now=1_020.0)  # expired already
    assert known.current("dc", now=1_100.0) is None  # 50 has expired
    assert known.offer(quotas(1, 1_100.0), now=1_100.0)  # the restarted controller
    assert not known.offer(quotas(49, 1_000.0), now=1_101.0)  # a replay: expired
    current = known.current("dc", now=1_101.0)
    assert current is not None
    assert current.version == 1


def test_a_dc_s_pace_is_its_newest_goodput_table_s_completions_of_the_model() -> None:
    """Requests of the model completed a second over the table's window; a replayed
    older table changes nothing, a table past ``TABLES_STALE_S`` says nothing, and any
    table replaces it."""

    def table(version: int, completed: int, end: float) -> GoodputTable:
        row = GoodputCounts(completed=completed).row("m", 60)
        return GoodputTable(
            dc="b", version=version, window_start=end - 60, window_end=end,
            classes=(), tenants=(), models=(row,),
        )  # fmt: skip

    view = FleetView(load_fleet(EXAMPLE))
    view.observe_goodput(table(2, 600, 1_000.0), now=1_000.0)
    view.observe_goodput(table(1, 6_000, 1_010.0), now=1_010.0)
    assert view.completed_per_s("m", "b", now=1_010.0) == 10
    assert view.completed_per_s("other", "b", now=1_010.0) == 0
    assert view.completed_per_s("m", "c", now=1_010.0) == 0
    later = 1_001.0 + TABLES_STALE_S
    assert view.completed_per_s("m", "b", now=later) == 0
    view.observe_goodput(table(1, 1_200, later), now=later)  # a worker whose clock is behind
    assert view.completed_per_s("m", "b", now=later) == 20


def test_vllm_metrics_become_telemetry() -> None:
    fleet = load_fleet(EXAMPLE)
    telemetry = telemetry_of(fleet.instances[0], parse_metrics(VLLM, "vllm"))
    assert (telemetry.running, telemetry.waiting) == (3, 5)
    assert (telemetry.kv_blocks_used, telemetry.kv_blocks_total) == (500, 2000)
    assert (telemetry.prefix_cache_hits, telemetry.prefix_cache_queries) == (400, 1000)
    assert telemetry.ready
    assert telemetry.block_size == 16
    assert telemetry_of(fleet.instances[0], parse_metrics(MLA, "vllm")).block_size == 64


def test_vllm_s_older_prefix_counters_are_read_where_the_newer_are_missing() -> None:
    """vLLM 0.8 to 0.9.1 named them ``gpu_prefix_cache_*``, read as 0 before; 0.9.2 to
    0.10 publish both names, and the newer count."""
    older = VLLM.replace("vllm:prefix_cache_", "vllm:gpu_prefix_cache_")
    both = VLLM + "".join(
        f'vllm:gpu_prefix_cache_{name}_total{{model_name="m"}} {value}\n'
        for name, value in (("queries", 7.0), ("hits", 3.0))
    )
    for exposition in (older, both):
        scraped = parse_metrics(exposition, "vllm")
        assert (scraped.prefix_hits, scraped.prefix_queries) == (400.0, 1000.0)


def test_sglang_metrics_become_telemetry() -> None:
    fleet = load_fleet(EXAMPLE)
    telemetry = telemetry_of(fleet.instances[0], parse_metrics(SGLANG, "sglang"))
    assert (telemetry.running, telemetry.waiting) == (2, 7)
    assert telemetry.kv_blocks_total == NOMINAL_KV_BLOCKS
    assert telemetry.kv_blocks_used == NOMINAL_KV_BLOCKS // 2
    assert telemetry.prefix_cache_hits == 300


def test_sglang_s_token_counters_are_its_prefix_cache_counters() -> None:
    """Counters, which the capacity tables read over their window (its per-batch hit rate
    is read only where they are missing)."""
    counters = SGLANG + (
        'sglang:prompt_tokens_total{model_name="m",is_streaming="true"} 600.0\n'
        'sglang:prompt_tokens_total{model_name="m",is_streaming="false"} 400.0\n'
        'sglang:cached_tokens_total{model_name="m",cache_source="device"} 250.0\n'
        'sglang:cached_tokens_total{model_name="m",cache_source="host"} 50.0\n'
    )
    scraped = parse_metrics(counters, "sglang")
    assert (scraped.prefix_hits, scraped.prefix_queries) == (300.0, 1000.0)


def test_sglang_s_token_counters_under_priority_scheduling_are_the_sum_of_the_priorities() -> None:
    """With ``--enable-priority-scheduling`` its tokenizer's counters carry each request's
    priority and no total (read as missing before: the nominal 1,000 queries, the tables'
    hit rate 0), where its gauges have a total beside the shares."""
    counters = SGLANG + (
        'sglang:prompt_tokens_total{model_name="m",priority="0"} 800.0\n'
        'sglang:prompt_tokens_total{model_name="m",priority="1"} 400.0\n'
        'sglang:cached_tokens_total{model_name="m",priority="0",cache_source="device"} 250.0\n'
        'sglang:cached_tokens_total{model_name="m",priority="1",cache_source="device"} 110.0\n'
    )
    scraped = parse_metrics(counters, "sglang")
    assert (scraped.prefix_hits, scraped.prefix_queries) == (360.0, 1200.0)


def test_vllm_s_api_server_processes_each_show_a_gauge_only_one_of_them_feeds() -> None:
    """``--api-server-count 4``: a gauge exported per process (``pid``) reads the engine's
    figure in one of them and 0 in the others (``kv_cache_usage_perc`` until vLLM PR
    #28792); averaged, the KV use read a quarter of itself."""
    pids = (("11", 0.0), ("12", 0.0), ("13", 0.8), ("14", 0.0))
    exposition = VLLM + "".join(
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="m",pid="{pid}"}} {use}\n'
        for pid, use in pids
    )
    assert parse_metrics(exposition, "vllm").kv_usage == pytest.approx(0.8)


def test_an_instance_that_did_not_answer_is_not_ready() -> None:
    fleet = load_fleet(EXAMPLE)
    assert not telemetry_of(fleet.instances[1], None).ready


def test_a_standby_instance_is_ready_only_once_its_telemetry_says_so() -> None:
    """A standby GPU runs nothing until a placement starts a replica on it: gateways
    must not send it requests before the collector has scraped it."""
    fleet = load_fleet(EXAMPLE)
    spare = fleet.instances[1].model_copy(update={"id": "spare", "standby": True})
    view = FleetView(fleet.model_copy(update={"instances": (*fleet.instances, spare)}))
    assert view.ready(fleet.instances[1].id)
    assert not view.ready("spare")
    view.observe(telemetry_of(spare, parse_metrics(VLLM, "vllm")))
    assert view.ready("spare")
    view.observe(telemetry_of(spare, None))  # taken back: its port closed
    assert not view.ready("spare")


def test_data_parallel_engines_add_their_requests_and_average_their_kv_use() -> None:
    """vLLM with ``--data-parallel-size 2`` (a series per engine; 0.9.2 to 0.10 also
    publish the old KV name beside the new) and SGLang with two DP ranks, priority
    scheduling and metrics from every tensor-parallel rank."""
    vllm = """\
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.4
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.2
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.4
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.2
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="4000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="4000"} 1.0
"""
    scraped = parse_metrics(vllm, "vllm")
    assert (scraped.running, scraped.waiting, scraped.kv_blocks_total) == (4, 2, 4000)
    assert scraped.kv_usage == pytest.approx(0.3)
    ranks = [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]  # (dp_rank, tp_rank)
    sglang = "".join(
        f'sglang:num_running_reqs{{dp_rank="{dp}",tp_rank="{tp}",priority=""}} 2.0\n'
        f'sglang:num_running_reqs{{dp_rank="{dp}",tp_rank="{tp}",priority="1"}} 2.0\n'
        f'sglang:num_queue_reqs{{dp_rank="{dp}",tp_rank="{tp}",priority=""}} 1.0\n'
        f'sglang:token_usage{{dp_rank="{dp}",tp_rank="{tp}"}} {0.2 + 0.4 * int(dp)}\n'
        f'sglang:max_total_num_tokens{{dp_rank="{dp}",tp_rank="{tp}"}} 16000\n'
        for dp, tp in ranks
    )
    scraped = parse_metrics(sglang, "sglang")
    assert (scraped.running, scraped.waiting, scraped.kv_blocks_total) == (4, 2, 2000)
    assert scraped.kv_usage == pytest.approx(0.4)
    # DP attention (tp 8, dp 2): a rank's tp_rank is global, its leader's 0 and 4
    attention = sglang.replace('dp_rank="1",tp_rank="0"', 'dp_rank="1",tp_rank="4"')
    assert parse_metrics(attention, "sglang").running == 4


def test_a_starting_sglang_server_reads_idle_until_its_first_stats() -> None:
    """Its labelled gauges appear with its first stats (30 s on an idle server); its
    constants are there from the start."""
    starting = 'sglang:max_total_num_tokens{model_name="m"} 16000\n'
    scraped = parse_metrics(starting, "sglang")
    assert (scraped.running, scraped.waiting, scraped.kv_blocks_total) == (0, 0, 1000)


def test_an_exposition_without_the_engine_s_gauges_is_not_read_as_idle() -> None:
    with pytest.raises(NoEngineMetrics, match="--disable-log-stats"):
        parse_metrics("python_gc_objects_collected_total 1.0\n", "vllm")  # stats off
    with pytest.raises(NoEngineMetrics, match="engine"):
        parse_metrics(VLLM, "sglang")  # the fleet file names the wrong engine
    unsized = VLLM.replace('num_gpu_blocks="2000"', 'num_gpu_blocks="None"')  # vLLM 0.8
    assert parse_metrics(unsized, "vllm").kv_blocks_total is None


def test_a_vllm_server_whose_engines_sleep_is_not_ready() -> None:
    """vLLM's ``/sleep`` offloads or drops the weights: the server answers, and would
    read as idle, but runs nothing until ``/wake_up``."""
    fleet = load_fleet(EXAMPLE)

    def state(*awake: int) -> str:
        return VLLM + "".join(
            f'vllm:engine_sleep_state{{engine="{n}",sleep_state="awake"}} {a}\n'
            f'vllm:engine_sleep_state{{engine="{n}",sleep_state="weights_offloaded"}} {1 - a}\n'
            for n, a in enumerate(awake)
        )

    assert not telemetry_of(fleet.instances[0], parse_metrics(state(0, 0), "vllm")).ready
    assert telemetry_of(fleet.instances[0], parse_metrics(state(0, 1), "vllm")).ready
    assert telemetry_of(fleet.instances[0], parse_metrics(state(1), "vllm")).ready


def test_garbage_is_not_an_exposition() -> None:
    with pytest.raises(ValueError, match="not a Prometheus sample"):
        parse_metrics("<html>not found</html>", "vllm")


def test_samples_read_as_prometheus_clients_parser_reads_them() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from streams.collector import samples

    ours = [(n, v) for n, _, v in samples(VLLM + SGLANG)]
    theirs = [
        (s.name, s.value) for f in text_string_to_metric_families(VLLM + SGLANG) for s in f.samples
    ]
    assert ours == theirs


def test_exemplars_and_blanks_around_samples_leave_their_values_as_they_are() -> None:
    """An OpenMetrics exemplar (a proxy or exporter may ask for that format) was read as
    the sample's labels, its value as the sample's; blanks around a line, which the format
    allows, made the whole exposition unreadable (the instance not ready)."""
    exposition = VLLM.replace(
        'vllm:prefix_cache_queries_total{model_name="m"} 1000.0',
        '  vllm:prefix_cache_queries_total{model_name="m"} 1000.0 # {trace_id="a}b"} 7.0\n \t',
    )
    scraped = parse_metrics(exposition, "vllm")
    assert (scraped.prefix_hits, scraped.prefix_queries) == (400.0, 1000.0)


def test_sglang_s_retractions_are_its_preemptions() -> None:
    """SGLang names preemption "retract"; its counter appears at the first one, and the
    tables read 0 for every SGLang instance before 2026-12-07. Ranks repeat it once."""
    retracted = SGLANG + "".join(
        f'sglang:num_retracted_requests_total{{model_name="m",tp_rank="{rank}"}} 9.0\n'
        for rank in (0, 1)
    )
    assert parse_metrics(retracted, "sglang").preemptions == 9.0
    assert parse_metrics(SGLANG, "sglang").preemptions == 0.0


def test_kv_events_become_one_message_per_run_in_order() -> None:
    events = [(1, True), (2, True), (1, False), (3, True)]
    messages = kv_messages("i0", events)
    assert [type(m) for m in messages] == [KvBlocksStored, KvBlocksRemoved, KvBlocksStored]
    assert [m.block_hashes for m in messages] == [(1, 2), (1,), (3,)]
    [cleared, stored] = kv_messages("i0", [(4, True)], lost="instance restarted")
    assert isinstance(cleared, KvAllCleared)
    assert cleared.reason == "instance restarted"
    assert stored.block_hashes == (4,)


def test_an_instance_s_key_comes_from_the_variable_its_fleet_file_names() -> None:
    instance = load_fleet(EXAMPLE).instances[0]
    assert instance.auth_headers({"ANY": "x"}) == {}  # no api_key_env: no key
    keyed = instance.model_copy(update={"api_key_env": "VLLM_KEY_A0"})
    assert keyed.auth_headers({"VLLM_KEY_A0": "sk-1"}) == {"authorization": "Bearer sk-1"}
    with pytest.raises(ValueError, match=r"a-0: VLLM_KEY_A0 \(its api_key_env\) is unset"):
        keyed.auth_headers({})
