"""Cascaded drafters (`--draft-model ngram+MODEL`): routing by hand, the '+' syntax, greedy equality with both
stages drafting, exact sampling over mixed rounds, load-time fallback, and the benchmark's use of the model part."""

import json
import logging

import pytest
import torch

from gates import virtual_costs
from conftest import chisquare_pvalue, count_stage_rounds, draft_batch, sample_first_tokens, tiny_llama
from verispec.cli import main
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.base import DraftProposal, Drafter
from verispec.drafters.cascade import CascadeDrafter, split_spec
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.build import build_drafter
from verispec.drafters.spec import parse_drafter_spec
from verispec.engine import CACHE_SLACK, SpeculativeEngine
from verispec.runtime.model.loading import ModelLoadError, load_model
from verispec.engine.acceptance import rejection_verify


class Scripted(Drafter):
    """Proposes `tokens` (or nothing), takes `seconds`, and records what it was told."""

    def __init__(self, name, tokens, seconds=0.5):
        self.name, self.tokens, self.seconds = name, tokens, seconds
        self.calls = []

    def can_propose(self, token_ids):
        return bool(self.tokens)

    def begin(self, slot, prompt_ids):
        self.calls.append(("begin", prompt_ids.numel()))

    def propose(self, batch):
        self.calls.append(("propose", [row.k for row in batch.rows]))
        return [DraftProposal(torch.tensor(self.tokens[: row.k], dtype=torch.long), None, self.seconds)
                for row in batch.rows]

    def observe(self, slot, committed_length, num_accepted, num_proposed):
        self.calls.append(("observe", committed_length))


def request(k=3):
    return draft_batch([torch.arange(6)], [k], vocab=50)


# -- routing by hand ----------------------------------------------------------------------------------------------


def test_first_stage_that_can_propose_drafts():
    empty, model, last = Scripted("ngram", []), Scripted("model", [7, 8]), Scripted("never", [1])
    cascade = CascadeDrafter([empty, model, last])
    assert cascade.name == "ngram+model+never"
    assert cascade.route(torch.arange(6)) is model
    proposal = cascade.propose(request())[0]
    assert proposal.token_ids.tolist() == [7, 8] and cascade.last_stage is model
    assert empty.calls == [] and last.calls == []  # only the routed stage is asked
    cascade.begin(0, torch.arange(4))
    cascade.observe(0, 9, 1, 2)
    for stage in (empty, model, last):  # every stage keeps its state in step, drafting or not
        assert ("begin", 4) in stage.calls and ("observe", 9) in stage.calls


def test_propose_takes_the_callers_routing():
    """The engine asked `route` already: the cascade hands the row to that stage without a second lookup."""
    first, second = Scripted("a", [1]), Scripted("b", [2])
    cascade = CascadeDrafter([first, second])
    batch = request()
    batch.rows[0].routed = second  # as the engine passes it (here unlike what the cascade would pick itself)
    assert cascade.propose(batch)[0].token_ids.tolist() == [2] and first.calls == []


def test_all_stages_empty_is_a_plain_round():
    cascade = CascadeDrafter([Scripted("a", []), Scripted("b", [])])
    assert cascade.propose(request())[0].token_ids.numel() == 0


def test_cascade_needs_two_stages():
    with pytest.raises(ValueError, match="at least two"):
        CascadeDrafter([NgramDrafter()])


# -- the '+' syntax -----------------------------------------------------------------------------------------------


def stage_names(name):
    return [stage.name for stage in parse_drafter_spec(name).stages]


def model_part(name):
    return parse_drafter_spec(name).model


def test_spec_parsing(tmp_path):
    assert split_spec("ngram+some/draft") == ["ngram", "some/draft"]
    assert stage_names("ngram+some/draft") == ["ngram", "some/draft"]
    assert stage_names("ngram") == ["ngram"] and stage_names(None) == []
    assert model_part("ngram+some/draft") == "some/draft"
    assert model_part("ngram") is None and model_part("none") is None and model_part("a/b") == "a/b"
    odd = tmp_path / "draft+v2"  # a folder whose name holds '+' is a path, not a cascade
    odd.mkdir()
    assert stage_names(str(odd)) == [str(odd)]
    with pytest.raises(ValueError, match="empty drafter"):
        stage_names("ngram+")
    with pytest.raises(ValueError, match="'none' cannot be part"):
        stage_names("ngram+none")
    with pytest.raises(ValueError, match="at most one draft model"):
        stage_names("a/b+c/d")


