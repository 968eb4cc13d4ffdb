"""Graceful fallback: drafter failures mid-request, back-off and retry, and load-time fallbacks (CLI included)."""

import json
import logging

import pytest
import torch

from conftest import VOCAB, tiny_llama
from verispec.cli import main
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.random import RandomDrafter
from verispec.engine import CACHE_SLACK, SpeculativeEngine
from verispec.drafters.build import build_drafter
from verispec.engine.drafter_calls import DrafterBackoff
from verispec.runtime.model.loading import ModelLoadError, load_model


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add contention


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer):
    """A target, a smaller draft, a draft with another vocabulary, and a draft with corrupt weights."""
    root = tmp_path_factory.mktemp("fallback-models")
    models = {"target": tiny_llama(20, hidden=64), "draft": tiny_llama(21, layers=1),
              "odd_vocab": tiny_llama(22, vocab=VOCAB + 7), "corrupt": tiny_llama(23, layers=1)}
    paths = {}
    for name, model in models.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = root / name
    weights = paths["corrupt"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])  # truncated: a valid folder whose weights cannot be read
    return paths


class FlakyDrafter(ModelDrafter):
    """A model drafter that raises in chosen calls, after advancing its cache (the state a crash leaves)."""

    name = "flaky"

    def __init__(self, model, max_len, fail_on=(), where="propose"):
        super().__init__(model, max_len)
        self.fail_on = set(fail_on)
        self.where = where
        self.calls = {"begin": 0, "propose": 0, "observe": 0}

    def _maybe_fail(self, where):
        self.calls[where] += 1
        if where == self.where and self.calls[where] in self.fail_on:
            raise RuntimeError(f"simulated {where} failure #{self.calls[where]}")

    def begin(self, slot, prompt_ids):
        super().begin(slot, prompt_ids)
        self._maybe_fail("begin")

    def propose(self, batch):
        proposals = super().propose(batch)
        self._maybe_fail("propose")
        return proposals

    def observe(self, slot, committed_length, num_accepted, num_proposed):
        self._maybe_fail("observe")
        super().observe(slot, committed_length, num_accepted, num_proposed)


PARAMS = SamplingParams(max_new_tokens=30, ignore_eos=True)


def run(engine, tokenizer, text="the cat sat on"):
    return engine.generate(tokenizer(text)["input_ids"], PARAMS)


# -- back-off ---------------------------------------------------------------------------------------------------


def test_backoff_doubles_and_resets():
    backoff = DrafterBackoff(max_skip=4)
    assert backoff.should_try()
    pattern = []
    for _ in range(4):
        backoff.failed()
        skipped = 0
        while not backoff.should_try():
            skipped += 1
        pattern.append(skipped)
    assert pattern == [1, 2, 4, 4]  # capped at max_skip
    backoff.succeeded()
    backoff.failed()
    assert not backoff.should_try() and backoff.should_try()  # after a success, back to skipping one request


# -- failures during a request ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where,fail_on", [("propose", {3}), ("begin", {1}), ("observe", {2})])
def test_failure_mid_request_completes_on_target_alone(tokenizer, caplog, where, fail_on):
    target = tiny_llama(7)
    # The drafter is the target itself: every draft token is accepted while it works, so any inconsistency
    # of its cache after the failure would show as rejections in the next requests.
    drafter = FlakyDrafter(target, 256 + CACHE_SLACK, fail_on=fail_on, where=where)
    engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(num_draft_tokens=3), max_len=256)
    alone = engine.generate(tokenizer("the cat sat on")["input_ids"], PARAMS, use_drafter=False)
    with caplog.at_level(logging.WARNING, logger="verispec"):
        failed = run(engine, tokenizer)
    assert failed.token_ids == alone.token_ids  # no token lost or repeated
    assert failed.stats.fallbacks == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"simulated {where} failure" in warnings[0].getMessage()

    proposes = drafter.calls["propose"]
    skipped = run(engine, tokenizer)  # back-off: this request runs without the drafter
    assert skipped.token_ids == alone.token_ids
    assert drafter.calls["propose"] == proposes and skipped.stats.draft_tokens == 0 and skipped.stats.fallbacks == 0

    retried = run(engine, tokenizer)  # retried, with a consistent cache
    assert retried.token_ids == alone.token_ids
    assert retried.stats.fallbacks == 0 and retried.stats.acceptance_rate == 1.0
    assert engine.total.fallbacks == 1


def test_consecutive_failures_back_off_exponentially(tokenizer):
    target = tiny_llama(7)
    drafter = FlakyDrafter(target, 256 + CACHE_SLACK, fail_on={1, 2, 3}, where="begin")
    engine = SpeculativeEngine(target, tokenizer, drafter, max_len=256)
    used = []
    for _ in range(10):
        before = drafter.calls["begin"]
        result = run(engine, tokenizer)
        used.append(drafter.calls["begin"] > before)
        assert result.stats.fallbacks == (1 if used[-1] and drafter.calls["begin"] <= 3 else 0)
    # fail, skip 1, fail, skip 2, fail, skip 4, then succeed
    assert used == [True, False, True, False, False, True, False, False, False, False]
    assert run(engine, tokenizer).stats.draft_tokens > 0


