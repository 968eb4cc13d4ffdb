"""`verispec pairs`: the registry of target -> draft pairs that `--draft-model auto` uses (see verispec.drafters.auto)."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    p = sub.add_parser("pairs", help="list the known target -> draft pairs (--draft-model auto)", description=__doc__)
    p.add_argument("--json", action="store_true", help="print the registry as JSON")
    p.add_argument("--model", default=None, metavar="TARGET",
                   help="also show what --draft-model auto picks for this target (name, hub id or folder)")
    p.add_argument("--search-dir", action="append", default=[], metavar="DIR",
                   help="extra folder of local models for tokenizer-family matching (repeatable)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..drafters.auto import registry_rows, select_draft

    rows = registry_rows()
    choice = select_draft(args.model, search_dirs=args.search_dir) if args.model else None
    if args.json:
        print(json.dumps({"pairs": rows, "selection": choice.to_dict() if choice else None}))
        return 0
    header = ("target", "draft", "K", "local", "note")
    table = [header] + [
        (r["target"], r["draft"] + (f" | {r['instruct_draft']}" if r["instruct_draft"] else ""),
         str(r["num_draft_tokens"]), ", ".join(r["available"]) or "no", r["note"])
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    print("\nOther targets: a local draft sharing the target's tokenizer, else the n-gram drafter.")
    if choice:
        print(f"\n{args.model}: draft {choice.draft}, K {choice.num_draft_tokens} ({choice.source}: {choice.reason})")
    return 0