def test_build_drafter_builds_the_cascade(model_dirs, tokenizer):
    target = load_model(model_dirs["target"])
    drafter = build_drafter(f"ngram+{model_dirs['draft']}", target, tokenizer, 128).drafter
    assert isinstance(drafter, CascadeDrafter) and drafter.provides_probs
    assert [type(s) for s in drafter.stages] == [NgramDrafter, ModelDrafter]
    assert drafter.runner is drafter.stages[1].runner
    with pytest.raises(ValueError, match="vocabulary size"):
        build_drafter(f"ngram+{model_dirs['odd_vocab']}", target, tokenizer, 128)


# -- end to end ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_equals_target_alone_with_both_stages_drafting(trained_pair, tokenizer, adaptive):
    target, draft = trained_pair
    cascade = CascadeDrafter([NgramDrafter(min_ngram=2), ModelDrafter(draft, 256 + CACHE_SLACK)])
    counts = count_stage_rounds(cascade)
    engine = SpeculativeEngine(target, tokenizer, cascade, SpeculativeConfig(num_draft_tokens=3, adaptive=adaptive),
                               max_len=256)
    for text in ["the cat sat on the mat. the cat sat on the", "a quick brown fox", "one two three one two"]:
        prompt = tokenizer(text)["input_ids"]
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        assert engine.generate(prompt, params).token_ids == engine.generate(prompt, params, use_drafter=False).token_ids
    assert counts["ngram"] > 0 and counts["model"] > 0  # both stages drafted rounds of the same requests


def test_sampling_mixes_point_mass_and_model_rounds(trained_pair, tokenizer, monkeypatch):
    import verispec.engine.verifier as engine_module

    seen = []

    def spy(meta, q, has_q, p, *args, **kwargs):
        drafted = meta.num_draft_tokens > 0
        if bool(drafted.any()):
            seen.append(q is None or not bool(has_q[drafted].any()))
        return rejection_verify(meta, q, has_q, p, *args, **kwargs)

    monkeypatch.setattr(engine_module, "rejection_verify", spy)
    target, draft = trained_pair
    cascade = CascadeDrafter([NgramDrafter(min_ngram=2), ModelDrafter(draft, 256 + CACHE_SLACK)])
    engine = SpeculativeEngine(target, tokenizer, cascade, SpeculativeConfig(num_draft_tokens=3), max_len=256)
    prompt = tokenizer("the cat sat on the mat. the cat sat on the")["input_ids"]
    engine.generate(prompt, SamplingParams(max_new_tokens=40, temperature=1.0, seed=0, ignore_eos=True, coupled=False))
    assert True in seen and False in seen  # n-gram rounds verify against a point mass, model rounds against q


@pytest.mark.parametrize("text", ["ab ab ab ab a", "xyz"])
def test_sampled_first_token_follows_the_target(trained_pair, tokenizer, text):
    """Level (b): whichever stage drafts (n-gram on a repeating prompt, the model otherwise), the first sampled
    token follows the target's processed distribution p."""
    target, draft = trained_pair
    prompt = tokenizer(text)["input_ids"]
    cascade = CascadeDrafter([NgramDrafter(min_ngram=2), ModelDrafter(draft, 64 + CACHE_SLACK)])
    counts_by_stage = count_stage_rounds(cascade)
    engine = SpeculativeEngine(target, tokenizer, cascade, SpeculativeConfig(num_draft_tokens=2), max_len=64)
    runs = 400
    counts, p = sample_first_tokens(engine, target, prompt, temperature=1.5, runs=runs)
    expected_stage = "ngram" if text.startswith("ab") else "model"
    assert counts_by_stage[expected_stage] >= runs  # that stage drafted the first round of every run
    assert chisquare_pvalue(counts, p) > 1e-3


# -- loading, CLI, benchmark --------------------------------------------------------------------------------------


