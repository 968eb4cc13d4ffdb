"""The playground: `GET /` serves one self-contained page (assets/playground.html: no build step, no CDN) that
streams /v1/chat/completions with `speculative.annotate` and colours each token by how it was decided;
`GET /v1/speculation` tells it (and any client) what a request may ask of speculation on this server.

The page itself needs no API key (it holds no data); every call it makes sends the key its user types, kept in
the page's memory only.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from pydantic import BaseModel

from ..drafters.spec import NONE


class SpeculationSettings(BaseModel):
    """The server's default speculation and the drafters a request may name (`speculative.draft_model`)."""

    model: str  # the served model's id
    max_model_len: int
    enable_speculative: bool  # requests speculate unless they say otherwise
    draft_model: str  # the default drafter ('none': the target alone)
    draft_models: list[str]  # names a request may give, the default first, 'none' last
    num_draft_tokens: int  # K (the most, when adaptive)
    adaptive: bool
    max_speculation_depth: int


@cache
def page() -> str:
    return resources.files("verispec").joinpath("assets/playground.html").read_text(encoding="utf-8")


def install_playground(app: FastAPI, server) -> None:
    """Add `GET /` and `GET /v1/speculation` to the app of `server` (app.Server)."""

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground() -> HTMLResponse:
        return HTMLResponse(page())

    @app.get("/v1/speculation", response_model=SpeculationSettings)
    async def speculation() -> SpeculationSettings:
        served, config = server.served, server.config
        names = [config.draft_model] + sorted(set(served.draft_models) - {config.draft_model, NONE}) + [NONE]
        server.metrics.count_request("/v1/speculation", 200)
        return SpeculationSettings(
            model=server.model_id, max_model_len=config.max_len, enable_speculative=config.speculates_by_default,
            draft_model=config.draft_model if config.speculates_by_default else NONE,
            draft_models=list(dict.fromkeys(names)), num_draft_tokens=served.spec.num_draft_tokens,
            adaptive=served.spec.adaptive, max_speculation_depth=served.spec.max_speculation_depth,
        )
