"""`ServerConfig`: what `create_app` needs to serve one target. The CLI builds it by keyword."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import SpeculativeConfig
from ..drafters.factory import NONE
from ..models import DEFAULT_DRAFTER, DEFAULT_TARGET


@dataclass(frozen=True)
class ServerConfig:
    model: str = DEFAULT_TARGET
    """Target: model folder, .gguf file, cached hub id, or the embedded default's name."""
    draft_model: str = DEFAULT_DRAFTER
    """Default drafter for requests that speculate: a model (same forms) or 'none' (the target alone)."""
    enable_speculative: bool = False
    """Speculate unless a request says otherwise; when False, only requests that ask for it speculate."""
    spec: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """Default speculation (K, threshold, adaptive depth); a request may change K."""
    draft_tokens_from_pair: bool = False
    """With draft_model 'auto': take K from the registered pair the server picks (as `verispec generate` does
    when --draft-tokens is not given) instead of spec.num_draft_tokens."""
    served_model_name: str | None = None
    """The id /v1/models lists and requests name; default: the model's folder name (or the name given)."""
    max_len: int = 2048
    """Longest prompt + output in tokens (the KV cache is allocated for this)."""
    dtype: torch.dtype = torch.float32
    """Weights dtype of the target and of every drafter the server loads."""
    device: str = "cpu"
    """Torch device of the models."""
    max_cached_drafters: int = 4
    """Drafters named by requests that stay loaded (least recently used ones are dropped); the default stays."""

    def __post_init__(self) -> None:
        if self.max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {self.max_len}")
        if self.max_cached_drafters < 0:
            raise ValueError(f"max_cached_drafters must be >= 0, got {self.max_cached_drafters}")
        if not self.model:
            raise ValueError("model must name a target model")

    @property
    def model_id(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        path = Path(self.model).expanduser()
        if path.exists():
            return path.stem if path.suffix == ".gguf" else path.name
        return self.model

    @property
    def speculates_by_default(self) -> bool:
        return self.enable_speculative and self.draft_model != NONE
