"""Which format a tokenizer's chat template calls for: the template's own where it renders tools and its calls are a
format verispec reads (Hermes, Llama 3 JSON), the generic one otherwise.

A template "renders tools" when a probe function's name appears in its output for `tools=[probe]`; which format it
speaks is read off the template and that output (`matches` of each format). The format learns which of its
markers the tokenizer holds as special tokens (tools/markers.py).
"""

from __future__ import annotations

import logging

from .base import ToolFormat
from .generic import GenericFormat
from .hermes import HermesFormat
from .llama3 import Llama3Format
from .markers import special_markers

logger = logging.getLogger("verispec.server")

PROBE = "verispec_probe_function"
TEMPLATE_FORMATS = (HermesFormat, Llama3Format)


def detect_format(tokenizer) -> ToolFormat:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return GenericFormat()
    probe = {"type": "function", "function": {"name": PROBE, "description": "probe",
                                              "parameters": {"type": "object", "properties": {}}}}
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe],
                                                 add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template may raise anything; it then does not render tools
        logger.info("the chat template cannot render tools (%s): generic tool format", exc)
        return GenericFormat()
    source = template if isinstance(template, str) else "\n".join(map(str, dict(template).values()))
    if PROBE in rendered:
        for fmt in TEMPLATE_FORMATS:
            if fmt.matches(source, rendered):
                return fmt(special_markers(tokenizer, fmt.syntax.markers))
        logger.info("the chat template renders tools in a format verispec does not read: generic tool format")
    return GenericFormat()
