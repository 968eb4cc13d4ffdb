"""The grammar of a tool-calling answer, in llguidance's Lark: what `tool_choice` allows, in a format's syntax.

Each callable function is one alternative whose literal part is the format's text up to the arguments with the
name written in (`{"name":"get_weather","arguments":`), and whose arguments are an inline `%json` of the function's
own schema: the output can only name a declared function and give it arguments valid against its schema. The
modes (`ToolRequest.mode`):

- auto: plain text or calls. Where calls follow content (`text_first`), the text before the trigger is a lazy
  lexeme that ends at the first trigger, and a plain answer may not contain the trigger at all, so every trigger
  the model writes starts a constrained call; elsewhere a plain answer may not start with the trigger's character;
- required / named: the calls at once (a named choice: only that function), no text before them;
- none: no grammar at all (the caller does not ask for one).

`parallel_tool_calls: false` (or a format that writes one call) allows exactly one call.
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


def regex_literal(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def tool_grammar(request: ToolRequest, syntax: CallSyntax, json_style: dict, single_call: bool = False) -> str:
    """The Lark grammar of an answer to `request` (mode auto, required or named). json_style: llguidance's
    x-guidance options for the arguments (whitespace, separators), as the format writes JSON."""
    assert request.calls, "tool_choice none asks for no grammar"
    lines = []
    for i, tool in enumerate(request.callable):
        head = literal(syntax.call_open + tool.name + syntax.args_open)
        lines.append(f"call_{i}: {head} args_{i} {literal(syntax.call_close)}")
        lines.append(f"args_{i}: %json {json.dumps({**tool.parameters, 'x-guidance': json_style})}")
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(request.callable))))
    many = request.parallel and not single_call
    lines.append(f"calls: call ({literal(syntax.separator)} call)*" if many else "calls: call")
    after = [literal(syntax.close)] if syntax.close else []
    if request.mode != "auto":
        opening = [literal(syntax.open)] if syntax.open else []
        return "\n".join([" ".join(["start:", *opening, "calls", *after]), *lines])
    if syntax.text_first:
        rest = syntax.open[len(syntax.trigger):]
        trigger = regex_literal(syntax.trigger)
        calls = " ".join(["head", *([literal(rest)] if rest else []), "calls", *after])
        return "\n".join([f"start: TEXT | {calls}", f"TEXT: /{ANY}/ & ~/{ANY}{trigger}{ANY}/",
                          f"head[lazy]: /{ANY}{trigger}/", *lines])
    opening = [literal(syntax.open)] if syntax.open else []
    first = regex_literal(syntax.trigger[0])
    return "\n".join([f"start: TEXT | {' '.join([*opening, 'calls', *after])}", f"TEXT: /([^{first}]{ANY})?/",
                      *lines])
