"""server/scale's pure parts: the routing key and choice (routing.py), the metrics merge (aggregate.py) and the
scale config. No Ray needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import machine_reason
from verispec.server.scale import aggregate
from verispec.server.scale.config import ScaleConfig
from verispec.server.resume import FINISHED_LINE, parse_resume, progress_line, read_progress, resume_header
from verispec.server.scale.routing import preference, rank, resumable, routing_key

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"


def _chat(*contents: str) -> bytes:
    return json.dumps({"messages": [{"role": "system" if i == 0 else "user", "content": c}
                                    for i, c in enumerate(contents)]}).encode()


def test_routing_key_is_the_prompts_start():
    system = "You are a helpful assistant. " * 10
    a = routing_key(CHAT, _chat(system, "what is 2 + 2?"), chars=200)
    b = routing_key(CHAT, _chat(system, "name a colour"), chars=200)
    assert a == b and len(a) == 200  # a shared system prompt longer than the key: one key
    assert routing_key(CHAT, _chat("x", "what is 2 + 2?"), 200) != routing_key(CHAT, _chat("x", "name a colour"), 200)
    assert routing_key(COMPLETION, json.dumps({"prompt": "the cat sat"}).encode(), 5) == "the c"
    assert routing_key(COMPLETION, json.dumps({"prompt": [1, 2, 3]}).encode(), 5) == "[1, 2"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert routing_key(CHAT, json.dumps(parts).encode(), 100) == "user\nhi\n"
    for path, body in [("/v1/models", b""), (CHAT, b"not json"), (CHAT, b"[1]"), (COMPLETION, b"{}"),
                       (CHAT, b'{"messages": 3}')]:
        assert routing_key(path, body, 100) is None


def test_rendezvous_order_moves_only_the_keys_of_a_replica_that_left():
    replicas = ["a", "b", "c", "d"]
    keys = [f"prompt {i}" for i in range(400)]
    owner = {k: preference(k, replicas)[0] for k in keys}
    assert set(owner.values()) == set(replicas)  # every replica owns some keys
    after = {k: preference(k, ["a", "b", "d"])[0] for k in keys}
    moved = [k for k in keys if owner[k] != after[k]]
    assert moved and all(owner[k] == "c" for k in moved)
    assert preference("x", replicas) == preference("x", list(reversed(replicas)))  # order of the list: no matter


def test_rank_prefers_the_keys_replica_unless_it_is_much_busier():
    first, second = preference("k", ["r1", "r2"])
    assert rank("k", {"r1": 0, "r2": 0}, imbalance=4) == [[first], [second]]
    assert rank("k", {first: 4, second: 0}, imbalance=4) == [[first], [second]]  # at the bound: still affinity
    assert rank("k", {first: 5, second: 0}, imbalance=4) == [[first, second]]  # past it: least loaded of all
    assert rank("k", {first: None, second: 3}, imbalance=0) == [[first], [second]]  # unknown load: affinity
    # Another's load unknown (Serve has not probed it): it may be idle, so past the bound it gets a chance.
    assert rank("k", {first: 4, second: None}, imbalance=4) == [[first], [second]]
    assert rank("k", {first: 5, second: None}, imbalance=4) == [[first, second]]
    top, *rest = preference("k", ["r1", "r2", "r3"])
    assert rank("k", {top: 5, rest[0]: 9, rest[1]: None}, imbalance=4) == [[top, *rest]]
    assert rank("k", {top: 5, rest[0]: 2, rest[1]: 3}, imbalance=4) == [[top], rest]
    assert rank(None, {"r1": 1, "r2": 0}, imbalance=4) == [["r1", "r2"]]
    assert rank("k", {"r1": 9}, imbalance=0) == [["r1"]]


def _registry(requests: int, ttfts: list[float], queued: int) -> str:
    r = CollectorRegistry()
    Counter("verispec_requests", "requests", ["endpoint", "status"], registry=r).labels("/v1/x", "200").inc(requests)
    h = Histogram("verispec_ttft_seconds", "ttft", buckets=(0.1, 1.0), registry=r)
    for t in ttfts:
        h.observe(t)
    Gauge("verispec_queued_requests", "queued", registry=r).set(queued)
    return generate_latest(r).decode()


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_merge_sums_counters_and_histograms_and_labels_each_replica():
    texts = {"a": _registry(3, [0.05, 0.5], 2), "b": _registry(4, [2.0], 1)}
    samples = _samples(aggregate.render(aggregate.merge(texts)))
    assert samples[("verispec_requests_total", (("endpoint", "/v1/x"), ("status", "200")))] == 7
    assert samples[("verispec_requests_total", (("endpoint", "/v1/x"), ("replica", "b"), ("status", "200")))] == 4
    assert samples[("verispec_ttft_seconds_bucket", (("le", "0.1"),))] == 1
    assert samples[("verispec_ttft_seconds_bucket", (("le", "1.0"),))] == 2
    assert samples[("verispec_ttft_seconds_bucket", (("le", "+Inf"),))] == 3
    assert samples[("verispec_ttft_seconds_count", ())] == 3
    assert samples[("verispec_ttft_seconds_sum", ())] == pytest.approx(2.55)
    assert samples[("verispec_queued_requests", ())] == 3
    assert not any(name.endswith("_created") for name, _ in samples)


def test_a_retired_replica_keeps_its_counters_but_not_its_gauges():
    texts = {"a": _registry(3, [], 2), "gone": _registry(5, [], 9)}
    families = aggregate.merge(texts, retired=frozenset({"gone"}))
    total = aggregate.totals(families)
    assert total['verispec_requests_total{endpoint="/v1/x",status="200"}'] == 8
    assert total["verispec_queued_requests"] == 2
    assert aggregate.per_replica(families)["gone"]['verispec_requests_total{endpoint="/v1/x",status="200"}'] == 5


def test_summary_ratios():
    s = aggregate.summary({"verispec_draft_tokens_total": 10, "verispec_accepted_tokens_total": 6,
                           "verispec_rounds_total": 4, "verispec_generated_tokens_total": 10})
    assert s["acceptance_rate"] == 0.6 and s["mean_accepted_length"] == 2.5
    assert aggregate.summary({})["acceptance_rate"] is None
    cache = {"verispec_prefix_cache_queries_total": 200, "verispec_prefix_cache_hits_total": 150}
    assert aggregate.summary(cache)["prefix_cache_hit_rate"] == 0.75


@pytest.mark.parametrize("kwargs", [dict(replicas=0), dict(replicas=2, min_replicas=3),
                                    dict(replicas=3, max_replicas=2), dict(replica_cpus=0), dict(replica_gpus=-1),
                                    dict(object_store_gb=0.01)])
def test_scale_config_rejects(kwargs):
    with pytest.raises(ValueError):
        ScaleConfig(**kwargs)


def test_scale_config_bounds():
    assert ScaleConfig(replicas=2).bounds == (2, 2) and not ScaleConfig(replicas=2).autoscaling
    assert ScaleConfig(replicas=2, min_replicas=1, max_replicas=4).autoscaling


def test_bench_replica_counts():
    from verispec.bench.serve_replicas import parse_replicas

    assert parse_replicas("2") == [1, 2] and parse_replicas("4,2,2") == [1, 2, 4]
    with pytest.raises(ValueError, match="--replicas"):
        parse_replicas("0,2")


def test_bench_replicas_resolves_auto_for_its_device():
    from verispec.cli.bench_serve import replica_sweep_config as config_from_args
    from verispec.cli import build_parser

    def config(*flags):
        return config_from_args(build_parser().parse_args(["bench", "--serve", "--replicas", "2", *flags]))

    cuda = config("--device", "cuda", "--dtype", "auto")
    assert (cuda.device, cuda.dtype) == ("cuda", "bfloat16")  # 'auto' on CUDA, not the CPU's choice
    assert config("--device", "cuda", "--weights", "gguf").dtype == "float32"  # quantized weights: float32
    assert config("--device", "cpu", "--dtype", "float16").dtype == "float16"


def test_bench_kill_every_flags():
    """`bench --serve --replicas R --kill-every S` (bench/serve_failover.py): R and the clients from the sweep's flags;
    one replica (none would survive a kill) or a period <= 0 is a CLI error."""
    from verispec.cli import CliError, build_parser
    from verispec.cli.bench_serve import failover_config

    def config(*flags):
        return failover_config(build_parser().parse_args(["bench", "--serve", *flags]))

    made = config("--replicas", "2", "--kill-every", "5", "--concurrency", "8")
    assert (made.replicas, made.concurrency, made.kill_every_s) == (2, 8, 5.0) and made.chaos_requests >= 64
    for flags in (["--replicas", "1", "--kill-every", "5"], ["--replicas", "2", "--kill-every", "0"]):
        with pytest.raises(CliError, match="--kill-every"):
            config(*flags)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason=machine_reason("no /proc (the test reads it)"))
def test_tree_cpu_counts_living_descendants():
    from verispec.bench.serve_replicas import tree_cpu_s

    burn = "import sys, time\nwhile time.process_time() < 0.3: pass\nprint('ready', flush=True)\nsys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"  # it used 0.3 s of CPU and waits
        mine = os.times()
        assert tree_cpu_s(os.getpid()) >= mine.user + mine.system + 0.29 - 0.02  # (clock ticks round down)
        assert tree_cpu_s(child.pid) >= 0.27
    finally:
        child.stdin.close()
        child.wait(30)
    assert tree_cpu_s(2**22 + 7) is None  # no such process


def test_which_requests_a_failover_can_resume():
    """A stream of one choice: one prompt (text, token ids, or a list of one), n 1."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert resumable(chat) and resumable({**chat, "n": 1}) and resumable({"prompt": [1, 2], "stream": True})
    assert resumable({"prompt": ["one"], "stream": True}) and resumable({"prompt": "one", "stream": True})
    for data in (None, {**chat, "stream": False}, {**chat, "n": 2}, {"prompt": ["a", "b"], "stream": True},
                 {"prompt": "x"}):
        assert not resumable(data), data


def test_progress_reports_come_off_the_events():
    """A replica's progress comment (server/resume.py) is read off its event; the rest is what the client gets."""
    event = b'data: {"id":"x"}\n\n'
    assert read_progress(progress_line([3, 4], 7).encode() + event) == ({"t": [3, 4], "s": 7}, event)
    assert read_progress((progress_line([5], 9) + "\n").encode()) == ({"t": [5], "s": 9}, b"")  # the report alone
    assert read_progress(FINISHED_LINE.encode() + event) == ({"t": [], "f": 1}, event)
    assert read_progress(event) == (None, event)
    resume = parse_resume(resume_header("cmpl-1", 5, [1, 2], 3).decode())
    assert (resume.id, resume.created, resume.continuation.token_ids, resume.continuation.shown) == \
        ("cmpl-1", 5, (1, 2), 3)
    for bad in ("{", '{"id": "a"}', '{"id": "a", "created": 1, "tokens": ["x"], "shown": 0}'):
        with pytest.raises(Exception, match="not a stream to resume"):
            parse_resume(bad)
