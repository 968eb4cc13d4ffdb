"""`verispec bench --workload long-context`: prompts of exact lengths made from real standard-library files (none of
it in the Spec-Bench evaluation set), the same file resent with new instructions; the run on the tiny pair: every
answer equal to the target alone's, the warm turns served from the target's prefix cache AND the draft's (a turn
after the caches were emptied gets nothing: the cold turn's own figures are the negative control)."""

from __future__ import annotations

import json

import pytest

from verispec.bench.code_workload import module_source
from verispec.bench.long_context import (INSTRUCTIONS, LongContextConfig, build_long_prompts, file_tokens,
                                         run_long_context)
from verispec.bench.prompts import default_prompts_path
from verispec.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_prompts_have_the_exact_length_and_real_source_outside_spec_bench(tokenizer):
    prompts = build_long_prompts(tokenizer, [96, 128], seed=0, limit=2, turns=3)
    assert [(p.length, p.index) for p in prompts] == [(96, 0), (96, 1), (128, 0), (128, 1)]
    assert len({p.source for p in prompts}) == 4  # each prompt its own file
    assert [p.ids(0) for p in prompts] == [p.ids(0) for p in build_long_prompts(tokenizer, [96, 128], 0, 2, 3)]
    evaluation = default_prompts_path().read_text(encoding="utf-8")
    for p in prompts:
        assert len(p.ids(0)) == p.length
        assert p.ids(1)[: len(p.head) + len(p.file)] == p.ids(0)[: len(p.head) + len(p.file)]  # the file resent
        assert p.ids(1) != p.ids(0)
        lines = [x for x in module_source(p.source).splitlines()[:40] if len(x.strip()) > 30]
        assert lines and not any(x in evaluation for x in lines)
    assert len({build_long_prompts(tokenizer, [96], seed=s)[0].source for s in range(4)}) > 1  # seeded choice
    with pytest.raises(ValueError, match="no room for the file"):
        build_long_prompts(tokenizer, [10])


def test_file_tokens_cut_at_a_line_then_tokens(tokenizer):
    text = "alpha beta\ngamma delta\nepsilon\n"
    ids = file_tokens(tokenizer, text, 13)  # one token a character: "alpha beta\nga"
    assert tokenizer.decode(ids) == text[:13]
    with pytest.raises(ValueError, match="fewer than 99"):
        file_tokens(tokenizer, text, 99)


def test_run_on_the_tiny_pair(tmp_path, model_dirs):
    config = LongContextConfig(target=str(model_dirs["target"]), draft=str(model_dirs["draft"]), out=tmp_path,
                               lengths=[96, 128], max_new_tokens=8, turn_tokens=4, turns=3, fixed_k=3)
    report = run_long_context(config, log=lambda line: None)
    saved = json.loads((tmp_path / "long_context.json").read_text())
    assert saved["rows"] == report["rows"] and saved["summary"] == report["summary"]
    assert [(r["length"], r["reference"]) for r in report["rows"]] == [(64, True), (96, False), (128, False)]
    for row in report["rows"]:
        assert set(row["methods"]) == {"target", "k=3"}
        for method, f in row["methods"].items():
            assert f["equal_to_target"] and f["tokens"] == 8 and f["ttft_s"] > 0 and f["decode_ms_per_token"] > 0
            assert [t["turn"] for t in f["turns"]] == [2, 3]
            for turn in f["turns"]:
                # the head and the file in full blocks of 16, served from the target's cache
                assert turn["cached_tokens"] >= 16, (row["length"], method, turn)
                if method == "k=3":  # the draft drafted, and skipped the file's prefill too
                    assert turn["draft_tokens"] > 0 and turn["draft_cached_tokens"] >= 16, (row["length"], turn)
                else:
                    assert turn["draft_tokens"] == turn["draft_cached_tokens"] == 0
    summary = report["summary"]
    assert summary["decode_ratio"]["target"]["lengths"] == [64, 128] and summary["decode_ratio"]["target"]["ratio"] > 0
    assert set(summary["warm_over_cold"]) == {"target", "k=3"}
    md = (tmp_path / "long_context.md").read_text()
    assert "| 128 | verispec | k=3 |" in md and "decode at 128 over decode at 64" in md
    assert (tmp_path / "long_context.png").stat().st_size > 0
    assert (tmp_path / "long_context_prompts.jsonl").read_text().count("\n") == 3


def test_cold_turn_starts_from_empty_caches(tmp_path, model_dirs):
    """The negative control of the warm turns: the resent file after the caches were emptied finds nothing."""
    from verispec.bench.long_context import _clear_prefixes, _draft_hits, _timed, build_long_prompts
    from verispec.config import SamplingParams, SpeculativeConfig
    from verispec.generator import SpeculativeGenerator

    gen = SpeculativeGenerator.from_pretrained(str(model_dirs["target"]), str(model_dirs["draft"]), max_len=256,
                                               spec=SpeculativeConfig(num_draft_tokens=3))
    prompt = build_long_prompts(gen.tokenizer, [96])[0]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    _timed(gen.engine, prompt.ids(0), params, "k=3")
    again = _timed(gen.engine, prompt.ids(1), params, "k=3")
    assert again["cached_tokens"] >= 16 and _draft_hits(gen.engine) >= 16
    _clear_prefixes(gen.engine)
    before = _draft_hits(gen.engine)
    cold = _timed(gen.engine, prompt.ids(1), params, "k=3")
    assert cold["cached_tokens"] == 0 and _draft_hits(gen.engine) == before == 0
    assert cold["tokens"] == again["tokens"]


def test_cli_flags(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--workload", "long-context", "--lengths", "0,512", "--out", str(tmp_path)])
    assert info.value.code == 2 and "--lengths" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["bench", "--workload", "long-context", "--turns", str(len(INSTRUCTIONS) + 1), "--out", str(tmp_path)])
    assert info.value.code == 2 and "turns must be" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["bench", "--workload", "long-context", "--peers", "vllm", "--out", str(tmp_path)])
    assert info.value.code == 2 and "llama.cpp only" in capsys.readouterr().err
