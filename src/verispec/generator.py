"""`SpeculativeGenerator`: the Python API, kept close to how users already write it.

    gen = SpeculativeGenerator(target_model, draft_model, tokenizer, K=4, max_len=2048)
    text = gen.generate("The capital of France is", max_new_tokens=32)
    texts = gen.generate(["Hello", "Bonjour"], sampling=[{"temperature": 0.7, "seed": 1}, {}])  # one batch
    for piece in gen.stream("Tell me a story", temperature=0.7, seed=1):
        print(piece, end="")
    gen.get_stats()
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from typing import TYPE_CHECKING

import torch

from .config import RunnerOptions, SamplingParams, SpeculativeConfig
from .drafters.base import Drafter
from .drafters.build import build_drafter, model_drafter
from .drafters.placement import check_device
from .drafters.spec import parse_drafter_spec
from .engine import GenerationResult, SpeculativeEngine
from .runtime.model.native_lm import is_causal_lm
from .stats import GenerationStats

logger = logging.getLogger("verispec")

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PromptLike = str | Sequence[int] | torch.Tensor | list[dict]


class SpeculativeGenerator:
    def __init__(
        self,
        target_model: PreTrainedModel,
        draft_model: PreTrainedModel | Drafter | str | None,
        tokenizer,
        K: int = 5,
        max_len: int = 2048,
        device: str | torch.device | None = None,
        spec: SpeculativeConfig | None = None,
        max_batch_size: int = 16,
        runner: RunnerOptions | None = None,
        tree_nodes: int = 0,
        enable_prefix_caching: bool = True,
        draft_device: str | torch.device | None = None,
    ) -> None:
        """runner: which model runner executes the models (RunnerOptions: backend "auto" | "native" | "hf",
        compile True / False / None for the measured default); tree_nodes: token trees of up to that many draft
        tokens per round, for drafters that propose trees (a draft head; default 0: chains of K);
        enable_prefix_caching: prompts that start like earlier ones reuse their prefix's KV (docs/server.md);
        draft_device: where a draft model runs (default: `device`, else where it is): its draft tokens and q cross
        to the target's device once per round (drafters/placement.py)."""
        if draft_device is not None:
            draft_device = check_device(draft_device)
        if device is not None:
            target_model = target_model.to(device)
        if is_causal_lm(draft_model) and (draft_device or device) is not None:
            draft_model = draft_model.to(draft_device or device)
        self.tokenizer = tokenizer
        if is_causal_lm(draft_model):
            drafter: Drafter | None = model_drafter(target_model, draft_model, max_len)
        elif isinstance(draft_model, str):  # a --draft-model value: 'ngram', 'self:int8', 'ngram+self:int4', a path
            drafter = build_drafter(draft_model, target_model, tokenizer, max_len, device=draft_device).drafter
        else:
            drafter = draft_model
        self.spec = spec or SpeculativeConfig(num_draft_tokens=K, tree_nodes=tree_nodes)
        self.engine = SpeculativeEngine(target_model.eval(), tokenizer, drafter, self.spec, max_len=max_len,
                                        max_batch_size=max_batch_size, runner=runner,
                                        enable_prefix_caching=enable_prefix_caching)
        self.last_stats = GenerationStats()

    @classmethod
    def from_pretrained(
        cls,
        target: str,
        draft: str | None,
        K: int = 5,
        max_len: int = 2048,
        dtype: torch.dtype | str = "auto",
        device: str = "cpu",
        spec: SpeculativeConfig | None = None,
        runner: RunnerOptions | None = None,
        tree_nodes: int = 0,
        weights: str = "auto",
        quantization: str = "none",
        draft_device: str | None = None,
        activations: str = "auto",
        threads: int | str | None = None,
    ) -> SpeculativeGenerator:
        """Load from local folders, `.gguf` files, the embedded default names or cached hub ids.

        `draft` is a model (same forms), a draft head ('head:PATH', 'verispec-head-smollm2-135m'), or a drafter
        name such as 'none' (the target alone) or a cascade ('ngram+verispec-head-smollm2-135m'). dtype: a torch
        dtype, its name, or 'auto' (default; runtime/model/dtype.py says what it picks and why). weights: 'auto'
        (default) a GGUF target's own quantized blocks (float32 compute; the embedded default is a GGUF file) where
        verispec's GGUF kernel runs them and dtype is 'auto', else the float conversion (`target.resolve_weights`);
        'fp32' the float conversion, 'gguf' the blocks; quantization='int8': weight-only int8 (a different model).
        draft_device: where a draft model runs (default: `device`). activations: what GGUF blocks compute with
        ('auto', 'q8', 'fp32': `target.resolve_activations`). threads: the process's step threads, N or 'auto' (the
        cores free now, adapting as the machine gets busy: runtime/threads.py); None (default) leaves them as torch
        has them (`torch.set_num_threads`). ValueError for anything else."""
        from .runtime.model.loading import load_tokenizer
        from .runtime.threads import configure_threads
        from .runtime.weights import hugepages

        if threads is not None:
            configure_threads(threads)
        from .runtime.model.target import TargetOptions, resolve_target

        options = runner or RunnerOptions()
        hugepages.configure(options.huge_pages)
        reads = isinstance(draft, str) and draft != "auto" and parse_drafter_spec(draft).reads_target_weights
        plan = resolve_target(TargetOptions(weights, quantization, dtype, activations, device, options.backend,
                                            options.compile, drafter_reads_weights=reads), target)
        logger.info("target %s: %s", target, plan.describe())
        dtype = plan.dtype  # 'auto': the device's fast dtype where speculation stays exact; float32 on quantized weights
        target_model = plan.load()
        tokenizer = load_tokenizer(target)
        drafter = build_drafter(draft, target_model, tokenizer, max_len, dtype=dtype,
                                device=draft_device or device).drafter
        return cls(target_model, drafter, tokenizer, K=K, max_len=max_len, spec=spec, runner=runner,
                   tree_nodes=tree_nodes)

    # -- prompts -------------------------------------------------------------------------------------------------

    def encode(self, prompt: PromptLike, chat: bool = False) -> list[int]:
        """Text (optionally through the chat template), chat messages, or token ids -> a fresh list of ids."""
        if isinstance(prompt, torch.Tensor):
            return prompt.flatten().tolist()
        if self.tokenizer is None and (isinstance(prompt, str) or chat or (prompt and isinstance(prompt[0], dict))):
            raise ValueError("this generator has no tokenizer (tokenizer=None), so it takes token ids only: pass a "
                             "list of ints or a tensor, or build it with a tokenizer to use text or chat prompts")
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

    def encode_prediction(self, prediction: str | list[int] | None) -> list[int] | None:
        """A prediction's text (tokenized as the answer spells it: no special tokens) or ids -> ids; None stays None."""
        if prediction is None or not isinstance(prediction, str):
            return None if prediction is None else [int(t) for t in prediction]
        if self.tokenizer is None:
            raise ValueError("this generator has no tokenizer (tokenizer=None): give the prediction as token ids")
        return list(self.tokenizer(prediction, add_special_tokens=False)["input_ids"])

    # -- generation ----------------------------------------------------------------------------------------------

    def generate(
        self,
        prompt_or_ids: PromptLike | list[PromptLike],
        *,
        chat: bool = False,
        speculative: bool | None = None,
        return_dict: bool = False,
        sampling: list[dict] | None = None,
        prediction: str | list[int] | list[str | list[int] | None] | None = None,
        **kwargs: Any,
    ) -> str | list[int] | GenerationResult | list:
        """Generate a continuation. Sampling keywords: max_new_tokens, temperature, top_p, top_k, min_p,
        repetition_penalty, presence_penalty, frequency_penalty, logit_bias ({token id: bias}), seed, stop,
        stop_token_ids, min_new_tokens, ignore_eos, logprobs (N alternatives; the GenerationResult of
        `return_dict=True` carries them), structured (a StructuredOutput: JSON schema, regex, choice, Lark grammar)
        (see SamplingParams).

        Returns the text for a text prompt, the generated ids for an id prompt, or the whole GenerationResult
        with `return_dict=True`. `speculative=False` runs the target alone.

        A list of prompts runs as one batch (many sequences per step) and returns a list, in order. The keywords
        apply to every prompt; `sampling=[{...}, ...]` (one dict per prompt) adds per-prompt settings on top,
        e.g. a different temperature or seed for each.

        `prediction`: the answer's expected text (or token ids), e.g. the file an edit rewrites (OpenAI's predicted
        outputs): it drafts first, the output stays the target's own (drafters/prediction.py); for a batch, a list
        with one per prompt (None for a prompt without one). Ignored with `speculative=False`.
        """
        # A batch is a list of prompts (texts, id lists, tensors or chat conversations); a list of ints or of
        # message dicts is one prompt.
        batched = isinstance(prompt_or_ids, list) and len(prompt_or_ids) > 0 and isinstance(
            prompt_or_ids[0], (str, torch.Tensor, list))
        prompts = prompt_or_ids if batched else [prompt_or_ids]
        if sampling is not None and len(sampling) != len(prompts):
            raise ValueError(f"sampling has {len(sampling)} entries for {len(prompts)} prompts: give one per prompt")
        params = [self._params(**{**kwargs, **(sampling[i] if sampling else {})}) for i in range(len(prompts))]
        ids = [self.encode(prompt, chat) for prompt in prompts]
        if batched and prediction is not None and len(prediction) != len(prompts):
            raise ValueError(f"prediction has {len(prediction)} entries for {len(prompts)} prompts: give one per "
                             "prompt (None for a prompt without one)")
        predictions = [self.encode_prediction(p) for p in (prediction if batched and prediction is not None
                                                           else [prediction] * len(prompts))]
        if speculative is False:
            predictions = [None] * len(prompts)
        results = self.engine.generate_batch(ids, params, use_drafter=speculative is not False,
                                             predictions=predictions)
        self.last_stats = GenerationStats()
        for result in results:
            self.last_stats.merge(result.stats)
        outputs = [
            result if return_dict else result.text if isinstance(prompt, str) or chat else result.token_ids
            for prompt, result in zip(prompts, results)
        ]
        return outputs if batched else outputs[0]

    def stream(
        self, prompt_or_ids: PromptLike, *, chat: bool = False, speculative: bool | None = None,
        prediction: str | list[int] | None = None, **sampling: Any
    ) -> Iterator[str]:
        """Yield text pieces as tokens are committed (a multi-token acceptance arrives as one piece). `prediction`:
        the answer's expected text or ids (as `generate`'s)."""
        ids = self.encode(prompt_or_ids, chat)
        prediction = None if speculative is False else self.encode_prediction(prediction)
        for chunk in self.engine.generate_iter(ids, self._params(**sampling), use_drafter=speculative is not False,
                                               prediction=prediction):
            if chunk.stats is not None:
                self.last_stats = chunk.stats
            if chunk.text:
                yield chunk.text

    def _params(self, **sampling: Any) -> SamplingParams:
        params = SamplingParams(**sampling)
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer (this generator has tokenizer=None): use stop_token_ids")
        return params

    def get_stats(self) -> dict:
        """{'last': this generator's last call, 'total': cumulative since construction}."""
        return {"last": self.last_stats.to_dict(), "total": self.engine.total.to_dict()}
