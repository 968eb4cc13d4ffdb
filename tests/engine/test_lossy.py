"""Lossy verification (--acceptance top_k:N): opt-in only, accepts more, and is labelled everywhere."""

import argparse
import json
import logging

import pytest
import torch

from conftest import tiny_llama
from verispec.cli import main
from verispec.cli.common import add_model_args, add_speculation_args, parse_acceptance, spec_kwargs
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.model import ModelDrafter
from verispec.engine import SpeculativeEngine
from verispec.stats import GenerationStats


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_off_by_default():
    assert SpeculativeConfig().lossless
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    add_speculation_args(parser)
    assert SpeculativeConfig(**spec_kwargs(parser.parse_args([]))).lossless
    stats = GenerationStats().to_dict()
    assert stats["acceptance_mode"] == "exact" and stats["lossy"] is False


def test_parse_acceptance():
    assert parse_acceptance("exact") == {"acceptance": "exact"}
    assert parse_acceptance("top_k:5") == {"acceptance": "top_k", "acceptance_top_k": 5}
    for bad in ("top_k", "top_k:0", "top_k:x", "topk:3", "lossy"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_acceptance(bad)


def test_top_k_accepts_more_than_exact_and_is_recorded(tokenizer, caplog):
    target, draft = tiny_llama(50), tiny_llama(51, layers=1)  # unrelated models: they mostly disagree
    prompt = tokenizer("the dog sat on the")["input_ids"]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    exact = SpeculativeEngine(target, tokenizer, ModelDrafter(draft, 400), max_len=256)
    exact_stats = exact.generate(prompt, params).stats
    lossy = SpeculativeEngine(target, tokenizer, ModelDrafter(draft, 400),
                              SpeculativeConfig(acceptance="top_k", acceptance_top_k=20), max_len=256)
    with caplog.at_level(logging.WARNING, logger="verispec"):
        lossy_stats = lossy.generate(prompt, params).stats
        lossy.generate(prompt, params)
    assert lossy_stats.acceptance_rate > exact_stats.acceptance_rate
    assert lossy_stats.to_dict()["lossy"] is True and lossy_stats.acceptance_mode == "top_k:20"
    assert exact_stats.to_dict()["lossy"] is False and exact_stats.acceptance_mode == "exact"
    assert lossy.total.lossy and lossy.total.acceptance_mode == "top_k:20"
    assert sum("LOSSY" in r.getMessage() for r in caplog.records) == 1  # warned once per engine
    assert "LOSSY" in lossy_stats.summary() and "LOSSY" not in exact_stats.summary()


def test_merge_marks_mixed_modes():
    total = GenerationStats()
    total.merge(GenerationStats(requests=1))
    total.merge(GenerationStats(requests=1, acceptance_mode="top_k:3", lossy=True))
    assert total.acceptance_mode == "mixed" and total.lossy


def test_cli_flag_warns_and_records(tmp_path, tokenizer, capsys):
    target = tiny_llama(52)
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    args = ["generate", "--model", str(tmp_path / "target"), "--draft-model", "ngram", "--prompt", "the cat",
            "--max-new-tokens", "8", "--json", "--device", "cpu"]
    assert main(args + ["--acceptance", "top_k:3"]) == 0
    out = capsys.readouterr()
    assert "LOSSY" in out.err
    stats = json.loads(out.out)["stats"]
    assert stats["lossy"] is True and stats["acceptance_mode"] == "top_k:3"
    with pytest.raises(SystemExit) as exit_info:
        main(args + ["--acceptance", "top_k:0"])
    assert exit_info.value.code == 2
    assert "--acceptance" in capsys.readouterr().err
