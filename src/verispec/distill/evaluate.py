"""Offline, exact measure of a draft under greedy verification: mean accepted length and per-position agreement.

Under greedy verification a round starting at continuation position `i` accepts the longest run of draft tokens
equal to the target's greedy tokens `y[i:i+K]`, then commits one more token (the recovered or bonus token, which
is the target's own `y` there). A draft's k-th token in a round is conditioned on its earlier ones, which equal
the true prefix whenever they were accepted, so one teacher-forced draft forward over `prompt + y` gives, at
every position, exactly the token it would have proposed: `match[t] = (draft argmax after y[:t] == y[t])`.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm


@dataclass
class RoundStats:
    """Counts over rounds of greedy speculative decoding with K draft tokens per round."""

    k: int
    rounds: int = 0
    committed: int = 0  # committed tokens: accepted + one recovered or bonus token per round
    reached: list[int] = field(default_factory=list)  # reached[j]: rounds that verified a (j+1)-th draft token
    accepted: list[int] = field(default_factory=list)  # accepted[j]: rounds whose (j+1)-th draft token was accepted

    def __post_init__(self):
        self.reached = self.reached or [0] * self.k
        self.accepted = self.accepted or [0] * self.k

    @property
    def mean_accepted_length(self) -> float:
        """Committed tokens per round (bonus included; 1.0 means the draft never helped)."""
        return self.committed / max(1, self.rounds)

    @property
    def acceptance_rate(self) -> float:
        """Accepted tokens / draft tokens verified."""
        return sum(self.accepted) / max(1, sum(self.reached))

    @property
    def position_agreement(self) -> list[float]:
        """P(draft token j accepted | draft tokens 1..j-1 accepted), for j = 1..K."""
        return [a / r if r else float("nan") for a, r in zip(self.accepted, self.reached)]

    def merge(self, other: "RoundStats") -> None:
        assert other.k == self.k
        self.rounds += other.rounds
        self.committed += other.committed
        self.reached = [a + b for a, b in zip(self.reached, other.reached)]
        self.accepted = [a + b for a, b in zip(self.accepted, other.accepted)]


def greedy_rounds(match: list[bool] | torch.Tensor, k: int) -> RoundStats:
    """Walk a continuation of length T in rounds of K draft tokens, given `match[t]` for every position t.

    Each round commits its accepted draft tokens plus one target token; a final round that runs past the end of
    the continuation commits only the tokens that remain.
    """
    if isinstance(match, torch.Tensor):
        match = match.tolist()
    stats = RoundStats(k=k)
    total, i = len(match), 0
    while i < total:
        accepted = 0
        for j in range(min(k, total - i)):
            stats.reached[j] += 1
            if not match[i + j]:
                break
            stats.accepted[j] += 1
            accepted += 1
        committed = min(accepted + 1, total - i)
        stats.rounds += 1
        stats.committed += committed
        i += committed
    return stats


@torch.inference_mode()
def draft_matches(draft, prompt_ids: list[int], continuation: list[int]) -> torch.Tensor:
    """[T] bool: whether the draft's argmax after `prompt + continuation[:t]` equals `continuation[t]`."""
    ids = torch.tensor([prompt_ids + continuation])  # [1, P + T]
    logits = draft(input_ids=ids, logits_to_keep=len(continuation) + 1).logits[0, :-1]  # [T, vocab]
    return logits.argmax(-1) == torch.tensor(continuation)


