"""`--draft-model` parsed once: a user's drafter value -> `DrafterSpec`, typed and validated (build.py builds it).

Values: 'none' (the target alone); a name in `NAMED_DRAFTERS` (named.py: 'ngram' prompt lookup, 'random');
'auto' (the registered draft for the target, see drafters/auto.py); the target's own quantized twin ('self:int8',
'self:int4', ...: twin.py); a draft head ('head:PATH', a folder holding
head_config.json, or the shipped head's name `DEFAULT_HEAD`: see head.py); anything else names a draft model (a
folder, a .gguf file, a hub id or the embedded default draft's name), its LM head reduced to the N most frequent
tokens with ':vN' ('MODEL:v16384'; ':vfull' keeps the whole head; vocab_ranks.py). Several values joined by '+' make a cascade
(cascade.py): 'ngram+MODEL' drafts by prompt lookup where the sequence repeats itself and with MODEL elsewhere. A
path that exists is never split at '+'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .cascade import split_spec
from .head import HEAD_PREFIX, is_head_folder
from .named import NAMED_DRAFTERS
from .twin import is_twin, twin_qtype
from .vocab_ranks import DEFAULT_DRAFT_VOCAB, MIN_DRAFT_VOCAB

NONE = "none"
AUTO = "auto"
DEFAULT_HEAD = "verispec-head-smollm2-135m"  # the draft head shipped for the embedded default target
DEFAULT_HEAD_DIR = Path(__file__).resolve().parent.parent / "assets" / "default_head"
KINDS = ("named", "auto", "head", "twin", "model")
_VOCAB_SUFFIX = re.compile(r"(?P<model>.+):v(?P<size>[^:/]*)")  # a draft model's reduced head: 'MODEL:vN'


@dataclass(frozen=True)
class DraftStage:
    """One drafter of a `--draft-model` value (a cascade has several, tried in order per row)."""

    kind: str
    """'named' (a NAMED_DRAFTERS entry), 'auto' (drafters/auto.py picks), 'head' (a trained draft head), 'twin' (the target's
    quantized twin, twin.py), 'model'."""
    name: str
    """The value as the user wrote it: 'ngram', 'auto', 'head:DIR', 'self:int8', a model path or hub id (without
    its ':vN', which is `draft_vocab`)."""
    head_dir: Path | None = None
    """The head's folder (kind 'head' only)."""
    draft_vocab: int | None = None
    """Rows a draft model's LM head keeps (kind 'model' only; written 'MODEL:vN', 'MODEL:vfull' for 0): the N most
    frequent tokens and the special ones (vocab_ranks.py). None: `vocab_ranks.DEFAULT_DRAFT_VOCAB` where a shipped
    table knows the tokenizer, else the whole head; 0: the whole head."""

    @property
    def label(self) -> str:
        """The stage as the user wrote it: its name, with ':vN' where a head size was asked for."""
        if self.draft_vocab is None:
            return self.name
        return f"{self.name}:v{self.draft_vocab or 'full'}"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"drafter kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if (self.kind == "head") != (self.head_dir is not None):
            raise ValueError(f"drafter {self.name!r}: a head_dir is given exactly for kind 'head'")
        if self.draft_vocab is not None and self.kind != "model":
            raise ValueError(f"drafter {self.name!r}: only a draft model's head is reduced (':vN')")
        if self.draft_vocab and self.draft_vocab < MIN_DRAFT_VOCAB:
            raise ValueError(f"--draft-model {self.name}:v{self.draft_vocab}: a draft model's head keeps at least "
                             f"{MIN_DRAFT_VOCAB} token ids (or ':vfull', the whole head)")


@dataclass(frozen=True)
class DrafterSpec:
    """A parsed `--draft-model` value: no stage (the target alone), one drafter, or a cascade of stages."""

    text: str
    """The value as given ('none' for no drafter)."""
    stages: tuple[DraftStage, ...] = ()
    """The drafters in cascade order; empty for 'none'."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        models = [stage.name for stage in self.stages if stage.kind == "model"]
        if len(models) > 1:
            raise ValueError(f"--draft-model {self.text!r}: a '+' list takes at most one draft model, got "
                             f"{', '.join(models)}")

    @property
    def model(self) -> str | None:
        """The draft model this value names, if any ('ngram+MODEL' -> 'MODEL'; 'ngram' -> None)."""
        return next((stage.name for stage in self.stages if stage.kind == "model"), None)

    @property
    def model_stage(self) -> DraftStage | None:
        """The stage that names a draft model, if any."""
        return next((stage for stage in self.stages if stage.kind == "model"), None)

    @property
    def reads_target_weights(self) -> bool:
        """Whether a stage reads the target's float weights (a draft head: its embedding and LM head; the twin:
        every linear, quantized), which a target on GGUF blocks no longer holds."""
        return any(stage.kind in ("head", "twin") for stage in self.stages)

    def __str__(self) -> str:
        return self.text


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


def draft_vocab_suffix(name: str) -> tuple[str, int | None]:
    """'MODEL:v16384' -> ('MODEL', 16384), 'MODEL:vfull' -> ('MODEL', 0), 'MODEL' -> ('MODEL', None). A path that
    exists keeps its name whole. ValueError for a ':v' that is not a count."""
    match = _VOCAB_SUFFIX.fullmatch(name)
    if match is None or Path(name).expanduser().exists():
        return name, None
    size = match["size"]
    if size != "full" and not size.isdigit():
        raise ValueError(f"--draft-model {name!r}: a draft model's reduced head is written ':vN' (N token ids, e.g. "
                         f"{match['model']}:v{DEFAULT_DRAFT_VOCAB}) or ':vfull' (the whole head)")
    return match["model"], 0 if size == "full" else int(size)


def parse_stage(name: str) -> DraftStage:
    """One value of a '+' list -> its stage (a head folder is looked up on disk; a model is not: build.py loads it)."""
    if name == AUTO:
        return DraftStage("auto", name)
    if name in NAMED_DRAFTERS:
        return DraftStage("named", name)
    if is_twin(name):
        twin_qtype(name)  # ValueError naming the formats
        return DraftStage("twin", name)
    head = head_path(name)
    if head is not None:
        return DraftStage("head", name, head)
    model, draft_vocab = draft_vocab_suffix(name)
    return DraftStage("model", model, draft_vocab=draft_vocab)


def parse_drafter_spec(value: str | DrafterSpec | None) -> DrafterSpec:
    """A `--draft-model` value (None: 'none') -> its DrafterSpec; ValueError naming the fix when it is malformed."""
    if isinstance(value, DrafterSpec):
        return value
    text = NONE if value is None else str(value).strip()
    if not text:
        raise ValueError("--draft-model is empty: name a drafter (e.g. ngram, auto, a draft model) or 'none'")
    if text == NONE:
        return DrafterSpec(NONE)
    parts = [text] if Path(text).expanduser().exists() else split_spec(text)
    if len(parts) > 1 and NONE in parts:
        raise ValueError(f"--draft-model {text!r}: 'none' cannot be part of a '+' list; pass 'none' alone")
    return DrafterSpec(text, tuple(parse_stage(part) for part in parts))
