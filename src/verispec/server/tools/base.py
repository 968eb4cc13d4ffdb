"""`ToolFormat`: how one family of models is shown tools and writes calls; one small subclass per format.

A format answers three questions:
- `prompt(messages, request)`: the messages (and `tools=` for the chat template, when the template renders them)
  that show the model its tools and the history's calls and results;
- `grammar(request)`: the Lark grammar of its answer (tools/lark.py, from its `syntax` and JSON style);
- `syntax`: how to read the calls back out of the text (tools/syntax.py).

History messages arrive normalised by the app (`normalise`): an assistant message's `tool_calls` as
`{"id", "name", "arguments"}`, a tool message with `tool_call_id` and the `name` of the call it answers. A call's
arguments are an object, or the string as sent when it is not a JSON object (OpenAI accepts any string: an agent
loop sends back a call cut by max_tokens as it got it). An assistant message holding such a call is written out
as the model would have written it (`calls_text`, the string in place of the arguments) instead of through the
template, whose `tojson` would quote the string.
"""

from __future__ import annotations

from dataclasses import dataclass
import json

from .lark import tool_grammar
from .spec import ToolRequest
from .syntax import CallSyntax


class ToolFormat:
    name: str = ""
    syntax: CallSyntax
    json_style: dict = {"whitespace_flexible": False}  # llguidance x-guidance options for the arguments
    single_call: bool = False  # the format writes one call per answer (parallel_tool_calls cannot add more)
    in_template: bool = False  # the chat template renders the tools (passed as apply_chat_template's tools=)

    def __init__(self, special_tokens: dict[str, int] | None = None) -> None:
        self.special_tokens = special_tokens or {}  # the syntax's markers that are special tokens: text -> token id

    def prompt(self, messages: list[dict], request: ToolRequest | None) -> tuple[list[dict], list[dict] | None]:
        """-> (messages for the chat template, the template's `tools` or None). By default the template renders
        the tools itself (`in_template` formats); a format that writes them into the prompt overrides this."""
        tools = [t.as_openai() for t in request.tools] if request is not None and request.calls else None
        return self.hf_messages(messages), tools

    def grammar(self, request: ToolRequest) -> str:
        return tool_grammar(request, self.syntax, self.json_style, self.single_call, self.special_tokens)

    def calls_text(self, calls: list[dict]) -> str:
        """Calls ({"name", "arguments": dict or the string as sent}) as this format writes them."""
        separators = (self.json_style.get("item_separator", ","), self.json_style.get("key_separator", ":"))

        def arguments(value: dict | str) -> str:
            return value if isinstance(value, str) else json.dumps(value, separators=separators, ensure_ascii=False)

        s = self.syntax
        return s.open + s.separator.join(s.call_open + c["name"] + s.args_open + arguments(c["arguments"]) +
                                         s.call_close for c in calls) + s.close

    def hf_messages(self, messages: list[dict]) -> list[dict]:
        """The history as Hugging Face chat templates read it: calls with `function.arguments` as an object, results
        as `tool` messages with the call's id and name; a message with a call whose arguments are not an object as
        its text (`calls_text`)."""
        out = []
        for m in messages:
            if any(isinstance(c["arguments"], str) for c in m.get("tool_calls") or ()):
                text = self.calls_text(m["tool_calls"])
                out.append({"role": "assistant", "content": f"{m['content']}\n{text}" if m["content"] else text})
            elif m.get("tool_calls"):
                calls = [{"id": c["id"], "type": "function",
                          "function": {"name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"]]
                out.append({"role": "assistant", "content": m["content"], "tool_calls": calls})
            elif m["role"] == "tool":
                out.append({"role": "tool", "content": m["content"], "tool_call_id": m["tool_call_id"],
                            "name": m["name"]})
            else:
                out.append({"role": m["role"], "content": m["content"]})
        return out


def normalise(messages: list[dict]) -> list[dict]:
    """Give each tool message the name of the call it answers (found by `tool_call_id` among the earlier calls;
    the message's own `name`, or "" when neither says)."""
    names: dict[str, str] = {}
    out = []
    for m in messages:
        for call in m.get("tool_calls") or ():
            names[call["id"]] = call["name"]
        if m["role"] == "tool":
            m = {**m, "name": names.get(m.get("tool_call_id") or "", m.get("name") or "")}
        out.append(m)
    return out


@dataclass(frozen=True)
class ToolCalling:
    """A request whose answer may be calls: what it asked (mode auto, required or named) in the served format."""

    request: ToolRequest
    format: ToolFormat

    def grammar(self) -> str:
        return self.format.grammar(self.request)

    @property
    def syntax(self) -> CallSyntax:
        return self.format.syntax
