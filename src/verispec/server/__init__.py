"""OpenAI-compatible HTTP server with per-request speculative decoding.

| module | job |
|---|---|
| `config.py` | `ServerConfig`: which target and drafter, default speculation, context length |
| `protocol.py` | pydantic request and response bodies (OpenAI schemas plus `speculative`) |
| `served.py` | `ServedModel`: target, tokenizer, engine, cached drafters, prompt encoding |
| `echo.py` | `echo` on `/v1/completions`: the prompt's logprobs from the target's own forward |
| `jobs.py` | `Job`, its `JobHandle` and events: a request as the threads pass it on |
| `prepare.py` | the front end: prompts tokenized and checked, grammars compiled, off the engine thread |
| `worker.py` | `EngineWorker`: the one thread that runs the model, a step loop over the shared batch |
| `app.py` | `create_app`: routes, request -> job, events -> JSON or SSE |
| `chat.py` | a chat request's prompt: messages, the history's tool calls and results, the tools in the served format |
| `tools/` | tool calling: the request's tools checked, the formats (generic, Hermes, Llama 3 JSON), the calls' grammar, reading calls back |
| `responses.py` | response bodies and stream chunks |
| `errors.py`, `metrics.py` | OpenAI error objects; Prometheus metrics in the app's own registry |
| `guard.py` | the ASGI middleware in front of the routes: API key, body size limit, fast 429s, 503 while draining |
| `shutdown.py` | `GracefulServer`: on SIGTERM / SIGINT, drain (finish or cancel running requests), then exit 0 |
"""

from .app import create_app
from .config import ServerConfig
from .served import ServedModel

__all__ = ["ServerConfig", "ServedModel", "create_app"]
