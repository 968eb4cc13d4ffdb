"""The generic format, for models whose chat template does not render tools (the embedded SmolLM2).

The tools go into the system prompt, one JSON line per function, with the answer's format. The answer is either
plain text (not starting with `{`) or only this JSON object, compact, keys in this order:

    {"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}

In the history, an assistant's calls are written back in that form (after its content, if any), and a run of
tool results becomes one user message, `Tool results:` and a JSON line per result:
`{"name":"get_weather","content":"..."}`. (llama.cpp's generic format wraps plain answers in JSON too; here
they stay text, so they stream as they are generated.)
"""

from __future__ import annotations

import json

from .base import ToolFormat
from .spec import ToolRequest
from .syntax import CallSyntax

SYNTAX = CallSyntax(trigger="{", open='{"tool_calls":[', call_open='{"name":"', args_open='","arguments":',
                    call_close="}", separator=",", close="]}", text_first=False)
RESULTS = "Tool results:"


def _compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def instructions(request: ToolRequest) -> str:
    """The system prompt's tool section."""
    lines = ["# Tools", "", "You can call these functions (one per line: name, description, JSON schema of its "
             "arguments):"]
    for tool in request.tools:
        lines.append(_compact({"name": tool.name, "description": tool.description, "parameters": tool.parameters}))
    shape = '{"tool_calls":[{"name":"<function name>","arguments":{<its arguments>}}]}'
    many = "one call or more" if request.parallel else "exactly one call"
    lines.append("")
    if request.mode == "auto":
        lines.append(f"To call functions, answer with only this JSON object ({many}):")
        lines.append(shape)
        lines.append("Otherwise answer in plain text.")
    elif request.mode == "required":
        lines.append(f"Call functions now: answer with only this JSON object ({many}):")
        lines.append(shape)
    else:
        lines.append(f"Call the function {request.name} now: answer with only this JSON object ({many}):")
        lines.append(shape)
    lines.append(f'Results come back in a user message that starts with "{RESULTS}".')
    return "\n".join(lines)


class GenericFormat(ToolFormat):
    name = "generic"
    syntax = SYNTAX

    def prompt(self, messages: list[dict], request: ToolRequest | None) -> tuple[list[dict], None]:
        out: list[dict] = []
        for m in messages:
            if m.get("tool_calls"):
                text = self.calls_text(m["tool_calls"])
                out.append({"role": "assistant", "content": f"{m['content']}\n{text}" if m["content"] else text})
            elif m["role"] == "tool":
                line = _compact({"name": m["name"], "content": m["content"]})
                if out and out[-1]["role"] == "user" and out[-1]["content"].startswith(RESULTS):
                    out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n{line}"}
                else:
                    out.append({"role": "user", "content": f"{RESULTS}\n{line}"})
            else:
                out.append({"role": m["role"], "content": m["content"]})
        if request is not None and request.calls:
            section = instructions(request)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{section}"}
            else:
                out.insert(0, {"role": "system", "content": section})
        return out, None
