"""The suffix drafter's cache through the server, per API key: a real server on loopback, the official `openai` client.

A request's finished text joins the suffix cache of its API key (a hash of the credentials it sent); another key's
requests never draft from it, unless the server runs with `--suffix-shared-across-keys` (one cache for all).
Observed from outside, by each response's speculative metrics: with a fixed K and greedy decoding, drafting is
deterministic, so a request whose cache holds nothing of it drafts exactly as the first request did (same rounds,
draft and accepted tokens), and one whose cache holds an earlier answer to the same prompt gets more accepted. Every
answer is the target alone's (the same request with speculation off).

The suffix cache is the process's (drafters/suffix.py, `shared_cache`): each test uses its own prompt and keys,
so nothing another test taught it can be drafted here.
"""

from __future__ import annotations

import openai
import pytest

from test_server import MODEL, SPEC_OFF, ServerThread, spec_metrics
from verispec.config import SpeculativeConfig
from verispec.server import ServerConfig, create_app


def start(model_dirs, shared: bool) -> ServerThread:
    config = ServerConfig(model=str(model_dirs["target"]), draft_model="suffix", enable_speculative=True,
                          spec=SpeculativeConfig(num_draft_tokens=4), max_len=256,
                          suffix_shared_across_keys=shared)
    return ServerThread(create_app(config))


def ask(url: str, key: str, prompt: str, **extra):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True, **extra})


def drafting(response) -> tuple[int, int, int]:
    metrics = spec_metrics(response)
    return metrics["rounds"], metrics["draft_tokens"], metrics["accepted_tokens"]


@pytest.mark.parametrize("shared", [False, True], ids=["per-key", "shared-across-keys"])
def test_a_keys_finished_requests_draft_only_for_that_key_unless_shared(model_dirs, shared):
    prompt = "seven Rome nine mat" if shared else "Paris four log sang"  # each test its own text
    tag = "shared" if shared else "scoped"
    key_a, key_b, key_c = (f"suffix-{tag}-{name}" for name in "abc")
    with start(model_dirs, shared) as server:
        alone = ask(server.url, key_a, prompt, **SPEC_OFF).choices[0].text
        cold = ask(server.url, key_a, prompt)  # key a's cache is empty: drafts from its own text only
        other = ask(server.url, key_b, prompt)  # key a's answer is in the cache, under key a's scope
        warm = ask(server.url, key_a, prompt)  # key a again: its earlier answers draft
        assert [r.choices[0].text for r in (cold, other, warm)] == [alone] * 3
        assert spec_metrics(cold)["enabled"] and drafting(cold)[1] > 0  # its own text drafts, the cache does not
        assert drafting(warm)[2] > drafting(cold)[2], (drafting(cold), drafting(warm))
        if shared:
            assert drafting(other)[2] > drafting(cold)[2], (drafting(cold), drafting(other))
        else:
            assert drafting(other) == drafting(cold)  # exactly as if key a had never asked
        # The target alone's answer (speculation off) teaches the cache too: a fresh key drafts from it only if shared.
        fresh = ask(server.url, key_c, prompt)
        assert fresh.choices[0].text == alone
        assert (drafting(fresh) == drafting(cold)) is not shared, (drafting(cold), drafting(fresh))


def test_the_flag_reaches_the_server(model_dirs, monkeypatch):
    """`verispec serve --suffix-shared-across-keys` and its default: the ServerConfig the command builds."""
    import verispec.server as server_package
    from verispec.cli import main

    configs = []

    class Built(Exception):
        pass

    def create_app_spy(config):
        configs.append(config)
        raise Built  # the config is what this test reads: no server starts

    monkeypatch.setattr(server_package, "create_app", create_app_spy)
    for flags in ([], ["--suffix-shared-across-keys"]):
        with pytest.raises(Built):
            main(["serve", "--model", str(model_dirs["target"]), "--draft-model", "suffix", "--port", "0", *flags])
    assert [c.suffix_shared_across_keys for c in configs] == [False, True]
    assert all(c.draft_model == "suffix" for c in configs)
