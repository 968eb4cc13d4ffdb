"""Where model files live and how failing to find one is reported: `cache_root` (`$VERISPEC_CACHE`, else
`~/.cache/verispec`) and `ModelLoadError`. (`loading.py` and `packaged.py` both use them.)"""

from __future__ import annotations

import os
from pathlib import Path


class ModelLoadError(ValueError):
    """A model or tokenizer could not be found or read; the message names the path and the fix."""


def cache_root() -> Path:
    """Folder for converted and joined models: `$VERISPEC_CACHE`, else `~/.cache/verispec`."""
    return Path(os.environ.get("VERISPEC_CACHE") or Path.home() / ".cache" / "verispec").expanduser()
