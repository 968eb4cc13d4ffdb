"""Predicted outputs through the server (OpenAI's `prediction`), with the official `openai` client: the answer is the
one without a prediction, streamed and not, on chat and text completions, with n > 1, logprobs, stop strings,
seeds, structured output and a request-named drafter; usage's accepted / rejected prediction tokens by hand (also
in the stream's usage chunk); OpenAI-shaped 400s for bad predictions while the server keeps serving; the
Prometheus counters. The server speculates only when asked (the default), so a prediction drafts on its own."""

from __future__ import annotations

import httpx
import openai
import pytest

from test_server import MODEL, ServerThread, assert_error, scrape
from verispec.config import MAX_DRAFT_TOKENS
from verispec.drafters import prediction as prediction_module
from verispec.server import ServerConfig, create_app

MAX_LEN = 256
NEW = 40
PROMPT = "the cat sat"


@pytest.fixture(scope="module")
def server(model_dirs, one_thread):
    config = ServerConfig(model=str(model_dirs["target"]), draft_model="ngram", enable_speculative=False,
                          max_len=MAX_LEN, allowed_draft_models=("ngram",))
    with ServerThread(create_app(config)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def answer(client) -> str:
    """The greedy text completion of PROMPT without a prediction (NEW tokens: the tiny tokenizer spells a character
    a token)."""
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(text) == NEW
    return text


def details(usage) -> tuple[int, int]:
    d = usage.completion_tokens_details
    return d.accepted_prediction_tokens, d.rejected_prediction_tokens


def test_completion_counts_by_hand(client, answer, monkeypatch):
    """tests/drafters/test_prediction.py's hand case through the API (the server runs in this process: a round's run
    is not capped, `run_cap`): three foreign characters inserted before answer[a], where answer[a - 1 : a + 1]
    occurs once; K fixed at 64 (speculative.draft_tokens). Round 1 accepts a
    tokens and rejects the other N - 1 - a it drafted; round 2 drafts and accepts the N - a - 2 left before the
    bonus token. Accepted N - 2, rejected N - 1 - a."""
    pairs = [answer[i : i + 2] for i in range(len(answer) - 1)]
    a = next(a for a in range(8, NEW - 8) if pairs.count(answer[a - 1 : a + 1]) == 1)
    prediction = answer[:a] + "ZZZ" + answer[a:]
    monkeypatch.setattr(prediction_module, "run_cap", lambda agreement: MAX_DRAFT_TOKENS)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0, extra_body={
        "ignore_eos": True, "prediction": prediction, "speculative": {"draft_tokens": MAX_DRAFT_TOKENS}})
    assert out.choices[0].text == answer
    assert details(out.usage) == (NEW - 2, NEW - 1 - a)
    metrics = out.model_extra["speculative_metrics"]
    assert metrics["rounds"] == 2 and metrics["draft_model"] == "prediction+ngram"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_with_the_official_client(client, stream):
    messages = [{"role": "user", "content": "the dog"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0)
    expected = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None  # no prediction, no prediction figures
    edited = expected[:10] + "QQ" + expected[14:]
    parts = [{"type": "text", "text": edited[:5]}, {"type": "text", "text": edited[5:]}]
    prediction = {"type": "content", "content": parts if stream else edited}
    if not stream:
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0,
                                             prediction=prediction)
        text, usage = out.choices[0].message.content, out.usage
    else:
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0,
                                                     prediction=prediction, stream=True,
                                                     stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    assert text == expected
    accepted, rejected = details(usage)
    assert accepted >= len(expected) // 2 and rejected >= 1  # it left the prediction at "QQ" and came back


def test_choices_logprobs_stops_seeds_and_a_named_drafter(client, answer):
    """n = 2 with seeds (coupled: seed + i per choice), logprobs and a stop string, the prediction in front of a
    request-named n-gram drafter: each choice as without the prediction."""
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0.9, seed=5, n=2, logprobs=2,
                stop=[answer[30:33]])
    plain = client.completions.create(**body, extra_body={"ignore_eos": True})
    predicted = client.completions.create(**body, extra_body={"ignore_eos": True, "prediction": answer,
                                                              "speculative": {"draft_model": "ngram"}})
    assert [c.text for c in predicted.choices] == [c.text for c in plain.choices]
    assert [c.logprobs.tokens for c in predicted.choices] == [c.logprobs.tokens for c in plain.choices]
    assert [c.finish_reason for c in predicted.choices] == [c.finish_reason for c in plain.choices]
    assert sum(details(predicted.usage)) > 0


def test_structured_output_with_a_prediction(client, answer):
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0)
    regex = {"guided_regex": "[a-z .]+"}
    plain = client.completions.create(**body, extra_body=regex).choices[0].text
    out = client.completions.create(**body, extra_body={**regex, "prediction": answer})
    assert out.choices[0].text == plain and details(out.usage)[0] > 0


def test_speculative_false_ignores_the_prediction(client, answer):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                    extra_body={"ignore_eos": True, "prediction": answer, "speculative": False})
    assert out.choices[0].text == answer and details(out.usage) == (0, 0)


@pytest.mark.parametrize("path, prediction, param", [
    ("/v1/chat/completions", "plain text", "prediction"),  # chat takes OpenAI's object only
    ("/v1/chat/completions", {"type": "text", "content": "x"}, "prediction.type"),
    ("/v1/chat/completions", {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     "prediction.content"),
    ("/v1/chat/completions", {"type": "content", "content": 5}, "prediction.content"),
    ("/v1/completions", 5, "prediction"),
    ("/v1/completions", "the cat " * 40, "prediction"),  # more than the context holds after the prompt
])
def test_bad_predictions_get_openai_400s_and_the_server_keeps_serving(http, client, answer, path, prediction, param):
    body = {"model": MODEL, "max_tokens": 4, "prediction": prediction}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": PROMPT})
    error = assert_error(http.post(path, json=body), 400)
    assert error["param"].startswith(param), error
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                    extra_body={"ignore_eos": True, "prediction": answer})
    assert out.choices[0].text == answer


def test_prometheus_counts_prediction_tokens(http, client, answer):
    before = scrape(http)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                     extra_body={"ignore_eos": True, "prediction": answer + "tail"})
    after = scrape(http)
    accepted, rejected = details(out.usage)
    delta = {name: after[name] - before.get(name, 0.0)
             for name in ("verispec_prediction_tokens_total", "verispec_accepted_prediction_tokens_total")}
    assert delta == {"verispec_prediction_tokens_total": accepted + rejected,
                     "verispec_accepted_prediction_tokens_total": accepted}
