"""Turn a user's `--draft-model` value into a Drafter.

Values: 'none' (target alone), a model folder / .gguf / hub id / the embedded default draft's name, a draft head
('head:PATH', a head folder, or the shipped head's name: see head.py), or a name in
`NAMED_DRAFTERS`: 'ngram' (prompt lookup, no model), 'random' (uniform random tokens: a deliberately bad drafter
for tests and benchmarks), 'auto' (the registered draft for the target, see pairs.py). New drafting methods
register a name there. Several values joined by '+' make a cascade (cascade.py): 'ngram+MODEL' drafts by prompt
lookup where the sequence repeats itself and with MODEL elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable

from pathlib import Path

import torch
from transformers import PreTrainedModel

from .base import Drafter
from .cascade import CascadeDrafter, split_spec
from .head import HEAD_PREFIX, head_drafter, is_head_folder
from .model import ModelDrafter
from .ngram import NgramDrafter
from .random import RandomDrafter

NONE = "none"
AUTO = "auto"
DEFAULT_HEAD = "verispec-head-smollm2-135m"  # the draft head shipped for the embedded default target
DEFAULT_HEAD_DIR = Path(__file__).resolve().parent.parent / "assets" / "default_head"

# name -> factory(target_model, tokenizer, max_len) for drafters that need no model of their own.
NAMED_DRAFTERS: dict[str, Callable[[PreTrainedModel, object, int], Drafter]] = {}


def _auto(target: PreTrainedModel, tokenizer, max_len: int) -> Drafter | None:
    from ..fallback import load_drafter_or_fallback

    weight = next(target.parameters())
    return load_drafter_or_fallback(AUTO, target, tokenizer, max_len, dtype=weight.dtype, device=weight.device).drafter


NAMED_DRAFTERS["ngram"] = lambda target, tokenizer, max_len: NgramDrafter()
NAMED_DRAFTERS["random"] = lambda target, tokenizer, max_len: RandomDrafter(
    int(target.get_output_embeddings().weight.shape[0])
)
NAMED_DRAFTERS[AUTO] = _auto


def check_vocab_match(target: PreTrainedModel, draft: PreTrainedModel) -> None:
    """Draft and target must share one vocabulary (same output size); name both sizes otherwise."""
    t = target.get_output_embeddings().weight.shape[0]
    d = draft.get_output_embeddings().weight.shape[0]
    if t != d:
        raise ValueError(
            f"draft vocabulary size {d} does not match target vocabulary size {t}: pick a draft model trained with "
            "the target's tokenizer, or use --draft-model ngram"
        )


def head_path(name: str) -> Path | None:
    """The folder of the draft head a drafter value names ('head:PATH', the shipped head's name, or a folder holding
    head_config.json); None when it names no head. ValueError when 'head:' names a folder without a head."""
    if name == DEFAULT_HEAD:
        return DEFAULT_HEAD_DIR
    if name.startswith(HEAD_PREFIX):
        rest = name[len(HEAD_PREFIX):]
        path = DEFAULT_HEAD_DIR if rest == DEFAULT_HEAD else Path(rest).expanduser()
        if not is_head_folder(path):
            raise ValueError(f"--draft-model {name!r}: {path} holds no draft head (head_config.json); make one with "
                             f"`verispec distill --head --target MODEL --out DIR`")
        return path
    return Path(name).expanduser() if is_head_folder(Path(name).expanduser()) else None


def model_drafter(target: PreTrainedModel, draft: PreTrainedModel, max_len: int) -> ModelDrafter:
    check_vocab_match(target, draft)
    return ModelDrafter(draft.eval(), max_len)


def cascade_parts(name: str | None) -> list[str]:
    """The drafter values a '+' list names ([name] when it is one value; a path that exists is never split)."""
    if name is None:
        return [NONE]
    from pathlib import Path

    if Path(str(name)).expanduser().exists():
        return [str(name)]
    parts = split_spec(str(name))
    if len(parts) > 1 and NONE in parts:
        raise ValueError(f"--draft-model {name!r}: 'none' cannot be part of a '+' list; pass 'none' alone")
    models = [part for part in parts if part not in NAMED_DRAFTERS and head_path(part) is None]
    if len(models) > 1:
        raise ValueError(f"--draft-model {name!r}: a '+' list takes at most one draft model, got {', '.join(models)}")
    return parts


def model_part(name: str | None) -> str | None:
    """The draft model a drafter value names, if any ('ngram+MODEL' -> 'MODEL'; 'ngram' -> None)."""
    models = [part for part in cascade_parts(name)
              if part != NONE and part not in NAMED_DRAFTERS and head_path(part) is None]
    return models[0] if models else None


def make_drafter(
    name: str | None,
    target: PreTrainedModel,
    tokenizer,
    max_len: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    draft_model: PreTrainedModel | None = None,
) -> Drafter | None:
    """Build the drafter named by `name` for `target` (None or 'none': no drafter).

    `draft_model`, when given, is the already loaded model that `name` (or its model part) names."""
    parts = cascade_parts(name)
    if len(parts) > 1:
        return CascadeDrafter([make_drafter(part, target, tokenizer, max_len, dtype, device, draft_model)
                               for part in parts])
    name = parts[0]
    if name == NONE:
        return None
    if name in NAMED_DRAFTERS:
        return NAMED_DRAFTERS[name](target, tokenizer, max_len)
    head = head_path(name)
    if head is not None:
        return head_drafter(head, target, max_len, name)
    if draft_model is None:
        from ..models import load_model

        draft_model = load_model(name, dtype=dtype, device=device)
    return model_drafter(target, draft_model, max_len)
