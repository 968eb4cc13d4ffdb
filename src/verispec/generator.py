"""`SpeculativeGenerator`: the Python API, kept close to how users already write it.

    gen = SpeculativeGenerator(target_model, draft_model, tokenizer, K=4, max_len=2048)
    text = gen.generate("The capital of France is", max_new_tokens=32)
    for piece in gen.stream("Tell me a story", temperature=0.7, seed=1):
        print(piece, end="")
    gen.get_stats()
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from .config import SamplingParams, SpeculativeConfig
from .drafters.base import Drafter
from .drafters.factory import make_drafter, model_drafter
from .engine import CACHE_SLACK, GenerationResult, SpeculativeEngine
from .stats import GenerationStats

PromptLike = str | Sequence[int] | torch.Tensor | list[dict]


class SpeculativeGenerator:
    def __init__(
        self,
        target_model: PreTrainedModel,
        draft_model: PreTrainedModel | Drafter | None,
        tokenizer,
        K: int = 5,
        max_len: int = 2048,
        device: str | torch.device | None = None,
        spec: SpeculativeConfig | None = None,
    ) -> None:
        if device is not None:
            target_model = target_model.to(device)
            if isinstance(draft_model, PreTrainedModel):
                draft_model = draft_model.to(device)
        self.tokenizer = tokenizer
        if isinstance(draft_model, PreTrainedModel):
            drafter: Drafter | None = model_drafter(target_model, draft_model, max_len + CACHE_SLACK)
        else:
            drafter = draft_model
        self.spec = spec or SpeculativeConfig(num_draft_tokens=K)
        self.engine = SpeculativeEngine(target_model.eval(), tokenizer, drafter, self.spec, max_len=max_len)
        self.last_stats = GenerationStats()

    @classmethod
    def from_pretrained(
        cls,
        target: str,
        draft: str | None,
        K: int = 5,
        max_len: int = 2048,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        spec: SpeculativeConfig | None = None,
    ) -> SpeculativeGenerator:
        """Load from local folders, `.gguf` files, the embedded default names or cached hub ids.

        `draft` is a model (same forms), or a drafter name such as 'none' (the target alone)."""
        from .models import load_model, load_tokenizer

        target_model = load_model(target, dtype=dtype, device=device)
        tokenizer = load_tokenizer(target)
        drafter = make_drafter(draft, target_model, tokenizer, max_len + CACHE_SLACK, dtype=dtype, device=device)
        return cls(target_model, drafter, tokenizer, K=K, max_len=max_len, spec=spec)

    # -- prompts -------------------------------------------------------------------------------------------------

    def encode(self, prompt: PromptLike, chat: bool = False) -> list[int]:
        """Text (optionally through the chat template), chat messages, or token ids -> a fresh list of ids."""
        if isinstance(prompt, torch.Tensor):
            return prompt.flatten().tolist()
        if isinstance(prompt, str):
            if not chat:
                return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
            prompt = [{"role": "user", "content": prompt}]
        if prompt and isinstance(prompt[0], dict):
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError("this tokenizer has no chat template: pass plain text without chat=True")
            ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return [int(t) for t in prompt]

    # -- generation ----------------------------------------------------------------------------------------------

    def _run(self, prompt: PromptLike, chat: bool, speculative: bool | None, sampling: dict) -> tuple[list[int], Iterator]:
        params = SamplingParams(**sampling)
        ids = self.encode(prompt, chat)
        use_drafter = speculative is not False
        return ids, self.engine.generate_iter(ids, params, use_drafter=use_drafter)

    def generate(
        self,
        prompt_or_ids: PromptLike,
        *,
        chat: bool = False,
        speculative: bool | None = None,
        return_dict: bool = False,
        **sampling: Any,
    ) -> str | list[int] | GenerationResult:
        """Generate a continuation. Sampling keywords: max_new_tokens, temperature, top_p, top_k, min_p,
        repetition_penalty, seed, stop, stop_token_ids, min_new_tokens, ignore_eos (see SamplingParams).

        Returns the text for a text prompt, the generated ids for an id prompt, or the whole GenerationResult
        with `return_dict=True`. `speculative=False` runs the target alone.
        """
        ids, chunks = self._run(prompt_or_ids, chat, speculative, sampling)
        token_ids, pieces, finish = [], [], "length"
        while True:
            try:
                chunk = next(chunks)
            except StopIteration as done:
                self.last_stats = done.value
                break
            token_ids += chunk.token_ids
            pieces.append(chunk.text)
            finish = chunk.finish_reason or finish
        result = GenerationResult(token_ids, "".join(pieces), finish, self.last_stats)
        if return_dict:
            return result
        return result.text if isinstance(prompt_or_ids, str) or chat else result.token_ids

    def stream(
        self, prompt_or_ids: PromptLike, *, chat: bool = False, speculative: bool | None = None, **sampling: Any
    ) -> Iterator[str]:
        """Yield text pieces as tokens are committed (a multi-token acceptance arrives as one piece)."""
        _, chunks = self._run(prompt_or_ids, chat, speculative, sampling)
        while True:
            try:
                chunk = next(chunks)
            except StopIteration as done:
                self.last_stats = done.value
                return
            if chunk.text:
                yield chunk.text

    def get_stats(self) -> dict:
        """{'last': this generator's last call, 'total': cumulative since construction}."""
        return {"last": self.last_stats.to_dict(), "total": self.engine.total.to_dict()}
