"""Online training of the served draft head (`verispec serve --online-train head`): per API key, from its own traffic.

What is learnt, and from what: each finished request that drafted with the deployment's head leaves its prompt, its
committed answer and the target's features at those positions (the ones the prefill and the verify passes already
computed for the head: no extra target pass) in a bounded buffer of its API key (`key`: a hash of the credentials
the request sent; requests without any share one anonymous bucket). Once a key's buffer has taken
`online_train_every` new answer tokens, a background thread takes `ROUND_STEPS` optimiser steps on that key's copy
of the head (made from the deployment's head at its first training: copy on first train), with the offline
training's loss (distill/head.py `head_loss`), and publishes the new weights, packed as a forward runs them.

Who drafts with what: every request of key A drafts with A's drafter (`KeyHead`: the deployment's head forked, with
slots of its own, made at A's first request), never with weights trained on another key's traffic. The worker
swaps published weights into a key's drafter between engine steps (`OnlineHeads.swap`), never during one. At most
`online_max_keys` keys keep a drafter and a trainer's state; the least recently used key is forgotten (drafter,
buffer, trained weights) and starts again from the deployment's head.

Why outputs cannot change: a draft only proposes; verification keeps exactly the target's tokens (greedy: its
argmax; sampled: rejection sampling or coupled noise, both exact whatever q is). Swapping weights changes q and
acceptance, never the committed tokens.

Cost: the trainer runs on one thread at the lowest CPU priority (nice 19), with torch's ops and the GIL shared with
the engine thread; memory per key: a float32 copy of the head's trainable weights with AdamW's two moments and
gradients (about 4x the head), one packed copy for drafting, the head's KV slots, and the buffer's features
(float16, `online_buffer_tokens` x hidden).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..drafters.head import HeadConfig, HeadDrafter, HeadWeights, pack_head
from .config import ServerConfig
from .metrics import ServerMetrics

if TYPE_CHECKING:
    from ..distill.head import HeadNet
    from .served import ServedModel

logger = logging.getLogger("verispec.server")

# A round: ROUND_STEPS steps on up to BATCH_TOKENS tokens, once per `every` (256) answer tokens. With the shipped
# SmolLM2 head, a round of 400 tokens took 1.0-1.5 s on 2 busy cores (load 8), where 256 tokens take ~15 s to serve
# (docs/server.md, "Online training"). The trainer runs on what the engine leaves (nice 19) and never queues work: a
# key that took more tokens meanwhile trains once, on its newest.
ROUND_STEPS = 1  # optimiser steps a key's head takes each time its buffer has taken `every` new answer tokens
TRAIN_LENGTH = 256  # tokens of each request's end a training window holds (as distill --head's train_length)
BATCH_TOKENS = 512  # most tokens of one training batch: the newest requests of the key's buffer that fit
UNROLL = 2  # steps of the unrolled loss (distill/head.py; distill --head's default is 3): a third less per step
FEATURE_DTYPE = torch.float16  # the buffer's features (half the bytes; the loss reads them as float32)
TRAINER_NICE = 19  # the trainer thread's CPU priority: the engine thread always goes first


@dataclass
class Traffic:
    """One finished request as training data: what the head saw and the target kept."""

    prompt_ids: torch.Tensor  # [P] long
    response_ids: torch.Tensor  # [R] long: the committed answer (as far as features reach)
    features: torch.Tensor  # [P + R, hidden] FEATURE_DTYPE: the target's feature at each position

    @property
    def tokens(self) -> int:
        return self.prompt_ids.numel() + self.response_ids.numel()


@dataclass
class _Seen:
    """What a key's drafter has seen of the sequence in one slot."""

    prompt_len: int
    tokens: list[int]  # prompt + committed so far
    features: list[torch.Tensor] = field(default_factory=list)  # [m, hidden] each, positions 0.. in order


class KeyHead(HeadDrafter):
    """One API key's draft head: the deployment's head forked (same weights until the first swap, slots of its own)
    that also records what its sequences commit, for that key's buffer (`record(traffic)` at `release`)."""

    wants_tokens = True

    def __init__(self, base: HeadDrafter, record: Callable[[Traffic], None]) -> None:
        vars(self).update(vars(base.fork()))  # the base's state, forked: no second load of the weights
        self._record = record
        self._seen: dict[int, _Seen] = {}  # slot -> its sequence so far

    def begin(self, slot: int, prompt_ids: torch.Tensor) -> None:
        super().begin(slot, prompt_ids)
        self._seen[slot] = _Seen(prompt_ids.numel(), prompt_ids.tolist())

    def observe_features(self, slot: int, features: torch.Tensor) -> None:
        super().observe_features(slot, features)
        self._seen[slot].features.append(features.detach().to("cpu", FEATURE_DTYPE))

    def observe_tokens(self, slot: int, token_ids: list[int]) -> None:
        self._seen[slot].tokens += token_ids

    def move_slot(self, src: int, dst: int) -> None:
        super().move_slot(src, dst)
        if src in self._seen:
            self._seen[dst] = self._seen.pop(src)

    def release(self, slot: int) -> None:
        super().release(slot)
        seen = self._seen.pop(slot, None)
        if seen is None or not seen.features:
            return
        features = torch.cat(seen.features)  # [n, hidden]: the last round's features never arrive
        n = min(features.shape[0], len(seen.tokens))
        if n > seen.prompt_len:  # the answer has features to learn from
            tokens = torch.tensor(seen.tokens[:n], dtype=torch.long)
            self._record(Traffic(tokens[: seen.prompt_len], tokens[seen.prompt_len :], features[:n]))


