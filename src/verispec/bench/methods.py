"""The decoding methods a benchmark compares, each behind one small interface, all greedy on one model pair.

Families (`--methods`): 'target' (our engine, drafter off: the baseline), 'verispec' (our speculative loop, one
method per K), 'adaptive' (our loop choosing K per round), 'tree' / 'adaptive-tree' (the same with token trees of up
to --tree-nodes draft tokens, for drafters that propose trees: a draft head or a draft model; 'tree' is per K = the
tree's depth), 'hf-assisted' (transformers assisted generation, one method per K, constant schedule, no confidence cut-off: the
anchor), 'hf-target' (transformers greedy `generate`).

Every method produces exactly `max_new_tokens` tokens: end-of-sequence ids are masked until then
(`min_new_tokens = max_new_tokens`, which both engines implement the same way), so tokens counted are the same
for every method and outputs can be compared token by token.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..config import SamplingParams, SpeculativeConfig, StructuredOutput
from ..drafters.cascade import CascadeDrafter
from ..engine import FixedK, SpeculativeEngine
from ..runtime.model.loading import model_weight_bytes
from ..stats import GenerationStats
from .memory import PeakMemory, persistent_bytes

def own_weight_bytes(drafter) -> int:
    """Weights a drafter holds of its own besides a loaded draft model: the twin's quantized linears
    (drafters/twin.py; its embedding is the target's)."""
    stages = getattr(drafter, "stages", [drafter]) if drafter is not None else []
    return sum(stage.weight_bytes() for stage in stages if hasattr(stage, "weight_bytes"))


FAMILIES = ("target", "verispec", "adaptive", "tree", "adaptive-tree", "hf-assisted", "hf-target")
PER_K = ("verispec", "tree", "hf-assisted")
TREES = ("tree", "adaptive-tree")


@dataclass
class BenchModels:
    """One loaded model pair and the engine that runs our methods on it."""

    target: torch.nn.Module
    draft: torch.nn.Module | None
    tokenizer: object
    engine: SpeculativeEngine
    device: torch.device
    structured: StructuredOutput | None = None  # the constraint our methods generate under (None: free text)

    @classmethod
    def build(cls, target, draft, tokenizer, max_len: int, drafter, runner=None,
              structured: StructuredOutput | None = None) -> BenchModels:
        """`draft`: the draft model HF assisted generation uses (None: HF assisted is skipped); `drafter`: what our
        methods draft with (None: only the target-only methods run). Prefix caching is off: every method prefills
        every prompt, as HF's and the peers' runs do (vLLM's with enable_prefix_caching=False)."""
        engine = SpeculativeEngine(target, tokenizer, drafter, max_len=max_len, runner=runner,
                                   enable_prefix_caching=False)
        return cls(target, draft, tokenizer, engine, engine.target.device, structured)


@dataclass
class MethodRun:
    """One timed generation: the generated ids (prompt excluded), wall seconds, the engine's stats if any."""

    token_ids: list[int]
    seconds: float
    stats: GenerationStats | None
    peak_bytes: int | None


@dataclass
class BatchRun:
    """One timed `generate_batch` call: generated ids per row (prompt excluded), wall seconds of the whole call,
    the engine's stats per row."""

    token_ids: list[list[int]]
    seconds: float
    stats: list[GenerationStats]


class Method(ABC):
    family: str = ""
    uses_draft: bool = False

    def __init__(self, models: BenchModels, k: int | None = None) -> None:
        self.models = models
        self.k = k

    @property
    def name(self) -> str:
        return f"{self.family}-k{self.k}" if self.family in PER_K else self.family

    @abstractmethod
    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int) -> tuple[list[int], GenerationStats | None]:
        """Greedy generation of exactly max_new_tokens tokens -> (generated ids, engine stats or None)."""

    def weight_bytes(self) -> int:
        models = [self.models.target] + ([self.models.draft] if self.uses_draft and self.models.draft else [])
        return sum(model_weight_bytes(m) for m in models)

    def persistent_bytes(self) -> int:
        """Memory this method keeps between calls besides weights (our preallocated KV caches)."""
        return 0

    def run(self, prompt_ids: list[int], max_new_tokens: int, seed: int) -> MethodRun:
        torch.manual_seed(seed)
        with PeakMemory(self.models.device) as memory:
            start = time.perf_counter()
            token_ids, stats = self.generate(prompt_ids, max_new_tokens, seed)
            seconds = time.perf_counter() - start
        return MethodRun(token_ids, seconds, stats, memory.peak_bytes)


