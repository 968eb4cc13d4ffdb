"""OpenAI-style errors: every failure leaves the server as `{"error": {"message", "type", "param", "code"}}`.

Bad input is a 4xx with a message that says what to change; the server keeps serving. FastAPI's own 422 for a
body that does not match the schema becomes a 400 `invalid_request_error`, as OpenAI answers it.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("verispec.server")

_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                   405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
                   429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error to send to the client as an OpenAI error object with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = _utf8(message)  # it may quote the request (a model name): lone surrogates cannot be sent
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers  # e.g. Retry-After on a 429

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _utf8(text: str) -> str:
    """`text` with what UTF-8 cannot encode (a JSON body's lone surrogate, "\\ud800") replaced by '?'."""
    return text.encode("utf-8", "replace").decode("utf-8")


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(name: str, param: str = "model", hint: str = "") -> APIError:
    message = f"The model `{name}` does not exist or cannot be loaded" + (f": {hint}." if hint else ".")
    return APIError(404, message, param=param, code="model_not_found")


def queue_full(limit: int) -> APIError:
    return APIError(429, f"The server is busy: {limit} requests already wait for a slot (--max-queued-requests). "
                         "Retry later.", code="queue_full", headers={"Retry-After": "1"})


def timed_out(seconds: float | None) -> APIError:
    return APIError(408, f"The request took longer than this server's --request-timeout ({seconds:g} s) and was "
                         "stopped; ask for fewer tokens or retry later.", code="request_timeout")


def shutting_down(detail: str = "it accepts no new requests") -> APIError:
    return APIError(503, f"The server is shutting down: {detail}.", code="server_shutting_down",
                    headers={"Connection": "close"})


def _is_type_tag(part: object) -> bool:
    """pydantic puts the union member it tried into `loc` ('str', 'list[int]', 'SpeculativeOptions')."""
    return isinstance(part, str) and (
        "[" in part or "-" in part or part[:1].isupper() or part in {"str", "int", "float", "bool", "list", "dict"}
    )


def _param(error: dict) -> str | None:
    loc = [part for part in error.get("loc", ()) if not _is_type_tag(part)]
    if loc and loc[0] == "body":
        loc = loc[1:]
    return ".".join(str(part) for part in loc) or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first schema violation as a 400, naming the field by its dotted path (`messages.0.role`).

    pydantic reports every member of a union that failed; of those at the first one's field, the member whose
    type matched (only a constraint failed: a list too long) says what to change."""
    errors = exc.errors()
    param = _param(errors[0])
    first = next((e for e in errors if _param(e) == param and not e.get("type", "").endswith("_type")), errors[0])
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error") or first.get("msg")
        position = first.get("loc", (None, None))[-1]
        where = f" at character {position}" if isinstance(position, int) else ""
        return invalid(f"We could not parse the JSON body of your request ({detail}{where}); send valid JSON.",
                       code="invalid_json")
    if kind == "missing":
        return invalid(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if param is None and isinstance(exc.body, bytes | str):
        return invalid("Send the request body as JSON, with the header `Content-Type: application/json`.",
                       code="invalid_json")
    if param is None:
        return invalid(f"The request body must be a JSON object: {first.get('msg')}.")
    return invalid(f"Invalid value for '{param}': {first.get('msg')}.", param=param, code="invalid_value")


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    """Route every error through the OpenAI shape; `on_error(request, status)` is told of each (for metrics)."""

    def reply(request: Request, error: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(request, error.status)
        return error.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return reply(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return reply(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"Unknown path {request.url.path}: see GET /v1/models, POST /v1/chat/completions, " \
                      "POST /v1/completions, GET /health, GET /metrics."
        return reply(request, APIError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s", request.url.path)
        return reply(request, APIError(500, f"Internal error ({type(exc).__name__}); the server logged it.",
                                       type="server_error"))
