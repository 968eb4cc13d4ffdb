"""Logprobs of a round's committed tokens, read from the verify pass's processed target distribution.

A row's committed tokens are its accepted draft tokens (positions 0..a-1 of the verify pass) and the recovered or
bonus token (position a). Position j of the verify pass is the target's processed distribution after the
committed sequence and draft[:j]: for every committed token that is exactly the distribution the target alone
would have sampled it from, so the numbers equal the target alone's.
"""

from __future__ import annotations

import torch

from .acceptance import SpecDecodeMetadata, VerifyResult
from .sequence import Sequence, TokenLogprob


def round_logprobs(rows: list[Sequence], meta: SpecDecodeMetadata, processed: torch.Tensor,
                   result: VerifyResult) -> dict[int, list[TokenLogprob]]:
    """-> {slot: [TokenLogprob per position 0..num_accepted]} for the rows that asked for logprobs (one host
    transfer for all of them; nothing when no row asked).

    processed: [batch, max_k + 1, vocab] the processed target logits of the verify pass.
    """
    wanted = [seq.slot for seq in rows if seq.params.logprobs is not None]
    if not wanted:
        return {}
    index = torch.tensor(wanted, device=processed.device)  # [r]
    logprobs = processed[index].log_softmax(dim=-1)  # [r, max_k + 1, vocab]
    # The token committed at each position: the draft token there, and the next token at num_accepted (positions
    # past it are never committed).
    chosen = torch.cat([meta.draft_token_ids, meta.draft_token_ids.new_zeros(len(rows), 1)], dim=1)[index]
    chosen = chosen.scatter(1, result.num_accepted[index].unsqueeze(1), result.next_token[index].unsqueeze(1))
    chosen_logprobs = logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)  # [r, max_k + 1]
    top = max(rows[slot].params.logprobs for slot in wanted)
    top_values, top_ids = logprobs.topk(top, dim=-1)  # [r, max_k + 1, top]; top may be 0
    out = {}
    for slot, ids, values, alt_ids, alt_values in zip(wanted, chosen.tolist(), chosen_logprobs.tolist(),
                                                      top_ids.tolist(), top_values.tolist()):
        n = rows[slot].params.logprobs
        out[slot] = [TokenLogprob(token, value, list(zip(alt_ids[j][:n], alt_values[j][:n])))
                     for j, (token, value) in enumerate(zip(ids, values))]
    return out
