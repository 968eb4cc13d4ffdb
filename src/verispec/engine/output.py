"""The output step: what a verify pass decided becomes each row's committed tokens.

Per row: stop checks token by token (tokens after a stop are dropped and never counted), the commit, the cache's
rollback (a tree's accepted path moved into place first: the one copy), the drafter's observe (and the target's
features for a drafter that reads them), statistics; per policy, the round's measurements. Finished sequences then
leave (the scheduler moves the last running sequence into a freed slot) and their figures go into the totals.

Rollback is bookkeeping: after a round, the target cache's slot keeps seq[:length - 1] (the last committed token
is fed at the start of the next round); entries past it are stale and hidden by the mask.
"""

from __future__ import annotations

import time

from ..stats import GenerationStats
from .drafter_calls import DrafterCalls, wants_features
from .proposer import StepDrafts
from .scheduler import Scheduler
from .sequence import GenerationChunk, GenerationResult, Sequence, round_origins
from .verifier import Verdict


class OutputStep:
    def __init__(self, target, scheduler: Scheduler, calls: DrafterCalls) -> None:
        self.target = target  # the target runner: rollback and a tree path's move
        self.scheduler = scheduler
        self.calls = calls
        self.total = GenerationStats()  # cumulative over finished (and cancelled) requests
        self.last_stats = GenerationStats()  # the latest finished (or cancelled) request's

    def commit(self, rows: list[Sequence], drafts: StepDrafts, verdict: Verdict) -> list[Sequence]:
        """-> the rows (all committed tokens this round); finished ones have left the batch."""
        rows = list(rows)
        tokens_fed = len(rows) * drafts.width
        by_policy: dict[int, tuple] = {}
        for i, seq in enumerate(rows):
            proposal, policy = drafts.proposals[i], drafts.policies[i]
            accepted = len(verdict.accepted[i])
            committed = verdict.accepted[i] + [verdict.next_token[i]]
            path = verdict.path[i]
            base = seq.length - 1  # the target cache index of the round's first fed token (the root)
            kept = 0
            for token in committed:
                kept += 1
                if seq.stopper.push(token) is not None:
                    break
            depth, drafted = verdict.depth[i], proposal.token_ids.numel()
            origins = round_origins(drafts.stages[i], seq.stats.rounds + 1, drafted, accepted, verdict.bonus[i],
                                    kept)  # the server's opt-in annotation
            seq.append(committed[:kept], verdict.logprobs.get(seq.slot, [])[:kept], origins)
            if path[-1] != len(path) - 1:
                # A tree's accepted path was fed at scattered indices: its entries move into place (the one copy).
                self.target.keep_path(seq.slot, base, path)
            self.target.truncate(seq.length - 1, seq.slot)
            # A round cut short by a stop counts only the draft positions in front of the stop.
            proposed = depth if kept == len(committed) else min(depth, kept)
            if seq.drafter is not None:
                self.calls.on_row(seq, lambda d: d.observe(seq.slot, seq.length, accepted, drafted))
                if seq.drafter is not None and seq.drafter.wants_tokens:
                    self.calls.on_row(seq, lambda d: d.observe_tokens(seq.slot, committed[:kept]))
                if verdict.hidden is not None and not seq.finished and wants_features(seq.drafter):
                    features = verdict.hidden[i, path]  # [accepted + 1, hidden]: the committed positions
                    self.calls.on_row(seq, lambda d: d.observe_features(seq.slot, features))
                entry = by_policy.setdefault(id(policy), (policy, [], proposal.seconds, drafts.ks[i]))
                entry[1].append((depth, accepted))
            verified = drafted if kept == len(committed) else None
            seq.stats.record_round(proposed, min(accepted, kept), kept, verified)
            seq.stats.draft_s += proposal.seconds + proposal.catch_up_s  # a deferred draft prefill is draft time
            if drafted and drafts.stages[i] is not None:
                seq.stats.record_stage(drafts.stages[i], proposed if verified is None else verified,
                                       min(accepted, kept))
            seq.stats.verify_s += verdict.verify_s
        for policy, pairs, draft_s, k in by_policy.values():
            policy.record_step(pairs, draft_s, k, verdict.verify_s, tokens_fed)
        for seq in sorted((s for s in rows if s.finished), key=lambda s: -s.slot):
            self.finish(seq)
        return rows

    def finish(self, seq: Sequence) -> None:
        """Take a finished (or cancelled) running sequence out; the last running sequence moves into its slot."""
        slot = seq.slot
        if seq.drafter is not None:
            if seq.finished:
                self.calls.backoff(seq.drafter).succeeded()  # a whole request with the drafter: forget failures
            self.calls.call(seq.drafter, seq.stats, lambda d: d.release(slot))
        moved = self.scheduler.retire(seq)
        if moved is not None:
            last, old = moved
            self.calls.on_row(last, lambda d: d.move_slot(old, slot))
        self.close(seq)

    def close(self, seq: Sequence) -> None:
        """A sequence is done (finished or cancelled): its wall time and figures go into the totals."""
        seq.stats.wall_s = time.perf_counter() - seq.wall_start
        self.total.merge(seq.stats)
        self.last_stats = seq.stats


def stream_chunk(seq: Sequence) -> GenerationChunk:
    """What a round hands a streaming caller: the tokens committed since the last chunk and the text they complete;
    the last chunk carries the request's stats."""
    token_ids, text = seq.take()
    return GenerationChunk(token_ids, text, seq.finish_reason, seq.stats if seq.finished else None,
                           seq.take_logprobs(), seq.take_origins())


def final_result(seq: Sequence) -> GenerationResult:
    return GenerationResult(list(seq.stopper.token_ids), seq.take()[1], seq.finish_reason, seq.stats, seq.logprobs)
