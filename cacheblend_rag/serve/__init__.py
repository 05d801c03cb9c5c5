"""`cacheblend-rag serve`: an OpenAI-compatible HTTP server over the engine, with RAG extensions.

    app.py        routes, errors, auth, SSE; `create_app(engine, ServeConfig(...))`
    schemas.py    request bodies (OpenAI fields + `documents`, `chunk_ids`, `retrieval`, `cacheblend`)
    scheduler.py  the bounded request queue and the engine's worker thread
    runner.py     one request through the engine (`engine_request`, the seam to the engine's API)
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
