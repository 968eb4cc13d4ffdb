"""Structured output: a grammar's token mask at every position of a round, through llguidance.

Why llguidance (over xgrammar and outlines-core): it computes a mask in tens of microseconds with no precomputed
automaton over the vocabulary (a JSON schema request starts at once), it rolls back consumed tokens (what
speculation needs), it has no torch dependency (nothing can pull another torch wheel), and it is the engine behind
vLLM's, SGLang's and llama.cpp's guidance backends.

A `Grammar` follows one sequence. Its matcher has consumed exactly the committed output; to mask a round it
consumes the round's draft tokens one by one, computes the mask after each prefix, and rolls them back. The same
masks go to the drafter's q (drafting step by step) and to the target's p (the verify pass), so rejection sampling
stays exact; a draft token the grammar forbids is cut from the draft before verification (`valid_prefix`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from ..config import StructuredOutput

logger = logging.getLogger("verispec")

_TOKENIZERS: dict[tuple, tuple[object, object]] = {}  # (id(tokenizer), vocab, eos ids) -> (tokenizer, LLTokenizer)
# JSON without free whitespace between tokens (a schema's "x-guidance" may say otherwise): small models otherwise
# fill the output with newlines, a known failure of flexible-whitespace JSON grammars.
_COMPACT = {"whitespace_flexible": False}
# Compiled grammars in their initial state, most recently used last: requests repeating a schema (the usual case)
# copy one instead of compiling it again.
MAX_CACHED_GRAMMARS = 64
_MATCHERS: OrderedDict[tuple, object] = OrderedDict()
_MATCHERS_LOCK = threading.Lock()  # the server compiles grammars on several threads (server/prepare.py)
_BITS = torch.arange(32, dtype=torch.int32)  # [32]


class _TokenTable:
    """A tokenizer as llguidance's TokenizerWrapper reads it: each id's bytes and an encoder. For tokenizers whose
    Rust definition llguidance cannot read (custom decoders, slow tokenizers)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        special = set(getattr(tokenizer, "all_special_ids", []))
        self.special_token_ids = sorted(t for t in special if t < vocab_size)
        self.tokens = [tokenizer.decode([i]).encode() if i < len(tokenizer) else b"" for i in range(vocab_size)]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer(text, add_special_tokens=False)["input_ids"]


def _ll_tokenizer(tokenizer, vocab_size: int, eos_ids: Sequence[int]):
    """llguidance's view of a Hugging Face tokenizer (~1 s to build, so built once per tokenizer)."""
    from llguidance import LLTokenizer, TokenizerWrapper
    from llguidance.hf import from_tokenizer

    key = (id(tokenizer), vocab_size, tuple(eos_ids))
    if key not in _TOKENIZERS:
        try:
            ll = from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))
        except ValueError:  # not a fast tokenizer, or a decoder llguidance does not know: read it token by token
            ll = LLTokenizer(TokenizerWrapper(_TokenTable(tokenizer, vocab_size)), n_vocab=vocab_size,
                             eos_token=list(eos_ids))
        # The tokenizer object is kept with its LLTokenizer, so its id cannot be reused by another one.
        _TOKENIZERS[key] = (tokenizer, ll)
    return _TOKENIZERS[key][1]


def _eos_in_vocab(eos_ids: Iterable[int], vocab_size: int) -> list[int]:
    """The EOS ids a grammar ends with, sorted: part of the cache keys, so the warm-up finds what requests use."""
    return sorted(t for t in eos_ids if 0 <= t < vocab_size)


def prepare_tokenizer(tokenizer, vocab_size: int, eos_ids: Iterable[int]) -> None:
    """Build llguidance's view of `tokenizer` now (a server does it at start-up, not on its first structured
    request). A tokenizer llguidance cannot read is left for that request to report."""
    try:
        _ll_tokenizer(tokenizer, vocab_size, _eos_in_vocab(eos_ids, vocab_size))
    except Exception as exc:  # noqa: BLE001 - only a warm-up: the request that needs it raises a clear error
        logger.info("structured output unavailable for this tokenizer: %s", exc)


