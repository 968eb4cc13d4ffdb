"""Suffix decoding replayed offline on the target's greedy outputs of the repetitive workload (docs/bench.md,
"Suffix decoding's ceiling on the repetitive workload"): no model in the loop, so every setting is compared on the
same text in seconds.

    PYTHONPATH=src python scripts/suffix_replay.py --generate OUT.json   # the target's outputs (once, minutes)
    PYTHONPATH=src python scripts/suffix_replay.py OUT.json [--curve bf16|gguf|SLOPE] [--k 8] [--min-prob 0.1]

Each round drafts as `SuffixDrafter` does (its request's own trie and the cache of the earlier prompts' texts, the
proposal with the higher score), accepts the draft's longest prefix equal to the output ahead, commits one more
token, and costs the verify pass of its width (a measured curve, relative to width 1). It prints the predicted
speedup, the mean accepted length and per category, then the accepted tokens a round of three choosers on the same
rounds: the latest longest match, the best of all earlier occurrences that continue the match, and the oracle (the
longest prefix of the text ahead that occurred anywhere earlier).
"""

from __future__ import annotations

import argparse
import json

from verispec.drafters.suffix import SPEC_FACTOR
from verispec.drafters.suffix_tree import SuffixCache, SuffixTrie

# Verify cost by width, relative to width 1 (docs/bench.md: CPU time at 1 thread, 140-token context, this CPU).
CURVES = {"bf16": {1: 1.0, 2: 1.08, 3: 1.18, 5: 1.26, 9: 1.73, 13: 2.30, 17: 2.84, 25: 3.96, 33: 5.01},
          "gguf": {1: 1.0, 2: 1.11, 3: 1.31, 5: 1.63, 9: 2.65, 13: 3.51, 17: 4.76, 25: 5.75, 33: 7.32}}


def cost_of(curve: str):
    if curve not in CURVES:
        slope = float(curve)
        return lambda width: 1.0 + slope * (width - 1)
    points = sorted(CURVES[curve].items())

    def cost(width: int) -> float:
        for (w0, c0), (w1, c1) in zip(points, points[1:]):
            if w0 <= width <= w1:
                return c0 + (c1 - c0) * (width - w0) / (w1 - w0)
        return points[-1][1]
    return cost


def generate(path: str, max_new_tokens: int = 256) -> None:
    from verispec.bench.prompts import encode_prompt, load_prompts, repetitive_prompts_file
    from verispec.config import SamplingParams
    from verispec.engine import SpeculativeEngine
    from verispec.runtime.model.loading import DEFAULT_TARGET, load_model, load_tokenizer

    target, tokenizer = load_model(DEFAULT_TARGET), load_tokenizer(DEFAULT_TARGET)
    engine = SpeculativeEngine(target, tokenizer, None, max_len=1024)
    rows = []
    for prompt in load_prompts(repetitive_prompts_file()):
        ids = encode_prompt(tokenizer, prompt.text)
        out = engine.generate(ids, SamplingParams(max_new_tokens=max_new_tokens), use_drafter=False).token_ids
        rows.append({"id": prompt.question_id, "cat": prompt.category, "prompt": ids, "out": out})
    with open(path, "w") as f:
        json.dump(rows, f)


def replay(rows: list[dict], cost, k: int, min_prob: float, max_match: int = 8, max_new: int = 128) -> None:
    cache, history, tokens, seconds, rounds, per = SuffixCache(65536), [-1], 0, 0.0, 0, {}  # history: earlier texts
    choosers = {"latest longest match": 0, "best continuing occurrence": 0, "oracle": 0}
    for row in rows:
        prompt, out = row["prompt"], row["out"][:max_new]
        trie, context, t, spent = SuffixTrie(16), list(prompt), 0, 0.0
        trie.extend(prompt)
        while t < len(out):
            own = trie.draft(context, k, min_prob, max_match, 0, SPEC_FACTOR)
            shared = cache.draft("", context, k, min_prob, max_match, 0, SPEC_FACTOR)
            draft = (own if own.score >= shared.score else shared).tokens
            accepted = _common(draft, out[t:])
            for name, value in _choosers(history + context, out[t:], k).items():
                choosers[name] += value
            new = out[t : t + min(accepted + 1, len(out) - t)]
            context += new
            trie.extend(new)
            t += len(new)
            spent += cost(len(draft) + 1)
            rounds += 1
        cache.add("", prompt + out)
        history += prompt + out + [-1]
        tokens += len(out)
        seconds += spent
        done = per.setdefault(row["cat"], [0, 0.0])
        done[0], done[1] = done[0] + len(out), done[1] + spent
    print(f"K {k} min_prob {min_prob}: predicted {tokens / seconds:.2f}x, mean accepted length {tokens / rounds:.2f}, "
          + ", ".join(f"{cat} {n / s:.2f}x" for cat, (n, s) in per.items()))
    print("accepted tokens a round, same rounds: " + ", ".join(f"{n} {v / rounds:.2f}" for n, v in choosers.items()))


def _common(draft: list[int], ahead: list[int]) -> int:
    n = 0
    while n < len(draft) and n < len(ahead) and draft[n] == ahead[n]:
        n += 1
    return n


def _choosers(text: list[int], ahead: list[int], k: int) -> dict[str, int]:
    """Accepted tokens of three choosers of an earlier occurrence to copy from (module docstring)."""
    last, n = text[-1], len(text)
    matches = []  # (matched length, continuation start), longest then latest first
    for i in range(n - 1):
        if text[i] == last:
            size = 1
            while size < 64 and i - size >= 0 and text[i - size] == text[n - 1 - size]:
                size += 1
            matches.append((size, i + 1))
    matches.sort(key=lambda m: (-m[0], -m[1]))
    copied = [_common(text[start : start + k], ahead) for _, start in matches]
    oracle = max((_common(text[i : i + k], ahead) for i in range(n) if ahead and text[i] == ahead[0]), default=0)
    return {"latest longest match": copied[0] if copied else 0, "best continuing occurrence": max(copied, default=0),
            "oracle": oracle}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outputs", help="the target's outputs (JSON, from --generate)")
    parser.add_argument("--generate", action="store_true", help="write the target's greedy outputs to OUTPUTS")
    parser.add_argument("--curve", default="bf16", help="bf16, gguf, or a linear slope per extra position")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--min-prob", type=float, default=0.1)
    args = parser.parse_args()
    if args.generate:
        generate(args.outputs)
        return
    with open(args.outputs) as f:
        replay(json.load(f), cost_of(args.curve), args.k, args.min_prob)


if __name__ == "__main__":
    main()
