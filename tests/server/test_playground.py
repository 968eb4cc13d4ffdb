"""The playground without a browser: GET / and GET /v1/speculation, and the opt-in per-token annotation of SSE
chunks (`speculative.annotate`), which must leave every OpenAI field as it was. The page in a real browser:
test_playground_browser.py (`make test-browser`)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from test_server import MAX_LEN, MODEL, ServerThread, assert_error, one_torch_thread  # noqa: F401 (a fixture)
from verispec.config import SpeculativeConfig
from verispec.server import ServerConfig, create_app

KEY = "sesame"
ORIGINS = {"accepted", "recovered", "bonus", "target"}


@pytest.fixture(scope="module")
def http(model_dirs, one_torch_thread):
    config = ServerConfig(model=str(model_dirs["target"]), draft_model=str(model_dirs["draft"]),
                          enable_speculative=True, spec=SpeculativeConfig(num_draft_tokens=4), max_len=MAX_LEN,
                          api_key=KEY)
    with ServerThread(create_app(config)) as running, \
            httpx.Client(base_url=running.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def chat_stream(http, speculative, **extra) -> list[dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "the cat sat on the"}], "max_tokens": 24,
            "temperature": 0, "stream": True, "speculative": speculative, **extra}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_page_loads_without_the_key_but_its_api_needs_it(http):
    page = httpx.get(f"{http.base_url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "verispec playground" in page.text and "<script>" in page.text
    assert not re.search(r"""(src|href)=|@import|https?://""", page.text)  # no CDN: it loads nothing else
    assert httpx.get(f"{http.base_url}/v1/speculation").status_code == 401
    settings = http.get("/v1/speculation").json()
    assert settings["model"] == MODEL and settings["enable_speculative"] and settings["num_draft_tokens"] == 4
    assert settings["draft_models"][0] == settings["draft_model"] and settings["draft_models"][-1] == "none"
    assert "ngram" in settings["draft_models"]


def test_annotation_tells_each_tokens_origin(http):
    chunks = chat_stream(http, {"enabled": True, "annotate": True})
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    tokens = [t for c in chunks for t in c.get("verispec", {}).get("tokens", [])]
    metrics = chunks[-1]["speculative_metrics"]
    assert {t["origin"] for t in tokens} <= ORIGINS and "accepted" in {t["origin"] for t in tokens}
    assert "".join(t["text"] for t in tokens) == text  # the test tokenizer has one character per token
    assert len(tokens) == 24 and sum(t["origin"] == "accepted" for t in tokens) == metrics["accepted_tokens"]
    rounds: dict[int, list[dict]] = {}
    for t in tokens:
        rounds.setdefault(t["round"], []).append(t)
    assert sorted(rounds) == list(range(1, metrics["rounds"] + 1))
    for committed in rounds.values():  # accepted draft tokens, then one recovered or bonus token
        *accepted, last = [t["origin"] for t in committed]
        drafted = committed[0]["drafted"]
        assert set(accepted) <= {"accepted"}
        if drafted == 0:  # e.g. the last round: one token left to generate, nothing to draft
            assert last == "target" and committed[0]["stage"] is None
        else:
            assert last == ("bonus" if len(accepted) == drafted else "recovered")
            assert {t["stage"] for t in committed} == {"model"}
    assert any(c[0]["drafted"] for c in rounds.values())
    target_alone = chat_stream(http, {"enabled": False, "annotate": True})
    tokens = [t for c in target_alone for t in c.get("verispec", {}).get("tokens", [])]
    assert {t["origin"] for t in tokens} == {"target"} and {t["stage"] for t in tokens} == {None}


def test_without_annotate_the_stream_is_unchanged(http):
    """Only the `verispec` key differs (ids, timestamps and timings aside): OpenAI's fields are never touched."""

    def normalise(chunks: list[dict]) -> list[dict]:
        for c in chunks:
            c.pop("id"), c.pop("created")
            for timing in ("draft_ms", "verify_ms"):
                c.get("speculative_metrics", {}).pop(timing, None)
        return chunks

    plain = normalise(chat_stream(http, {"enabled": True}, logprobs=True, top_logprobs=2))
    annotated = normalise(chat_stream(http, {"enabled": True, "annotate": True}, logprobs=True, top_logprobs=2))
    assert not any("verispec" in c for c in plain)
    for c in annotated:
        c.pop("verispec", None)
    assert annotated == plain


def test_annotate_needs_a_stream(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "speculative": {"annotate": True}}
    assert_error(http.post("/v1/chat/completions", json=body), 400, "speculative.annotate")


def test_prediction_tokens_are_annotated_and_coloured_on_their_own(http):
    """A request with a prediction: its accepted prediction tokens carry the stage 'prediction', which the page
    colours in its own gold (and sends the prediction field from its own text box)."""
    plain = chat_stream(http, {"enabled": True})
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in plain if c["choices"])
    chunks = chat_stream(http, {"enabled": True, "annotate": True},
                         prediction={"type": "content", "content": text}, stream_options={"include_usage": True})
    tokens = [t for c in chunks for t in c.get("verispec", {}).get("tokens", [])]
    assert "".join(t["text"] for t in tokens) == text
    predicted = sum(t["origin"] == "accepted" and t["stage"] == "prediction" for t in tokens)
    assert predicted == chunks[-1]["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    page = httpx.get(f"{http.base_url}/").text
    assert '["prediction", "var(--accepted-prediction)"]' in page and 'id="prediction"' in page
    assert "body.prediction = { type: \"content\", content: predicted }" in page