# -- load time --------------------------------------------------------------------------------------------------


def load(name, folders, tokenizer, **kwargs):
    target = load_model(folders["target"])
    return build_drafter(name, target, tokenizer, 256 + CACHE_SLACK, target_name=str(folders["target"]),
                         on_error="fallback", **kwargs)


def test_load_named_and_model_drafters(folders, tokenizer):
    assert load("none", folders, tokenizer).drafter is None
    assert isinstance(load("ngram", folders, tokenizer).drafter, NgramDrafter)
    assert isinstance(load("random", folders, tokenizer).drafter, RandomDrafter)
    loaded = load(str(folders["draft"]), folders, tokenizer)
    assert isinstance(loaded.drafter, ModelDrafter) and loaded.warning is None


def test_user_errors_stay_errors(folders, tokenizer, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(str(tmp_path / "no-such-draft"), folders, tokenizer)
    with pytest.raises(ValueError, match="vocabulary size"):
        load(str(folders["odd_vocab"]), folders, tokenizer)


def test_corrupt_weights_fall_back_with_a_warning(folders, tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="verispec"):
        loaded = load(str(folders["corrupt"]), folders, tokenizer)
    assert loaded.drafter is None and loaded.name == "none"
    assert "loading failed" in loaded.warning and "target alone" in loaded.warning
    assert any("loading failed" in r.getMessage() for r in caplog.records)


def test_memory_check_falls_back_before_loading(folders, tokenizer, monkeypatch):
    import verispec.runtime.model.loading as models

    loads = []
    real_load = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    loaded = load(str(folders["draft"]), folders, tokenizer, free_bytes=10_000)
    assert loaded.drafter is None and "not enough memory" in loaded.warning and "GiB" in loaded.warning
    assert loads == []  # refused before loading anything
    assert isinstance(load(str(folders["draft"]), folders, tokenizer, free_bytes=2**40).drafter, ModelDrafter)


def test_auto_picks_a_local_family_draft_or_ngram(folders, tokenizer):
    loaded = load("auto", folders, tokenizer, search_dirs=[folders["draft"].parent])
    assert isinstance(loaded.drafter, ModelDrafter) and loaded.name == str(folders["draft"])
    alone = load("auto", folders, tokenizer, search_dirs=[])
    assert isinstance(alone.drafter, NgramDrafter) and alone.warning is None
    # the family draft does not fit: auto falls back to the n-gram drafter, which needs no memory
    tight = load("auto", folders, tokenizer, search_dirs=[folders["draft"].parent], free_bytes=10_000)
    assert isinstance(tight.drafter, NgramDrafter) and "not enough memory" in tight.warning


# -- CLI --------------------------------------------------------------------------------------------------------


def cli_json(capsys, folders, draft, *extra):
    code = main(["generate", "--model", str(folders["target"]), "--draft-model", draft, "--prompt", "the cat",
                 "--max-new-tokens", "12", "--json", "--device", "cpu", *extra])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if code == 0 else None), out.err


def test_cli_corrupt_draft_falls_back_bad_path_exits_2(folders, capsys, tmp_path):
    code, baseline, _ = cli_json(capsys, folders, "none")
    assert code == 0
    code, fell_back, err = cli_json(capsys, folders, str(folders["corrupt"]))
    assert code == 0 and fell_back["token_ids"] == baseline["token_ids"]
    assert fell_back["draft_model"] == "none" and "loading failed" in fell_back["drafter_warning"]
    assert "target alone" in err
    with pytest.raises(SystemExit) as exit_info:
        cli_json(capsys, folders, str(tmp_path / "missing"))
    assert exit_info.value.code == 2
    assert "does not exist" in capsys.readouterr().err
    code, ngram, _ = cli_json(capsys, folders, "ngram", "--no-adaptive")
    assert code == 0 and ngram["token_ids"] == baseline["token_ids"] and ngram["stats"]["fallbacks"] == 0


def test_cli_missing_default_draft_uses_ngram(folders, capsys, monkeypatch, tmp_path):
    import dataclasses

    from verispec.runtime.model.packaged import CODER_DRAFT, PACKAGED

    # the default draft's packages not installed (and no joined file in the cache)
    missing = dataclasses.replace(PACKAGED[CODER_DRAFT], filename="not-joined.gguf", packages=("verispec-no-such-part",))
    monkeypatch.setitem(PACKAGED, CODER_DRAFT, missing)
    code = main(["generate", "--model", str(folders["target"]), "--prompt", "the cat", "--max-new-tokens", "8",
                 "--json", "--device", "cpu"])
    out = capsys.readouterr()
    assert code == 0 and json.loads(out.out)["draft_model"] == "ngram"
    assert "default draft unavailable" in out.err
