"""/metrics on a dedicated server (the shared one's counts depend on every other test): valid
Prometheus text, histograms whose counts match the requests made, finish-reason counters, and a
stream the client hangs up on counted once, as an abort."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from server_harness import HEADERS, Server, launch_server, wait_idle

from radixlm_runtime.server.metrics import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    QUEUE_BUCKETS,
    TTFT_BUCKETS,
    ServerMetrics,
)

pytestmark = pytest.mark.slow

PROMPT = "List the planets of the solar system:"
HISTOGRAMS = {
    "radixlm_time_to_first_token_seconds": TTFT_BUCKETS,
    "radixlm_inter_token_latency_seconds": ITL_BUCKETS,
    "radixlm_e2e_request_latency_seconds": E2E_BUCKETS,
    "radixlm_queue_time_seconds": QUEUE_BUCKETS,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = launch_server(tmp_path_factory.mktemp("metrics"))
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def parse(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a Prometheus text body, keyed by (sample name, labels); the parser raises on
    anything Prometheus would not accept."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(server: Server) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    r = requests.get(f"{server.url}/metrics", headers=HEADERS, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(r.text)


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def generate(server: Server, params: dict) -> dict:
    body = {"text": PROMPT, "sampling_params": {"temperature": 0} | params}
    r = requests.post(f"{server.url}/generate", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def hang_up_after_two_events(server: Server) -> None:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}, "stream": True}
    with requests.post(f"{server.url}/generate", json=body, headers=HEADERS, stream=True, timeout=120) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines(decode_unicode=True):
            if line:
                assert "error" not in json.loads(line.removeprefix("data: "))
                events += 1
            if events == 2:
                break  # leaving the block closes the connection mid-stream


def assert_histogram(samples: dict, name: str, buckets: tuple[float, ...], count: int) -> None:
    cumulative = [value(samples, f"{name}_bucket", le=str(b)) for b in buckets]
    assert cumulative == sorted(cumulative)
    assert value(samples, f"{name}_bucket", le="+Inf") == value(samples, f"{name}_count") == count
    assert cumulative[-1] <= count and value(samples, f"{name}_sum") >= 0


def test_fresh_server_exposes_every_series_at_zero(server: Server) -> None:
    samples = scrape(server)
    for reason in ("stop", "length", "abort"):
        assert value(samples, "radixlm_requests_finished_total", finish_reason=reason) == 0
    for name in ("requests", "requests_rejected", "prompt_tokens", "generation_tokens", "cached_tokens"):
        assert value(samples, f"radixlm_{name}_total") == 0
    for name, buckets in HISTOGRAMS.items():
        assert_histogram(samples, name, buckets, 0)


def test_counts_match_requests_and_a_hang_up_counts_once_as_abort(server: Server) -> None:
    first = generate(server, {"max_new_tokens": 1})
    stop_id = first["output_ids"][0]
    # Greedy: the same prompt's first token again, now a stop token.
    stopped = generate(server, {"max_new_tokens": 8, "stop_token_ids": [stop_id]})
    assert stopped["meta_info"]["finish_reason"]["type"] == "stop"
    lengths = [generate(server, {"max_new_tokens": 6, "ignore_eos": True}) for _ in range(3)]
    hang_up_after_two_events(server)
    info = wait_idle(server)
    assert info["num_tracked"] == 0 and info["num_inflight_requests"] == 0, info
    samples = scrape(server)

    finished = {
        r: value(samples, "radixlm_requests_finished_total", finish_reason=r)
        for r in ("stop", "length", "abort")
    }
    assert finished == {"stop": 1, "length": 4, "abort": 1}
    assert value(samples, "radixlm_requests_total") == 6 == sum(finished.values())
    assert value(samples, "radixlm_requests_rejected_total") == 0
    for gauge in ("radixlm_num_running_reqs", "radixlm_num_queue_reqs", "radixlm_num_inflight_reqs"):
        assert value(samples, gauge) == 0

    # Every request was scheduled and got at least one token; each later token is one ITL observation.
    generated = value(samples, "radixlm_generation_tokens_total")
    answered = sum(len(o["output_ids"]) for o in [first, stopped, *lengths])
    assert generated >= answered + 2  # the abandoned stream got at least its two events' tokens
    assert_histogram(samples, "radixlm_time_to_first_token_seconds", TTFT_BUCKETS, 6)
    assert_histogram(samples, "radixlm_inter_token_latency_seconds", ITL_BUCKETS, int(generated) - 6)
    assert_histogram(samples, "radixlm_e2e_request_latency_seconds", E2E_BUCKETS, 6)
    assert_histogram(samples, "radixlm_queue_time_seconds", QUEUE_BUCKETS, 6)

    prompt_len = first["meta_info"]["prompt_tokens"]
    assert value(samples, "radixlm_prompt_tokens_total") == 6 * prompt_len
    cached = value(samples, "radixlm_cached_tokens_total")
    assert 0 < cached < 6 * prompt_len  # repeats of one prompt hit the radix cache
    assert value(samples, "radixlm_cache_hit_rate") == pytest.approx(cached / (6 * prompt_len))


def test_registry_per_instance_and_token_accounting() -> None:
    """Two instances in one process (as two apps would be) count apart; a jump-forward's several
    tokens give one ITL observation each, and the first output's extra tokens a gap of 0."""
    a, b = ServerMetrics(), ServerMetrics()
    a.tokens_out(3, since_arrival=0.2, since_last=None)
    a.tokens_out(2, since_arrival=0.5, since_last=0.3)
    a.request_ended("length", prompt_tokens=10, cached_tokens=4, e2e=0.5)
    sa, sb = parse(a.render().decode()), parse(b.render().decode())
    assert (
        value(sa, "radixlm_generation_tokens_total") == 5
        and value(sb, "radixlm_generation_tokens_total") == 0
    )
    assert value(sa, "radixlm_time_to_first_token_seconds_count") == 1
    assert value(sa, "radixlm_inter_token_latency_seconds_count") == 4
    assert value(sa, "radixlm_inter_token_latency_seconds_sum") == pytest.approx(0.3)
    assert value(sa, "radixlm_cache_hit_rate") == pytest.approx(0.4)
    assert value(sa, "radixlm_requests_finished_total", finish_reason="length") == 1


