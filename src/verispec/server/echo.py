"""`echo` on /v1/completions: the prompt in front of the completion, and with `logprobs` its tokens' logprobs, what
lm-evaluation-harness's loglikelihood tasks send (`echo=True, logprobs=N`, `max_tokens` 0 or 1).

A prompt token's logprob is log_softmax of the target's logits at the position before it: the raw distribution of
the served model (no temperature or penalties: nothing was sampled there), as OpenAI and vLLM report it. The first
token has none (null), as theirs. The logits come from the target run by a runner of its own (`make_runner` with
the engine's options: the same weights and the same kind of forward), whose one-slot KV cache is sized to the
prompt and dropped afterwards, so the engine's cache and the requests running in it are never touched. It runs on
the worker thread (the one that runs the model), between two steps, in chunks of `CHUNK` tokens so that the logits
held at once stay `CHUNK x vocab`.
"""

from __future__ import annotations

import torch

from ..config import cache_len
from ..engine import TokenLogprob
from ..runtime.runners.select import make_runner
from .responses import TokenText, decode_logprobs

CHUNK = 256  # prompt tokens per forward: logits of [CHUNK, vocab] floats at a time


@torch.inference_mode()
def prompt_logprobs(runner, prompt_ids: list[int], top: int) -> list[TokenLogprob]:
    """-> for each prompt token after the first, its logprob given the tokens before it and the `top` most likely
    tokens there (id, logprob), most likely first. `runner`: an empty slot 0 that holds the prompt (left empty)."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)  # [1, n]
    n = len(prompt_ids)
    out: list[TokenLogprob] = []
    try:
        for start in range(0, n - 1, CHUNK):  # the last token's logits predict no prompt token: not fed
            end = min(start + CHUNK, n - 1)
            logits = runner.forward(ids[:, start:end]).logits[0].float()  # [end - start, vocab]
            logprobs = torch.log_softmax(logits, dim=-1)  # [end - start, vocab]
            targets = ids[0, start + 1:end + 1].to(logprobs.device)  # [end - start]: the token each position predicts
            chosen = logprobs.gather(-1, targets[:, None])[:, 0]  # [end - start]
            if top:
                values, indices = logprobs.topk(top, dim=-1)  # [end - start, top]
            else:
                values = indices = logprobs.new_empty(end - start, 0)
            # One transfer per chunk: the chosen logprobs and the alternatives.
            chosen_l, values_l, indices_l = chosen.tolist(), values.tolist(), indices.tolist()
            for j, token in enumerate(targets.tolist()):
                out.append(TokenLogprob(token, chosen_l[j], list(zip(map(int, indices_l[j]), values_l[j]))))
    finally:
        runner.reset()
    return out


def echo_tokens(served, prompt_ids: list[int], top: int) -> list[TokenText]:
    """The prompt's tokens as a completion's logprobs list them: the first with logprob null, then each with its
    logprob and `top` alternatives, decoded (on the worker thread, which runs the model)."""
    runner = make_runner(served.target, cache_len(len(prompt_ids)), 1, served.engine.runner_options)
    scored = prompt_logprobs(runner, prompt_ids, top)
    first = TokenText(served.tokenizer.decode([prompt_ids[0]]), None, None)
    return [first, *decode_logprobs(scored, served.tokenizer)]


def echo_text(served, prompt: str | list[int], prompt_ids: list[int]) -> str:
    """The text echoed: the prompt as sent, or its token ids decoded."""
    return prompt if isinstance(prompt, str) else served.tokenizer.decode(prompt_ids)
