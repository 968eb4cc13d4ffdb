"""Turn a user's `--draft-model` value into a Drafter.

Values: 'none' (target alone), a model folder / .gguf / hub id / the embedded default draft's name, or a name in
`NAMED_DRAFTERS`: 'ngram' (prompt lookup, no model), 'random' (uniform random tokens: a deliberately bad drafter
for tests and benchmarks), 'auto' (the registered draft for the target, see pairs.py). New drafting methods
register a name there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from .base import Drafter
from .model import ModelDrafter
from .ngram import NgramDrafter
from .random import RandomDrafter

NONE = "none"
AUTO = "auto"

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


def model_drafter(target: PreTrainedModel, draft: PreTrainedModel, max_len: int) -> ModelDrafter:
    check_vocab_match(target, draft)
    return ModelDrafter(draft.eval(), max_len)


def make_drafter(
    name: str | None,
    target: PreTrainedModel,
    tokenizer,
    max_len: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Drafter | None:
    """Build the drafter named by `name` for `target` (None or 'none': no drafter)."""
    if name is None or name == NONE:
        return None
    if name in NAMED_DRAFTERS:
        return NAMED_DRAFTERS[name](target, tokenizer, max_len)
    from ..models import load_model

    return model_drafter(target, load_model(name, dtype=dtype, device=device), max_len)