def test_load_falls_back_stage_by_stage(model_dirs, tokenizer, tmp_path, caplog):
    target = load_model(model_dirs["target"])

    def load(name, **kwargs):
        return build_drafter(name, target, tokenizer, 128 + CACHE_SLACK, on_error="fallback", **kwargs)

    loaded = load(f"ngram+{model_dirs['draft']}")
    assert isinstance(loaded.drafter, CascadeDrafter) and loaded.warning is None
    assert loaded.name == f"ngram+{model_dirs['draft']}"
    with caplog.at_level(logging.WARNING, logger="verispec"):
        tight = load(f"ngram+{model_dirs['draft']}", free_bytes=10_000)  # the model does not fit: n-gram alone
    assert isinstance(tight.drafter, NgramDrafter) and tight.name == "ngram" and "not enough memory" in tight.warning
    with pytest.raises(ModelLoadError, match="does not exist"):  # a typo stays the user's error
        load(f"ngram+{tmp_path / 'missing'}")


def test_cli_generate_with_a_cascade_equals_target_alone(model_dirs, capsys):
    def run(draft):
        code = main(["generate", "--model", str(model_dirs["target"]), "--draft-model", draft, "--prompt",
                     "the cat sat on the mat. the cat", "--max-new-tokens", "24", "--min-new-tokens", "24", "--json",
                     "--no-adaptive"])
        assert code == 0
        return json.loads(capsys.readouterr().out)

    cascade, alone = run(f"ngram+{model_dirs['draft']}"), run("none")
    assert cascade["token_ids"] == alone["token_ids"] and cascade["draft_model"].startswith("ngram+")
    assert cascade["stats"]["draft_tokens"] > 0
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(model_dirs["target"]), "--draft-model", "ngram+none", "--prompt", "x"])
    assert exit_info.value.code == 2
    assert "'none' cannot be part" in capsys.readouterr().err


def test_bench_drafts_with_the_cascade_and_anchors_on_its_model(model_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": "q1", "category": "animals",
                                   "turns": ["the cat sat on the mat. the cat sat on the"]}) + "\n")
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(model_dirs["target"]), "--draft-model", f"ngram+{model_dirs['draft']}",
               "--prompts", str(prompts), "--max-new-tokens", "12", "--k", "2", "--methods",
               "target,verispec,hf-assisted", "--probe-repeats", "1", "--warmup-tokens", "0", "--no-progress",
               "--out", str(out)])
    assert rc == 0
    run = json.loads((out / "report.json").read_text())["runs"][0]
    assert [m["name"] for m in run["methods"]] == ["target", "verispec-k2", "hf-assisted-k2"]
    assert any("ngram+" in note and "hf-assisted" in note for note in run["notes"])
    assert run["results"]["overall"]["verispec-k2"]["equal_to_target"] == 1


def test_adaptive_k_per_stage_switches_off_only_the_stage_that_does_not_pay(tokenizer, monkeypatch):
    """With adaptive speculation each stage has its own estimates: a costly useless stage (random tokens, 3 ms a
    draft token) goes to K = 0 while prompt lookup keeps drafting on a target that repeats itself; output unchanged."""
    from verispec.engine.policy import AdaptivePolicy
    from verispec.drafters.random import RandomDrafter

    target = tiny_llama(3)
    ngram, useless = NgramDrafter(min_ngram=2), RandomDrafter(target.config.vocab_size, delay_s=0.003)
    engine = SpeculativeEngine(target, tokenizer, CascadeDrafter([ngram, useless]), SpeculativeConfig(adaptive=True),
                               max_len=256)
    # The costs the policy measures come from a clock the test drives, not from this machine's speed: a target
    # forward costs 5 ms + 0.1 ms a fed token, the useless stage 3 ms a draft token, prompt lookup nothing.
    virtual_costs(monkeypatch, engine)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    prompt = tokenizer("the cat sat on the mat. the cat")["input_ids"]
    alone = engine.generate(prompt, params, use_drafter=False).token_ids
    for _ in range(3):
        assert engine.generate(prompt, params).token_ids == alone
    lookup, random = engine.draft_policy(engine.spec, ngram), engine.draft_policy(engine.spec, useless)
    assert isinstance(lookup, AdaptivePolicy) and lookup is not random
    assert lookup.rounds > 0 and random.rounds > 0  # both stages had rounds routed to them
    assert sum(random.chosen[1:]) <= 0.25 * sum(random.chosen)  # the useless stage: mostly K = 0
    assert sum(lookup.chosen[1:]) >= 0.5 * sum(lookup.chosen)  # prompt lookup: mostly drafting
