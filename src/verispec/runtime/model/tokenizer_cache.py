"""Tokenizers loaded without the costs that do not change between runs.

A GGUF file's tokenizer is built by transformers from the file's metadata (its vocabulary and merges, string by
string through gguf-py's reader: ~5 s for the embedded model) the first time only: it is saved under
`$VERISPEC_CACHE/tokenizers/`, keyed by the file (path, size, modification time) and the transformers version, and
every later load reads that tokenizer.json back (`PreTrainedTokenizerFast`, ~0.2 s): the same tokenizer, so the
same token ids and chat template.

A folder whose tokenizer is a plain fast tokenizer (`tokenizer_class` "TokenizersBackend" or
"PreTrainedTokenizerFast", what transformers saves for one) is read by that class directly: `AutoTokenizer` would
build the same class, after importing every model family's module names (~1.5 s).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path

from ..kernels.ext import cache_root

logger = logging.getLogger("verispec")
_PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
_FORMAT = 1  # bump when what is cached changes


def gguf_tokenizer(path: Path):
    """The tokenizer of the GGUF file at `path`: converted by transformers once, read from the cache after."""
    from transformers import PreTrainedTokenizerFast

    folder = cached_folder(path)
    if (folder / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer  # (importing the name imports every model family's names: ~0.6 s)

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    try:
        _save(tokenizer, folder)
    except OSError as exc:  # a read-only cache: converted again next time
        logger.warning("tokenizer of %s not cached in %s (%s)", path, folder, exc)
    return tokenizer


def cached_folder(path: Path) -> Path:
    """Where the tokenizer of the GGUF file at `path` is kept: one folder per file version and transformers
    version."""
    import transformers

    path = Path(path).resolve()
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{_FORMAT}"
    return cache_root() / "tokenizers" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def folder_tokenizer(folder: Path):
    """The tokenizer saved in a model folder (`PreTrainedTokenizerFast` where that is the class it names, else
    `AutoTokenizer`)."""
    try:
        named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        named = None
    if named in _PLAIN_CLASSES and (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


# The files a tokenizer is saved as (`save_pretrained`), whichever of them a folder has.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")


def saved_alike(folder: Path, tokenizer) -> bool:
    """Whether `folder` holds the very tokenizer files `tokenizer` was read from (the same bytes, file by file):
    then it is the same tokenizer, without reading it (e.g. the default draft's, which is its target's)."""
    source = Path(getattr(tokenizer, "name_or_path", "") or "")
    if not Path(folder).is_dir() or not (source / "tokenizer.json").is_file():
        return False
    for name in _TOKENIZER_FILES:
        mine, theirs = Path(folder) / name, source / name
        if mine.is_file() != theirs.is_file() or (mine.is_file() and mine.read_bytes() != theirs.read_bytes()):
            return False
    return True


def write_folder(folder: Path, write, complete: str) -> None:
    """`write(tmp)` fills a temporary sibling of `folder`, which is then renamed into place, so a crash or a
    concurrent process never leaves half a cache folder: where another process got there first (its `complete` file
    is there), the first complete one stays. Used for the tokenizer cache and the fp32 conversion (loading.py)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        write(tmp)
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / complete).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save(tokenizer, folder: Path) -> None:
    write_folder(folder, tokenizer.save_pretrained, "tokenizer.json")