def test_kv_figures_come_from_the_schedulers_info() -> None:
    """The KV pool's and the host tier's figures are the scheduler process's, as last observed."""
    m = ServerMetrics()
    assert "radixlm_kv_pool_free_tokens" not in m.render().decode()  # nothing observed yet
    m.kv.observe(
        {"free_tokens": 90, "cached_tokens_in_tree": 10, "host_tier_tokens": 500, "cached_tokens_on_host": 40}
        | {"device_hit_tokens": 7, "host_hit_tokens": 30, "host_stored_tokens": 40}
        | {"host_loaded_tokens": 30, "host_evicted_tokens": 0}
    )
    s = parse(m.render().decode())
    assert value(s, "radixlm_kv_pool_free_tokens") == 90 and value(s, "radixlm_kv_pool_cached_tokens") == 10
    assert value(s, "radixlm_kv_host_tier_size_tokens") == 500
    assert value(s, "radixlm_kv_host_tier_cached_tokens") == 40
    assert value(s, "radixlm_kv_pool_hit_tokens_total") == 7
    assert value(s, "radixlm_kv_host_tier_hit_tokens_total") == 30
    assert value(s, "radixlm_kv_host_tier_stored_tokens_total") == 40


def test_disk_tier_figures_and_load_latency() -> None:
    m = ServerMetrics()
    m.kv.observe(
        {"disk_tier_tokens": 1000, "cached_tokens_on_disk": 300, "disk_hit_tokens": 120}
        | {"disk_stored_tokens": 300, "disk_loaded_tokens": 150, "disk_evicted_tokens": 5}
        | {"disk_failed_tokens": 2, "disk_stored_bytes": 3000, "disk_loaded_bytes": 1500}
        | {"disk_reads": 4, "disk_read_seconds": 0.5}
    )
    s = parse(m.render().decode())
    assert value(s, "radixlm_kv_disk_tier_size_tokens") == 1000
    assert value(s, "radixlm_kv_disk_tier_cached_tokens") == 300
    assert value(s, "radixlm_kv_disk_tier_hit_tokens_total") == 120
    assert value(s, "radixlm_kv_disk_tier_failed_tokens_total") == 2
    assert value(s, "radixlm_kv_disk_tier_loaded_bytes_total") == 1500
    assert value(s, "radixlm_kv_disk_tier_load_seconds_count") == 4
    assert value(s, "radixlm_kv_disk_tier_load_seconds_sum") == pytest.approx(0.5)


def test_a_scrape_carries_the_schedulers_kv_figures(server: Server) -> None:
    samples = scrape(server)
    info = server.info()
    assert (
        value(samples, "radixlm_kv_pool_free_tokens") + value(samples, "radixlm_kv_pool_cached_tokens")
        == (info["max_total_tokens"])
    )
    assert value(samples, "radixlm_kv_host_tier_size_tokens") == 0


def test_speculation_counters_accumulate_and_rate() -> None:
    m = ServerMetrics()
    m.speculation_ended(verify_steps=5, drafted=8, accepted=6)
    m.speculation_ended(verify_steps=3, drafted=2, accepted=0)
    s = parse(m.render().decode())
    assert value(s, "radixlm_spec_verify_steps_total") == 8
    assert value(s, "radixlm_spec_draft_tokens_total") == 10
    assert value(s, "radixlm_spec_accepted_tokens_total") == 6
    assert value(s, "radixlm_spec_accept_rate") == pytest.approx(0.6)


def test_speculative_server_reports_acceptance(tmp_path_factory: pytest.TempPathFactory) -> None:
    """--speculative-num-draft-tokens: SGLang's spec_* fields in meta_info, summed in /metrics."""
    srv = launch_server(tmp_path_factory.mktemp("spec_metrics"), "--speculative-num-draft-tokens", "4")
    try:
        text = "one two three four five six seven eight. one two three four five six seven eight. one two"
        body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 12}}
        r = requests.post(f"{srv.url}/generate", json=body, headers=HEADERS, timeout=300)
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert 0 < meta["spec_accept_token_num"] <= meta["spec_draft_token_num"]
        assert meta["spec_verify_ct"] < meta["completion_tokens"]
        samples = scrape(srv)
        assert value(samples, "radixlm_spec_verify_steps_total") == meta["spec_verify_ct"]
        assert value(samples, "radixlm_spec_draft_tokens_total") == meta["spec_draft_token_num"]
        assert value(samples, "radixlm_spec_accepted_tokens_total") == meta["spec_accept_token_num"]
        assert value(samples, "radixlm_spec_accept_rate") == pytest.approx(meta["spec_accept_rate"])
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
