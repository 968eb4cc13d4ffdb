"""`ServerConfig`: what `create_app` needs to serve one target. The CLI builds it by keyword."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import RunnerOptions, SpeculativeConfig
from ..drafters.placement import check_device
from ..drafters.spec import DEFAULT_HEAD, NONE, parse_drafter_spec
from ..runtime.model.loading import DEFAULT_DRAFTER, DEFAULT_TARGET
from ..runtime.model.target import TargetOptions, resolve_target
from .protocol import MAX_CHOICES

NGRAM = "ngram"
ONLINE_TRAIN = ("off", "head")  # what --online-train may keep training (a draft model's online training: not built)


@dataclass(frozen=True)
class ServerConfig:
    model: str = DEFAULT_TARGET
    """Target: model folder, .gguf file, cached hub id, or the embedded default's name."""
    chat_template: Path | None = None
    """A Jinja chat template file for the chat API (default: the model's own, else its architecture's known one)."""
    draft_model: str = DEFAULT_DRAFTER
    """Default drafter for requests that speculate: a model (same forms) or 'none' (the target alone)."""
    enable_speculative: bool = False
    """Speculate unless a request says otherwise; when False, only requests that ask for it speculate."""
    spec: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """Default speculation (K, threshold, adaptive depth); a request may change K."""
    draft_tokens_from_pair: bool = False
    """With draft_model 'auto': take K from the registered pair the server picks (as `verispec generate` does
    when --draft-tokens is not given) instead of spec.num_draft_tokens."""
    served_model_name: str | None = None
    """The id /v1/models lists and requests name; default: the model's folder name (or the name given)."""
    max_len: int = 2048
    """Longest prompt + output in tokens (the KV cache is allocated for this)."""
    dtype: torch.dtype | str = "auto"
    """Weights dtype of the target and of every drafter the server loads: a torch dtype, its name, or 'auto'
    (runtime/model/dtype.py: bf16 where the device computes it natively and speculation stays exact); resolved to a
    torch dtype when the config is made, with `dtype_reason` saying why."""
    dtype_reason: str = ""
    """Why the dtype is what it is (set from `dtype`)."""
    weights: str = "auto"
    """The target's weights: 'auto' (a GGUF target's own blocks where verispec's kernel runs them and the dtype is
    auto; else the float conversion: `target.resolve_weights`), 'fp32' (the float conversion) or 'gguf' (a GGUF
    target's own quantized blocks); resolved when the config is made, with `weights_reason` saying why."""
    weights_reason: str = ""
    """Why the weights are what they are (set from `weights`)."""
    quantization: str = "none"
    """'int8': the target's linears quantized per output channel (a different model than the original)."""
    activations: str = "auto"
    """What GGUF blocks compute with: 'q8' (integer activations, as llama.cpp), 'fp32' (the fp32 conversion's
    values), 'auto' (`target.resolve_activations`); resolved when the config is made, with `activations_reason`."""
    activations_reason: str = ""
    """Why the activations are what they are (set from `activations`)."""
    device: str = "cpu"
    """Torch device of the target (and of the drafters, unless draft_device says otherwise)."""
    draft_device: str | None = None
    """Torch device of the draft models (--draft-device; drafters/placement.py); None: `device`. A draft head or
    twin stays on `device` (it shares the target's tensors)."""
    max_cached_drafters: int = 4
    """Drafters named by requests that stay loaded (least recently used ones are dropped); the default stays."""
    max_num_seqs: int = 16
    """Sequences (choices) decoding together in one batch; more wait in a FIFO queue (--max-num-seqs)."""
    max_batched_tokens: int | None = None
    """Tokens fed to the target per step: decoding rows (K + 1 each), then prefill chunks (--max-batched-tokens).
    None: one chunk's worth (at least max_num_seqs), so a prompt feeds one chunk a step beside decoding rows."""
    prefill_chunk_tokens: int | None = None
    """Most prompt tokens per prefill forward, so a long prompt does not stall decoding for long
    (--prefill-chunk-tokens). None: chosen at start from measured costs (engine/budget.py: the widest chunk whose
    forward costs at most prefill_chunk_steps decode steps, or 8 where even the narrowest costs more), said in the
    log."""
    prefill_chunk_steps: float = 2.0
    """The bound of the chosen chunk: its forward costs at most this many decode steps, so streaming clients'
    inter-token time while a long prompt arrives stays within about (1 + this)x (--prefill-chunk-steps)."""
    kv_cache_memory_gb: float | None = None
    """Bound on the target's KV cache in GiB: each slot holds max_len tokens, so the bound caps the slots
    (sequences decoding at once) below max_num_seqs (--kv-cache-memory). None: max_num_seqs slots."""
    enable_prefix_caching: bool = True
    """Keep the KV of prompt prefixes for later requests that start the same (--[no-]enable-prefix-caching): it
    takes what --kv-cache-memory leaves beyond the slots, else as many tokens as the slots hold (within free
    memory)."""
    runner: RunnerOptions = field(default_factory=RunnerOptions)
    """What runs the models: the native Llama-family runner or Hugging Face modeling (--runner, --compile)."""
    # -- limits for untrusted clients (docs/server.md, "Running it safely") --
    api_key: str | None = None
    """Every /v1 request must send `Authorization: Bearer <api_key>` (--api-key, VERISPEC_API_KEY); None: open."""
    allowed_draft_models: tuple[str, ...] | None = None
    """Drafters a request may name in `speculative.draft_model`: entries NAME (a drafter value, named as itself)
    or NAME=VALUE (requests say NAME, the server loads VALUE: a path stays private). The served draft_model and
    'none' are always allowed; None: also 'ngram' (--allowed-draft-models)."""
    max_queued_requests: int = 128
    """Requests waiting for a slot at once; one more is refused with 429 and Retry-After (--max-queued-requests)."""
    request_timeout: float | None = 600.0
    """Seconds from arrival after which a request ends with a 408 error and its row is freed; None: no limit
    (--request-timeout)."""
    max_request_bytes: int = 4 * 2**20
    """Largest request body; a larger one is refused with 413 (--max-request-bytes)."""
    max_choices: int = MAX_CHOICES
    """Most choices one request may ask for: n, times the prompts of a completion request (--max-choices)."""
    shutdown_timeout: float = 30.0
    """On SIGTERM / SIGINT, seconds running requests get to finish before they are cancelled (--shutdown-timeout)."""
    suffix_cache_tokens: int = 65536
    """Tokens of finished requests the `suffix` drafter keeps to draft from, least recently added dropped first
    (--suffix-cache-tokens; 0: each request drafts from its own text only)."""
    suffix_shared_across_keys: bool = False
    """The suffix cache is shared by every request; by default each API key has its own (--suffix-shared-across-keys;
    docs/server.md, "Suffix decoding and tenants")."""
    online_train: str = "off"
    """'head': keep training the served draft head from each API key's own traffic, one copy per key (server/online.py;
    docs/server.md, "Online training"); 'off': the head stays as loaded (--online-train)."""
    online_train_every: int = 256
    """New answer tokens of a key between its training rounds (--online-train-every)."""
    online_max_keys: int = 8
    """API keys that keep their own trained head; the least recently used one beyond is forgotten and drafts with the
    deployment's head again (--online-max-keys)."""
    online_buffer_tokens: int = 16384
    """Tokens (prompt + answer) of its latest requests each key's training buffer keeps (--online-buffer-tokens)."""
    online_lr: float = 3e-4
    """The online trainer's AdamW learning rate (--online-lr)."""

    def __post_init__(self) -> None:
        resolved = self.weights_reason and self.activations_reason and self.dtype_reason \
            and isinstance(self.dtype, torch.dtype)  # (replace() keeps a resolved plan)
        if not resolved:  # weights, activations and dtype decided once, each with why (target.resolve_target)
            draft = self.draft_model
            reads = draft not in (None, "auto") and parse_drafter_spec(draft).reads_target_weights  # head, twin
            plan = resolve_target(TargetOptions(self.weights, self.quantization, self.dtype, self.activations,
                                                self.device, self.runner.backend, self.runner.compile,
                                                drafter_reads_weights=reads), self.model)
            for name, value in (("weights", plan.weights), ("activations", plan.activations), ("dtype", plan.dtype)):
                object.__setattr__(self, name, value)
                object.__setattr__(self, f"{name}_reason", plan.reasons[name])
        if self.max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {self.max_len}")
        if self.draft_device is not None:
            check_device(self.draft_device, "draft_device")  # ValueError naming the fix, before anything loads
        if self.max_cached_drafters < 0:
            raise ValueError(f"max_cached_drafters must be >= 0, got {self.max_cached_drafters}")
        if not self.model:
            raise ValueError("model must name a target model")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1 (or None: measured), got {self.prefill_chunk_tokens}")
        if not self.prefill_chunk_steps > 0:
            raise ValueError(f"prefill_chunk_steps must be > 0, got {self.prefill_chunk_steps}")
        if self.max_batched_tokens is not None and self.max_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_batched_tokens ({self.max_batched_tokens}) must be at least max_num_seqs "
                             f"({self.max_num_seqs}): every decoding row feeds one token or more per step")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty: give a secret, or leave it out to serve without one")
        if self.suffix_cache_tokens < 0:
            raise ValueError(f"suffix_cache_tokens must be >= 0 (0: no cache), got {self.suffix_cache_tokens}")
        if self.max_queued_requests < 1:  # a request counts as queued from its arrival until it gets a slot
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds (or None for no limit), got {self.request_timeout}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if not 1 <= self.max_choices <= MAX_CHOICES:
            raise ValueError(f"max_choices must be in 1..{MAX_CHOICES}, got {self.max_choices}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        self._check_online()
        _ = self.draft_models  # a bad entry fails here, at start-up, not on the first request naming it

    def _check_online(self) -> None:
        if self.online_train not in ONLINE_TRAIN:
            raise ValueError(f"online_train must be one of {', '.join(ONLINE_TRAIN)}, got {self.online_train!r}")
        if self.online_train_every < 1:
            raise ValueError(f"online_train_every must be >= 1 answer tokens, got {self.online_train_every}")
        if self.online_max_keys < 1:
            raise ValueError(f"online_max_keys must be >= 1, got {self.online_max_keys}")
        if self.online_buffer_tokens < 1:
            raise ValueError(f"online_buffer_tokens must be >= 1, got {self.online_buffer_tokens}")
        if not 0 < self.online_lr < 1:
            raise ValueError(f"online_lr must be in (0, 1), got {self.online_lr}")
        if self.online_train == "head":
            spec = parse_drafter_spec(self.draft_model) if self.draft_model != "auto" else None
            if spec is None or len(spec.stages) != 1 or spec.stages[0].kind != "head":
                raise ValueError(f"--online-train head trains the served draft head, and --draft-model "
                                 f"{self.draft_model!r} is not one: serve a head (--draft-model head:DIR, e.g. "
                                 f"{DEFAULT_HEAD}) or leave --online-train off")

    @property
    def draft_models(self) -> dict[str, str]:
        """The drafters requests may name: name -> the drafter value the server loads for it."""
        allowed = {self.draft_model: self.draft_model, NONE: NONE}
        for entry in (NGRAM,) if self.allowed_draft_models is None else self.allowed_draft_models:
            name, _, value = entry.partition("=")
            name, value = name.strip(), value.strip() or name.strip()
            if not name:
                raise ValueError(f"allowed draft model {entry!r} has no name: give NAME or NAME=VALUE")
            if allowed.get(name, value) != value:
                raise ValueError(f"allowed draft model name {name!r} is given twice, for {allowed[name]!r} and "
                                 f"{value!r}: give each name once")
            allowed[name] = value
        return allowed

    @property
    def model_id(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        path = Path(self.model).expanduser()
        if path.exists():
            return path.stem if path.suffix == ".gguf" else path.name
        return self.model

    @property
    def speculates_by_default(self) -> bool:
        return self.enable_speculative and self.draft_model != NONE
