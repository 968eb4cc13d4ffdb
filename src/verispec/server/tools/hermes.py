"""Hermes-style calls, as Qwen2.5 (and NousResearch's Hermes models) write them: the chat template renders the
tools (its own `<tools>` section), and each call is a JSON object between `<tool_call>` lines, after any content:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Arguments are written as Python's json.dumps writes them (", " and ": "), as these models were trained to. Where the
tokenizer holds `<tool_call>` and `</tool_call>` as special tokens (Qwen2.5-Coder), the grammar writes them by
token id and the server puts their text back into the output it reads calls from (tools/markers.py).
"""

from __future__ import annotations

from .base import ToolFormat
from .syntax import CallSyntax

SYNTAX = CallSyntax(trigger="<tool_call>", open="<tool_call>\n", call_open='{"name": "', args_open='", "arguments": ',
                    call_close="}\n</tool_call>", separator="\n<tool_call>\n", close="", text_first=True,
                    markers=("<tool_call>", "</tool_call>"))


class HermesFormat(ToolFormat):
    name = "hermes"
    syntax = SYNTAX
    json_style = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    in_template = True

    @staticmethod
    def matches(template: str, rendered: str) -> bool:
        return "<tool_call>" in template or "<tool_call>" in rendered

