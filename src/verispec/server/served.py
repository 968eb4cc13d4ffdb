"""`ServedModel`: the target, its tokenizer and engine, the drafters requests may use, and prompt encoding.

Threads, once the server runs: the front end's threads (server/prepare.py) encode prompts and check requests,
which only read the tokenizer and fixed sizes; everything else (drafters, the engine) is the worker thread's.
`load` runs before the worker starts, on a thread of its own that ends with it (`on_own_thread`), so that the
engine thread's OpenMP pool is the only one in the process: torch's CPU kernels run about 270 parallel regions a
decode step, and libgomp lets a pool's workers spin between regions only while the workers of all pools fit the
CPUs. A pool the loading main thread kept, idle, tipped that count on 2 CPUs, and the engine thread's worker
then slept in the kernel after each region (~300 context switches a step): a GGUF decode step took 9.9 ms in the
server against 5.0 ms in process (docs/bench.md, "Runs of 2026-11-26 (SERVE helper)").

Memory: the target's KV cache grows slot by slot up to `max_num_seqs` slots of `max_len` tokens, so the slots are
capped at start-up to what fits in free memory (`kv_bounded_slots`): further requests wait for a slot instead of
running the machine out of memory. A drafter a request names must be on the operator's allow-list; a model
drafter's weights and KV cache are checked against free memory on the device it will run on (less the target KV
still to come, on the target's) before it loads, and at most `max_cached_drafters` of them stay loaded (least
recently used dropped first).
"""

from __future__ import annotations

import gc
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from ..config import SamplingParams, cache_len
from ..drafters.base import Drafter
from ..drafters.build import build_drafter
from ..drafters.head import HeadDrafter
from ..drafters.placement import same_device
from ..drafters.suffix import shared_cache
from ..drafters.spec import NONE, parse_drafter_spec
from ..drafters.twin import twin_memory_bytes
from ..engine import SpeculativeEngine
from ..engine.budget import PrefillBudget, budget_from_costs, probe_chunk_costs, step_tokens
from ..engine.scheduler import SchedulerConfig
from ..runtime.model.memory import HEADROOM, free_memory_bytes, gib, kv_cache_bytes, weights_bytes
from ..runtime.model.loading import ModelLoadError, load_tokenizer, read_model_config, resolve_model_path
from ..runtime.model.target import load_target
from ..sampling.grammar import prepare_tokenizer
from .config import ServerConfig
from .errors import APIError, invalid, model_not_found
from .tools import ToolFormat, detect_format

logger = logging.getLogger("verispec.server")

T = TypeVar("T")



@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages with what the chat template also takes: the tools, where the template renders them."""

    messages: list[dict]  # as the template reads them (server/tools/ formats write a history's calls and results)
    tools: list[dict] | None = None  # OpenAI-shaped function definitions for the template's `tools=`


# A prompt as the worker receives it: text, token ids, or chat messages ({"role", "content"} dicts, or a ChatPrompt).
Prompt = str | list[int] | list[dict] | ChatPrompt


def kv_slot_bytes(config: ServerConfig, target) -> int:
    """The target's KV cache of one slot (max_len tokens)."""
    return kv_cache_bytes(target.config, cache_len(config.max_len), next(target.parameters()).dtype)


