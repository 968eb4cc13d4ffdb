"""A chat request's prompt: its messages as dicts, and, when it declares tools or its history holds calls and their
results, the prompt the served model's tool format writes (server/tools/) with what the request asked of tools."""

from __future__ import annotations

from .errors import invalid
from .protocol import ChatCompletionRequest
from .served import ChatPrompt, Prompt, ServedModel
from .tools import ToolCalling, history_arguments, normalise, tool_request


def chat_prompt(body: ChatCompletionRequest, served: ServedModel) -> tuple[Prompt, ToolCalling | None]:
    """-> (the prompt, what the answer may call: None for plain text). Raises APIError (400) naming a bad tool
    definition, tool_choice, or history message."""
    request = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls)
    messages = chat_messages(body)
    if request is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages, None
    fmt = served.tool_format
    messages, template_tools = fmt.prompt(normalise(messages), request)
    calling = ToolCalling(request, fmt) if request is not None and request.calls else None
    return ChatPrompt(messages, template_tools), calling


def chat_messages(body: ChatCompletionRequest) -> list[dict]:
    """The messages as dicts: content as text (null as "", text parts joined); an assistant's calls with their
    arguments parsed (`history_arguments`: the string as sent when it is not a JSON object), a tool message with
    the id of the call it answers."""
    out = []
    for i, m in enumerate(body.messages):
        # 'developer' is OpenAI's newer name for 'system'; chat templates know only the latter.
        message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls and m.role == "assistant":
            message["tool_calls"] = [{"id": c.id, "name": c.function.name,
                                      "arguments": history_arguments(c.function.arguments)} for c in m.tool_calls]
        if m.role == "tool":
            if not m.tool_call_id:
                raise invalid("a tool message needs tool_call_id: the id of the call it answers.",
                              param=f"messages.{i}.tool_call_id")
            message.update(tool_call_id=m.tool_call_id, name=m.name)
        out.append(message)
    return out
