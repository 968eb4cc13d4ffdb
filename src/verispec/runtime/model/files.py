"""Where model files live and how failing to find one is reported: `cache_root` (`$VERISPEC_CACHE`, else
`~/.cache/verispec`) and `ModelLoadError`. (`loading.py` and `packaged.py` both use them.)"""

from __future__ import annotations

from ..kernels.ext import cache_root  # noqa: F401  (one definition: $VERISPEC_CACHE, else ~/.cache/verispec)


class ModelLoadError(ValueError):
    """A model or tokenizer could not be found or read; the message names the path and the fix."""