class EngineMethod(Method):
    """Our engine: 'target' (drafter off), 'verispec' (fixed K) or 'adaptive'."""

    def __init__(self, models: BenchModels, family: str, k: int | None = None, tree_nodes: int = 0) -> None:
        super().__init__(models, k)
        self.family = family
        self.uses_draft = family != "target"
        nodes = tree_nodes if family in TREES else 0
        if family.startswith("adaptive"):
            self.spec = SpeculativeConfig(adaptive=True, tree_nodes=nodes)
        else:
            self.spec = SpeculativeConfig(num_draft_tokens=k or 1, tree_nodes=nodes)

    def weight_bytes(self) -> int:
        drafter = getattr(self, "drafter", None) or self.models.engine.drafter  # a DrafterMethod's own, else the run's
        return super().weight_bytes() + (own_weight_bytes(drafter) if self.uses_draft else 0)

    def params(self, max_new_tokens: int, seed: int) -> SamplingParams:
        """Exactly max_new_tokens tokens (EOS masked), or, under a constraint, until the constraint completes."""
        if self.models.structured is not None:
            return SamplingParams(max_new_tokens=max_new_tokens, seed=seed, structured=self.models.structured)
        return SamplingParams(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, seed=seed)

    def generate(self, prompt_ids, max_new_tokens, seed):
        params = self.params(max_new_tokens, seed)
        result = self.models.engine.generate(prompt_ids, params, spec=self.spec, use_drafter=self.uses_draft)
        return result.token_ids, result.stats

    def run_batch(self, prompts: list[list[int]], max_new_tokens: int, seed: int) -> BatchRun:
        """All prompts through one `engine.generate_batch` call, timed as a whole (prefill included)."""
        params = self.params(max_new_tokens, seed)
        torch.manual_seed(seed)
        if self.models.device.type == "cuda":
            torch.cuda.synchronize(self.models.device)  # earlier queued work must not count against this call
        start = time.perf_counter()
        results = self.models.engine.generate_batch(prompts, params, spec=self.spec, use_drafter=self.uses_draft)
        seconds = time.perf_counter() - start  # results hold token ids on the host: the device is done
        return BatchRun([r.token_ids for r in results], seconds, [r.stats for r in results])

    def persistent_bytes(self) -> int:
        engine = self.models.engine
        total = persistent_bytes(engine.target)
        if self.uses_draft and hasattr(engine.drafter, "runner"):
            total += persistent_bytes(engine.drafter.runner)
        return total


class DrafterMethod(EngineMethod):
    """Adaptive speculation with a drafter of its own ('adaptive[suffix]', `--also-drafters`), beside the run's
    drafter, so several drafters are compared in one run. A suffix stage gets a cache of its own, emptied after the
    warm-up: what it drafts from is this method's earlier prompts of the run, never another method's outputs."""

    def __init__(self, models: BenchModels, drafter_name: str) -> None:
        from ..drafters.build import build_drafter
        from ..drafters.suffix import SuffixDrafter
        from ..drafters.suffix_tree import SuffixCache

        super().__init__(models, "adaptive")
        self.drafter_name = drafter_name
        self.drafter = build_drafter(drafter_name, models.target, models.tokenizer, models.engine.max_len,
                                     draft_model=models.draft).drafter
        self.caches = []
        for stage in getattr(self.drafter, "stages", [self.drafter]):
            if isinstance(stage, SuffixDrafter):
                stage.cache = SuffixCache(stage.cache.max_tokens, stage.cache.depth)
                self.caches.append(stage.cache)

    @property
    def name(self) -> str:
        return f"adaptive[{self.drafter_name}]"

    def after_warmup(self) -> None:
        for cache in self.caches:
            cache.clear()

    def generate(self, prompt_ids, max_new_tokens, seed):
        params = self.params(max_new_tokens, seed)
        result = self.models.engine.generate(prompt_ids, params, spec=self.spec, drafter=self.drafter)
        return result.token_ids, result.stats

    def run_batch(self, prompts, max_new_tokens, seed):
        raise NotImplementedError("--also-drafters runs with the batch-1 suite")


