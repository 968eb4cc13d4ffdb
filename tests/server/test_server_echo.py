"""`echo` with `logprobs` on /v1/completions (prompt logprobs, as lm-evaluation-harness's loglikelihood tasks ask
for them), end to end through the official `openai` client on loopback, on the tiny trained pair.

The prompt's logprobs equal log_softmax of the target's own forward at the position before each token (a copy
shifted by one position does not: the check can fail); the first is null, as OpenAI's and vLLM's. Echo in front of
a generation leaves the generation as it is without echo, streamed or not, for text and token-id prompts; an echo
computed while another request decodes changes nothing of that request; bad input gets OpenAI-shaped 400s.
"""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
import torch

from gates import EventReader, StepGate
from test_server import MAX_LEN, MODEL, ServerThread

from verispec.config import SpeculativeConfig
from verispec.server import ServerConfig, create_app

PROMPT = "the cat sat on the mat. the dog"
TOP = 3


@pytest.fixture(scope="module")
def running(model_dirs, one_thread):
    config = ServerConfig(model=str(model_dirs["target"]), draft_model=str(model_dirs["draft"]),
                          enable_speculative=True, spec=SpeculativeConfig(num_draft_tokens=4), max_len=MAX_LEN,
                          dtype="float32")  # the reference forward below is fp32
    app = create_app(config)
    with ServerThread(app) as server:
        server.app = app
        yield server


@pytest.fixture(scope="module")
def client(running):
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=120)


def scored(client, prompt=PROMPT, max_tokens=0, **extra):
    return client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=TOP, max_tokens=max_tokens,
                                     temperature=0, **extra)


def model_logprobs(trained_pair, ids: list[int]) -> torch.Tensor:
    """[n, vocab]: log_softmax of the target's own logits at each prompt position (Hugging Face modeling, fp32)."""
    with torch.no_grad():
        return torch.log_softmax(trained_pair[0](torch.tensor([ids])).logits[0].float(), dim=-1)


def test_prompt_logprobs_are_the_models_own(client, tokenizer, trained_pair):
    response = scored(client)
    [choice] = response.choices
    ids = tokenizer(PROMPT)["input_ids"]
    lp = choice.logprobs
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == 0
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert lp.text_offset == offsets
    reference = model_logprobs(trained_pair, ids)  # [n, vocab]
    got = torch.tensor(lp.token_logprobs[1:])
    target = torch.tensor(ids[1:])
    expected = reference[:-1].gather(-1, target[:, None])[:, 0]  # position i - 1 predicts token i
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    shifted = reference[1:].gather(-1, target[:, None])[:, 0]  # the negative control: one position late
    assert not torch.allclose(got, shifted, atol=1e-2)
    for i in range(1, len(ids)):
        values, indices = reference[i - 1].topk(TOP)
        assert set(lp.top_logprobs[i]) == {tokenizer.decode([t]) for t in indices.tolist()}
        torch.testing.assert_close(sorted(lp.top_logprobs[i].values(), reverse=True), values.tolist(), atol=1e-4,
                                   rtol=0)


def test_echo_in_front_of_a_generation_changes_nothing(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=TOP, max_tokens=12, temperature=0)
    echoed = scored(client, max_tokens=12)
    alone = scored(client)
    [p], [e], [a] = plain.choices, echoed.choices, alone.choices
    assert e.text == PROMPT + p.text and e.finish_reason == p.finish_reason
    n = len(a.logprobs.tokens)
    assert e.logprobs.tokens == a.logprobs.tokens + p.logprobs.tokens
    assert e.logprobs.token_logprobs == a.logprobs.token_logprobs + p.logprobs.token_logprobs
    assert e.logprobs.top_logprobs == a.logprobs.top_logprobs + p.logprobs.top_logprobs
    assert e.logprobs.text_offset[n:] == [a.logprobs.text_offset[-1] + len(a.logprobs.tokens[-1]) + o
                                          for o in p.logprobs.text_offset]
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    # Without logprobs: the text alone.
    bare = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=12, temperature=0)
    assert bare.choices[0].text == e.text and bare.choices[0].logprobs is None
    # Streamed: the echo is the first chunk; the chunks add up to the same text and logprobs.
    text, tokens, values, offsets = "", [], [], []
    for chunk in scored(client, max_tokens=12, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert (text, tokens, values, offsets) == (e.text, e.logprobs.tokens, e.logprobs.token_logprobs,
                                               e.logprobs.text_offset)


def test_token_id_prompts_as_lm_eval_sends_them(client, tokenizer):
    """lm-evaluation-harness: token-id prompts, a batch of them, `echo=True, logprobs=1, max_tokens=1`."""
    prompts = [tokenizer(text)["input_ids"] for text in ("one two three", "a bird sang in the tree.")]
    batch = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    for ids, choice in zip(prompts, batch.choices):
        one = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
        assert choice.text == one.choices[0].text and choice.text.startswith(tokenizer.decode(ids))
        assert choice.logprobs.token_logprobs == one.choices[0].logprobs.token_logprobs
        assert len(choice.logprobs.tokens) == len(ids) + 1
        # What lm-eval reads: the continuation's logprobs and whether each token was the most likely one.
        for token, top in zip(choice.logprobs.tokens[1:], choice.logprobs.top_logprobs[1:]):
            assert len(top) == 1 and all(isinstance(v, float) for v in top.values()) and token
    assert batch.usage.prompt_tokens == sum(len(ids) for ids in prompts)


def test_an_echo_between_steps_leaves_a_running_request_alone(client, running, monkeypatch):
    """A prompt is scored on the worker thread between two steps of a request that is decoding; that request's
    tokens are those it gets alone, and the echo's are those it gets on an idle server."""
    body = {"model": MODEL, "prompt": "the dog", "max_tokens": 40, "ignore_eos": True, "temperature": 0,
            "stream": True}
    alone = client.completions.create(model=MODEL, prompt="the dog", max_tokens=40, temperature=0,
                                      extra_body={"ignore_eos": True})
    idle = scored(client)
    gate = StepGate(monkeypatch, running.app.state.server.worker.engine)
    results = {}
    gate.hold()
    try:
        with httpx.Client(base_url=running.url, timeout=60) as http, http.stream("POST", "/v1/completions",
                                                                                  json=body) as r:
            events = EventReader(r)
            gate.advance_until(lambda: events.has(2))  # decoding
            thread = threading.Thread(target=lambda: results.setdefault("echo", scored(client)), daemon=True)
            thread.start()
            gate.advance_until(lambda: "echo" in results, limit=20)
            assert not any('"finish_reason":"length"' in e for e in events.events)  # still decoding
            gate.release()
            chunks = [json.loads(e[6:]) for e in events.all() if e.startswith("data: {")]
    finally:
        gate.release()
    thread.join(60)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == alone.choices[0].text
    assert results["echo"].choices[0].logprobs.token_logprobs == idle.choices[0].logprobs.token_logprobs


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1, "echo": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "a" * (MAX_LEN + 1), "max_tokens": 0, "echo": True, "logprobs": 1}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": [], "echo": True, "max_tokens": 0}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
])
def test_bad_echo_requests_get_openai_400s(client, running, path, body, param):
    r = httpx.post(f"{running.url}{path}", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert scored(client).choices[0].text == PROMPT  # the server keeps serving
