"""Prefill: a step's prompt chunks, each its own target forward into the sequence's slot, before the decoding rows
are verified (the scheduler chose the chunks, `Scheduler.admit`).

A chunk's boundaries are set by its prompt alone (no padding, no other rows), so its numbers are those of the
request run alone. A sequence takes its slot with its first chunk (`Scheduler.stage`); with its last it joins the
running rows, and its drafter begins its slot (its scope first, then the prompt, then a draft head's features).
"""

from __future__ import annotations

import time

import torch

from ..runtime.runners.base import SlotRunner
from .drafter_calls import DrafterCalls, wants_features
from .scheduler import PrefillChunk, Scheduler


class Prefill:
    """Runs prompt chunks on the target for one engine."""

    def __init__(self, target: SlotRunner, scheduler: Scheduler, calls: DrafterCalls) -> None:
        self.target = target
        self.scheduler = scheduler
        self.calls = calls

    def run(self, chunk: PrefillChunk) -> None:
        seq = chunk.seq
        if seq.slot < 0:
            self.scheduler.stage(seq)
        if chunk.end > chunk.start:
            start = time.perf_counter()
            features = wants_features(seq.drafter)  # a draft head reads the prompt's hidden states
            out = self.target.forward(seq.committed[chunk.start : chunk.end].unsqueeze(0), start_slot=seq.slot,
                                      last_only=True, all_hidden=features)
            if features:
                seq.features.append(out.hidden[0])  # [chunk, hidden]
            self.scheduler.store_prefix(seq, chunk.end)
            seq.stats.prefill_s += time.perf_counter() - start
        if chunk.joins:
            self._join(seq)

    def _join(self, seq) -> None:
        self.scheduler.join(seq)
        if seq.scope is not None:
            self.calls.on_row(seq, lambda d: d.set_scope(seq.slot, seq.scope))
        self.calls.on_row(seq, lambda d: d.begin(seq.slot, seq.committed))
        if wants_features(seq.drafter) and seq.features:
            features = torch.cat(seq.features)  # [prompt - 1, hidden]
            self.calls.on_row(seq, lambda d: d.observe_features(seq.slot, features))
        seq.features = []
