"""`ServedModel`: the target, its tokenizer and engine, the drafters requests may use, and prompt encoding.

Only the worker thread calls into it once the server runs (tokenizers and the engine are not shared across
threads); `load` runs before the worker starts.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import replace

from ..config import SamplingParams
from ..drafters.base import Drafter
from ..drafters.factory import NONE, make_drafter
from ..engine import CACHE_SLACK, SpeculativeEngine
from ..engine.scheduler import SchedulerConfig
from ..memory import kv_cache_bytes
from ..fallback import load_drafter_or_fallback
from ..models import ModelLoadError, load_model, load_tokenizer
from .config import ServerConfig
from .errors import APIError, invalid, model_not_found

logger = logging.getLogger("verispec.server")

# A prompt as the worker receives it: text, token ids, or chat messages ({"role", "content"} dicts).
Prompt = str | list[int] | list[dict]


def kv_bounded_slots(config: ServerConfig, target) -> int:
    """max_num_seqs, lowered to the slots the KV bound holds (a slot keeps max_len tokens of the target's KV).

    Raises ValueError when the bound holds no slot at all."""
    if config.kv_cache_memory_gb is None:
        return config.max_num_seqs
    dtype = next(target.parameters()).dtype
    per_slot = kv_cache_bytes(target.config, config.max_len + CACHE_SLACK, dtype)
    slots = int(config.kv_cache_memory_gb * 2**30 // per_slot)
    if slots < 1:
        raise ValueError(f"--kv-cache-memory {config.kv_cache_memory_gb:g} GiB holds no sequence: one slot of "
                         f"max_len {config.max_len} tokens needs {per_slot / 2**30:.3f} GiB; raise it or lower "
                         f"--max-len")
    if slots < config.max_num_seqs:
        logger.info("KV bound: %d slots of %d tokens fit in %g GiB (max_num_seqs %d)", slots, config.max_len,
                    config.kv_cache_memory_gb, config.max_num_seqs)
    return min(slots, config.max_num_seqs)


class ServedModel:
    def __init__(self, config: ServerConfig, target, tokenizer) -> None:
        self.config = config
        self.target = target
        self.tokenizer = tokenizer
        scheduler = SchedulerConfig(max_batched_tokens=config.max_batched_tokens,
                                    prefill_chunk_tokens=config.prefill_chunk_tokens)
        self.max_num_seqs = kv_bounded_slots(config, target)
        self.engine = SpeculativeEngine(target, tokenizer, drafter=None, spec=config.spec, max_len=config.max_len,
                                        max_batch_size=self.max_num_seqs, scheduler=scheduler, runner=config.runner)
        self.spec = config.spec  # the default speculation of requests (K may come from an 'auto' pair once loaded)
        self.vocab_size = len(tokenizer)
        self._default: tuple[str, Drafter | None] | None = None  # the server's --draft-model, never evicted
        self._cache: OrderedDict[str, Drafter | None] = OrderedDict()  # request-named drafters, LRU order

    @classmethod
    def load(cls, config: ServerConfig) -> ServedModel:
        """Load the target and tokenizer, and the default drafter when speculation is on by default.

        Raises ValueError (ModelLoadError) for a model that cannot be found or read."""
        target = load_model(config.model, dtype=config.dtype, device=config.device)
        tokenizer = load_tokenizer(config.model)
        served = cls(config, target, tokenizer)
        if config.speculates_by_default:
            served._default = (config.draft_model, served._load_drafter(config.draft_model))
        return served

    # -- drafters ------------------------------------------------------------------------------------------------

    def drafter(self, name: str | None) -> Drafter | None:
        """The drafter called `name` ('none' or None: no drafter), loading and caching it on first use.

        Raises APIError: 404 when the model cannot be found or read, 400 when it cannot draft for this target.
        """
        if name is None or name == NONE:
            return None
        if self._default is not None and name == self._default[0]:
            return self._default[1]
        if name in self._cache:
            self._cache.move_to_end(name)
            return self._cache[name]
        try:
            drafter = self._load_drafter(name)
        except ModelLoadError as exc:
            raise model_not_found(name, param="speculative.draft_model", hint=str(exc).rstrip(".")) from exc
        except ValueError as exc:  # e.g. a vocabulary that does not match the target's
            raise invalid(f"draft model {name!r} cannot draft for this target: {exc}",
                          param="speculative.draft_model") from exc
        if name == self.config.draft_model:
            self._default = (name, drafter)
        elif self.config.max_cached_drafters > 0:
            self._cache[name] = drafter
            while len(self._cache) > self.config.max_cached_drafters:
                evicted, _ = self._cache.popitem(last=False)
                logger.info("dropped drafter %s from the cache", evicted)
        return drafter

    def _load_drafter(self, name: str) -> Drafter | None:
        """The server's --draft-model loads as for `verispec generate`: a valid draft that does not fit in memory
        or fails to load leaves the target alone (with a warning), 'auto' picks the registered draft. Drafters
        that requests name are built as asked (make_drafter), so a request learns why one cannot be used."""
        logger.info("loading drafter %s", name)
        max_len = self.config.max_len + CACHE_SLACK
        if name == self.config.draft_model:
            loaded = load_drafter_or_fallback(name, self.target, self.tokenizer, max_len, dtype=self.config.dtype,
                                              device=self.config.device, target_name=self.config.model)
            if loaded.num_draft_tokens and self.config.draft_tokens_from_pair:
                self.spec = replace(self.spec, num_draft_tokens=loaded.num_draft_tokens)
            return loaded.drafter
        return make_drafter(name, self.target, self.tokenizer, max_len, dtype=self.config.dtype,
                            device=self.config.device)

    # -- prompts -------------------------------------------------------------------------------------------------

    def encode(self, prompt: Prompt, param: str) -> list[int]:
        """Text, token ids, or chat messages (through the tokenizer's chat template) -> token ids."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if prompt and isinstance(prompt[0], dict):
            return self._encode_chat(prompt)
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise invalid(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}).", param=param)
        return list(prompt)

    def _encode_chat(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise invalid("This model's tokenizer has no chat template: use POST /v1/completions with a prompt.",
                          param="messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - a template may raise anything (jinja's TemplateError, ...)
            raise invalid(f"The chat template rejected these messages: {exc}", param="messages") from exc
        # The template already wrote any BOS it wants; adding special tokens again would double it.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def check_request(self, prompt_len: int, params: SamplingParams, param: str) -> None:
        """The engine's length checks as a 400 (the engine would raise the same ValueError when it starts)."""
        if prompt_len < 1:
            raise invalid("The prompt is empty: give at least one token.", param=param)
        try:
            self.engine.check_request(prompt_len, params)
        except ValueError as exc:
            raise APIError(400, f"{exc} (this model's context is {self.config.max_len} tokens).", param=param,
                           code="context_length_exceeded") from exc
