"""The playground page (GET /) in headless Chromium against a real server on loopback (tiny trained pair, an API
key): the page loads, a wrong key is refused, a prompt streams (the step loop is held, so the test sees tokens on
the page while the request is still running), tokens are coloured by origin, and the on/off comparison shows
identical text under greedy decoding.

Needs Debian's `chromium` and `chromium-driver` and the `selenium` package: `make test-browser` (which .ci/run
calls after installing them). Without them the tests skip, saying why, unless VERISPEC_REQUIRE_BROWSER is set.
Every wait is on something the page shows (WebDriverWait polls the DOM), bounded generously: none assumes a speed.
"""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from gates import StepGate
from test_server import MAX_LEN, MODEL, ServerThread, one_torch_thread  # noqa: F401 (a fixture)
from verispec.config import SpeculativeConfig
from verispec.server import ServerConfig, create_app

pytestmark = pytest.mark.browser

KEY = "sesame"
PROMPT = "the cat sat on the"
MAX_TOKENS = 24
WAIT_S = 120  # a bound on every wait for the page, never a guess of how long something takes
ACCEPTED_RGB = "rgb(183, 228, 199)"  # --accepted in playground.html


def _missing(reason: str):
    if os.environ.get("VERISPEC_REQUIRE_BROWSER"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def driver():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _missing("browser tests need the selenium package (pip install -e '.[dev]')")
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        _missing("browser tests need Debian's chromium and chromium-driver: apt-get install chromium chromium-driver")
    options = Options()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(chromedriver), options=options)
    yield browser
    browser.quit()


@pytest.fixture(scope="module")
def running(model_dirs, one_torch_thread):
    config = ServerConfig(model=str(model_dirs["target"]), draft_model=str(model_dirs["draft"]),
                          enable_speculative=True, spec=SpeculativeConfig(num_draft_tokens=4), max_len=MAX_LEN,
                          api_key=KEY)
    app = create_app(config)
    with ServerThread(app) as running:
        running.app = app
        yield running


@pytest.fixture(scope="module")
def greedy_text(running) -> str:
    """The target's greedy answer, straight from the API (not through the page)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "speculative": False}
    r = httpx.post(f"{running.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def wait_for(driver, condition, message: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(lambda d: condition(d), message)


def text(driver, element_id: str) -> str:
    return driver.find_element("id", element_id).text


def set_value(driver, element_id: str, value) -> None:
    element = driver.find_element("id", element_id)
    element.clear()
    element.send_keys(str(value))


def tokens(driver, parent: str) -> list[dict]:
    """The coloured token spans under `parent`: their origin, text and background colour."""
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0] + ' .tok')].map((s) => ({origin: s.dataset.origin, "
        "text: s.textContent, colour: getComputedStyle(s).backgroundColor}))", f"#{parent}")


def connect(driver, url: str, key: str) -> None:
    driver.get(f"{url}/")
    assert driver.title == "verispec playground"
    wait_for(driver, lambda d: "API key" in text(d, "status"), "the page did not ask for the API key")
    set_value(driver, "api-key", key)
    driver.find_element("id", "connect").click()


def test_a_wrong_key_is_refused(driver, running):
    connect(driver, running.url, "wrong")
    wait_for(driver, lambda d: "refused (401)" in text(d, "status"), "a wrong key was not refused")
    set_value(driver, "prompt", PROMPT)
    driver.find_element("id", "send").click()
    wait_for(driver, lambda d: "401" in text(d, "error"), "sending with a wrong key showed no 401")
    assert tokens(driver, "output") == []


def test_a_prompt_streams_coloured_tokens(driver, running, greedy_text, monkeypatch):
    connect(driver, running.url, KEY)
    wait_for(driver, lambda d: f"connected: {MODEL}" in text(d, "status"), "the right key did not connect")
    assert driver.find_element("id", "speculate").is_selected()
    set_value(driver, "prompt", PROMPT)
    set_value(driver, "max-tokens", MAX_TOKENS)
    set_value(driver, "draft-tokens", 4)
    gate = StepGate(monkeypatch, running.app.state.server.worker.engine)
    with gate.held_from_start():
        driver.find_element("id", "send").click()
        # Prefill, then two rounds: at most 2 x (K + 1) = 10 of the 24 tokens, so the request is still running.
        for _ in range(3):
            gate.advance()
        wait_for(driver, lambda d: tokens(d, "output"), "no token reached the page while the request ran")
        assert 0 < len(tokens(driver, "output")) <= 10
        assert not driver.find_element("id", "send").is_enabled()  # still streaming
    wait_for(driver, lambda d: d.find_element("id", "send").is_enabled(), "the stream did not finish")
    assert text(driver, "error") == ""
    shown = tokens(driver, "output")
    assert len(shown) == MAX_TOKENS and "".join(t["text"] for t in shown) == greedy_text
    origins = {t["origin"] for t in shown}
    assert "accepted" in origins and origins <= {"accepted", "recovered", "bonus", "target"}
    colours = {t["origin"]: t["colour"] for t in shown}
    assert colours["accepted"] == ACCEPTED_RGB and len(set(colours.values())) == len(colours)
    figures = text(driver, "figures")
    assert f"tokens\n{MAX_TOKENS}" in figures and "mean accepted length" in figures
    assert len(driver.find_elements("css selector", "#by-position div")) == 4  # one bar per draft position


def test_on_off_comparison_is_identical_under_greedy(driver, running, greedy_text):
    connect(driver, running.url, KEY)
    wait_for(driver, lambda d: f"connected: {MODEL}" in text(d, "status"), "the right key did not connect")
    set_value(driver, "prompt", PROMPT)
    set_value(driver, "max-tokens", MAX_TOKENS)
    driver.find_element("id", "compare").click()
    wait_for(driver, lambda d: d.find_element("id", "compare-verdict").get_attribute("class") in ("same", "differ"),
             "the comparison never finished")
    assert text(driver, "error") == ""
    verdict = driver.find_element("id", "compare-verdict")
    assert verdict.get_attribute("class") == "same" and "identical" in verdict.text
    on, off = tokens(driver, "compare-on"), tokens(driver, "compare-off")
    assert "".join(t["text"] for t in on) == "".join(t["text"] for t in off) == greedy_text
    assert "accepted" in {t["origin"] for t in on} and {t["origin"] for t in off} == {"target"}


def test_logprobs_on_hover_and_structured_output(driver, running):
    """Logprobs asked: each token's hover text has its logprob and alternatives; a choice constrains the answer."""
    connect(driver, running.url, KEY)
    wait_for(driver, lambda d: f"connected: {MODEL}" in text(d, "status"), "the right key did not connect")
    set_value(driver, "prompt", PROMPT)
    set_value(driver, "top-logprobs", 2)
    driver.find_element("id", "logprobs").click()
    driver.find_element("css selector", "#structured option[value=choice]").click()
    set_value(driver, "structured-arg", "the mat\nthe log")
    driver.find_element("id", "send").click()  # disables Send until the stream ends (the click runs the handler)
    wait_for(driver, lambda d: d.find_element("id", "send").is_enabled(), "the stream did not finish")
    assert text(driver, "error") == ""
    shown = tokens(driver, "output")
    assert "".join(t["text"] for t in shown) in ("the mat", "the log")
    titles = driver.execute_script("return [...document.querySelectorAll('#output .tok')].map((s) => s.title)")
    assert len(titles) == len(shown) and all("logprob -" in t or "logprob 0" in t for t in titles)
    assert all(len(t.splitlines()) == 2 + 1 + 2 for t in titles)  # origin, round, logprob, two alternatives
