"""Prefix caching through the server, with the official `openai` client: a request whose prompt starts like an
earlier one reports the reused tokens in `usage.prompt_tokens_details.cached_tokens` (as OpenAI does), /metrics
counts the lookups and hits, and the text is what a server without prefix caching answers."""

from __future__ import annotations

import httpx
import openai
import pytest

from test_server import MODEL, ServerThread, scrape
from verispec.config import SpeculativeConfig
from verispec.server import ServerConfig, create_app

SYSTEM = "You are a helpful assistant. Answer briefly and well. " * 2


def start(model_dirs, enable: bool) -> ServerThread:
    config = ServerConfig(
        model=str(model_dirs["target"]), draft_model=str(model_dirs["draft"]), enable_speculative=True,
        spec=SpeculativeConfig(num_draft_tokens=3), max_len=256, max_num_seqs=4, max_batched_tokens=64,
        prefill_chunk_tokens=32, enable_prefix_caching=enable,
    )
    return ServerThread(create_app(config))


@pytest.fixture(scope="module")
def servers(model_dirs):
    with start(model_dirs, True) as on, start(model_dirs, False) as off:
        yield on, off


def ask(url: str, prompt: str, **kwargs):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}, **kwargs)


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def test_cached_tokens_reported_and_text_unchanged(servers):
    on, off = servers
    prompts = [SYSTEM + "the cat sat on the", SYSTEM + "one two three", SYSTEM + "the cat sat on the"]
    answers = [ask(on.url, p) for p in prompts]
    expected = [ask(off.url, p) for p in prompts]
    assert [a.choices[0].text for a in answers] == [e.choices[0].text for e in expected]
    assert cached(answers[0]) == 0
    assert 0 < cached(answers[1]) < answers[1].usage.prompt_tokens  # the shared system prompt's blocks
    assert cached(answers[2]) == (answers[2].usage.prompt_tokens - 1) // 16 * 16  # all of it but the last block's rest
    assert all(cached(e) == 0 for e in expected)
    with httpx.Client(base_url=on.url) as http:
        metrics = scrape(http)
    hits = metrics["verispec_prefix_cache_hits_total"]
    assert hits == sum(cached(a) for a in answers)
    assert metrics["verispec_prefix_cache_queries_total"] >= hits + 16


def test_n_choices_count_the_prompt_once_and_stream_usage(servers):
    on, _ = servers
    prompt = "zz " * 12 + SYSTEM + "seven eight nine ten"  # nothing of it is cached yet
    with httpx.Client(base_url=on.url) as http:
        before = scrape(http)["verispec_prefix_cache_hits_total"]
        first = ask(on.url, prompt, n=3)
        hits = scrape(http)["verispec_prefix_cache_hits_total"] - before
    # Choices 2 and 3 copy choice 1's blocks (hits), but usage counts the prompt once, as computed: none cached.
    assert cached(first) == 0 and hits == 2 * ((first.usage.prompt_tokens - 1) // 16 * 16)
    client = openai.OpenAI(base_url=f"{on.url}/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=8, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    usages = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usages) == 1 and usages[0].prompt_tokens_details.cached_tokens == 0  # a chat template differs
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=8, extra_body={"ignore_eos": True})
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
