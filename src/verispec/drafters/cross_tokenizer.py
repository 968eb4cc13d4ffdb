"""Drafting with a draft model whose tokenizer differs from the target's: text is re-tokenized at the boundary.

Per slot the wrapped `ModelDrafter` keeps its own token sequence, the draft tokenizer's encoding of the committed
text (the target's tokens decoded). A round, for each drafting row:
1. resync: the committed text is encoded with the draft tokenizer; the draft cache is rolled back to the common
   token prefix of what it holds and the new encoding (bookkeeping: a length moves), and the model drafter feeds
   the rest before drafting, as it does for its own rows;
2. the draft model drafts about as many tokens of its own as cover k target tokens' text (k times the row's ratio
   of draft to target tokens so far), plus `lookahead` (greedy: no randomness is drawn);
3. their text X (the draft tokenizer's decode, read as the difference of two decodes so no tokenizer's leading-space
   handling leaks in; cut at an incomplete character or a special token the target does not know) becomes target
   tokens: the text A of the target's last committed tokens and A + X are encoded with the target tokenizer; the
   tokens past A's are the candidates, kept only when A's tokens are a prefix of A + X's (X does not merge into
   committed tokens). The last candidate is dropped unless it is a special token: more text may merge it
   differently (" wor" before "ld").
The proposal carries no probabilities: the verifier treats it as a point mass q = one_hot(x), like n-gram drafts, so
greedy output equals the target alone and sampling stays exact whatever the draft model says.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from ..config import RunnerOptions, SamplingParams
from ..sampling import RowSamplingState, SamplingBatch
from .base import DraftBatch, DraftProposal, Drafter, DraftRow, empty_proposal
from .model import ModelDrafter

logger = logging.getLogger("verispec")

MAX_RATIO = 3.0  # most draft tokens drafted per target token wanted
INCOMPLETE = "\ufffd"  # what a decode shows for bytes that do not finish a character yet


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers map text to the same ids (same vocabulary, added tokens included)."""
    return a is b or (len(a) == len(b) and a.get_vocab() == b.get_vocab())


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists (C-speed on the long shared head)."""
    n = min(len(a), len(b))
    head = max(0, n - 64)  # a resync changes the tail: check the head in one comparison
    start = head if a[:head] == b[:head] else 0
    for i in range(start, n):
        if a[i] != b[i]:
            return i
    return n


class CrossTokenizerDrafter(Drafter):
    """A ModelDrafter with its own tokenizer behind the target's token ids (module docstring).

    Cache invariant (per member slot): `context[slot]` lists draft ids whose first `inner.runner.lengths[slot]`
    are what the draft cache holds; after a resync `context[slot]` is the draft encoding of the committed text
    and the cache holds at most all but its last id (the model drafter's own invariant, D <= N - 1).
    """

    name = "cross-tokenizer"
    provides_probs = False

    def __init__(self, inner: ModelDrafter, target_tokenizer, draft_tokenizer, lookahead: int = 1,
                 window: int = 4) -> None:
        if lookahead < 0 or window < 1:
            raise ValueError(f"lookahead must be >= 0 and window >= 1, got {lookahead}, {window}")
        self.inner = inner
        self.target_tokenizer = target_tokenizer
        self.draft_tokenizer = draft_tokenizer
        self.lookahead = lookahead  # draft tokens beyond k: the last candidate is dropped, so draft a little more
        self.window = window  # committed tokens (each side) decoded to anchor the text at the boundary
        self.context: dict[int, list[int]] = {}
        output_size = inner.model.get_output_embeddings().weight.shape[0]
        self.draft_vocab = min(len(draft_tokenizer), output_size)
        known = set(target_tokenizer.get_added_vocab())
        # Draft special tokens the target cannot spell: the draft's text ends there (its EOS, its turn markers).
        self.draft_stops = {i for i in draft_tokenizer.all_special_ids
                            if draft_tokenizer.convert_ids_to_tokens(i) not in known}
        self.target_specials = set(target_tokenizer.all_special_ids)
        self._greedy: dict[int, SamplingBatch] = {}  # batch size -> the draft's greedy logits processing

    @property
    def runner(self):
        """The draft model's KV-cache runner (memory accounting)."""
        return self.inner.runner

    def reserve(self, num_slots: int, runner: RunnerOptions | None = None) -> None:
        self.inner.reserve(num_slots, runner)

    def begin(self, slot: int, prompt_ids: torch.Tensor) -> None:
        ids = self._encode_context([prompt_ids])[0]
        self.context[slot] = []
        self.inner.runner.reset(slot)
        if len(ids) + 1 < self.inner.max_len:  # else the row never drafts (propose checks the room)
            self.inner.begin(slot, torch.tensor(ids, dtype=torch.long))
            self.context[slot] = ids

    def move_slot(self, src: int, dst: int) -> None:
        self.inner.move_slot(src, dst)
        self.context[dst] = self.context.pop(src, [])

    def release(self, slot: int) -> None:
        self.inner.release(slot)
        self.context.pop(slot, None)

    # observe: nothing to do; the next propose resyncs from the committed tokens.

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> list[DraftProposal]:
        start = time.perf_counter()
        rows = batch.rows
        proposals = [empty_proposal(row) for row in rows]
        wanted = [i for i, row in enumerate(rows) if row.member and row.k > 0]
        if not wanted:
            return proposals
        encoded = self._encode_context([rows[i].token_ids for i in wanted])
        inner_rows = [DraftRow(row.token_ids.new_empty(0), 0, row.slot, row.generator, member=False) for row in rows]
        drafting: dict[int, list[int]] = {}  # row -> its draft context ids
        for i, ids in zip(wanted, encoded):
            # k target tokens of text are about k * ratio draft tokens (the row's own ratio so far)
            ratio = min(max(len(ids) / max(rows[i].token_ids.numel(), 1), 0.5), MAX_RATIO)
            k = math.ceil(rows[i].k * ratio) + self.lookahead
            if len(ids) + k + 1 > self.inner.max_len:
                continue  # the draft's cache has no room for this row: the target decodes it alone
            self._resync(rows[i].slot, ids)
            inner_rows[i] = DraftRow(torch.tensor(ids, dtype=torch.long), k, rows[i].slot, rows[i].generator)
            drafting[i] = ids
        if not drafting:
            return proposals
        drafts = self.inner.propose(DraftBatch(inner_rows, self._greedy_batch(len(rows))))
        texts = {}
        for i, ids in drafting.items():
            tokens = drafts[i].token_ids.tolist()
            self.context[rows[i].slot] = ids + tokens  # the cache holds ids + all but the last drafted token
            texts[i] = tokens
        candidates = self._target_tokens(rows, drafting, texts)
        seconds = time.perf_counter() - start
        for i, ids in candidates.items():
            device = rows[i].token_ids.device
            proposals[i] = DraftProposal(torch.tensor(ids[: rows[i].k], dtype=torch.long, device=device), None)
        for proposal in proposals:
            proposal.seconds = seconds
        return proposals

    # -- the boundary between the two tokenizers ------------------------------------------------------------------

    def _encode_context(self, token_ids: list[torch.Tensor]) -> list[list[int]]:
        """Committed target tokens (one [n] tensor per row) -> the draft tokenizer's ids of the same text."""
        texts = self.target_tokenizer.batch_decode([t.tolist() for t in token_ids], skip_special_tokens=False,
                                                   clean_up_tokenization_spaces=False)
        bos = self.target_tokenizer.bos_token
        texts = [text[len(bos):] if bos and text.startswith(bos) else text for text in texts]  # the draft adds its own
        return self.draft_tokenizer(texts, add_special_tokens=True)["input_ids"]

    def _resync(self, slot: int, ids: list[int]) -> None:
        """Roll the draft cache back to the common prefix of what it holds and `ids` (at most len(ids) - 1)."""
        keep = min(common_prefix(self.context.get(slot, []), ids), len(ids) - 1)
        if self.inner.runner.lengths[slot] > keep:
            self.inner.runner.truncate(keep, slot)
        self.context[slot] = ids

    def _target_tokens(self, rows: list[DraftRow], contexts: dict[int, list[int]],
                       drafted: dict[int, list[int]]) -> dict[int, list[int]]:
        """Draft ids of each row -> the target ids of their text that are fully determined (module docstring)."""
        order = [i for i in contexts if drafted[i]]
        pairs = []  # per row: the draft's window, then the window + its draft tokens
        for i in order:
            tokens = drafted[i]
            cut = next((j for j, t in enumerate(tokens) if t in self.draft_stops), len(tokens))
            tail = contexts[i][-self.window:]
            pairs += [tail, tail + tokens[:cut]]
        decoded = self.draft_tokenizer.batch_decode(pairs, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        anchors = self.target_tokenizer.batch_decode([rows[i].token_ids[-self.window:].tolist() for i in order],
                                                     skip_special_tokens=False, clean_up_tokenization_spaces=False)
        texts = []  # per row: the target's anchor text, then the anchor + the draft's text
        kept = []
        for n, i in enumerate(order):
            base, full = decoded[2 * n], decoded[2 * n + 1]
            anchor = anchors[n]
            if not full.startswith(base) or anchor.endswith(INCOMPLETE):
                continue
            text = full[len(base):].split(INCOMPLETE, 1)[0]
            if text:
                texts += [anchor, anchor + text]
                kept.append(i)
        if not kept:
            return {}
        encoded = self.target_tokenizer(texts, add_special_tokens=False)["input_ids"]
        out = {}
        for n, i in enumerate(kept):
            anchor, full = encoded[2 * n], encoded[2 * n + 1]
            if full[: len(anchor)] != anchor:
                continue  # the draft's text merges into committed tokens: nothing is determined
            ids = full[len(anchor):]
            if ids and ids[-1] not in self.target_specials:
                ids = ids[:-1]  # more text may merge the last token differently
            if ids:
                out[i] = ids
        return out

    def _greedy_batch(self, size: int) -> SamplingBatch:
        """Greedy processing over the draft's vocabulary for `size` rows: the draft is a point mass, so it need not
        follow the target's sampling parameters (and cannot: they name target ids)."""
        if size not in self._greedy:
            device = self.inner.runner.device
            state = RowSamplingState(SamplingParams(), (), [], self.draft_vocab, device)
            self._greedy[size] = SamplingBatch.stack([state] * size, self.draft_vocab, device)
        return self._greedy[size]


def cross_tokenizer_drafter(inner: ModelDrafter, target_tokenizer, draft_tokenizer, name: str) -> CrossTokenizerDrafter:
    """Wrap a model drafter whose tokenizer differs from the target's, saying so once in the log."""
    logger.info("draft model %s has another tokenizer than the target (%d vs %d tokens): drafting across tokenizers "
                "(text re-tokenized at the boundary; drafts are point masses, so output stays exact)", name,
                len(draft_tokenizer), len(target_tokenizer))
    return CrossTokenizerDrafter(inner, target_tokenizer, draft_tokenizer)
