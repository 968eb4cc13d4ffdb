"""How many rounds does the prediction drafter need on the code-edit workload, and what would it gain at a given
verify-cost curve, whatever the machine's speed?

Greedy answers do not depend on the drafter, so the target's answers are computed once (`--dump`, the real engine:
prompt lookup speculates, the answers equal the target alone's) and every alignment or K choice is replayed against
them: a round's accepted tokens are the common prefix of its draft and the answer, it commits one more. K comes from
the engine's own `DraftPolicies` (adaptive, fed the modelled costs) or is fixed (`--k 8`). The modelled speedup is
committed tokens over the summed verify costs, relative to one plain step (`--curve`: a verify pass's cost by width,
relative to width 1; the default was measured on the 1.5B coder target, 2 shared cores, 2026-11-28). `--unrelated`
gives each answer the next prompt's code as its prediction (the goal: >= 0.95x). `--show ID` prints one prompt's
rounds: the draft, the tokens accepted, what was committed.

    PYTHONPATH=src python recipes/prediction_replay.py --dump answers.json --functions 6 --files 2 --max-new-tokens 384
    PYTHONPATH=src python recipes/prediction_replay.py answers.json [--k 8] [--unrelated] [--show edit-file-00]
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import pairwise
from pathlib import Path

import torch

from verispec.config import SpeculativeConfig
from verispec.drafters.base import DraftBatch, DraftRow
from verispec.drafters.prediction import PredictionDrafter
from verispec.engine.policy import DraftPolicies

CURVE = {1: 1.0, 2: 1.02, 3: 1.12, 4: 1.34, 9: 2.3, 65: 31.6}  # measured by the engine's policy, see the docstring


def dump(out: Path, functions: int, files: int, max_new_tokens: int) -> None:
    from verispec.bench.code_edit import build_edit_prompts
    from verispec.config import SamplingParams
    from verispec.generator import SpeculativeGenerator

    gen = SpeculativeGenerator.from_pretrained("qwen2.5-coder-1.5b-instruct", "ngram", max_len=4096,
                                               spec=SpeculativeConfig(adaptive=True))
    rows = []
    for prompt in build_edit_prompts(functions, files, 0):
        ids, prediction = gen.encode(prompt.text, chat=True), gen.encode_prediction(prompt.original)
        answer = gen.engine.generate(ids, SamplingParams(max_new_tokens=max_new_tokens), prediction=prediction)
        rows.append({"id": prompt.question_id, "source": prompt.source, "prompt": [int(t) for t in ids],
                     "prediction": prediction, "answer": answer.token_ids})
        print(prompt.question_id, prompt.source, len(answer.token_ids), flush=True)
    out.write_text(json.dumps(rows))


def cost(width: int, curve: dict[int, float]) -> float:
    """The curve's cost of a verify pass of `width`, linear between its points."""
    points = sorted(curve.items())
    for (w0, c0), (w1, c1) in pairwise(points):
        if w0 <= width <= w1:
            return c0 + (c1 - c0) * (width - w0) / (w1 - w0)
    return points[-1][1]


def replay(row: dict, policies: DraftPolicies, k: int | None, curve: dict[int, float], show=None) -> dict:
    drafter = PredictionDrafter(row["prediction"])
    drafter.begin(0, torch.tensor(row["prompt"]))
    spec, answer, context = SpeculativeConfig(adaptive=True), row["answer"], list(row["prompt"])
    done = rounds = proposed = accepted = 0
    seconds = 0.0
    while done < len(answer):
        policy = policies.get(spec, drafter.route(None)) if k is None else None
        want = policy.choose(1, 1) if policy is not None else k
        draft = []
        if want and drafter.can_propose(None):
            row_ = DraftRow(torch.tensor(context), want, 0, None)
            draft = drafter.propose(DraftBatch([row_], None))[0].token_ids.tolist()
        n = 0
        while n < len(draft) and done + n < len(answer) and draft[n] == answer[done + n]:
            n += 1
        committed = answer[done : done + n + 1]
        seconds += cost(len(draft) + 1, curve)
        if policy is not None:
            policy.record_step([(len(draft), n)] if draft else [], 1e-6, len(draft), cost(len(draft) + 1, curve),
                               len(draft) + 1)
        if show is not None:
            print(f"round {rounds:3d} K={want:2d} pos={drafter.pos} draft={show.decode(draft)!r:.70} accepted={n} "
                  f"committed={show.decode(committed)!r}")
        drafter.observe_tokens(0, committed)
        context += committed
        done, rounds, proposed, accepted = done + len(committed), rounds + 1, proposed + len(draft), accepted + n
    return {"tokens": done, "rounds": rounds, "tokens_per_round": round(done / rounds, 2), "proposed": proposed,
            "accepted": accepted, "modelled_speedup": round(done / seconds, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("answers", type=Path)
    parser.add_argument("--dump", action="store_true", help="compute the answers into ANSWERS (the real pair)")
    parser.add_argument("--functions", type=int, default=6)
    parser.add_argument("--files", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--k", type=int, default=None, help="a fixed K (default: the adaptive policies)")
    parser.add_argument("--unrelated", action="store_true", help="the next prompt's code as each prediction")
    parser.add_argument("--curve", type=json.loads, default=None, help='verify cost by width, e.g. {"1":1,"9":2.3}')
    parser.add_argument("--show", default=None, help="print this prompt's rounds")
    args = parser.parse_args(argv)
    if args.dump:
        dump(args.answers, args.functions, args.files, args.max_new_tokens)
        return 0
    rows = json.loads(args.answers.read_text())
    if args.unrelated:
        rows = [dict(row, prediction=rows[(i + 1) % len(rows)]["prediction"]) for i, row in enumerate(rows)]
    curve = {int(w): float(c) for w, c in args.curve.items()} if args.curve else CURVE
    tokenizer = None
    if args.show:
        from verispec.runtime.model.loading import load_tokenizer
        tokenizer = load_tokenizer("qwen2.5-coder-1.5b-instruct")
    policies, totals = DraftPolicies(), {"tokens": 0, "rounds": 0, "proposed": 0, "accepted": 0, "cost": 0.0}
    for row in rows:
        result = replay(row, policies, args.k, curve, tokenizer if row["id"] == args.show else None)
        print(row["id"], row["source"], result)
        for key in ("tokens", "rounds", "proposed", "accepted"):
            totals[key] += result[key]
        totals["cost"] += result["tokens"] / result["modelled_speedup"]
    print(f"all: tokens per round {totals['tokens'] / totals['rounds']:.2f}, accepted / proposed "
          f"{totals['accepted']} / {totals['proposed']}, modelled speedup {totals['tokens'] / totals['cost']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
