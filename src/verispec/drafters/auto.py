"""Draft auto-selection (`--draft-model auto`): which draft goes with which target.

In order:
1. the registry of known pairs (`REGISTRY`), matched by normalised family and size, so
   `meta-llama/Llama-3.1-8B-Instruct`, `Meta-Llama-3.1-8B-Instruct` and `llama3.1-8b` all find `llama-3.1-8b`;
   the draft's instruct variant is tried first for an instruct target;
2. the known pairs of verispec's named models (the coder pair, SmolLM2 and its draft, Gemma 3 with prompt lookup);
3. a tokenizer-family match among the models available locally (the Hugging Face cache, the bundled draft,
   and any `search_dirs`): same vocabulary size, BOS/UNK tokens and tokenizer class, at most half the target's
   size; the largest at or below 1/8 of the target's size, else the smallest;
4. the n-gram drafter, which needs no model.
A registry draft that is not available locally is skipped (verispec never downloads).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from ..runtime.model import loading as models
from ..runtime.model.memory import weights_bytes

NGRAM = "ngram"
DEFAULT_K = 4


@dataclass(frozen=True)
class DraftPair:
    target: str  # normalised family-size key, e.g. 'llama-3.1-8b'
    draft: str  # hub id (base variant) or alias of the draft
    num_draft_tokens: int  # K the pair was tuned for
    instruct_draft: str | None = None  # the draft's instruct variant, tried first for an instruct target
    note: str = ""

    def candidates(self, instruct: bool) -> list[str]:
        both = [self.instruct_draft, self.draft] if instruct else [self.draft, self.instruct_draft]
        return [name for name in both if name]


@dataclass(frozen=True)
class DraftChoice:
    draft: str  # a model name or path for `load_model`, or 'ngram'
    num_draft_tokens: int
    source: str  # 'registry' | 'default' | 'tokenizer' | 'ngram'
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def normalize_model_name(name: str | os.PathLike) -> tuple[str, bool]:
    """A hub id, folder or file name -> (lower-case 'family-version-size...' key, whether it is an instruct model).

    'meta-llama/Meta-Llama-3.1-8B-Instruct' -> ('llama-3.1-8b-instruct', True); 'Qwen2.5-72B' -> ('qwen-2.5-72b', False)
    """
    base = Path(str(name).rstrip("/\\")).name
    if base.endswith(".gguf"):
        base = base[: -len(".gguf")]
    key = re.sub(r"[\s_]+", "-", base.lower())
    key = re.sub(r"^meta-(?=llama)", "", key)
    key = re.sub(r"^([a-z]+)(\d)", r"\1-\2", key)  # llama3.1 -> llama-3.1, qwen2.5 -> qwen-2.5
    tokens = key.split("-")
    instruct = any(t in ("instruct", "chat", "it") for t in tokens)
    return key, instruct


def _matches(key: str, registry_key: str) -> bool:
    return key == registry_key or key.startswith(registry_key + "-")


REGISTRY: tuple[DraftPair, ...] = (
    DraftPair("llama-3.1-70b", "meta-llama/Llama-3.2-3B", 4, "meta-llama/Llama-3.2-3B-Instruct"),
    DraftPair("llama-3.1-8b", "meta-llama/Llama-3.2-1B", 3, "meta-llama/Llama-3.2-1B-Instruct"),
    DraftPair("qwen-2.5-72b", "Qwen/Qwen2.5-7B", 4, "Qwen/Qwen2.5-7B-Instruct"),
    DraftPair("deepseek-v3", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", 4,
              note="origins' table; its vocabulary differs from DeepSeek-V3's, so loading checks and falls back"),
    DraftPair(normalize_model_name(models.CODER_TARGET)[0], models.CODER_DRAFT, DEFAULT_K,
              note="embedded default pair (verispec[coder]'s Q4_K_M files)"),
    DraftPair(normalize_model_name(models.SMOLLM2_TARGET)[0], models.SMOLLM2_DRAFT, DEFAULT_K,
              note="SmolLM2 and its distilled draft"),
    DraftPair(models.GEMMA3_TARGET, NGRAM, DEFAULT_K,
              note="verispec[gemma]'s Q4_K_M file; no draft model to train (suffix also works)"),
)


def lookup_pair(target: str | os.PathLike) -> DraftPair | None:
    """The registry pair whose target key is a prefix of the normalised name (longest key wins)."""
    key, _ = normalize_model_name(target)
    hits = [pair for pair in REGISTRY if _matches(key, pair.target)]
    return max(hits, key=lambda pair: len(pair.target)) if hits else None


def local_path(name: str) -> Path | None:
    """Where a model name resolves locally, or None (never downloads)."""
    try:
        return models.resolve_model_path(name)
    except models.ModelLoadError:
        return None


def available(name: str) -> bool:
    """Whether a registry draft can be used here: a drafter without a model (n-gram, suffix) always, a model when it
    resolves locally."""
    from .spec import parse_drafter_spec

    return parse_drafter_spec(name).model is None or local_path(name) is not None


# -- tokenizer-family matching ----------------------------------------------------------------------------------


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


@dataclass(frozen=True)
class TokenizerSignature:
    vocab_size: int
    bos: str | None
    unk: str | None
    tokenizer_class: str | None  # compared only when both sides know it

    def compatible(self, other: TokenizerSignature) -> bool:
        same_class = self.tokenizer_class is None or other.tokenizer_class is None or (
            self.tokenizer_class == other.tokenizer_class
        )
        return (self.vocab_size, self.bos, self.unk) == (other.vocab_size, other.bos, other.unk) and same_class


def folder_signature(folder: Path) -> TokenizerSignature | None:
    """From config.json and tokenizer_config.json only (no tokenizer or weights loaded); None if unreadable."""
    try:
        config = json.loads((folder / "config.json").read_text())
        tok = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not vocab:
        return None
    return TokenizerSignature(int(vocab), _token_text(tok.get("bos_token")), _token_text(tok.get("unk_token")),
                              tok.get("tokenizer_class"))


def object_signature(config, tokenizer) -> TokenizerSignature:
    vocab = config.get_text_config().vocab_size if hasattr(config, "get_text_config") else config.vocab_size
    return TokenizerSignature(int(vocab), tokenizer.bos_token, tokenizer.unk_token, None)


def local_model_dirs(search_dirs: list[str | os.PathLike] | None = None) -> list[Path]:
    """Model folders available locally: `search_dirs` (and their direct subfolders), the bundled draft, and
    every snapshot in the Hugging Face cache."""
    found: list[Path] = []
    for root in search_dirs or ():
        root = Path(root)
        found += [root] if (root / "config.json").is_file() else sorted(p.parent for p in root.glob("*/config.json"))
    bundled = local_path(models.SMOLLM2_DRAFT)
    if bundled is not None:
        found.append(bundled)
    try:
        from huggingface_hub.constants import HF_HUB_CACHE

        found += sorted(p.parent for p in Path(HF_HUB_CACHE).glob("models--*/snapshots/*/config.json"))
    except ImportError:
        pass
    return found


def find_family_draft(
    target_signature: TokenizerSignature,
    target_numel: int | None,
    search_dirs: list[str | os.PathLike] | None = None,
    exclude: Path | None = None,
) -> Path | None:
    """The best local draft sharing the target's tokenizer (see the module docstring), or None."""
    candidates: list[tuple[int, Path]] = []
    for folder in local_model_dirs(search_dirs):
        if exclude is not None and folder.resolve() == exclude.resolve():
            continue
        signature = folder_signature(folder)
        size = weights_bytes(folder)
        if signature is None or size is None or not target_signature.compatible(signature):
            continue
        numel = size // 4  # weights_bytes counts 4 bytes per element by default
        if target_numel is not None and numel > target_numel // 2:
            continue
        candidates.append((numel, folder))
    if not candidates:
        return None
    candidates.sort(key=lambda c: c[0])
    if target_numel is not None:
        small = [c for c in candidates if c[0] <= target_numel // 8]
        if small:
            return small[-1][1]
    return candidates[0][1]


# -- selection --------------------------------------------------------------------------------------------------


def select_draft(
    target: str | os.PathLike,
    *,
    target_config=None,
    tokenizer=None,
    target_numel: int | None = None,
    search_dirs: list[str | os.PathLike] | None = None,
) -> DraftChoice:
    """Pick the draft for `target` (a name, hub id or folder), in the order of the module docstring."""
    pair = lookup_pair(target)
    if pair is not None:
        _, instruct = normalize_model_name(target)
        source = "default" if pair.draft in (models.DEFAULT_DRAFT, models.SMOLLM2_DRAFT) else "registry"
        for name in pair.candidates(instruct):
            if available(name):
                return DraftChoice(name, pair.num_draft_tokens, source, f"known pair {pair.target} -> {name}")
        missing = ", ".join(pair.candidates(instruct))
        registry_miss = f"the known draft ({missing}) is not available locally"
    else:
        registry_miss = "no known pair"

    target_path = local_path(str(target))
    signature = folder_signature(target_path) if target_path is not None and target_path.is_dir() else None
    if signature is None and target_config is not None and tokenizer is not None:
        signature = object_signature(target_config, tokenizer)
    if signature is not None:
        if target_numel is None and target_path is not None:
            size = weights_bytes(target_path)
            target_numel = None if size is None else size // 4
        folder = find_family_draft(signature, target_numel, search_dirs, exclude=target_path)
        if folder is not None:
            return DraftChoice(str(folder), DEFAULT_K, "tokenizer",
                               f"{registry_miss}; {folder} shares the target's tokenizer and is smaller")
    return DraftChoice(NGRAM, DEFAULT_K, "ngram", f"{registry_miss} and no local draft shares the target's tokenizer")


def registry_rows() -> list[dict]:
    """The registry as rows for `verispec pairs`, with whether each draft is available locally."""
    rows = []
    for pair in REGISTRY:
        local = [name for name in pair.candidates(True) if available(name)]
        rows.append({"target": pair.target, "draft": pair.draft, "instruct_draft": pair.instruct_draft,
                     "num_draft_tokens": pair.num_draft_tokens, "available": local, "note": pair.note})
    return rows
