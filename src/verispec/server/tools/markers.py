"""Call markers that are special tokens: `<tool_call>` and `</tool_call>` where the tokenizer holds each as one
special token (Qwen2.5-Coder's), so that decoding (`skip_special_tokens`, as the engine's detokenizer decodes)
drops them from the text the calls are read from.

Two places see them: the grammar names them by token id (`<[id]>` in llguidance's Lark, tools/lark.py), so a call
opens only with the token itself; and `MarkedText` puts their text back into the output where the model wrote
them, so `read` and `ToolStream` (tools/syntax.py) get the text the format's syntax describes.
"""

from __future__ import annotations

from collections.abc import Iterable

from ...engine.detokenize import IncrementalDetokenizer


def special_markers(tokenizer, markers: Iterable[str]) -> dict[str, int]:
    """-> marker text -> token id, for each marker the tokenizer encodes as one token that decoding drops (a
    special token). Markers it spells with ordinary tokens, or holds as an ordinary added token, are left out:
    they stay in the decoded text."""
    out = {}
    for marker in markers:
        ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == "":
            out[marker] = ids[0]
    return out


class MarkedText:
    """One choice's output text with its special markers put back.

    `feed(token_ids, text)` takes a round's committed tokens and the text the engine let out for them (its
    detokenizer's, held back for a stop string or an incomplete character) and returns that text with the markers
    at their places. A second detokenizer, fed the same tokens, says how many characters of plain text came before
    each marker; a marker is let out once the engine's text reaches its place, and never when a stop string cut the
    text before it."""

    def __init__(self, tokenizer, special: dict[str, int]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.marker = {token_id: text for text, token_id in special.items()}  # token id -> its text
        self.plain = 0  # characters of plain text the tokens fed so far decode to
        self.waiting: list[tuple[int, str]] = []  # (plain characters before it, marker text), not let out yet
        self.shown = 0  # characters of the engine's text fed so far

    def feed(self, token_ids: Iterable[int], text: str) -> str:
        for token_id in token_ids:
            self.plain += len(self.detok.push(token_id))  # a special token adds no text
            if token_id in self.marker:
                self.waiting.append((self.plain, self.marker[token_id]))
        pieces, at = [], 0  # at: characters of `text` written out
        end = self.shown + len(text)
        while self.waiting and self.waiting[0][0] <= end:
            place, marker = self.waiting.pop(0)
            cut = max(place - self.shown, at)
            pieces += [text[at:cut], marker]
            at = cut
        pieces.append(text[at:])
        self.shown = end
        return "".join(pieces)
