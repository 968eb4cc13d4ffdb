"""`verispec bench --serve`: a real `verispec serve` subprocess driven by the async openai client at two
concurrencies, on the tiny trained pair; report.json, report.md and the plot are written and consistent."""

import json

import pytest

from verispec.bench.serve_load import parse_concurrency
from verispec.cli import main as cli_main
from verispec.runtime.model.dtype import choose_dtype, dtype_name


def test_parse_concurrency():
    assert parse_concurrency("8, 2,2") == [1, 2, 8]  # 1 is always measured: scaling is against it
    for bad in ("", "two", "0,4", "300"):
        with pytest.raises(ValueError, match="--concurrency"):
            parse_concurrency(bad)


@pytest.mark.slow  # a real server and load generator (~5-11 s): run by .ci/run, keeping make test within 5 minutes
def test_bench_serve_writes_its_report(model_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [text]})
                                 for i, text in enumerate(["the cat sat", "one two three", "Paris is the"])))
    out = tmp_path / "out"
    assert cli_main(["bench", "--serve", "--concurrency", "2", "--model", str(model_dirs["target"]),
                     "--draft-model", str(model_dirs["draft"]), "--prompts", str(prompts), "--max-new-tokens", "12",
                     "--threads", "1", "--out", str(out),
                     # a fixed K and no confidence cut-off: "on" drafts whatever the measured costs (adaptive K may
                     # settle at 0 on a tiny pair, and the warm-up at the largest concurrency feeds it more rounds)
                     "--serve-args", "--max-len 256 --no-adaptive --speculative-threshold 0"]) == 0
    report = json.loads((out / "report.json").read_text())
    [run] = report["runs"]
    assert set(run["results"]) == {"1", "2"} and "--max-num-seqs 2" in run["server_command"]
    # untimed: each mode alone, then at the sweep's largest concurrency (the KV buffers grow before the timed runs)
    assert run["warm_up"]["clients"] == 2 and set(run["warm_up"]["modes"]) == {"on", "off"}
    for clients, figures in run["results"].items():
        assert figures["on_vs_off"] > 0
        for mode in ("on", "off"):
            row = figures[mode]
            assert row["failed"] == 0 and row["requests"] == 2 * max(3, 2 * int(clients))  # two repeats: A B B A
            assert len(row["per_request"]) == row["requests"]
            assert row["tokens"] == 12 * row["requests"] and row["tokens_per_s"] > 0
            assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] and 0 < row["tpot_p50_s"] <= row["tpot_p99_s"]
            assert row["identical_to_alone"] == row["compared"] == row["requests"]  # greedy, the 'auto' dtype
        assert figures["on"]["draft_tokens"] > 0 and figures["off"]["draft_tokens"] == 0
        assert sum(figures["on"]["chosen_k"].values()) > 0 and not figures["off"]["chosen_k"]
    assert run["results"]["1"]["on"]["identical_to_off"] == "3/3"
    assert {g["goal"].split(":")[0] for g in run["goals"]} >= {"greedy outputs under load identical to the same "
                                                               "request alone"}
    text = (out / "report.md").read_text()
    assert "| clients |" in text and "### Goals" in text and (out / run["plot"]).stat().st_size > 1000
    assert (out / f"server_{dtype_name(choose_dtype('cpu')[0])}.log").exists()  # the 'auto' dtype here


@pytest.mark.parametrize("flags, system", [([], None), (["--shared-system-prompt"], "builtin"),
                                           (["--shared-system-prompt", "--system-prompt", "Be brief."], "Be brief."),
                                           (["--system-prompt", "Be brief."], None)])
def test_shared_system_prompt_goes_before_every_request_of_the_sweep(flags, system, model_dirs):
    from verispec.bench.prompts import SYSTEM_PROMPT
    from verispec.cli.bench_serve import serve_load_config as config_from_args
    from verispec.cli import build_parser

    # the tiny target: resolving 'auto' weights reads its folder, not the embedded GGUF (what the next test checks)
    args = build_parser().parse_args(["bench", "--serve", "--concurrency", "1,8,16", "--limit", "1",
                                      "--model", str(model_dirs["target"]), *flags])
    config = config_from_args(args)
    assert config.system == (SYSTEM_PROMPT if system == "builtin" else system)
    assert config.concurrency == [1, 8, 16]


@pytest.mark.parametrize("flags, weights", [([], "auto"), (["--dtypes", "float32,bfloat16"], "fp32"),
                                            (["--weights", "fp32"], "fp32")])
def test_servers_get_the_weights_the_bench_resolves(flags, weights):
    """The servers are given the dtype, auto resolved: without --weights, an explicit dtype would make them pick the
    float conversion. 'auto': what `verispec serve` picks with no flags (the embedded target's GGUF blocks where
    the kernel is built)."""
    from verispec.cli.bench_serve import serve_load_config as config_from_args
    from verispec.cli import build_parser
    from verispec.runtime.model.loading import SMOLLM2_TARGET
    from verispec.runtime.model.target import resolve_weights

    config = config_from_args(build_parser().parse_args(["bench", "--serve", "--limit", "1", *flags]))
    expected = resolve_weights("auto", SMOLLM2_TARGET)[0] if weights == "auto" else weights
    assert config.serve_args == ("--weights", expected, "--quantization", "none")


def test_serve_args_come_after_the_resolved_weights(model_dirs):
    """A flag given twice counts the last time: the user's --serve-args override what the bench resolved."""
    from verispec.cli.bench_serve import serve_load_config as config_from_args
    from verispec.cli import build_parser

    args = build_parser().parse_args(["bench", "--serve", "--model", str(model_dirs["target"]),
                                      "--serve-args", "--weights fp32 --max-batched-tokens 64"])
    assert config_from_args(args).serve_args[4:] == ("--weights", "fp32", "--max-batched-tokens", "64")
