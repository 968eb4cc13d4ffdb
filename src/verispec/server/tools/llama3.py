"""Llama 3.1 / 3.2 / 3.3 JSON tool calling: the chat template renders the tools (in the first user message, or the
system message) and asks for one call as a JSON object, the whole answer:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

One call per answer (these templates describe no parallel calls); results come back as `ipython` messages, which
the templates make of `tool` messages. The built-in tools (`<|python_tag|>`, brave_search, ...) are not used.
"""

from __future__ import annotations

from .base import ToolFormat
from .syntax import CallSyntax

SYNTAX = CallSyntax(trigger="{", open="", call_open='{"name": "', args_open='", "parameters": ', call_close="}",
                    separator="", close="", text_first=False)


class Llama3Format(ToolFormat):
    name = "llama3_json"
    syntax = SYNTAX
    json_style = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    single_call = True
    in_template = True

    @staticmethod
    def matches(template: str, rendered: str) -> bool:
        return "<|start_header_id|>" in rendered and '"parameters"' in rendered

