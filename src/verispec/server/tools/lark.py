"""The grammar of a tool-calling answer, in llguidance's Lark: what `tool_choice` allows, in a format's syntax.

Each callable function is one alternative whose literal part is the format's text up to the arguments with the
name written in (`{"name":"get_weather","arguments":`), and whose arguments are an inline `%json` of the function's
own schema, closed to keys it does not declare (`Tool.arguments_schema`): the output can only name a declared
function and give it arguments valid against its schema. The
modes (`ToolRequest.mode`):

- auto: plain text or calls. Where calls follow content (`text_first`), the text before the trigger is a lazy
  lexeme that ends at the first trigger, and a plain answer may not contain the trigger at all, so every trigger
  the model writes starts a constrained call; elsewhere a plain answer may not start with the trigger's character;
- required / named: the calls at once (a named choice: only that function), no text before them;
- none: no grammar at all (the caller does not ask for one).

`parallel_tool_calls: false` (or a format that writes one call) allows exactly one call.

A marker the tokenizer holds as a special token (`special`: text -> token id, tools/markers.py) is written by id,
`<[id]>`: only that token writes it (its characters spelled one by one are text). Where it is the trigger, text
before the calls is a plain TEXT lexeme, which no special token can continue, and a plain answer still may not
spell the trigger out.
"""

from __future__ import annotations

import json

from .spec import ToolRequest
from .syntax import CallSyntax

_REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~/")
ANY = "(?s:.*)"


def literal(text: str) -> str:
    """A Lark string literal (JSON's string syntax is Lark's)."""
    return json.dumps(text)


def items(text: str, special: dict[str, int]) -> str:
    """`text` as Lark items: string literals, and `<[id]>` for each special marker in it."""
    out, at = [], 0
    while at < len(text):
        found = [(text.find(marker, at), marker) for marker in special if text.find(marker, at) >= 0]
        if not found:
            out.append(literal(text[at:]))
            break
        where, marker = min(found)
        if where > at:
            out.append(literal(text[at:where]))
        out.append(f"<[{special[marker]}]>")
        at = where + len(marker)
    return " ".join(out) if out else literal("")


def regex_literal(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def tool_grammar(request: ToolRequest, syntax: CallSyntax, json_style: dict, single_call: bool = False,
                 special: dict[str, int] | None = None) -> str:
    """The Lark grammar of an answer to `request` (mode auto, required or named). json_style: llguidance's
    x-guidance options for the arguments (whitespace, separators), as the format writes JSON; special: the
    format's markers that are special tokens (text -> token id)."""
    assert request.calls, "tool_choice none asks for no grammar"
    special = special or {}
    lines = []
    for i, tool in enumerate(request.callable):
        head = items(syntax.call_open + tool.name + syntax.args_open, special)
        lines.append(f"call_{i}: {head} args_{i} {items(syntax.call_close, special)}")
        lines.append(f"args_{i}: %json {json.dumps({**tool.arguments_schema, 'x-guidance': json_style})}")
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(request.callable))))
    many = request.parallel and not single_call
    lines.append(f"calls: call ({items(syntax.separator, special)} call)*" if many else "calls: call")
    after = [items(syntax.close, special)] if syntax.close else []
    opening = [items(syntax.open, special)] if syntax.open else []
    if request.mode != "auto":
        return "\n".join([" ".join(["start:", *opening, "calls", *after]), *lines])
    if syntax.text_first:
        trigger = regex_literal(syntax.trigger)
        text = f"TEXT: /{ANY}/ & ~/{ANY}{trigger}{ANY}/"
        if syntax.trigger in special:  # the text before the calls ends where the special token comes
            return "\n".join([f"start: TEXT | {' '.join(['TEXT', *opening, 'calls', *after])}", text, *lines])
        rest = syntax.open[len(syntax.trigger):]
        calls = " ".join(["head", *([literal(rest)] if rest else []), "calls", *after])
        return "\n".join([f"start: TEXT | {calls}", text, f"head[lazy]: /{ANY}{trigger}/", *lines])
    first = regex_literal(syntax.trigger[0])
    return "\n".join([f"start: TEXT | {' '.join([*opening, 'calls', *after])}", f"TEXT: /([^{first}]{ANY})?/",
                      *lines])
