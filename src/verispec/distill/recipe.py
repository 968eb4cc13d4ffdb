"""`DistillRecipe`: every setting of a `verispec distill` run, validated; written to `distill_recipe.json`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

STORAGE_DTYPES = ("float16", "bfloat16", "float32")


@dataclass
class DistillRecipe:
    """Settings of one distillation run (data, draft shape, training, evaluation)."""

    target: str  # target model: folder, .gguf file, cached hub id, or the default target's name
    corpus: list[str] = field(default_factory=lambda: ["builtin"])  # "builtin" and/or prompt files (.txt/.jsonl)
    seed: int = 0  # seeds prompts, documents, initialisation and batch order
    # --- teacher data
    tokens: int = 240_000  # budget of target answer tokens to generate (greedy)
    max_new_tokens: int = 128  # longest target answer per prompt
    documents: int = 96  # articles/passages the target writes (sampled) as material to summarise and retrieve
    document_tokens: int = 256  # longest such document
    document_temperature: float = 0.8
    topk: int = 8  # target log-probs kept per answer token, for the soft loss
    gen_batch_size: int = 48  # prompts per generation batch
    gen_batch_tokens: int = 16_384  # padded prompt tokens per generation batch
    teacher_dtype: str = "bfloat16"  # the target's dtype while it writes the data (float32 where bf16 is slow: AVX2)
    # --- teacher shards instead (`verispec distill teacher`'s output: shard_data.py)
    shards: list[str] = field(default_factory=list)  # folders of teacher shards to train on (skips the data stages)
    heldout_fraction: float = 0.05  # share of the shards' conversations held apart for the curve
    shard_limit: int = 0  # train on the first N shards only (manifest order; 0 = all)
    # --- a draft head instead of a draft model (`--head`: drafters/head.py, distill/head.py)
    head: bool = False  # train a feature-level draft head on the target's hidden states
    head_vocab: int = 8192  # the head's draft vocabulary: the most frequent answer tokens
    head_unroll: int = 3  # training-time unroll steps (the head reads its own predicted features when drafting)
    head_tree_nodes: int = 16  # token-tree node budget evaluated beside the chain
    head_prompt_loss: bool = True  # also learn at prompt positions (teacher-forced), not only the answers
    head_holdout: int = 16  # samples held apart from training: held-out accuracy at every checkpoint
    # --- draft shape (a Llama with the target's vocabulary and tied embeddings)
    hidden_size: int = 128
    num_layers: int = 4
    intermediate_size: int = 512
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 8192
    draft_vocab: int = 0  # reduced LM head: the N most frequent answer tokens (0: the whole vocabulary)
    # --- training
    steps: int = 3000
    lr: float = 3e-3
    batch_tokens: int = 4096  # padded tokens per training batch
    max_length: int = 1024  # longest prompt + answer the teacher answers (longer prompts are skipped)
    train_length: int = 768  # longest training sequence: the prompt's start is trimmed to fit
    kd_weight: float = 0.5  # weight of the soft top-k term against the hard greedy-token term
    weight_decay: float = 0.01
    copy_weight: float = 0.5  # weight of the auxiliary copy loss (repeat spans seen earlier); 0 = off
    negatives: int = 2048  # sampled-softmax negatives per step beyond the target's top-k tokens (0 = full softmax)
    train_bf16: bool = True  # bf16 autocast for training matmuls (fp32 master weights)
    checkpoint_every: int = 100  # steps between checkpoints (and held-apart evaluations)
    storage_dtype: str = "float16"  # dtype of the written safetensors
    # --- evaluation
    eval_prompts: int = 40  # benchmark first turns to evaluate on (0 = skip)
    eval_max_new_tokens: int = 128
    eval_k: int = 4

    def __post_init__(self):
        positive = ["head_vocab", "head_unroll", "tokens", "max_new_tokens", "document_tokens", "topk", "gen_batch_size", "gen_batch_tokens",
                    "hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads", "max_positions",
                    "steps", "checkpoint_every", "batch_tokens", "max_length", "train_length", "eval_max_new_tokens", "eval_k"]
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("documents", "eval_prompts", "negatives", "head_holdout", "draft_vocab", "shard_limit"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden-size {self.hidden_size} must be divisible by num-heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num-heads {self.num_heads} must be divisible by num-kv-heads {self.num_kv_heads}")
        if not 0.0 <= self.kd_weight <= 1.0:
            raise ValueError(f"kd-weight must be in [0, 1], got {self.kd_weight}")
        if self.copy_weight < 0:
            raise ValueError(f"copy-weight must be >= 0, got {self.copy_weight}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.teacher_dtype not in STORAGE_DTYPES:
            raise ValueError(f"teacher dtype must be one of {STORAGE_DTYPES}, got {self.teacher_dtype!r}")
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage dtype must be one of {STORAGE_DTYPES}, got {self.storage_dtype!r}")
        if self.max_length <= self.max_new_tokens:
            raise ValueError(f"max-length {self.max_length} must exceed max-new-tokens {self.max_new_tokens}")
        if self.train_length <= self.max_new_tokens:
            raise ValueError(f"train-length {self.train_length} must exceed max-new-tokens {self.max_new_tokens}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout-fraction must be in (0, 1), got {self.heldout_fraction}")
        if not self.corpus:
            raise ValueError("corpus must name at least one source ('builtin' or a prompt file)")

    def to_dict(self) -> dict:
        return asdict(self)