@dataclass
class _KeyState:
    """A key's buffer and, once it trained, its trainable head and optimiser (the trainer thread's)."""

    buffer: deque[Traffic] = field(default_factory=deque)
    tokens: int = 0  # tokens the buffer holds
    fresh: int = 0  # answer tokens taken since the key last trained
    net: HeadNet | None = None  # made at the key's first training round
    optimiser: torch.optim.Optimizer | None = None
    steps: int = 0
    losses: list[float] = field(default_factory=list)  # each training round's mean loss, in order


@dataclass(frozen=True)
class OnlineSettings:
    """The online training knobs (ServerConfig's `online_*` fields)."""

    every: int  # new answer tokens of a key between its training rounds
    max_keys: int  # keys that keep their own head; the least recently used one is forgotten beyond
    buffer_tokens: int  # tokens (prompt + answer) of its latest requests a key's buffer keeps
    lr: float  # AdamW's learning rate


class OnlineHeads:
    """The per-key heads of one deployment and their trainer thread. `drafter_for` and `swap` run on the engine
    thread; `_train_loop` on its own; `_lock` guards the keys' states and the published weights between them."""

    def __init__(self, base: HeadDrafter, config: HeadConfig, weights: dict[str, torch.Tensor], lm: torch.Tensor,
                 settings: OnlineSettings, metrics: ServerMetrics | None = None, seed: int = 0) -> None:
        self.base = base  # the deployment's head: what a key starts from
        self._config, self._weights = config, weights  # the head as loaded
        # The frozen tensors every key's trainable head reads, shared (float32 views where the target is float32):
        # detached from the target's parameters, the rotary tables copied out of inference mode (autograd saves them).
        self._frozen = (base.embed.detach().float(), lm, base.cos.float().clone(), base.sin.float().clone())
        self.settings = settings
        self.metrics = metrics
        self.seed = seed
        self._drafters: OrderedDict[str, KeyHead] = OrderedDict()  # key -> its drafter, least recently used first
        self._states: dict[str, _KeyState] = {}
        self._published: dict[str, HeadWeights] = {}  # key -> weights to swap in before the next step
        self._lock = threading.Condition()
        self._busy = False  # the trainer is training a key now
        self._stopping = False
        self._thread: threading.Thread | None = None

    @classmethod
    def for_head(cls, base: HeadDrafter, head_dir: Path, target, settings: OnlineSettings,
                 metrics: ServerMetrics | None = None) -> OnlineHeads:
        """The online heads of `base`, the drafter of the head in `head_dir` on `target`."""
        from ..drafters.head import load_head

        config, weights = load_head(head_dir)
        lm = target.get_output_embeddings().weight.detach()[base.vocab.cpu()].float()  # [V', hidden], frozen
        return cls(base, config, weights, lm, settings, metrics)

    # -- the engine thread ---------------------------------------------------------------------------------------

    def drafter_for(self, key: str) -> KeyHead:
        """Key `key`'s drafter, made (from the deployment's head) at its first request; the least recently used key
        beyond `max_keys` is forgotten."""
        drafter = self._drafters.get(key)
        if drafter is not None:
            self._drafters.move_to_end(key)
            return drafter
        drafter = self._drafters[key] = KeyHead(self.base, lambda traffic: self._add(key, drafter, traffic))
        while len(self._drafters) > self.settings.max_keys:
            evicted, _ = self._drafters.popitem(last=False)
            with self._lock:
                self._states.pop(evicted, None)
                self._published.pop(evicted, None)
            self._count("online_evictions")
        self._gauges()
        return drafter

    def swap(self) -> int:
        """Swap every key's newly published weights into its drafter (between steps) -> how many were swapped."""
        with self._lock:
            published, self._published = self._published, {}
        for key, weights in published.items():
            if key in self._drafters:
                self._drafters[key].swap_weights(weights)
                self._count("online_swaps")
        return len(published)

    def _add(self, key: str, drafter: KeyHead, traffic: Traffic) -> None:
        """A finished request of `key` (recorded by `drafter`) joins the key's buffer; the trainer wakes once the
        key has taken `every` new answer tokens. A drafter its key no longer holds (forgotten) records nothing."""
        if self._drafters.get(key) is not drafter:
            return
        with self._lock:
            state = self._states.setdefault(key, _KeyState())
            state.buffer.append(traffic)
            state.tokens += traffic.tokens
            state.fresh += traffic.response_ids.numel()
            while state.tokens > self.settings.buffer_tokens and len(state.buffer) > 1:
                state.tokens -= state.buffer.popleft().tokens
            self._lock.notify_all()
        self._gauges()

    # -- the trainer thread --------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._train_loop, name="verispec-online-train", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def wait_idle(self, timeout: float) -> bool:
        """Until no key is due to train and no training runs (tests; a bound, not a guess at speed) -> whether so."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._busy and self._due() is None, timeout=timeout)

    def losses(self, key: str) -> list[float]:
        """Key `key`'s mean training loss of each round so far (before each round's steps: what it learnt since)."""
        with self._lock:
            state = self._states.get(key)
            return [] if state is None else list(state.losses)

    def _due(self) -> str | None:
        """The key whose buffer took the most new answer tokens past `every`, or None."""
        due = [(state.fresh, key) for key, state in self._states.items() if state.fresh >= self.settings.every]
        return max(due)[1] if due else None

    def _train_loop(self) -> None:
        try:  # Linux gives each thread its own nice value: only this thread yields to the engine's
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TRAINER_NICE)
        except (AttributeError, OSError):  # another OS: the thread keeps the process's priority
            logger.info("online training: the trainer thread's priority could not be lowered")
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._stopping or self._due() is not None)
                if self._stopping:
                    return
                key = self._due()
                state = self._states[key]
                state.fresh = 0
                batch = _newest(state.buffer, BATCH_TOKENS)
                self._busy = True
            try:
                weights = self._train(state, batch)
            except Exception:  # noqa: BLE001 - a failed round leaves the key's drafter as it was, never the server
                logger.exception("online training of a key's head failed")
                weights = None
            with self._lock:
                self._busy = False
                if weights is not None and self._states.get(key) is state:  # not forgotten meanwhile
                    self._published[key] = weights
                self._lock.notify_all()

    def _train(self, state: _KeyState, batch: list[Traffic]) -> HeadWeights:
        """ROUND_STEPS optimiser steps of `state`'s head on `batch` -> its new weights, packed for drafting."""
        from ..distill.head import HeadNet, head_loss, window_batch

        if state.net is None:  # copy on first train: the key's own trainable head, from the deployment's
            state.net = HeadNet.from_weights(self._config, self._weights, *self._frozen)
            params = list(state.net.parameters())
            state.optimiser = torch.optim.AdamW(
                [{"params": [p for p in params if p.dim() > 1]},
                 {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
                lr=self.settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
        net, optimiser = state.net, state.optimiser
        tokens, inputs, wanted, valid = window_batch(batch, [t.features for t in batch], TRAIN_LENGTH,
                                                     prompt_loss=False, hidden=self._config.hidden_size)
        torch.manual_seed(self.seed + state.steps)  # nothing draws today; fixed should the loss ever sample
        losses = []
        for _ in range(ROUND_STEPS):
            loss, _ = head_loss(net, tokens, inputs, wanted, valid, UNROLL)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            optimiser.step()
            losses.append(loss.item())
            state.steps += 1
            self._count("online_train_steps")
        state.losses.append(sum(losses) / len(losses))
        if self.metrics is not None:
            self.metrics.online_loss.set(state.losses[-1])
        return pack_head(self.base.spec, net.export(), self.base.dtype, self.base.device)

    # -- metrics ---------------------------------------------------------------------------------------------------

    def _count(self, name: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, name).inc()

    def _gauges(self) -> None:
        if self.metrics is not None:
            with self._lock:
                self.metrics.online_buffer_tokens.set(sum(s.tokens for s in self._states.values()))
            self.metrics.online_keys.set(len(self._drafters))


def _newest(buffer: deque[Traffic], tokens: int) -> list[Traffic]:
    """The newest requests of `buffer` whose windows (at most TRAIN_LENGTH + 1 tokens each) fit in `tokens` (one at
    least), oldest first."""
    chosen, total = [], 0
    for traffic in reversed(buffer):
        size = min(traffic.tokens, TRAIN_LENGTH + 1)
        if chosen and total + size > tokens:
            break
        chosen.append(traffic)
        total += size
    return chosen[::-1]


def online_heads(config: ServerConfig, served: ServedModel,
                 metrics: ServerMetrics | None = None) -> OnlineHeads | None:
    """The online heads of a served model (loaded with `config`) when the config turns them on, else None."""
    if config.online_train == "off":
        return None
    from ..drafters.spec import parse_drafter_spec

    settings = OnlineSettings(every=config.online_train_every, max_keys=config.online_max_keys,
                              buffer_tokens=config.online_buffer_tokens, lr=config.online_lr)
    head_dir = parse_drafter_spec(config.draft_model).stages[0].head_dir
    return OnlineHeads.for_head(served.default_drafter, head_dir, served.target, settings, metrics)
