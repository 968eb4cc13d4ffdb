"""A reduced LM head: it stands where the head's `[vocab, hidden]` weight does and computes the logits of a fixed
subset of token ids only (`ids`, from a `[n, hidden]` weight of their rows), -inf for every other token. What the
twin's `:vN` head and a draft model's reduced head run (drafters/twin_head.py, drafters/vocab_ranks.py); a
GGUF draft's is made from its file's own head blocks, row by row (`gguf_weights.read_rows`: no re-quantization).

Its q is then a proper distribution over the subset (zero elsewhere), so rejection sampling stays exact (the
residual max(0, p - q) keeps all of p's mass outside the subset) and greedy and coupled output are exact by
verification; only acceptance can fall, where the target's choice lies outside the subset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ReducedHead:
    """Stands where the LM head's `[vocab, hidden]` weight does (as runtime/kernels/quant.py's QuantWeight does) and answers
    `F.linear`: logits of `ids` from `weight` (their rows, quantized), -inf for every other token; or, `compact`,
    the subset's logits alone (`[..., n]`, column i is token ids[i]) for a caller that maps them itself (the model
    drafter: a greedy draft token is ids[argmax], no vocabulary-wide tensor made; drafters/model.py)."""

    def __init__(self, weight, ids: torch.Tensor, vocab_size: int, compact: bool = False) -> None:
        self.weight = weight  # [n, hidden]: QuantWeight (or a float tensor) of the subset's rows
        self.ids = ids  # [n] long, ascending
        self.shape = torch.Size((vocab_size, weight.shape[1]))
        self.dtype = weight.dtype
        self.device = ids.device
        self.compact = compact

    def __repr__(self) -> str:
        return f"ReducedHead({self.ids.numel()} of {self.shape[0]} tokens, {self.weight!r})"

    @property
    def activations(self) -> str | None:
        """What its rows compute with (a QuantWeight's 'fp32' or 'q8'; None for a float tensor)."""
        return getattr(self.weight, "activations", None)

    @property
    def nbytes(self) -> int:
        own = self.weight.nbytes if not isinstance(self.weight, torch.Tensor) else self.weight.numel() * \
            self.weight.element_size()
        return own + self.ids.numel() * self.ids.element_size()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., vocab]: the subset's logits in place, -inf elsewhere ([..., n] where compact)."""
        subset = F.linear(x, self.weight)  # [..., n]
        return subset if self.compact else expand_logits(subset, self.ids, self.shape[0])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            assert bias is None  # an LM head has none
            return args[1].linear(args[0])
        raise TypeError(f"ReducedHead does not support {getattr(func, '__name__', func)}")


def expand_logits(subset: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """subset [..., n] (column i: token ids[i]) -> [..., vocab]: each in its token's place, -inf elsewhere."""
    logits = subset.new_full((*subset.shape[:-1], vocab_size), float("-inf"))  # [..., vocab]
    return logits.index_copy_(-1, ids, subset)
