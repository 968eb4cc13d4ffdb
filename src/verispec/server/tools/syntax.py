"""Reading tool calls out of the generated text, whole or as it streams.

Every format writes its calls the same way up to a few literals (`CallSyntax`): an opening that starts the calls
(`trigger` first), then per call `call_open`, the name, `args_open`, the arguments as JSON, `call_close`, with
`separator` between calls and `close` after the last. The grammar generated those literals itself, so reading them
back needs no guessing: `read` walks them, and everything before the trigger is the message's content.

`read(text)` is the one parser; `ToolStream` calls it on the text so far after every round and sends what is new
(content, a call once its name is complete, argument text as it grows), so the chunks of a stream add up to
exactly what `read` gives for the whole text. A name or content that could still turn out to be the start of a
trigger is held back until the text decides.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CallSyntax:
    """How one format writes calls; see the module docstring."""

    trigger: str  # the text that starts the calls ('{', '<tool_call>')
    open: str  # from the trigger to the first call_open ('{"tool_calls":[' includes the trigger '{')
    call_open: str  # before a name ('{"name":"')
    args_open: str  # between the name and the arguments ('","arguments":')
    call_close: str  # after the arguments ('}')
    separator: str  # between two calls (',')
    close: str  # after the last call (']}')
    text_first: bool  # content may come before the trigger; else the trigger is the text's first character
    markers: tuple[str, ...] = ()  # literals a tokenizer may hold as one special token each (tools/markers.py)


@dataclass
class Call:
    """One call as read so far."""

    name: str
    arguments: str  # JSON text of the arguments as generated (complete once `done`)
    done: bool = False


@dataclass
class Output:
    """The generated text read as content and calls."""

    content: str  # text before the calls (all of it when there are none)
    calls: list[Call] = field(default_factory=list)
    pending: str = ""  # text held back: it may still be a trigger, or a call whose name is not complete


def json_end(text: str, start: int) -> int | None:
    """The index just past the JSON value (object, array, string or scalar) at text[start:], or None when the
    text ends inside it. Scalars end at the next `,`, `}`, `]` or whitespace, so they need the character after them."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        i = start + 1
        while i < len(text):
            if text[i] == "\\":
                i += 2
                continue
            if text[i] == '"':
                return i + 1
            i += 1
        return None
    if first not in "{[":
        for i in range(start, len(text)):
            if text[i] in ",}] \n\t\r":
                return i
        return None
    depth, i, in_string = 0, start, False
    while i < len(text):
        char = text[i]
        if in_string:
            if char == "\\":
                i += 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _held(text: str, marker: str) -> int:
    """Characters at the end of `text` that begin `marker` (they may become it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _trigger_at(text: str, syntax: CallSyntax) -> tuple[int | None, int]:
    """(where the calls start, or None; characters held back at the end as a possible start)."""
    if not syntax.text_first:
        if not text:
            return None, 0
        if text.startswith(syntax.trigger):
            return 0, 0
        return (None, len(text)) if syntax.trigger.startswith(text) else (None, 0)
    at = text.find(syntax.trigger)
    return (at, 0) if at >= 0 else (None, _held(text, syntax.trigger))


def read(text: str, syntax: CallSyntax, final: bool = False) -> Output:
    """`text` (the output so far, or all of it when `final`) as content and calls.

    Without `final`, a possible trigger at the end and a call whose name is not complete are `pending`; with it,
    text that started calls but holds none (an output cut by max_tokens) is content, as it would stream."""
    at, held = _trigger_at(text, syntax)
    if at is None:
        if final or not held:
            return Output(text)
        return Output(text[:-held], pending=text[-held:])
    out = Output(text[:at])
    pos = at + len(syntax.open)
    if not text.startswith(syntax.open[: len(text) - at], at):
        return Output(text)  # not the format's opening after all (the grammar never writes this)
    while pos <= len(text):
        if not text.startswith(syntax.call_open, pos):
            break
        name_at = pos + len(syntax.call_open)
        name_end = text.find(syntax.args_open, name_at)
        if name_end < 0:
            break
        args_at = name_end + len(syntax.args_open)
        end = json_end(text, args_at)
        call = Call(text[name_at:name_end], text[args_at: len(text) if end is None else end])
        out.calls.append(call)
        if end is None or not text.startswith(syntax.call_close, end):
            break
        call.done = True
        pos = end + len(syntax.call_close)
        if text.startswith(syntax.separator, pos) and text.startswith(syntax.call_open, pos + len(syntax.separator)):
            pos += len(syntax.separator)
    if not out.calls:
        if final:
            return Output(text)
        out.pending = text[at:]
    return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallDelta:
    """What a stream chunk says of one call: its first chunk has `id` and `name`, later ones only arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


class ToolStream:
    """One choice's stream: `feed` each round's text, `finish` at the end; each returns (content, call deltas) to
    send. The ids it gives the calls are `ids`, in call order (the same ones a non-streamed body would show)."""

    def __init__(self, syntax: CallSyntax) -> None:
        self.syntax = syntax
        self.text = ""
        self.sent_content = 0
        self.sent_args: list[int] = []  # per call started: characters of its arguments sent
        self.ids: list[str] = []

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.text += text
        return self._diff(read(self.text, self.syntax))

    def finish(self) -> tuple[str, list[CallDelta]]:
        return self._diff(read(self.text, self.syntax, final=True))

    def _diff(self, out: Output) -> tuple[str, list[CallDelta]]:
        content = out.content[self.sent_content:]
        self.sent_content = len(out.content)
        deltas = []
        for index, call in enumerate(out.calls):
            if index == len(self.sent_args):
                self.ids.append(new_call_id())
                self.sent_args.append(len(call.arguments))
                deltas.append(CallDelta(index, call.arguments, self.ids[index], call.name))
            elif len(call.arguments) > self.sent_args[index]:
                deltas.append(CallDelta(index, call.arguments[self.sent_args[index]:]))
                self.sent_args[index] = len(call.arguments)
        return content, deltas
