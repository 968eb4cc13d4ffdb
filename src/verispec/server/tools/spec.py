"""A chat request's tools, checked: the function definitions, `tool_choice` and `parallel_tool_calls` as one typed
`ToolRequest`, or an OpenAI-style 400 naming the field (`tools.1.function.name`, `tool_choice`).

What is checked here needs no tokenizer: types, names (OpenAI's `^[a-zA-Z0-9_-]{1,64}$`, so a name needs no
escaping in JSON or a grammar), duplicates, a named choice that is in `tools`. Whether each parameters schema
compiles is checked by llguidance on the front end's threads (`schema_errors`), before the request is queued.

Arguments hold only the properties a schema declares: the grammar constrains them by `closed(parameters)`, which
adds `additionalProperties: false` to every object schema that declares `properties` and does not say otherwise
(as OpenAI's strict tools require and llama.cpp's grammars default to), so a call cannot invent a key. The model is
shown the schema as it was given.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..errors import invalid

MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHOICE_MODES = ("auto", "none", "required")


@dataclass(frozen=True)
class Tool:
    """One function a request declares."""

    name: str
    description: str  # "" when none was given
    parameters: dict  # a JSON schema of an object (the `arguments` of a call)

    @property
    def arguments_schema(self) -> dict:
        """The schema the grammar holds the arguments to: `parameters`, closed to undeclared keys (`closed`)."""
        return closed(self.parameters)

    def as_openai(self) -> dict:
        """The definition as OpenAI's `tools` items spell it (what chat templates read)."""
        description = {"description": self.description} if self.description else {}
        return {"type": "function", "function": {"name": self.name, **description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolRequest:
    """What a request asks of tool calling.

    mode: "auto" (a call or a plain answer), "required" (one call at least), "named" (a call of `name`) or "none"
    (plain text, no tool shown to the model)."""

    tools: tuple[Tool, ...]
    mode: str
    name: str | None = None  # the function a "named" choice calls
    parallel: bool = True  # several calls in one answer (False: at most one)

    @property
    def calls(self) -> bool:
        """The output may be a call (every mode but "none")."""
        return self.mode != "none"

    @property
    def callable(self) -> tuple[Tool, ...]:
        """The tools the output may call: all, or the named one."""
        return tuple(t for t in self.tools if self.mode != "named" or t.name == self.name)

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)


def tool_request(tools: list | None, tool_choice: object, parallel_tool_calls: object) -> ToolRequest | None:
    """The checked tools of a chat request (its `tools`, `tool_choice`, `parallel_tool_calls`), or None when it
    declares none. Raises APIError (400) naming the field at fault."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise invalid("parallel_tool_calls must be true or false.", param="parallel_tool_calls")
    if not tools:  # "auto" and "none" ask for nothing without tools; a call cannot be required of none
        if tool_choice not in (None, "auto", "none"):
            raise invalid("tool_choice needs tools: declare the functions in `tools`, or leave tool_choice out.",
                          param="tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise invalid(f"at most {MAX_TOOLS} tools may be declared, got {len(tools)}.", param="tools")
    parsed: list[Tool] = []
    for i, item in enumerate(tools):
        tool = _tool(item, f"tools.{i}")
        if any(t.name == tool.name for t in parsed):
            raise invalid(f"two tools are named `{tool.name}`: function names must be unique.",
                          param=f"tools.{i}.function.name")
        parsed.append(tool)
    mode, name = _choice(tool_choice, parsed)
    return ToolRequest(tuple(parsed), mode, name, parallel_tool_calls is not False)


def _tool(item: object, where: str) -> Tool:
    if not isinstance(item, dict):
        raise invalid(f"each tool must be an object {{\"type\": \"function\", \"function\": {{...}}}}.", param=where)
    if item.get("type") != "function":
        raise invalid(f"only tools of type `function` are supported, got {item.get('type')!r}.",
                      param=f"{where}.type")
    function = item.get("function")
    if not isinstance(function, dict):
        raise invalid("a function tool needs `function`: an object with its name and parameters.",
                      param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise invalid(f"a function name must be 1 to 64 letters, digits, underscores or dashes, got {name!r}.",
                      param=f"{where}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid("a function's description must be a string.", param=f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is None:  # a function without arguments
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise invalid("a function's parameters must be a JSON schema object.", param=f"{where}.function.parameters")
    kind = parameters.get("type", "object")
    if kind != "object":
        raise invalid(f"a function's parameters must describe an object (its arguments), got type {kind!r}.",
                      param=f"{where}.function.parameters")
    if "type" not in parameters:
        parameters = {"type": "object", **parameters}
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid("a function's strict must be true or false.", param=f"{where}.function.strict")
    return Tool(name, description or "", parameters)


def _choice(choice: object, tools: list[Tool]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in CHOICE_MODES:
            raise invalid(f"tool_choice must be one of {', '.join(CHOICE_MODES)} or "
                          f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}.",
                          param="tool_choice")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(function, dict):
        raise invalid("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                      param="tool_choice")
    name = function.get("name")
    if not any(t.name == name for t in tools):
        raise invalid(f"tool_choice names the function {name!r}, which is not in tools.", param="tool_choice")
    return "named", name


# Keywords whose value is one subschema, or a list or map of them, that `closed` walks into. Not `allOf`: its
# branches combine, and closing one would forbid the properties another declares.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties")
_LISTS = ("anyOf", "oneOf", "prefixItems")
_MAPS = ("properties", "$defs", "definitions")


def closed(schema: object) -> object:
    """`schema` with `additionalProperties: false` on each object schema that declares `properties` and says nothing
    of other keys (no `additionalProperties`, `patternProperties` or `unevaluatedProperties`); the rest as given."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(item) for item in out[key]]
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(item) for name, item in out[key].items()}
    if "properties" in out and not any(k in out for k in ("additionalProperties", "patternProperties",
                                                          "unevaluatedProperties")):
        out["additionalProperties"] = False
    return out


def schema_errors(request: ToolRequest) -> tuple[int, str] | None:
    """The first tool whose parameters schema llguidance cannot compile: (its index in tools, why), else None."""
    from llguidance import LLMatcher

    for i, tool in enumerate(request.tools):
        try:
            error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(tool.arguments_schema))
        except (ValueError, TypeError, RuntimeError) as exc:
            error = str(exc)
        if error:
            return i, error.strip().splitlines()[0]
    return None


def history_arguments(text: str) -> dict | str:
    """The `arguments` of a call in the history: the object its JSON string holds, or the string as sent when it
    holds none (a call cut by max_tokens; OpenAI accepts any string here)."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError, RecursionError):
        return text
    return value if isinstance(value, dict) else text
