"""One builder: a `--draft-model` value (parsed by spec.py) and a loaded target -> the drafter, strict or falling back.

Sizes: `max_len` is the user's (the longest sequence, prompt and generated tokens, the engine runs). Every drafter
cache is sized from it here, in one place: `config.cache_len(max_len)` adds the widest verify pass
(`config.MAX_VERIFY_WIDTH`), as the engine does for the target. A draft head adds its own drafting slack (head.py).

on_error="raise": every failure raises (a request that names a drafter learns why it cannot be used).
on_error="fallback" (`--draft-model` of `verispec generate` and `serve`): a user's bad path or a draft whose
vocabulary does not match the target's stays an error (the CLI exits 2); a draft that is valid but does not fit in
memory (checked before loading, see runtime/model/memory.py) or fails to load (out of memory, corrupt weights) is left out with a
warning, and the run goes on with the other stages of a cascade or the target alone.
'auto' falls back to the n-gram drafter in both modes: what it picks is never the user's mistake.
Failures while generating are the engine's to handle (engine/drafter_calls.py: back-off per drafter).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..config import cache_len
from ..runtime.model.twins import model_device
from .base import Drafter
from .cascade import SEPARATOR, CascadeDrafter
from .cross_tokenizer import cross_tokenizer_drafter, same_tokenizer
from .head import head_drafter
from .model import ModelDrafter
from .named import NAMED_DRAFTERS
from .ngram import NgramDrafter
from .placement import check_device, on_target_device
from .spec import NONE, DraftStage, DrafterSpec, parse_drafter_spec
from .twin import twin_drafter, twin_memory_bytes
from .vocab_ranks import draft_head_ids

logger = logging.getLogger("verispec")
ON_ERROR = ("raise", "fallback")


@dataclass
class DrafterLoad:
    """What `build_drafter` produced."""

    drafter: Drafter | None  # None: the target alone
    name: str  # what actually drafts: 'none', 'ngram', a model path, ...
    requested: str  # the value the user gave
    num_draft_tokens: int | None = None  # K of the pair `auto` picked (None: keep the configured K)
    warning: str | None = None  # why a stage was left out; None when everything loaded as asked


@dataclass
class _Build:
    """The arguments every stage of one build shares."""

    target: object  # the loaded target model (a PreTrainedModel)
    tokenizer: object
    cache_len: int  # KV cache entries per slot of a drafter with a cache
    dtype: torch.dtype
    device: torch.device | str
    on_error: str
    draft_model: object | None
    target_name: str | None
    check_memory: bool
    free_bytes: int | None
    search_dirs: list | None


def build_drafter(
    spec: str | DrafterSpec | None,
    target,
    tokenizer,
    max_len: int,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    on_error: str = "raise",
    draft_model=None,
    target_name: str | None = None,
    check_memory: bool = True,
    free_bytes: int | None = None,
    search_dirs: list | None = None,
) -> DrafterLoad:
    """Build the drafter `spec` names (a DrafterSpec, or a `--draft-model` value parsed here) next to `target`.

    max_len: the user's longest sequence (the engine's max_len); caches are sized from it here. dtype, device: of
    a draft model to load (default: the target's; a draft head or twin must stay on the target's, placement.py). on_error: "raise" or "fallback" (module docstring).
    draft_model: the already loaded model the spec's model stage names. target_name: what the user called the
    target (for 'auto'; default: the target config's name_or_path). free_bytes overrides the measured free memory
    (tests). Raises ModelLoadError (a ValueError) for a draft path that does not exist and ValueError for a draft
    whose vocabulary differs from the target's, in both modes: those are the user's to fix.
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    spec = parse_drafter_spec(spec)
    weight = next(target.parameters())
    if device is not None:
        device = check_device(device)
    build = _Build(target, tokenizer, cache_len(max_len), dtype or weight.dtype, device or model_device(target), on_error,
                   draft_model, target_name, check_memory, free_bytes, search_dirs)
    loads = [_build_stage(stage, build) for stage in spec.stages]
    kept = [load for load in loads if load.drafter is not None]
    stages = [load.drafter for load in kept]
    drafter = CascadeDrafter(stages) if len(stages) > 1 else (stages[0] if stages else None)
    warning = "; ".join(load.warning for load in loads if load.warning) or None
    if warning is not None:
        if drafter is None:
            warning += "; running the target alone"
        logger.warning(warning)
    return DrafterLoad(drafter, SEPARATOR.join(load.name for load in kept) or NONE, spec.text,
                       next((load.num_draft_tokens for load in loads if load.num_draft_tokens), None), warning)


def _build_stage(stage: DraftStage, build: _Build) -> DrafterLoad:
    name = stage.name
    if stage.kind == "named":
        return DrafterLoad(NAMED_DRAFTERS[name](build.target, build.tokenizer, build.cache_len), name, name)
    if stage.kind in ("head", "twin"):  # both share the target's tensors
        on_target_device("draft head" if stage.kind == "head" else "twin", name, build.device, build.target)
    if stage.kind == "head":  # a few MB on the target's own embeddings: a mismatch is the user's to fix
        return DrafterLoad(head_drafter(stage.head_dir, build.target, build.cache_len, name), name, name)
    if stage.kind == "auto":
        return _auto(build)
    if stage.kind == "twin":  # the target's own weights, quantized: a target that cannot have one is the user's to fix
        check = _twin_memory(name, build) if build.on_error == "fallback" else None  # as a model's (module doc)
        if check is not None and not check.fits:
            return DrafterLoad(None, NONE, name, warning=f"draft model {name} not used (not enough memory: {check})")
        return DrafterLoad(twin_drafter(build.target, name, build.cache_len), name, name)
    label = stage.label
    if build.draft_model is not None and (stage.draft_vocab is None or _has_head(build.draft_model, stage, build)):
        return DrafterLoad(_loaded_drafter(build, build.draft_model, name), label, label)
    if build.on_error == "raise":
        from ..runtime.model.loading import load_draft

        draft_tokenizer = _draft_tokenizer(name, build.tokenizer)
        draft = load_draft(name, dtype=build.dtype, device=build.device,
                           head_ids=_head_ids(stage.draft_vocab, build, draft_tokenizer))
        return DrafterLoad(_loaded_drafter(build, draft, name, draft_tokenizer), label, label)
    drafter, reason = _try_model_drafter(name, build, stage.draft_vocab)
    if drafter is None:
        return DrafterLoad(None, NONE, label, warning=f"draft model {name} not used ({reason})")
    return DrafterLoad(drafter, label, label)


def _has_head(draft, stage: DraftStage, build: _Build) -> bool:
    """Whether an already loaded draft model has the head `stage` asks for (its `draft_vocab`'s rows): else it is
    loaded anew (the bench compares heads of one draft: `--also-drafters MODEL:v8192,MODEL:vfull`)."""
    ids = _head_ids(stage.draft_vocab, build, _draft_tokenizer(stage.name, build.tokenizer))
    has = getattr(draft.config, "draft_vocab", None)
    return (ids is None and not has) or (ids is not None and has is not None and ids.tolist() == list(has))


def _twin_memory(name: str, build: _Build):
    """The memory check of the twin `name` (its quantized weights and one slot of KV cache, memory.twin_bytes)
    against free memory; None when not checked (check_memory off, or free memory unknown)."""
    from ..runtime.model.memory import HEADROOM, MemoryCheck, free_memory_bytes, gib

    if not build.check_memory:
        return None
    needed = twin_memory_bytes(name, build.target.config, build.cache_len, 1, build.dtype)
    free = free_memory_bytes(build.device) if build.free_bytes is None else build.free_bytes
    if free is None:
        return None
    return MemoryCheck(needed <= HEADROOM * free, needed, free,
                       f"the twin needs {gib(needed)} (quantized weights and KV cache) and {gib(free)} is free")


def _auto(build: _Build) -> DrafterLoad:
    """The registered draft for the target (drafters/auto.py), or the n-gram drafter when there is none or it cannot load."""
    from .auto import select_draft

    target = build.target
    choice = select_draft(build.target_name or target.config.name_or_path, target_config=target.config,
                          tokenizer=build.tokenizer, target_numel=sum(p.numel() for p in target.parameters()),
                          search_dirs=build.search_dirs)
    logger.info("--draft-model auto: %s (%s)", choice.draft, choice.reason)
    if choice.draft == "ngram":
        return DrafterLoad(NgramDrafter(), "ngram", "auto", choice.num_draft_tokens)
    try:
        drafter, reason = _try_model_drafter(choice.draft, build)
    except (ValueError, OSError) as exc:  # an auto-picked draft is never the user's mistake
        drafter, reason = None, f"{type(exc).__name__}: {exc}"
    if drafter is not None:
        return DrafterLoad(drafter, choice.draft, "auto", choice.num_draft_tokens)
    return DrafterLoad(NgramDrafter(), "ngram", "auto", choice.num_draft_tokens,
                       f"auto-selected draft {choice.draft} not used ({reason}); using the n-gram drafter")


def head_ids_for(stage: DraftStage, target, tokenizer) -> torch.Tensor | None:
    """The token ids the draft model of `stage` keeps in its head (`DraftStage.draft_vocab`), for a caller that
    loads the draft itself (`load_draft(..., head_ids=)`: the bench); None: the whole head."""
    build = _Build(target, tokenizer, 0, torch.float32, "cpu", "raise", None, None, False, None, None)
    return _head_ids(stage.draft_vocab, build, _draft_tokenizer(stage.name, tokenizer))


def _head_ids(draft_vocab: int | None, build: _Build, draft_tokenizer) -> torch.Tensor | None:
    """The token ids a draft model's reduced head keeps (`DraftStage.draft_vocab`, vocab_ranks.py), or None: the
    whole head (asked for, or a draft with another tokenizer, whose ids are not the target's)."""
    if draft_tokenizer is not None and not same_tokenizer(build.tokenizer, draft_tokenizer):
        return None
    vocab_size = build.target.get_output_embeddings().weight.shape[0]
    return draft_head_ids(draft_vocab, build.tokenizer, build.target, vocab_size)


def _try_model_drafter(name: str, build: _Build, draft_vocab: int | None = None) -> tuple[Drafter | None, str | None]:
    """(the model drafter, None), or (None, why) when the draft does not fit or fails to load. draft_vocab: its
    head's rows (`DraftStage.draft_vocab`).

    Raises for a path that does not exist and for a vocabulary mismatch (a draft with the target's tokenizer but
    another output size): those are the user's to fix. A draft with another tokenizer drafts across tokenizers.
    """
    from ..runtime.model.memory import check_draft_memory
    from ..runtime.model.loading import load_draft, read_model_config, resolve_model_path

    path = resolve_model_path(name)
    if build.check_memory:
        config = read_model_config(path)
        if config is not None:
            check = check_draft_memory(path, config, build.target.config, build.cache_len, build.dtype, build.device,
                                       free_bytes=build.free_bytes)
            if not check.fits:
                return None, f"not enough memory: {check}"
    draft_tokenizer = _draft_tokenizer(name, build.tokenizer)
    try:
        draft = load_draft(name, dtype=build.dtype, device=build.device,
                           head_ids=_head_ids(draft_vocab, build, draft_tokenizer))
    except Exception as exc:  # noqa: BLE001 - the path exists: corrupt weights (safetensors raises its own type), OOM
        return None, f"loading failed: {type(exc).__name__}: {exc}"
    return _loaded_drafter(build, draft, name, draft_tokenizer), None


def check_vocab_match(target, draft) -> None:
    """Draft and target must share one vocabulary (same output size); name both sizes otherwise."""
    t = target.get_output_embeddings().weight.shape[0]
    d = draft.get_output_embeddings().weight.shape[0]
    if t != d:
        raise ValueError(
            f"draft vocabulary size {d} does not match target vocabulary size {t}: pick a draft model trained with "
            "the target's tokenizer, or use --draft-model ngram"
        )


_UNREAD = object()


def _loaded_drafter(build: _Build, draft, name: str, draft_tokenizer=_UNREAD) -> Drafter:
    """The drafter for the draft model `name`, loaded as `draft`, with its own tokenizer (read from `name` where
    not given)."""
    if draft_tokenizer is _UNREAD:
        draft_tokenizer = _draft_tokenizer(name, build.tokenizer)
    return _model_drafter(build.target, draft, build.cache_len, build.tokenizer, draft_tokenizer, name)


def _draft_tokenizer(name: str, target_tokenizer=None):
    """The tokenizer stored with a draft model (the target's own object where the draft's folder saved the same
    files: nothing to read), or None when it has none (the draft is then taken to share the target's, and its
    vocabulary size is checked)."""
    from ..runtime.model.loading import load_tokenizer, resolve_model_path
    from ..runtime.model.tokenizer_cache import saved_alike

    try:
        if target_tokenizer is not None and saved_alike(resolve_model_path(name), target_tokenizer):
            return target_tokenizer
        return load_tokenizer(name)
    except Exception:  # noqa: BLE001 - no readable tokenizer (ModelLoadError, or a tokenizer class's own error)
        return None


# A draft with another tokenizer keys its cache by its own tokens, which may be more per text than the target's.
CROSS_TOKENIZER_CACHE_RATIO = 2


def _model_drafter(target, draft, cache_len: int, tokenizer=None, draft_tokenizer=None,
                   name: str = "draft") -> Drafter:
    """A ModelDrafter, or one wrapped to draft across tokenizers when both tokenizers are known and differ."""
    if tokenizer is not None and draft_tokenizer is not None and not same_tokenizer(tokenizer, draft_tokenizer):
        inner = ModelDrafter(draft.eval(), CROSS_TOKENIZER_CACHE_RATIO * cache_len)
        return cross_tokenizer_drafter(inner, tokenizer, draft_tokenizer, name)
    check_vocab_match(target, draft)
    return ModelDrafter(draft.eval(), cache_len)


def model_drafter(target, draft, max_len: int, tokenizer=None, draft_tokenizer=None) -> Drafter:
    """The drafter for an already loaded draft model (the Python API's `draft_model=`), sized for max_len; with both
    tokenizers given and different, it drafts across tokenizers (cross_tokenizer.py)."""
    return _model_drafter(target, draft, cache_len(max_len), tokenizer, draft_tokenizer)