class HFMethod(Method):
    """transformers `generate`: greedy target alone, or assisted generation with the draft at a constant K."""

    def __init__(self, models: BenchModels, family: str, k: int | None = None) -> None:
        super().__init__(models, k)
        self.family = family
        self.uses_draft = family == "hf-assisted"

    def generation_config(self, max_new_tokens: int):
        from transformers import GenerationConfig

        # A fresh config, so model-card defaults (temperature, repetition penalty...) never differ from ours.
        eos = sorted(self.models.engine.eos_token_ids)
        pad = self.models.tokenizer.pad_token_id
        return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                eos_token_id=eos, pad_token_id=eos[0] if pad is None else pad)

    def generate(self, prompt_ids, max_new_tokens, seed):
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.models.device)  # [1, n]
        kwargs = {}
        if self.uses_draft:
            # transformers (5.x) reads K, its schedule and the confidence cut-off from the ASSISTANT's
            # generation_config; 0 disables the dynamic cut-off (no early stop, no ROC re-tuning).
            assistant_config = self.models.draft.generation_config
            assistant_config.num_assistant_tokens = self.k
            assistant_config.num_assistant_tokens_schedule = "constant"
            assistant_config.assistant_confidence_threshold = 0.0
            kwargs["assistant_model"] = self.models.draft
        with torch.inference_mode():
            out = self.models.target.generate(ids, attention_mask=torch.ones_like(ids),
                                              generation_config=self.generation_config(max_new_tokens), **kwargs)
        return out[0, len(prompt_ids):].tolist(), None


def adaptive_supported(engine: SpeculativeEngine) -> bool:
    """True once the engine's draft-length policy honours `SpeculativeConfig(adaptive=True)`."""
    try:
        return not isinstance(engine.draft_policy(SpeculativeConfig(adaptive=True)), FixedK)
    except Exception:  # noqa: BLE001 - an engine without the hook simply has no adaptive mode
        return False


def _proposes_trees(drafter) -> bool:
    from ..drafters.head import HeadDrafter
    from ..drafters.model import model_drafters

    stages = getattr(drafter, "stages", [drafter])
    return any(isinstance(stage, HeadDrafter) for stage in stages) or bool(model_drafters(drafter))


def parse_methods(text: str) -> list[str]:
    families = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in families if m not in FAMILIES]
    if unknown or not families:
        raise ValueError(f"unknown method {', '.join(unknown) or '(none given)'} in --methods: choose from "
                         f"{', '.join(FAMILIES)}")
    return list(dict.fromkeys(families))


def parse_ks(text: str) -> list[int]:
    try:
        ks = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise ValueError(f"--k must be a comma-separated list of integers such as 1,2,4, got {text!r}") from None
    if not ks or any(not 1 <= k <= 64 for k in ks):
        raise ValueError(f"--k values must be between 1 and 64, got {text!r}")
    return sorted(set(ks))


def build_methods(families: list[str], ks: list[int], models: BenchModels,
                  tree_nodes: int = 16, also_drafters: list[str] = ()) -> tuple[list[Method], list[str]]:
    """-> (methods in run order, notes on methods skipped)."""
    methods: list[Method] = []
    notes: list[str] = []
    for family in families:
        if family.startswith("hf-") and models.structured is not None:
            notes.append(f"{family}: skipped, transformers generate has no structured output")
        elif family == "hf-assisted" and models.draft is None:
            notes.append(f"{family}: skipped, HF assisted generation needs a draft model")
        elif family not in ("target", "hf-target") and models.engine.drafter is None:
            notes.append(f"{family}: skipped, no drafter")
        elif family.startswith("adaptive") and not adaptive_supported(models.engine):
            notes.append("adaptive: skipped, this engine does not implement SpeculativeConfig(adaptive=True) yet")
        elif family in TREES and not _proposes_trees(models.engine.drafter):
            notes.append(f"{family}: skipped, the drafter {models.engine.drafter.name} proposes chains only")
        elif family in PER_K:
            if family == "hf-assisted":
                methods += [HFMethod(models, family, k) for k in ks]
            else:
                methods += [EngineMethod(models, family, k, tree_nodes) for k in ks]
        elif family.startswith("hf-"):
            methods.append(HFMethod(models, family))
        else:
            methods.append(EngineMethod(models, family, tree_nodes=tree_nodes))
    methods += [DrafterMethod(models, name) for name in also_drafters]
    drafter = models.engine.drafter
    if isinstance(drafter, CascadeDrafter) and any(m.family == "hf-assisted" for m in methods):
        notes.append(f"hf-assisted: drafts with the draft model alone; our methods draft with {drafter.name} "
                     "(transformers cannot combine prompt lookup with an assistant model)")
    if not any(m.family == "target" for m in methods):
        methods.insert(0, EngineMethod(models, "target"))
        notes.append("target: added, every speedup is measured against the target alone")
    return methods, notes
