"""Prometheus metrics of one app, in a registry of its own (several apps in one process do not collide).

Names follow DEVELOPERS.md's vocabulary. Counters are cumulative since the app started; per-position counters
carry a 0-based `position` label, so `accepted_tokens_by_position / draft_tokens_by_position` is the acceptance
rate at each draft position. `chosen_k_total{k}` counts, per round of a speculating row, the K its draft-length
policy chose for that step (0: speculation switched off for that step), so its distribution shows how
speculation shrinks under load.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..drafters.prediction import NAME as PREDICTION
from ..stats import GenerationStats

# Latency buckets in seconds: tiny CPU models answer in milliseconds, 135M-parameter models in tenths.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("verispec_requests", "API requests answered, by endpoint and HTTP status "
                                "(499: the client went away)", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("verispec_prompt_tokens", "Prompt tokens of generations started", registry=r)
        self.generated_tokens = Counter("verispec_generated_tokens", "Committed tokens generated", registry=r)
        self.rounds = Counter("verispec_rounds", "Rounds (draft-then-verify steps, or target-only steps)",
                              registry=r)
        self.draft_tokens = Counter("verispec_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("verispec_accepted_tokens", "Draft tokens the target accepted", registry=r)
        self.draft_tokens_by_position = Counter("verispec_draft_tokens_by_position",
                                                "Draft tokens proposed at each draft position", ["position"],
                                                registry=r)
        self.accepted_tokens_by_position = Counter("verispec_accepted_tokens_by_position",
                                                   "Draft tokens accepted at each draft position", ["position"],
                                                   registry=r)
        self.prediction_tokens = Counter("verispec_prediction_tokens", "Draft tokens proposed from requests' "
                                         "predictions (predicted outputs)", registry=r)
        self.accepted_prediction_tokens = Counter("verispec_accepted_prediction_tokens", "Draft tokens from requests' "
                                                  "predictions the target accepted", registry=r)
        self.fallbacks = Counter("verispec_fallbacks", "Drafter failures that sent a generation on to the target "
                                 "alone", registry=r)
        self.draft_seconds = Counter("verispec_draft_seconds", "Time spent drafting", registry=r)
        self.verify_seconds = Counter("verispec_verify_seconds", "Time spent in target verification passes",
                                      registry=r)
        self.generations = Counter("verispec_generations", "Generations (choices) run, by outcome and by whether "
                                   "they speculated", ["outcome", "speculative"], registry=r)
        self.time_to_first_token = Histogram("verispec_time_to_first_token_seconds", "From a request's arrival "
                                             "(queueing included) to its first committed token",
                                             buckets=_TTFT_BUCKETS, registry=r)
        self.time_per_output_token = Histogram("verispec_time_per_output_token_seconds", "Decoding time per "
                                               "output token after the first, per generation",
                                               buckets=_TPOT_BUCKETS, registry=r)
        self.request_duration = Histogram("verispec_request_duration_seconds", "From a request's arrival to its "
                                          "last byte", ["endpoint"], buckets=_DURATION_BUCKETS, registry=r)
        self.chosen_k = Counter("verispec_chosen_k", "Rounds of speculating rows, by the K (draft tokens) chosen "
                                "for them (0: speculation switched off for that step)", ["k"], registry=r)
        self.prefix_cache_queries = Counter("verispec_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                            "cache (the cacheable part of each admitted prompt)", registry=r)
        self.prefix_cache_hits = Counter("verispec_prefix_cache_hits", "Prompt tokens found in the prefix cache "
                                         "(their prefill skipped); hit rate = hits / queries", registry=r)
        self.steps = Counter("verispec_steps", "Engine steps (one batched verify pass each)", registry=r)
        self.step_rows = Histogram("verispec_step_rows", "Rows (sequences) verified together per step",
                                   buckets=_ROW_BUCKETS, registry=r)
        self.queued = Gauge("verispec_queued_requests", "Requests none of whose choices has a slot yet",
                            registry=r)
        self.running = Gauge("verispec_running_requests", "Requests with a choice in the batch (being prefilled or "
                             "decoding)", registry=r)
        self.batch_rows = Gauge("verispec_batch_rows", "Sequences decoding in the batch (rows of the next step)",
                                registry=r)
        self.waiting_sequences = Gauge("verispec_waiting_sequences", "Sequences (choices) waiting for a slot or "
                                       "being prefilled", registry=r)
        self.threads = Gauge("verispec_step_threads", "Threads the latest engine step ran on (--threads; under "
                             "'auto' fewer while other processes keep cores busy)", registry=r)
        # --online-train (server/online.py): zero and unchanging without it
        self.online_train_steps = Counter("verispec_online_train_steps", "Optimiser steps the online trainer took "
                                          "on the API keys' own draft heads", registry=r)
        self.online_swaps = Counter("verispec_online_swaps", "Trained weights swapped into a key's draft head "
                                    "(between engine steps)", registry=r)
        self.online_evictions = Counter("verispec_online_evictions", "Keys forgotten (their head, buffer and trained "
                                        "weights) to keep --online-max-keys", registry=r)
        self.online_buffer_tokens = Gauge("verispec_online_buffer_tokens", "Tokens (prompt + answer) the keys' "
                                          "training buffers hold, all keys together", registry=r)
        self.online_keys = Gauge("verispec_online_keys", "API keys with a draft head of their own", registry=r)
        self.online_loss = Gauge("verispec_online_loss", "Mean training loss of the latest online training round",
                                 registry=r)

    def count_request(self, endpoint: str, status: int, seconds: float | None = None) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        if seconds is not None:
            self.request_duration.labels(endpoint).observe(seconds)

    def observe_step(self, rows: int, speculative_ks: list[int], threads: int) -> None:
        self.steps.inc()
        self.threads.set(threads)
        self.step_rows.observe(rows)
        for k in speculative_ks:
            self.chosen_k.labels(str(k)).inc()

    def observe_round(self, committed: int) -> None:
        self.rounds.inc()
        self.generated_tokens.inc(committed)

    def observe_generation(self, stats: GenerationStats | None, speculative: bool, outcome: str) -> None:
        """At the end of a generation (stats: None when it was cancelled before its first round)."""
        self.generations.labels(outcome, str(speculative).lower()).inc()
        if stats is None:
            return
        self.draft_tokens.inc(stats.draft_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        self.fallbacks.inc(stats.fallbacks)
        self.prediction_tokens.inc(stats.draft_tokens_by_stage.get(PREDICTION, 0))
        self.accepted_prediction_tokens.inc(stats.accepted_by_stage.get(PREDICTION, 0))
        self.draft_seconds.inc(stats.draft_s)
        self.verify_seconds.inc(stats.verify_s)
        for position, (proposed, accepted) in enumerate(zip(stats.proposed_by_position,
                                                            stats.accepted_by_position)):
            self.draft_tokens_by_position.labels(str(position)).inc(proposed)
            self.accepted_tokens_by_position.labels(str(position)).inc(accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
