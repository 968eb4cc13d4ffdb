"""Typed, validated configuration. The CLI and the HTTP layer build these by keyword.

Every `ValueError` raised here names the field and what to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's top_logprobs limit)
MAX_DRAFT_TOKENS = 64  # most draft tokens a drafter proposes in a round: K, adaptive K's ceiling, a tree's nodes
MAX_FORCED_DRAFT = 32  # most grammar-forced tokens drafted in a round, before the drafter's own K
# The widest verify pass: forced tokens, then K drafted after them, then the bonus position. Every row of a pass is
# fed (padded) to the widest row's width and written at its cache length, so this is the cache's slack past max_len.
MAX_VERIFY_WIDTH = MAX_FORCED_DRAFT + MAX_DRAFT_TOKENS + 1


def cache_len(max_len: int) -> int:
    """KV cache entries per slot for sequences of up to `max_len` tokens (the user's max_len): a round writes at most
    MAX_VERIFY_WIDTH entries past a slot's kept length, which stays below max_len. Drafters are sized with it
    (drafters/build.py); the engine's CACHE_SLACK is the same width for the target."""
    return max_len + MAX_VERIFY_WIDTH


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint the output must follow, compiled to a token mask by llguidance (sampling/grammar.py).

    kind "json_object": any JSON object; "json_schema": `spec` is the schema (JSON text); "regex": `spec` is the
    regular expression; "choice": `choices` are the allowed outputs; "grammar": `spec` is a Lark grammar.
    """

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        _check(self.kind in STRUCTURED_KINDS, f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                                              f"got {self.kind!r}")
        if self.kind == "choice":
            _check(len(self.choices) > 0, "structured output 'choice' needs at least one choice")
        elif self.kind != "json_object":
            _check(bool(self.spec), f"structured output {self.kind!r} needs its spec (the schema, regex or grammar)")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. The defaults are greedy decoding."""

    max_new_tokens: int = 128
    """Most tokens to generate (the prompt not counted)."""
    min_new_tokens: int = 0
    """End-of-sequence tokens are forbidden until this many tokens were generated (as in HF `generate`)."""
    temperature: float = 0.0
    """0 is greedy decoding (argmax); > 0 samples from softmax(logits / temperature)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; 1.0 keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's; 0 keeps all."""
    repetition_penalty: float = 1.0
    """HF/CTRL repetition penalty over the prompt and the output; 1.0 is off."""
    presence_penalty: float = 0.0
    """OpenAI presence penalty: subtracted once from every token already in the output (not the prompt); 0 is off."""
    frequency_penalty: float = 0.0
    """OpenAI frequency penalty: subtracted per occurrence of a token in the output (not the prompt); 0 is off."""
    seed: int | None = None
    """Seed of the sampler; the same seed reproduces the same output."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends before the first occurrence, which is not returned."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end generation, besides the model's EOS ids."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS ids (benchmarks use this for equal lengths)."""
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    """OpenAI's logit_bias: token id -> bias in [-100, 100], added to that token's logit (stored as sorted pairs)."""
    logprobs: int | None = None
    """Return the log-probability of every generated token under the processed target distribution, and the
    `logprobs` most likely alternatives at each position (0..20); None returns none."""
    structured: StructuredOutput | None = None
    """A grammar (JSON schema, regex, choice, Lark) every output follows; tokens it forbids are masked."""
    coupled: bool | None = None
    """Coupled (Gumbel-max) sampling: the noise of output position t is keyed by (seed, t), so a seed gives the
    target alone's tokens whatever the drafter, K, batch or trees (unseeded: a seed drawn once per request).
    False: rejection sampling, the same distribution with the highest acceptance (measured: coupled keeps 99-101%
    of its mean accepted length, docs/speculation.md). None (default): coupled when a seed is given, else
    rejection. No effect on greedy decoding."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.coupled is None:  # a seed asks for reproducible output: the one mode whose output ignores K and batch
            object.__setattr__(self, "coupled", self.seed is not None)
        _check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            f"min_new_tokens must be between 0 and max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}",
        )
        _check(self.temperature >= 0, f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        _check(self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0 <= self.min_p < 1, f"min_p must be in [0, 1), got {self.min_p}")
        _check(self.repetition_penalty > 0, f"repetition_penalty must be > 0 (1.0 is off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, f"{name} must be in [-2, 2] (0 is off), got {value}")
        _check(all(s != "" for s in self.stop), "stop strings must not be empty")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        for token, value in self.logit_bias:
            _check(token >= 0, f"logit_bias token ids must be >= 0, got {token}")
            _check(-100 <= value <= 100, f"logit_bias values must be in [-100, 100], got {value} for token {token}")
        if self.logprobs is not None:
            _check(0 <= self.logprobs <= MAX_LOGPROBS,
                   f"logprobs must be in [0, {MAX_LOGPROBS}] (alternatives per token), got {self.logprobs}")
        if self.structured is not None:
            _check(not self.ignore_eos, "ignore_eos cannot be combined with structured output: the grammar decides "
                                        "where the output ends")
            _check(self.min_new_tokens == 0, "min_new_tokens cannot be combined with structured output: the grammar "
                                             "decides where the output ends")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


ACCEPTANCE_MODES = ("exact", "top_k")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How far to speculate and how to verify."""

    num_draft_tokens: int = 4
    """K: draft tokens proposed per round (the most, when adaptive speculation is on)."""
    adaptive: bool = False
    """Choose K per round from measured acceptance and costs (never above max_speculation_depth)."""
    max_speculation_depth: int = 8
    """Upper bound on K when adaptive speculation is on."""
    speculative_threshold: float = 0.0
    """Stop drafting within a round once the drafter's top probability falls below this (0 disables)."""
    acceptance: str = "exact"
    """'exact' (lossless) or 'top_k' (LOSSY: also accept draft tokens in the target's top `acceptance_top_k`)."""
    acceptance_top_k: int = 1
    """N of the lossy 'top_k' acceptance mode."""
    tree_nodes: int = 0
    """Most draft tokens of a token tree per round, for drafters that propose trees (0 or <= K: chains)."""

    def __post_init__(self) -> None:
        _check(self.num_draft_tokens >= 1, f"num_draft_tokens (K, --draft-tokens) must be >= 1, got {self.num_draft_tokens}")
        _check(self.num_draft_tokens <= MAX_DRAFT_TOKENS,
               f"num_draft_tokens (K, --draft-tokens) must be <= {MAX_DRAFT_TOKENS}, got {self.num_draft_tokens}")
        _check(1 <= self.max_speculation_depth <= MAX_DRAFT_TOKENS,
               f"max_speculation_depth (--max-speculation-depth) must be in [1, {MAX_DRAFT_TOKENS}] (<= "
               f"{MAX_DRAFT_TOKENS}), got {self.max_speculation_depth}")
        _check(0 <= self.speculative_threshold < 1, f"speculative_threshold must be in [0, 1), got {self.speculative_threshold}")
        _check(self.acceptance in ACCEPTANCE_MODES, f"acceptance must be one of {ACCEPTANCE_MODES}, got {self.acceptance!r}")
        _check(self.acceptance_top_k >= 1, f"acceptance_top_k must be >= 1, got {self.acceptance_top_k}")
        _check(0 <= self.tree_nodes <= MAX_DRAFT_TOKENS,
               f"tree_nodes (--tree-nodes) must be in [0, {MAX_DRAFT_TOKENS}], got {self.tree_nodes}")

    @property
    def lossless(self) -> bool:
        return self.acceptance == "exact"



RUNNER_BACKENDS = ("auto", "native", "hf")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
DRAFT_WEIGHTS = ("auto", "float", "Q8_0")
DRAFT_ACTIVATIONS = ("fp32", "q8")


@dataclass(frozen=True)
class RunnerOptions:
    """Which model runner executes the target's (and a draft model's) forward passes."""

    backend: str = "auto"
    """"native": verispec's own Llama-family module; "hf": Hugging Face modeling; "auto": native where it applies."""
    compile: bool | None = None
    """torch.compile the native runner's steps; None: the measured default for the device (see README)."""
    batch_invariant: bool | None = None
    """Native runner: every attention in one fixed order, prefill chunks of any length included, so a row's logits
    do not depend on the verify width, the batch, its padding or how its prompt was chunked (bit for bit the
    one-token step's; docs/speculation.md, "Bit for bit"). None (default): on where verispec's C++ kernels are
    built (free there: their tiled attention runs long chunks as fast as torch's SDPA), off elsewhere (torch's
    invariant ops cost speed). False: long prefill chunks through SDPA (not invariant). The HF runner ignores it."""
    kv_cache_dtype: str = "auto"
    """Native runner: the KV cache's entries. "float16" / "bfloat16" halve the bytes attention reads each step
    (each entry rounded once, to nearest even: a row's bits still never depend on the others); "float32" /
    the model's dtype keep them as computed. "auto": float16 where GGUF blocks compute with integer activations
    (--activations q8) on the CPU kernels, the model's dtype elsewhere (model/dtype.py::resolve_kv_cache_dtype
    says why). The HF runner ignores it."""

    draft_weights: str = "auto"
    """Native CPU runner: what a draft model's linears and LM head run as. "Q8_0": GGUF's 8-bit blocks (~1/4 of
    fp32's bytes: a draft token at about half the cost, docs/bench.md); "float": as loaded; "auto" (default): Q8_0
    wherever verispec's quantized kernel runs. A draft's numerics move only how often its tokens are accepted, never
    the output (verification decides). drafters/model.py::draft_weights."""
    draft_activations: str = "fp32"
    """What a draft model's Q8_0 blocks compute with: "fp32" (default: the float draft's argmax kept where the
    blocks' values allow, so an identical draft still accepts everything on the tiny test models), or "q8", integer
    activations (only acceptance moves)."""
    huge_pages: bool = True
    """Large long-lived CPU buffers (KV caches, packed weights) on 2 MiB transparent huge pages where Linux gives
    them (runtime/weights/hugepages.py: the same values, fewer TLB misses). Process-wide: applied when an app or
    `from_pretrained` starts (`hugepages.configure`)."""
    sliding_ring: bool = True
    """Native runner: sliding-window layers (Gemma 3's) keep a ring of their latest entries (window + the widest
    verify pass) instead of every entry; False keeps every entry (the same logits, more memory: side-by-side runs)."""

    def __post_init__(self) -> None:
        _check(self.draft_weights in DRAFT_WEIGHTS,
               f"draft_weights (--draft-weights) must be one of {', '.join(DRAFT_WEIGHTS)}, got {self.draft_weights!r}")
        _check(self.draft_activations in DRAFT_ACTIVATIONS, f"draft_activations (--draft-activations) must be one of "
               f"{', '.join(DRAFT_ACTIVATIONS)}, got {self.draft_activations!r}")
        _check(self.backend in RUNNER_BACKENDS, f"runner backend must be one of {', '.join(RUNNER_BACKENDS)}, got {self.backend!r}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"kv_cache_dtype (--kv-cache-dtype) must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
