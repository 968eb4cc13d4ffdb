"""`verispec bench --serve --arrival-tokens N`: the inter-token gaps of streaming clients, counted from when every
client streams, and those inside the arrival's prefill window (hand-built timestamps); the report's shape on the
tiny pair through a real server (slow)."""

from __future__ import annotations

import json

import pytest

from verispec.bench.serve_arrival import Stream, gaps, markdown, merge, percentiles, summarize_run
from verispec.cli import main as cli_main


def test_gaps_since_every_client_streams_and_inside_the_window():
    a = Stream(0.0, [1.0, 1.1, 1.2, 1.5, 1.6])
    b = Stream(0.0, [1.15, 1.25, 1.35])
    since = 1.15  # b's first chunk: from then on both stream
    assert gaps([a, b], since) == pytest.approx([0.3, 0.1, 0.1, 0.1])  # a's 1.0->1.1 and 1.1->1.2 are before
    assert gaps([a, b], since, window=(1.3, 1.55)) == pytest.approx([0.3, 0.1])  # gaps ending inside it
    assert gaps([a, b], 2.0) == []  # negative control: nothing after the streams ended
    assert percentiles([]) == {"gaps": 0, "p50_ms": None, "p99_ms": None}
    assert percentiles([0.1, 0.1, 0.3])["p50_ms"] == 100.0


def test_run_and_mode_figures():
    streams = [Stream(0.0, [1.0, 1.1, 1.2, 1.5, 1.6]), Stream(0.0, [1.0, 1.1, 1.2, 1.3]), Stream(0.0, [], "boom")]
    raw = {"streams": streams, "arrival": {"sent": 1.15, "answered": 1.45, "prompt_tokens": 200, "cached_tokens": 0}}
    figures, ok, since = summarize_run(raw)
    assert since == 1.0 and len(ok) == 2 and figures["failed"] == 1
    assert figures["itl"]["gaps"] == 7 and figures["itl_during_prefill"]["gaps"] == 3  # ends at 1.2, 1.2, 1.3
    assert figures["arrival_ttft_s"] == 0.3 and figures["clients_streaming_at_answer"] == 1
    assert figures["largest_gaps"][0] == {"ms": 300.0, "at_s": 0.05, "client": 0}  # 1.2 -> 1.5, after the arrival
    alone = merge([{"streams": streams[:2], "arrival": None}])
    assert "itl_during_prefill" not in alone and alone["itl"]["gaps"] == 7
    both = merge([raw, raw])
    assert both["itl"]["gaps"] == 14 and both["arrival_ttft_s"] == [0.3, 0.3]
    report = {"settings": {"clients": 2, "max_new_tokens": 5, "arrival_tokens": 200, "repeats": 2, "order": "A B B A"},
              "modes": {"alone": alone, "arrival": both}, "p99_ratio_arrival_over_alone": 1.0,
              "server_command": "verispec serve", "budget": None}
    text = "\n".join(markdown(report))
    assert "| arrival |" in text and "goal <= 1.5x" in text


@pytest.mark.slow  # a real server subprocess and clients (~10 s)
def test_arrival_bench_report(model_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [text]})
                                 for i, text in enumerate(["the cat sat", "one two three"])))
    out = tmp_path / "out"
    assert cli_main(["bench", "--serve", "--arrival-tokens", "160", "--concurrency", "2", "--model",
                     str(model_dirs["target"]), "--draft-model", str(model_dirs["draft"]), "--prompts", str(prompts),
                     "--max-new-tokens", "24", "--threads", "1", "--out", str(out), "--serve-repeats", "1",
                     "--serve-args", "--max-len 256"]) == 0
    report = json.loads((out / "arrival.json").read_text())
    assert set(report["modes"]) == {"alone", "arrival"} and report["settings"]["clients"] == 2
    assert report["modes"]["alone"]["failed"] == report["modes"]["arrival"]["failed"] == 0
    [run] = report["modes"]["arrival"]["runs"]
    # a file of its own: only the chat template's head (a block of 16) can come from the cache
    assert run["arrival_prompt_tokens"] == 160 and run["arrival_cached_tokens"] <= 16
    assert report["modes"]["alone"]["itl"]["gaps"] > 0 and report["p99_ratio_arrival_over_alone"] > 0
    assert report["budget"] and "prefill chunks of" in report["budget"]  # the server measured its own
    assert "| alone |" in (out / "arrival.md").read_text()
