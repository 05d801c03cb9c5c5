"""`cacheblend-rag serve`: registers the OpenAI-compatible server's subcommand (`serve/command.py` runs it)."""

from __future__ import annotations

from .common import add_kv_store_argument


def add_serve(subparsers) -> None:
    from ..serve.command import add_arguments, run_cli

    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server (chat/completions with documents)",
                              description="Serve the engine over HTTP: OpenAI-compatible /v1/chat/completions and "
                              "/v1/completions (with documents, chunk_ids, retrieval and cacheblend options), "
                              "/v1/models, /health and Prometheus /metrics. Binds 127.0.0.1 by default.")
    add_arguments(p)
    add_kv_store_argument(p)
    p.set_defaults(func=run_cli)
