"""Incremental detokenisation and stop conditions, decided by token id first and by decoded text second."""

from __future__ import annotations

from collections.abc import Iterable

from ..config import SamplingParams

_REPLACEMENT = "\ufffd"  # an incomplete UTF-8 sequence: wait for the next token before emitting text


class IncrementalDetokenizer:
    """Decodes generated tokens as they are committed, one window at a time (never the whole output again)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add one token; -> the text it completes (possibly '' while a multi-byte character is split)."""
        self.token_ids.append(token_id)
        if self.tokenizer is None:  # ids in, ids out (SpeculativeGenerator(..., tokenizer=None)): no text
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if new_text.endswith(_REPLACEMENT) or len(new_text) <= len(prefix_text):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text) :]


class StopChecker:
    """Feeds committed tokens one at a time and says when and why to stop.

    Order per token: the token is kept; a stop token id (model EOS ids unless ignored, plus the user's ids) ends
    generation without adding text; otherwise its text is added and stop strings are searched across token
    boundaries, the output being cut before the match; then max_new_tokens / the context limit end it.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int], tokenizer, max_tokens: int) -> None:
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.detok = IncrementalDetokenizer(tokenizer)
        self.max_tokens = max_tokens  # max_new_tokens, capped by what fits in the context
        self.text = ""
        self.emitted = 0  # characters of `text` already handed out by `take_text`
        self.finish_reason: str | None = None
        self._longest_stop = max((len(s) for s in params.stop), default=0)

    @property
    def token_ids(self) -> list[int]:
        return self.detok.token_ids

    def push(self, token_id: int) -> str | None:
        """-> finish reason ('stop' / 'length') once generation must end, else None."""
        assert self.finish_reason is None
        if token_id in self.stop_ids:
            self.detok.token_ids.append(token_id)
            self.finish_reason = "stop"
            return self.finish_reason
        before = len(self.text)
        self.text += self.detok.push(token_id)
        if self._longest_stop and len(self.text) > before:
            window = max(0, before - self._longest_stop + 1)
            hits = [i for i in (self.text.find(s, window) for s in self.params.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.finish_reason = "stop"
                return self.finish_reason
        if len(self.token_ids) >= self.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason

    def take_text(self) -> str:
        """Text that is safe to show now: all of it once finished, else short of a possible stop-string start."""
        end = len(self.text)
        if self.finish_reason is None and self._longest_stop:
            for size in range(min(self._longest_stop - 1, end), 0, -1):
                tail = self.text[end - size :]
                if any(s.startswith(tail) for s in self.params.stop):
                    end -= size
                    break
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta
