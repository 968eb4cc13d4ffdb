"""Tool calling: the OpenAI `tools` surface on top of structured output.

| module | job |
|---|---|
| `spec.py` | `ToolRequest`: a request's tools, `tool_choice`, `parallel_tool_calls`, checked (400s naming the field) |
| `base.py` | `ToolFormat`: prompt (messages and template tools), grammar, syntax; the history normalised |
| `generic.py`, `hermes.py`, `llama3.py` | the formats: tools in the system prompt with a JSON answer; Qwen2.5 / Hermes `<tool_call>`; Llama 3 JSON |
| `select.py` | `detect_format`: the format a chat template calls for |
| `lark.py` | the answer's grammar per tool_choice (llguidance Lark with a `%json` schema per function) |
| `syntax.py` | reading calls back out of the text, whole (`read`) or as it streams (`ToolStream`) |
| `markers.py` | markers that are special tokens (Qwen2.5-Coder's `<tool_call>`), put back into the text |

The calls are ordinary structured output: the grammar goes to the engine as a `StructuredOutput("grammar", ...)`,
so its mask applies to p and q at every draft position, forbidden draft tokens are cut, and the literal text it
forces (`{"tool_calls":[{"name":"`, the rest of a unique name) is drafted as forced tokens: speculation changes
nothing in the output.
"""

from .base import ToolCalling, ToolFormat, normalise
from .select import detect_format
from .spec import Tool, ToolRequest, history_arguments, schema_errors, tool_request
from .syntax import CallDelta, Output, ToolStream, new_call_id, read

__all__ = ["CallDelta", "Output", "Tool", "ToolCalling", "ToolFormat", "ToolRequest", "ToolStream", "detect_format",
           "history_arguments", "new_call_id", "normalise", "read", "schema_errors", "tool_request"]