def kv_bounded_slots(config: ServerConfig, target, free_bytes: int | None = None) -> int:
    """max_num_seqs, lowered to the slots the KV bound holds (a slot keeps max_len tokens of the target's KV) and
    to those that fit in HEADROOM x free memory (`free_bytes`, measured by default): the cache grows slot by slot,
    so without this a busy server would run out of memory mid-request instead of queueing.

    Raises ValueError when the bound or the free memory holds no slot at all."""
    per_slot = kv_slot_bytes(config, target)
    slots = config.max_num_seqs
    if config.kv_cache_memory_gb is not None:
        slots = int(config.kv_cache_memory_gb * 2**30 // per_slot)
        if slots < 1:
            raise ValueError(f"--kv-cache-memory {config.kv_cache_memory_gb:g} GiB holds no sequence: one slot of "
                             f"max_len {config.max_len} tokens needs {per_slot / 2**30:.3f} GiB; raise it or lower "
                             f"--max-len")
        if slots < config.max_num_seqs:
            logger.info("KV bound: %d slots of %d tokens fit in %g GiB (max_num_seqs %d)", slots, config.max_len,
                        config.kv_cache_memory_gb, config.max_num_seqs)
    free = free_memory_bytes(config.device) if free_bytes is None else free_bytes
    if free is not None:
        fit = int(HEADROOM * free // per_slot)
        if fit < 1:
            raise ValueError(f"free memory ({gib(free)}) holds no KV cache slot of max_len {config.max_len} tokens "
                             f"({gib(per_slot)}): lower --max-len or free memory")
        if fit < min(slots, config.max_num_seqs):
            logger.warning("only %d KV cache slots of %d tokens fit in free memory (%s): at most %d sequences "
                           "decode at once, more wait for a slot", fit, config.max_len, gib(free), fit)
        slots = min(slots, fit)
    return min(slots, config.max_num_seqs)


def prefix_cache_tokens(config: ServerConfig, target, slots: int, free_bytes: int | None = None) -> int:
    """Tokens the prefix cache keeps: with --kv-cache-memory, what the bound leaves beyond the slots' KV; else as
    many as the slots hold, within HEADROOM x free memory beside them (`free_bytes`, measured by default)."""
    if not config.enable_prefix_caching:
        return 0
    per_slot = kv_slot_bytes(config, target)
    per_token = per_slot / cache_len(config.max_len)
    if config.kv_cache_memory_gb is not None:
        room = config.kv_cache_memory_gb * 2**30 - slots * per_slot
    else:
        room = slots * per_slot
        free = free_memory_bytes(config.device) if free_bytes is None else free_bytes
        if free is not None:
            room = min(room, HEADROOM * free - slots * per_slot)
    return max(int(room // per_token), 0)


def on_own_thread(work: Callable[[], T]) -> T:
    """work() on a new thread that ends with it (its exception raised here): the OpenMP pool that the thread's torch
    ops start ends with the thread, and none stays behind on the calling thread. The thread is a daemon: Ctrl-C
    during a long load exits without waiting for it."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as it is
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="verispec-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class ServedModel:
    def __init__(self, config: ServerConfig, target, tokenizer) -> None:
        self.config = config
        self.target = target
        self.tokenizer = tokenizer
        self.max_num_seqs = kv_bounded_slots(config, target)
        prefix_tokens = prefix_cache_tokens(config, target, self.max_num_seqs)
        if config.enable_prefix_caching:
            logger.info("prefix caching: up to %d tokens of prompt prefixes kept", prefix_tokens)
        self.engine = SpeculativeEngine(target, tokenizer, drafter=None, spec=config.spec, max_len=config.max_len,
                                        max_batch_size=self.max_num_seqs, runner=config.runner,
                                        enable_prefix_caching=config.enable_prefix_caching,
                                        prefix_cache_tokens=prefix_tokens)
        self.prefill_budget = self._choose_budget(config)
        self.spec = config.spec  # the default speculation of requests (K may come from an 'auto' pair once loaded)
        self.vocab_size = len(tokenizer)
        self.draft_models = config.draft_models  # request name -> drafter value (the operator's allow-list)
        self.suffix_cache = shared_cache(config.suffix_cache_tokens)  # what every `suffix` drafter here learns into
        self._default: tuple[str, Drafter | None] | None = None  # the server's --draft-model, never evicted
        self._cache: OrderedDict[str, Drafter | None] = OrderedDict()  # request-named drafters, LRU order
        self._tool_format: ToolFormat | None = None

    def _choose_budget(self, config: ServerConfig) -> PrefillBudget | None:
        """The scheduler's chunk and step budget: as configured, else measured on the engine's runner
        (engine/budget.py), said in the log. -> the measured budget (None: both configured)."""
        budget, chunk, batched = None, config.prefill_chunk_tokens, config.max_batched_tokens
        if chunk is None:
            decode_s, chunk_s = probe_chunk_costs(self.engine.target, config.prefill_chunk_steps)
            budget = budget_from_costs(chunk_s, decode_s, self.max_num_seqs, config.prefill_chunk_steps)
            chunk = budget.chunk_tokens
            logger.info("%s", budget.describe())
        if batched is None:
            batched = step_tokens(chunk, self.max_num_seqs)
        self.engine.scheduler.config = SchedulerConfig(max_batched_tokens=batched, prefill_chunk_tokens=chunk)
        return budget

    @classmethod
    def load(cls, config: ServerConfig) -> ServedModel:
        """Load the target and tokenizer, and the default drafter when speculation is on by default, on a thread of
        their own (see the module's docstring).

        Raises ValueError (ModelLoadError) for a model that cannot be found or read."""
        return on_own_thread(lambda: cls._load(config))

    @classmethod
    def _load(cls, config: ServerConfig) -> ServedModel:
        target = load_target(config.model, config.weights, config.quantization, dtype=config.dtype,
                             device=config.device, activations=config.activations)
        tokenizer = load_tokenizer(config.model, config.chat_template)
        served = cls(config, target, tokenizer)
        engine = served.engine
        prepare_tokenizer(tokenizer, engine.target.vocab_size, engine.eos_token_ids)  # ~0.6 s for a 49k vocabulary
        logger.info("tool calling: %s format", served.tool_format.name)
        if config.speculates_by_default or config.online_train != "off":
            served._default = (config.draft_model, served._load_drafter(config.draft_model))
        if config.online_train != "off" and not isinstance(served._default[1], HeadDrafter):
            raise ValueError(f"--online-train {config.online_train} trains the served draft head, and "
                             f"{config.draft_model!r} did not load as one (see the warning above)")
        return served

    @property
    def default_drafter(self) -> Drafter | None:
        """The server's --draft-model once loaded (None before, or when it left the target alone)."""
        return None if self._default is None else self._default[1]

    # -- drafters ------------------------------------------------------------------------------------------------

    def drafter(self, name: str | None) -> Drafter | None:
        """The drafter called `name` ('none' or None: no drafter), loading and caching it on first use.

        Raises APIError: 400 when the operator does not allow that name or it cannot draft for this target, 404
        when its model cannot be found or read, 503 when it does not fit in memory.
        """
        if name is None or name == NONE:
            return None
        value = self.draft_models.get(name)
        if value is None:  # checked before anything touches the filesystem: a request never names a path
            names = ", ".join(f"`{allowed}`" for allowed in self.draft_models)
            raise APIError(400, f"The drafter `{name}` is not allowed on this server; requests may name {names}. "
                                "The operator allows more with --allowed-draft-models.",
                           param="speculative.draft_model", code="draft_model_not_allowed")
        if self._default is not None and name == self._default[0]:
            return self._default[1]
        if name in self._cache:
            self._cache.move_to_end(name)
            return self._cache[name]
        try:
            self._make_room(name, value)
            drafter = self._load_drafter(value)
        except ModelLoadError as exc:
            raise model_not_found(name, param="speculative.draft_model", hint=str(exc).rstrip(".")) from exc
        except ValueError as exc:  # e.g. a vocabulary that does not match the target's
            raise invalid(f"draft model {name!r} cannot draft for this target: {exc}",
                          param="speculative.draft_model") from exc
        if value == self.config.draft_model:
            self._default = (value, drafter)
        elif self.config.max_cached_drafters > 0:
            self._cache[name] = drafter
            while len(self._cache) > self.config.max_cached_drafters:
                evicted, _ = self._cache.popitem(last=False)
                logger.info("dropped drafter %s from the cache", evicted)
        return drafter

    def _make_room(self, name: str, value: str) -> None:
        """Check that a drafter fits in free memory before it loads (a model's weights and its KV cache for every
        slot, on the draft device; a twin's, on the target's, drafters/placement.py), dropping cached drafters
        when that makes it fit. Raises APIError 503 when it cannot."""
        spec = parse_drafter_spec(value)
        # The target's quantized twins: counted from the target's config (their weights and KV caches).
        twins = sum(twin_memory_bytes(stage.name, self.target.config, cache_len(self.config.max_len),
                                      self.max_num_seqs, self.config.dtype)
                    for stage in spec.stages if stage.kind == "twin")
        model = 0
        if spec.model is not None:
            path = resolve_model_path(spec.model)
            config = read_model_config(path)
            weights = weights_bytes(path, self.config.dtype)
            if config is None or weights is None:
                return  # unknown size: loading reports any real problem
            model = weights + self.max_num_seqs * kv_cache_bytes(config, cache_len(self.config.max_len),
                                                                 self.config.dtype)
        target_device = self.config.device
        draft_device = self.config.draft_device or target_device
        if same_device(draft_device, target_device):
            needs = [(target_device, twins + model)]
        else:
            needs = [(target_device, twins), (draft_device, model)]
        needs = [(device, need) for device, need in needs if need]  # none for n-gram and other weightless drafters
        while (short := self._short(needs)) is not None:
            device, need, room = short
            if not self._cache:
                raise APIError(503, f"The drafter `{name}` needs {gib(need)} (weights and KV cache for "
                                    f"{self.max_num_seqs} slots) on {device} and only {gib(room)} is free for it "
                                    "there; use another drafter or none.",
                               param="speculative.draft_model", code="insufficient_memory")
            evicted, _ = self._cache.popitem(last=False)
            gc.collect()
            logger.info("dropped drafter %s from the cache to make room for %s", evicted, name)

    def _short(self, needs: list[tuple[str, int]]) -> tuple[str, int, int] | None:
        """The first (device, bytes needed, room) of `needs` ((device, bytes) pairs) that does not fit, or None."""
        for device, need in needs:
            room = self._room(device)
            if room is not None and need > room:
                return device, need, room
        return None

    def _room(self, device: str) -> int | None:
        """Bytes a drafter may take on `device` (HEADROOM x its free memory, less on the target's device what the
        target's cache grows into later: the slots it has not taken yet); None where free memory is unknown."""
        free = free_memory_bytes(device)
        if free is None:
            return None
        spoken_for = 0
        if same_device(device, self.config.device):
            spoken_for = self.max_num_seqs * kv_slot_bytes(self.config, self.target) - _kv_allocated(self.engine)
        return int(HEADROOM * free - spoken_for)

    def _load_drafter(self, name: str) -> Drafter | None:
        """The server's --draft-model loads as for `verispec generate`: a valid draft that does not fit in memory
        or fails to load leaves the target alone (with a warning), 'auto' picks the registered draft. Drafters
        that requests name are built as asked (on_error "raise"), so a request learns why one cannot be used."""
        logger.info("loading drafter %s", name)
        default = name == self.config.draft_model
        loaded = build_drafter(name, self.target, self.tokenizer, self.config.max_len, dtype=self.config.dtype,
                               device=self.config.draft_device or self.config.device,
                               on_error="fallback" if default else "raise",
                               target_name=self.config.model)
        if default and loaded.num_draft_tokens and self.config.draft_tokens_from_pair:
            self.spec = replace(self.spec, num_draft_tokens=loaded.num_draft_tokens)
        return loaded.drafter

    # -- prompts -------------------------------------------------------------------------------------------------

    @property
    def tool_format(self) -> ToolFormat:
        """How this model is shown tools and writes calls (server/tools/select.py), read off its chat template once."""
        if self._tool_format is None:
            self._tool_format = detect_format(self.tokenizer)
        return self._tool_format

    def encode(self, prompt: Prompt, param: str) -> list[int]:
        """Text, token ids, or chat messages (through the tokenizer's chat template) -> token ids."""
        if isinstance(prompt, str):
            return self._tokenize(prompt, param, add_special_tokens=True)
        if isinstance(prompt, ChatPrompt):
            return self._encode_chat(prompt.messages, prompt.tools)
        if prompt and isinstance(prompt[0], dict):
            return self._encode_chat(prompt)
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise invalid(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}).", param=param)
        return list(prompt)

    def _encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise invalid("This model's tokenizer has no chat template: use POST /v1/completions with a prompt.",
                          param="messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as exc:  # noqa: BLE001 - a template may raise anything (jinja's TemplateError, ...)
            raise invalid(f"The chat template rejected these messages: {exc}", param="messages") from exc
        # The template already wrote any BOS it wants; adding special tokens again would double it.
        return self._tokenize(text, "messages", add_special_tokens=False)

    def _tokenize(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        except (TypeError, ValueError, UnicodeError) as exc:  # a lone surrogate ("\\ud800") is valid JSON
            raise invalid(f"The text cannot be tokenized ({type(exc).__name__}); send valid UTF-8 text.",
                          param=param) from exc

    def check_prompt(self, prompt_len: int, param: str) -> None:
        """A prompt that is scored, not continued (an echo with max_tokens 0): 1 to max_len tokens, else a 400."""
        if prompt_len < 1:
            raise invalid("The prompt is empty: give at least one token.", param=param)
        if prompt_len > self.config.max_len:
            raise APIError(400, f"The prompt has {prompt_len} tokens, more than this model's context of "
                                f"{self.config.max_len} tokens.", param=param, code="context_length_exceeded")

    def encode_prediction(self, text: str) -> list[int]:
        """A prediction's text -> its token ids (as the answer would spell it: no special tokens added)."""
        return self._tokenize(text, "prediction", add_special_tokens=False)

    def check_prediction(self, prompt_len: int, prediction_len: int) -> None:
        """A prediction the context cannot hold after the prompt is a 400 (the engine's own check)."""
        try:
            self.engine.check_request(prompt_len, SamplingParams(max_new_tokens=1), prediction_len)
        except ValueError as exc:
            raise APIError(400, f"{exc} (this model's context is {self.config.max_len} tokens).",
                           param="prediction", code="context_length_exceeded") from exc

    def check_request(self, prompt_len: int, params: SamplingParams, param: str) -> None:
        """The engine's length checks as a 400 (the engine would raise the same ValueError when it starts)."""
        if prompt_len < 1:
            raise invalid("The prompt is empty: give at least one token.", param=param)
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise invalid(f"stop token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}).",
                          param="stop_token_ids")
        try:
            self.engine.check_request(prompt_len, params)
        except ValueError as exc:
            raise APIError(400, f"{exc} (this model's context is {self.config.max_len} tokens).", param=param,
                           code="context_length_exceeded") from exc


def _kv_allocated(engine: SpeculativeEngine) -> int:
    """Bytes the target's KV cache holds now (its buffers grow as slots are first used)."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in engine.target.cache.layers
               if layer.is_initialized)
