"""Drafters known by a name, that need no model of their own: 'ngram' (prompt lookup), 'suffix' (suffix
decoding over the request's text and earlier requests', suffix.py) and 'random' (uniform random
tokens: a deliberately bad drafter for tests and benchmarks). A new model-free drafting method registers its name
here; `--draft-model NAME` (spec.py) then finds it and build.py builds it."""

from __future__ import annotations

from collections.abc import Callable

from .base import Drafter
from .ngram import NgramDrafter
from .random import RandomDrafter
from .suffix import SuffixDrafter

# name -> factory(target_model, tokenizer, cache_len): cache_len is the KV cache length a drafter with a cache
# keeps per slot (build.py: max_len plus the widest verify pass).
NAMED_DRAFTERS: dict[str, Callable[[object, object, int], Drafter]] = {
    "ngram": lambda target, tokenizer, cache_len: NgramDrafter(),
    "suffix": lambda target, tokenizer, cache_len: SuffixDrafter(),
    "random": lambda target, tokenizer, cache_len: RandomDrafter(int(target.get_output_embeddings().weight.shape[0])),
}
