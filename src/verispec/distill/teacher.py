"""The target as teacher: batched generation that records, per generated token, the target's top-k log-probs.

Prompts are left-padded into batches of similar length; finished rows leave the batch (the KV cache is compacted
when a quarter of the rows are done), so a long answer never holds a batch of short ones hostage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class Sample:
    """One teacher answer: `response_ids[j]` was generated given `prompt_ids + response_ids[:j]`."""

    category: str
    prompt_ids: torch.Tensor  # [P] int32
    response_ids: torch.Tensor  # [R] int32
    topk_ids: torch.Tensor  # [R, k] int32: the target's k most likely tokens at each generated position
    topk_logprobs: torch.Tensor  # [R, k] float16: their log-probabilities (fp32 softmax of the target logits)


@torch.inference_mode()
def generate_batch(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: set[int],
    pad_id: int,
    topk: int = 8,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Generate for a batch of token-id prompts; returns `(response_ids, topk_ids, topk_logprobs)` per prompt.

    `temperature == 0` is greedy (the answers a draft must match under greedy verification); otherwise tokens are
    sampled from the temperature-scaled distribution (used for documents, not for labels). The response includes
    the end-of-sequence token when one was generated.
    """
    batch = len(prompts)
    device = next(model.parameters()).device  # the batch runs there; the results come back to the CPU
    width = max(len(p) for p in prompts)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)  # [batch, width]
    attention = torch.zeros((batch, width), dtype=torch.long)  # [batch, width]
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention[row, width - len(prompt):] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # [batch, width]
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)

    cache = DynamicCache()
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    rows = torch.arange(batch)  # original row index of each live row (on the CPU)
    next_pos = positions[:, -1] + 1  # [live]
    tokens: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    top_ids: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    top_lp: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    done = torch.zeros(batch, dtype=torch.bool, device=device)  # [live]
    last_compacted = batch
    for _ in range(max_new_tokens):
        logprobs = torch.log_softmax(out.logits[:, -1].float(), dim=-1)  # [live, vocab]
        if temperature > 0:
            probs = torch.softmax(logprobs / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # [live]
        else:
            nxt = logprobs.argmax(-1)  # [live]
        lp, ids = logprobs.topk(topk, dim=-1)  # [live, k]
        step = [t.cpu() for t in (nxt, ids, lp, done)]  # one copy each per step where the model is not on the CPU
        for i, row in enumerate(rows.tolist()):
            if not step[3][i]:
                tokens[row].append(step[0][i])
                top_ids[row].append(step[1][i])
                top_lp[row].append(step[2][i])
        done |= torch.isin(nxt, eos)
        if bool(done.all()):
            break
        live = int((~done).sum())
        if live <= 0.75 * last_compacted:
            keep = (~done).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows = rows[keep.cpu()]
            nxt, next_pos, attention, done = nxt[keep], next_pos[keep], attention[keep], done[keep]
            last_compacted = live
        attention = torch.cat([attention, torch.ones((len(rows), 1), dtype=torch.long, device=device)], dim=1)
        out = model(input_ids=nxt[:, None], attention_mask=attention, position_ids=next_pos[:, None],
                    past_key_values=cache, use_cache=True)
        next_pos = next_pos + 1
    results = []
    for row in range(batch):
        results.append((
            torch.stack(tokens[row]).to(torch.int32),
            torch.stack(top_ids[row]).to(torch.int32),
            torch.stack(top_lp[row]).to(torch.float16),
        ))
    return results


@torch.inference_mode()
def engine_answers(engine, prompts: list[list[int]], max_new_tokens: int, topk: int,
                   on_step=None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Greedy answers through verispec's own batched engine (continuous batching on the native runner: several
    times HF generate's throughput on a CPU); -> `(response_ids, topk_ids, topk_logprobs)` per prompt, as
    `generate_batch`. on_step(tokens committed) is called after every step (progress bars)."""
    from ..config import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, logprobs=topk)
    seqs = [engine.add_request(p, params, use_drafter=False) for p in prompts]
    done = 0
    while engine.has_unfinished:
        engine.step()
        now = sum(len(seq.stopper.token_ids) for seq in seqs)
        if on_step is not None:
            on_step(now - done)
        done = now
    results = []
    for seq in seqs:
        ids = torch.tensor(seq.stopper.token_ids, dtype=torch.int32)
        top_ids = torch.tensor([[t for t, _ in lp.top[:topk]] for lp in seq.logprobs], dtype=torch.int32)
        top_lp = torch.tensor([[v for _, v in lp.top[:topk]] for lp in seq.logprobs], dtype=torch.float16)
        results.append((ids, top_ids.view(len(ids), topk), top_lp.view(len(ids), topk)))
    return results


def length_batches(lengths: list[int], max_batch: int, max_tokens: int) -> list[list[int]]:
    """Group indices by similar length: at most `max_batch` rows and about `max_tokens` padded prompt tokens each."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = max([lengths[j] for j in current] + [lengths[i]])
        if current and (len(current) >= max_batch or width * (len(current) + 1) > max_tokens):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches
