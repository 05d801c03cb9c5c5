"""`cacheblend-rag serve`: an OpenAI-compatible HTTP server over the engine, with RAG extensions.

    app.py        routes, auth, error answers; `create_app(engine, ServeConfig(...))`
    config.py     `ServeConfig`, the server's settings
    schemas.py    request bodies (OpenAI fields + `documents`, `chunk_ids`, `retrieval`, `cacheblend`)
    calls.py      a body → the engine's `Request`, built once (`engine_call`, the seam to the engine's API);
                  API errors
    admission.py  size limits, grammar size and compile, the queue (429, Retry-After)
    responses.py  JSON and SSE answers, usage, tool calls
    scheduler.py  the bounded request queue and the engine's worker thread
    runner.py     one call on the worker: its retrieval, then the engine
    limits.py     the API key, the body's size and deadlines, a prompt's size from its characters
    tooling.py    tool calling and structured output
    metrics.py    Prometheus counters, histograms and gauges
    command.py    the CLI subcommand

Needs the `serve` extra (fastapi, uvicorn, prometheus-client): pip install 'cacheblend-rag[serve]'.
"""

from __future__ import annotations


def __getattr__(name: str):  # fastapi is imported only when the app is asked for
    if name in ("create_app", "ServeConfig", "APIError"):
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["APIError", "ServeConfig", "create_app"]
