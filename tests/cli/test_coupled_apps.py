"""Coupled sampling through the server (`"speculative": {"coupling": "gumbel"}`) and the CLI (`--coupled`): a seeded
request gets the target alone's text with speculation on or off, any K, adaptive K, n > 1; a bad mode is a 400
naming the field."""

import json

import pytest

from test_cli_generate import run_cli

from test_server import MODEL, assert_error, base_url, client, complete, http, one_torch_thread, running  # noqa: F401

SAMPLED = dict(prompt="a bird", max_tokens=24, temperature=1.3, ignore_eos=True)


def sample(client, seed, **speculative):
    return complete(client, seed=seed, speculative=speculative, **SAMPLED).choices[0].text


def test_seeded_coupled_requests_get_the_target_alone_text(client):
    for seed in (3, 4, 5):
        alone = sample(client, seed, enabled=False, coupling="gumbel")
        for option in ({}, {"draft_tokens": 2}, {"draft_tokens": 7}, {"adaptive": True}, {"draft_model": "ngram"}):
            assert sample(client, seed, coupling="gumbel", **option) == alone, (seed, option)
    texts = {sample(client, seed, enabled=False, coupling="gumbel") for seed in range(3, 8)}
    assert len(texts) > 1  # sampling does sample


def test_n_choices_are_coupled_with_seed_plus_i(client):
    both = complete(client, seed=9, n=2, speculative={"coupling": "gumbel"}, **SAMPLED)
    assert [c.text for c in both.choices] == [sample(client, 9, enabled=False, coupling="gumbel"),
                                              sample(client, 10, enabled=False, coupling="gumbel")]


def test_rejection_mode_is_accepted_and_a_bad_mode_is_a_400(client, http):
    assert sample(client, 3, coupling="rejection") == sample(client, 3, coupling="rejection")
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "speculative": {"coupling": "exact"}})
    assert_error(r, 400, "speculative.coupling")


@pytest.mark.parametrize("coupling, adaptive", [("gumbel", True), ("rejection", False), (None, False)])
def test_a_coupled_seeded_request_keeps_adaptive_k(coupling, adaptive):
    from types import SimpleNamespace

    from verispec.config import SamplingParams, SpeculativeConfig
    from verispec.server import ServerConfig
    from verispec.server.app import Server
    from verispec.server.protocol import SpeculativeOptions

    server = Server(ServerConfig(model="t", draft_model="d", enable_speculative=True),
                    SimpleNamespace(spec=SpeculativeConfig(num_draft_tokens=4, adaptive=True)))
    params = SamplingParams(temperature=0.7, seed=1, coupled=coupling == "gumbel")
    spec, _ = server.speculation(SpeculativeOptions(coupling=coupling), params)
    assert spec.adaptive == adaptive


def test_cli_generate_coupled_equals_the_target_alone(capsys, model_dirs):
    common = ["--model", model_dirs["target"], "--prompt", "a bird", "--max-new-tokens", 30, "--json",
              "--temperature", 1.3, "--seed", 5, "--coupled"]
    outputs = []
    for drafter in (["--draft-model", model_dirs["draft"], "--draft-tokens", 5], ["--draft-model", "ngram"],
                    ["--draft-model", "none"]):
        code, out, _ = run_cli(capsys, *common, *drafter)
        assert code == 0
        outputs.append(json.loads(out))
    assert outputs[0]["token_ids"] == outputs[1]["token_ids"] == outputs[2]["token_ids"]
    assert outputs[0]["stats"]["draft_tokens"] > 0
