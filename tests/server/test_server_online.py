"""`serve --online-train head` end to end: a real server on loopback, the official `openai` client, the tiny trained
target and its trained head (conftest).

Each API key drafts with its own copy of the head, trained from that key's requests alone and swapped in between
engine steps. What the tests show from outside: every answer is the target alone's (greedy and seeded, before and
after swaps, and across a swap in the middle of a running request); a key's training lowers its loss and raises its
acceptance on a repeated prompt; another key's drafting is exactly as if the first key had never asked (and would
not be if keys shared one head: the negative control). Deterministic: greedy with a fixed K, and each test waits
for the trainer to be idle (`wait_idle`, a bound on an event) before the next request.
"""

from __future__ import annotations

import hashlib
import json
import threading

import httpx

import openai
import pytest
import torch

from gates import EventReader, StepGate
from test_server import MODEL, SPEC_OFF, ServerThread, scrape, spec_metrics
from verispec.config import SpeculativeConfig
from verispec.server import ServerConfig, create_app
from verispec.server.online import OnlineHeads

WAIT_S = 120  # bound on waiting for the trainer
PROMPT = "the cat sat on the mat and the dog"


def start(model_dirs, trained_head, **online) -> ServerThread:
    config = ServerConfig(model=str(model_dirs["target"]), draft_model=f"head:{trained_head}", enable_speculative=True,
                          spec=SpeculativeConfig(num_draft_tokens=4), max_len=256, online_train="head",
                          online_train_every=1, online_lr=3e-3, **online)
    app = create_app(config)
    server = ServerThread(app)
    server.app, server.online = app, app.state.server.worker.online
    return server


def ask(url: str, key: str, prompt: str = PROMPT, max_tokens: int = 40, **extra):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    fields = {k: extra.pop(k) for k in ("temperature", "seed") if k in extra}
    fields.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                     extra_body={"ignore_eos": True, **extra}, **fields)


def trained(server) -> None:
    assert server.online.wait_idle(WAIT_S), "the online trainer did not finish"


def drafting(response) -> tuple[int, int, int]:
    metrics = spec_metrics(response)
    return metrics["rounds"], metrics["draft_tokens"], metrics["accepted_tokens"]


def key_of(api_key: str) -> str:
    """The key the server files a request under (app.py `Server.key`)."""
    return hashlib.sha256(f"Bearer {api_key}".encode()).hexdigest()[:32]


def scraped(server) -> dict[str, float]:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        return scrape(http)


@pytest.mark.parametrize("isolated", [True, False], ids=["per-key", "one-head-for-all-keys(negative-control)"])
def test_a_keys_traffic_trains_its_own_head_only_and_never_changes_output(model_dirs, trained_head, monkeypatch,
                                                                         isolated):
    if not isolated:  # the planted fault: every key drafts with the first key's head
        shared = {}
        drafter_for = OnlineHeads.drafter_for
        monkeypatch.setattr(OnlineHeads, "drafter_for",
                            lambda self, key: shared.setdefault("head", drafter_for(self, key)))
    with start(model_dirs, trained_head) as server:
        alone = ask(server.url, "a", **SPEC_OFF).choices[0].text
        runs = []
        for _ in range(6):
            runs.append(ask(server.url, "a"))
            trained(server)
        assert [r.choices[0].text for r in runs] == [alone] * 6  # across five swaps
        losses = server.online.losses(key_of("a"))
        assert len(losses) == 6 and losses[-1] < 0.5 * losses[0], losses
        assert drafting(runs[-1])[2] > drafting(runs[0])[2], [drafting(r) for r in runs]
        # Seeded sampling (coupled by default with a seed): the target alone's tokens whatever the head drafts.
        sampled = ask(server.url, "a", temperature=0.9, seed=11)
        assert sampled.choices[0].text == ask(server.url, "a", temperature=0.9, seed=11, **SPEC_OFF).choices[0].text
        trained(server)
        # Key b has sent nothing yet: it drafts with the deployment's head, exactly as key a's first request did.
        other = ask(server.url, "b")
        assert other.choices[0].text == alone
        assert (drafting(other) == drafting(runs[0])) is isolated, (drafting(runs[0]), drafting(other))
        metrics = scraped(server)
    assert metrics["verispec_online_train_steps_total"] >= 6 and metrics["verispec_online_swaps_total"] >= 6
    assert metrics["verispec_online_keys"] == 2 and metrics["verispec_online_buffer_tokens"] > 0
    # The heads themselves: a's weights moved away from the deployment's; b drafts with a head of its own (the planted
    # fault: with a's).
    online = server.online
    head_a, head_b = online.drafter_for(key_of("a")), online.drafter_for(key_of("b"))
    assert not torch.equal(head_a.norm, online.base.norm)
    assert (head_a is not head_b) is isolated


def test_keys_beyond_the_bound_are_forgotten_back_to_the_deployments_head(model_dirs, trained_head):
    with start(model_dirs, trained_head, online_max_keys=1) as server:
        cold = ask(server.url, "a")
        trained(server)
        for _ in range(3):
            ask(server.url, "a")
            trained(server)
        assert drafting(ask(server.url, "a")) != drafting(cold)  # a's head has learnt
        trained(server)
        ask(server.url, "b")  # b takes the one place: a is forgotten (head, buffer, trained weights)
        trained(server)
        again = ask(server.url, "a")
        assert drafting(again) == drafting(cold) and again.choices[0].text == cold.choices[0].text
        trained(server)
        assert len(server.online.losses(key_of("a"))) == 1  # trained afresh from its one request since
        assert scraped(server)["verispec_online_evictions_total"] == 2  # a, then b


def test_weights_swapped_in_the_middle_of_a_request_leave_its_output_alone(model_dirs, trained_head, monkeypatch):
    with start(model_dirs, trained_head) as server:
        alone = ask(server.url, "a", max_tokens=120, **SPEC_OFF).choices[0].text
        engine = server.app.state.server.served.engine
        gate = StepGate(monkeypatch, engine)
        gate.hold()
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 120, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=server.url, timeout=60, headers={"authorization": "Bearer a"}) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:  # the long request, taken by the idle worker
                events = EventReader(r)
                gate.advance_until(lambda: events.has(1))
                short = threading.Thread(target=lambda: ask(server.url, "a", prompt="the dog", max_tokens=6))
                short.start()  # the same key's short request finishes while the long one runs: its head trains
                gate.advance_until(lambda: not short.is_alive(), limit=200)
                short.join()
                trained(server)
                swaps = scrape(http)["verispec_online_swaps_total"]
                gate.advance()  # the swap happens before this step, between two steps of the running request
                assert scrape(http)["verispec_online_swaps_total"] == swaps + 1
                assert not any("[DONE]" in e for e in events.events)  # still running
                gate.release()
                chunks = [json.loads(e.removeprefix("data: ")) for e in events.all() if e != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == alone


@pytest.mark.parametrize("flags, message", [
    (["--online-train", "draft"], "invalid choice"),
    (["--online-train", "head"], "is not one"),  # the default drafter is no head
    (["--online-train", "head", "--online-train-every", "0"], "--online-train-every"),
    (["--online-train", "head", "--online-lr", "2"], "online_lr"),
])
def test_bad_online_flags_exit_2_with_a_message(flags, message, capsys):
    from verispec.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--port", "0", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