def grammar_source(structured: StructuredOutput) -> str:
    """The llguidance grammar of a constraint. Raises ValueError for a schema that is not JSON."""
    from llguidance import LLMatcher

    if structured.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_COMPACT)
    if structured.kind == "json_schema":
        try:
            schema = json.loads(structured.spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
        return LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
    if structured.kind == "regex":
        return LLMatcher.grammar_from_regex(structured.spec)
    if structured.kind == "choice":
        # A Lark alternation of string literals (JSON string syntax is Lark's): no regex escaping to get wrong.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in structured.choices))
    return LLMatcher.grammar_from_lark(structured.spec)


def _bitmask(token_ids: Sequence[int], words: int) -> Tensor:
    """[words] int32 with the bits of `token_ids` set (llguidance's layout: bit t % 32 of word t // 32)."""
    bits = torch.zeros(words, dtype=torch.int64)
    for token in token_ids:
        bits[token // 32] |= 1 << (token % 32)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)  # the same bits, as int32


class Grammar:
    """One sequence's grammar state: consumed = the committed output tokens."""

    def __init__(self, structured: StructuredOutput, tokenizer, vocab_size: int, eos_ids: Iterable[int]) -> None:
        """Raises ValueError (naming the constraint) when the grammar cannot be compiled."""
        from llguidance import LLMatcher

        if tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer (tokenizer=None was given)")
        self.structured = structured
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos_ids = _eos_in_vocab(eos_ids, vocab_size)
        self.broken = False  # the matcher refused a committed token (an engine fault): only EOS from then on
        self._eos_only = _bitmask(self.eos_ids, self.words)  # [words] int32
        # llguidance lets the unknown token through where nothing else fits; it never continues a grammar.
        unk = getattr(tokenizer, "unk_token_id", None)
        self._not_unk = None if unk is None or unk in self.eos_ids or unk >= vocab_size else ~_bitmask([unk], self.words)
        key = (structured, id(tokenizer), vocab_size, tuple(self.eos_ids))
        with _MATCHERS_LOCK:
            compiled = _MATCHERS.get(key)
        if compiled is None:  # compiled outside the lock: two threads may compile one grammar, never wait on one
            compiled = LLMatcher(_ll_tokenizer(tokenizer, vocab_size, self.eos_ids), grammar_source(structured),
                                 log_level=0)
            if compiled.is_error():
                raise ValueError(f"the {structured.kind} constraint cannot be compiled: {compiled.get_error()}")
        with _MATCHERS_LOCK:
            _MATCHERS[key] = compiled
            _MATCHERS.move_to_end(key)
            while len(_MATCHERS) > MAX_CACHED_GRAMMARS:
                _MATCHERS.popitem(last=False)
        self.matcher = compiled.deep_copy()  # a fresh state: the cached one never consumes a token

    def commit(self, token_ids: Sequence[int]) -> None:
        """Advance over tokens appended to the output (sampled under this grammar's masks, so all allowed)."""
        if token_ids and self._consume(token_ids) < 0 and not self.broken:
            # Only a grammar engine fault gets here; the request ends (its masks allow only EOS from now on)
            # instead of the step failing for every row of the batch.
            self.broken = True
            logger.error("structured output: the grammar refused committed tokens %s: %s", list(token_ids),
                         self.matcher.get_error().splitlines()[0])

    def _consume(self, token_ids: Sequence[int]) -> int:
        """Consume tokens up to the grammar's end (the EOS that follows it is not consumed: a stopped matcher
        refuses everything). -> how many were consumed, or -1 when the matcher refused one."""
        for count, token in enumerate(token_ids):
            if self.matcher.is_stopped():
                return count
            if not self.matcher.consume_token(int(token)):
                return -1
        return len(token_ids)

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces after the committed output (its only continuation, tokenized the
        canonical way), or [] when the next token is a choice."""
        if self.broken or self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading draft tokens the grammar allows (nothing is consumed)."""
        return self.matcher.validate_tokens(list(token_ids)) if token_ids else 0

    def masks(self, pending: Sequence[int], windows: Sequence[int]) -> Tensor:
        """Allowed tokens at positions that see pending[:windows[i]] after the committed output.

        windows: non-decreasing. -> [len(windows), vocab] bool. Positions past a draft token the grammar forbids
        allow everything: their logits are never used (that token is rejected, or was cut before verification).
        Where no token continues the grammar (past an EOS, or a character this vocabulary lacks) only EOS is
        allowed, so the output ends there, alone or speculating alike.
        """
        bitmask = torch.full((len(windows), self.words), -1, dtype=torch.int32)  # [n, words]; -1: all allowed
        valid = self.valid_prefix(pending[: max(windows, default=0)])
        consumed = rolled = 0  # draft tokens passed, and those the matcher consumed (the EOS ending it is not)
        for i, window in enumerate(windows):
            if window > valid:
                continue
            if window > consumed:
                rolled += self._consume(pending[consumed:window])
                consumed = window
            row = bitmask[i]
            self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), self.words * 4)
            if self._not_unk is not None:
                row &= self._not_unk
            if self.broken or not row.any():
                if window == 0 and not self.broken:
                    logger.warning("structured output: no token continues the %s constraint; ending the output",
                                   self.structured.kind)
                row.copy_(self._eos_only)
        if rolled:
            self.matcher.rollback(rolled)
        bits = (bitmask.unsqueeze(-1) >> _BITS) & 1  # [n, words, 32]
        return bits.view(len(windows), -1)[:, : self.vocab_size].bool()  # [n, vocab]


def grammar_masks(rows: list[tuple[int, Grammar]], batch: int, pending: Tensor | None, offset: Tensor, n: int,
                  vocab: int, device: torch.device) -> Tensor:
    """[batch, n, vocab] bool: each grammar row's allowed tokens per position, True everywhere for other rows.

    pending: [batch, m] long draft tokens or None; offset: [batch or 1, n] long, position i of row b sees
    pending[b, :offset[b, i]] (clamped to m). One host sync for the pending tokens (only grammar rows pay it).
    """
    allowed = torch.ones(batch, n, vocab, dtype=torch.bool)  # [batch, n, vocab]
    width = 0 if pending is None else pending.shape[1]
    drafts = pending.tolist() if width else [[] for _ in range(batch)]
    windows = offset.clamp(0, width).expand(batch, n).tolist()  # [batch][n]
    for row, grammar in rows:
        allowed[row] = grammar.masks(drafts[row], windows[row])
    return allowed.to(device)
