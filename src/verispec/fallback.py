"""Graceful fallback to the target alone: when a drafter cannot be loaded, or fails during a request.

- At load time, `load_drafter_or_fallback` turns a `--draft-model` value into a drafter. A user's bad path or a
  draft whose vocabulary does not match stays an error (the CLI exits 2); a draft that is valid but does not fit
  in memory (checked before loading, see memory.py) or fails to load (out of memory, corrupt weights) gives a
  warning and no drafter, and the run goes on with the target alone. `auto` falls back to the n-gram drafter.
- During a request, the engine catches a drafter's exception, finishes the request on the target alone (no
  token lost or repeated: the failed round is verified with no draft tokens), counts it in
  `GenerationStats.fallbacks` and logs it once. `DrafterBackoff` then skips the drafter for 1, 2, 4, ... requests
  after consecutive failures, and forgets the failures after a request that used the drafter without failing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .drafters.base import Drafter

logger = logging.getLogger("verispec")


class DrafterBackoff:
    """Exponential back-off over requests after drafter failures (one per drafter, kept by the engine)."""

    def __init__(self, max_skip: int = 64) -> None:
        self.max_skip = max_skip
        self.failures = 0  # consecutive failures
        self.skip = 0  # requests still to run without the drafter

    def should_try(self) -> bool:
        """Called once per request: False while the drafter is being skipped (counts that request down)."""
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def failed(self) -> int:
        """A failure: skip the next 2 ** (failures - 1) requests (capped). Returns that number."""
        self.failures += 1
        self.skip = min(2 ** (self.failures - 1), self.max_skip)
        return self.skip

    def succeeded(self) -> None:
        self.failures = 0
        self.skip = 0


@dataclass
class DrafterLoad:
    """What `load_drafter_or_fallback` produced."""

    drafter: Drafter | None  # None: the target alone
    name: str  # what actually drafts: 'none', 'ngram', a model path, ...
    requested: str  # the value the user gave
    num_draft_tokens: int | None = None  # K of the pair `auto` picked (None: keep the configured K)
    warning: str | None = None  # why it fell back; None when it loaded as asked


def load_drafter_or_fallback(
    name: str | None,
    target,
    tokenizer,
    max_len: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    target_name: str | None = None,
    check_memory: bool = True,
    free_bytes: int | None = None,
    search_dirs: list | None = None,
) -> DrafterLoad:
    """Build the drafter for `--draft-model name` next to a loaded `target`, falling back where that is safe.

    max_len is the drafter's cache length (the engine's max_len + CACHE_SLACK). `target_name` is what the user
    called the target (for `auto`; default: the target config's name_or_path). `free_bytes` overrides the
    measured free memory (tests). Raises `ModelLoadError` (a ValueError) for a path that does not exist and
    ValueError for a draft whose vocabulary differs from the target's: those are the user's to fix.
    """
    from .drafters.cascade import SEPARATOR, CascadeDrafter
    from .drafters.factory import AUTO, NAMED_DRAFTERS, NONE, cascade_parts, head_path
    from .drafters.ngram import NgramDrafter

    requested = NONE if name is None else str(name)
    if requested == NONE:
        return DrafterLoad(None, NONE, requested)
    parts = cascade_parts(requested)
    if len(parts) > 1:  # 'ngram+MODEL': each part loads (or falls back) on its own; the survivors cascade
        loads = [load_drafter_or_fallback(part, target, tokenizer, max_len, dtype, device, target_name=target_name,
                                          check_memory=check_memory, free_bytes=free_bytes, search_dirs=search_dirs)
                 for part in parts]
        kept = [load for load in loads if load.drafter is not None]
        stages = [load.drafter for load in kept]
        drafter = CascadeDrafter(stages) if len(stages) > 1 else (stages[0] if stages else None)
        return DrafterLoad(drafter, SEPARATOR.join(load.name for load in kept) or NONE, requested,
                           next((load.num_draft_tokens for load in loads if load.num_draft_tokens), None),
                           "; ".join(load.warning for load in loads if load.warning) or None)
    if requested == AUTO:
        from .pairs import select_draft

        choice = select_draft(
            target_name or target.config.name_or_path, target_config=target.config, tokenizer=tokenizer,
            target_numel=sum(p.numel() for p in target.parameters()), search_dirs=search_dirs,
        )
        logger.info("--draft-model auto: %s (%s)", choice.draft, choice.reason)
        if choice.draft != "ngram":
            try:
                drafter, reason = _try_model_drafter(choice.draft, target, max_len, dtype, device, check_memory,
                                                     free_bytes)
            except (ValueError, OSError) as exc:  # an auto-picked draft is never the user's mistake
                drafter, reason = None, f"{type(exc).__name__}: {exc}"
            if drafter is not None:
                return DrafterLoad(drafter, choice.draft, requested, choice.num_draft_tokens)
            warning = f"auto-selected draft {choice.draft} not used ({reason}); using the n-gram drafter"
            logger.warning(warning)
            return DrafterLoad(NgramDrafter(), "ngram", requested, choice.num_draft_tokens, warning)
        return DrafterLoad(NgramDrafter(), "ngram", requested, choice.num_draft_tokens)
    if requested in NAMED_DRAFTERS:
        return DrafterLoad(NAMED_DRAFTERS[requested](target, tokenizer, max_len), requested, requested)
    head = head_path(requested)
    if head is not None:  # a few MB, built on the target's own embeddings: a mismatch is the user's to fix
        from .drafters.head import head_drafter

        return DrafterLoad(head_drafter(head, target, max_len, requested), requested, requested)
    drafter, reason = _try_model_drafter(requested, target, max_len, dtype, device, check_memory, free_bytes)
    if drafter is not None:
        return DrafterLoad(drafter, requested, requested)
    warning = f"draft model {requested} not used, running the target alone: {reason}"
    logger.warning(warning)
    return DrafterLoad(None, NONE, requested, warning=warning)


def _try_model_drafter(name, target, max_len, dtype, device, check_memory, free_bytes):
    """(ModelDrafter, None), or (None, why) when the draft does not fit or fails to load.

    Raises for a path that does not exist and for a vocabulary mismatch: those are the user's to fix.
    """
    from .drafters.factory import model_drafter
    from .memory import check_draft_memory
    from .models import load_model, resolve_model_path

    path = resolve_model_path(name)
    if check_memory:
        config = read_model_config(path)
        if config is not None:
            check = check_draft_memory(path, config, target.config, max_len, dtype, device, free_bytes=free_bytes)
            if not check.fits:
                return None, f"not enough memory: {check}"
    try:
        draft = load_model(name, dtype=dtype, device=device)
    except Exception as exc:  # noqa: BLE001 - the path exists: corrupt weights (safetensors raises its own type), OOM
        return None, f"loading failed: {type(exc).__name__}: {exc}"
    return model_drafter(target, draft, max_len), None


def read_model_config(path):
    """The model config without its weights (None when unreadable: loading will report why)."""
    from transformers import AutoConfig

    try:
        if path.suffix == ".gguf":
            return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        return AutoConfig.from_pretrained(path)
    except Exception:  # noqa: BLE001 - only the memory estimate is lost; load_model gives the real error
        return None