@torch.inference_mode()
def reference_continuations(target, tokenizer, prompts: list[str], max_new_tokens: int,
                            cache_dir: Path | None = None, cache_key: str = "", progress: bool = True):
    """The target's greedy continuations (unbatched, in the target's dtype) of chat-formatted prompts.

    Returns `[(prompt_ids, continuation_ids)]`; cached on disk under `cache_dir` keyed by `cache_key`, the
    prompts, and `max_new_tokens` (the target is expensive; the draft is cheap to re-evaluate).
    """
    path = None
    if cache_dir is not None:
        digest = hashlib.sha256(json.dumps([cache_key, prompts, max_new_tokens]).encode()).hexdigest()[:16]
        path = Path(cache_dir) / f"reference-{digest}.json"
        if path.is_file():
            return [tuple(pair) for pair in json.loads(path.read_text())]
    eos = _eos_ids(target, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    out = []
    for text in tqdm(prompts, desc="reference", unit="prompt", disable=not progress, dynamic_ncols=True):
        prompt_ids = chat_ids(tokenizer, text)
        ids = torch.tensor([prompt_ids])  # [1, P]
        generated = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, eos_token_id=sorted(eos), pad_token_id=pad_id)
        out.append((prompt_ids, generated[0, len(prompt_ids):].tolist()))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out))
        tmp.replace(path)
    return out


def evaluate_draft(draft, references, categories: list[str], k: int = 4) -> dict[str, RoundStats]:
    """RoundStats per category and `"overall"`, plus teacher-forced top-1 agreement under key `"_agreement"`."""
    per: dict[str, RoundStats] = defaultdict(lambda: RoundStats(k=k))
    overall = RoundStats(k=k)
    agree = total = 0
    for (prompt_ids, continuation), category in zip(references, categories):
        if not continuation:
            continue
        match = draft_matches(draft, list(prompt_ids), list(continuation))
        stats = greedy_rounds(match, k)
        per[category].merge(stats)
        overall.merge(stats)
        agree += int(match.sum())
        total += len(match)
    result = dict(sorted(per.items()))
    result["overall"] = overall
    result["_agreement"] = agree / max(1, total)
    return result


def format_report(result: dict, draft_ms_per_token: float | None = None) -> str:
    """A small table: mean accepted length and per-position agreement, per category and overall."""
    overall: RoundStats = result["overall"]
    lines = [f"greedy, K={overall.k}: mean accepted length {overall.mean_accepted_length:.3f} "
             f"(acceptance rate {overall.acceptance_rate:.3f}, teacher-forced agreement {result['_agreement']:.3f})"]
    if draft_ms_per_token is not None:
        lines.append(f"draft decode cost: {draft_ms_per_token:.2f} ms/token")
    lines.append(f"{'category':<16}{'rounds':>8}{'mean acc len':>14}  per-position agreement")
    for name, stats in result.items():
        if name.startswith("_"):
            continue
        positions = " ".join(f"{a:.2f}" for a in stats.position_agreement)
        lines.append(f"{name:<16}{stats.rounds:>8}{stats.mean_accepted_length:>14.3f}  {positions}")
    return "\n".join(lines)


def result_to_dict(result: dict) -> dict:
    """JSON-ready form of `evaluate_draft`'s result."""
    out = {"teacher_forced_agreement": result["_agreement"]}
    for name, stats in result.items():
        if not name.startswith("_"):
            out[name] = {"rounds": stats.rounds, "committed_tokens": stats.committed,
                         "mean_accepted_length": stats.mean_accepted_length,
                         "acceptance_rate": stats.acceptance_rate, "position_agreement": stats.position_agreement}
    return out


def load_eval_prompts(path: Path, n: int) -> list[tuple[str, str]]:
    """`n` first turns spread evenly over a Spec-Bench style JSONL file (`category`, `turns`): `[(category, text)]`."""
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if n >= len(rows):
        chosen = rows
    else:
        chosen = [rows[(i * len(rows)) // n] for i in range(n)]
    return [(row.get("category", "all"), row["turns"][0]) for row in chosen]


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a one-turn chat with the generation prompt appended (plain text if there is no template)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids)
    return tokenizer(text)["input_ids"]


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if configured is not None:
        ids.update(configured if isinstance(configured, list) else [configured])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@torch.inference_mode()
def decode_cost_ms(draft, context: int = 256, tokens: int = 64) -> float:
    """Milliseconds per single-token decode step of the draft with a KV cache (batch 1, after `context` tokens)."""
    import time

    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.randint(0, draft.config.vocab_size, (1, context))
    out = draft(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(4):  # warm-up
        nxt = draft(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(tokens):
        nxt = draft(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    return (time.perf_counter() - start) * 1000 / tokens
