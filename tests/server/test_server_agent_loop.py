"""An agent loop through the server with the official `openai` client: the same file resent with a new instruction
is served from the prefix cache (usage.prompt_tokens_details.cached_tokens, /metrics' hits grow by as much), and
the turn's chain is protected in the cache (prefix_cache.py, "Conversations"); a first request is neither."""

from __future__ import annotations

import httpx
import openai
import pytest

from test_server import MODEL, ServerThread, scrape
from verispec.config import SpeculativeConfig
from verispec.server import ServerConfig, create_app

FILE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 3


@pytest.fixture(scope="module")
def server(model_dirs):
    config = ServerConfig(model=str(model_dirs["target"]), draft_model=str(model_dirs["draft"]),
                          enable_speculative=True, spec=SpeculativeConfig(num_draft_tokens=3), max_len=512,
                          max_num_seqs=2, max_batched_tokens=64, prefill_chunk_tokens=32)
    app = create_app(config)
    with ServerThread(app) as running:
        yield running, app


def turn(url: str, instruction: str):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"{FILE}\n{instruction}"}], max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True})


def test_the_resent_file_comes_from_the_cache(server):
    running, app = server
    with httpx.Client(base_url=running.url) as http:
        first = turn(running.url, "explain it")
        before = scrape(http)["verispec_prefix_cache_hits_total"]
        second = turn(running.url, "add docstrings")
        hits = scrape(http)["verispec_prefix_cache_hits_total"] - before
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # negative control: nothing was cached yet
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(FILE) - 32 and cached == hits  # the file (a token a character), in full blocks
    assert app.state.server.worker.engine.prefix_cache.protected  # the second turn's chain
