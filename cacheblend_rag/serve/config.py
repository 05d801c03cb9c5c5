"""The settings of one server (`ServeConfig`): names, keys, limits and timeouts, checked when built."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class ServeConfig:
    """Settings of one server."""

    model_name: str  # the name clients send as `model`, listed by /v1/models
    # other names a request's `model` may say: the --model argument as given (a folder path), as vLLM answers to it
    model_aliases: tuple[str, ...] = ()
    # when set, every route but /health needs `Authorization: Bearer <one of them>`; each key is a cache namespace
    # of its own (its requests' salt), so clients with different keys never share cached prompts
    api_keys: tuple[str, ...] = ()
    max_queue: int = 16  # requests that may wait for the engine; one more gets 429
    timeout_s: float = 300.0  # per request, from arrival to the last token
    default_max_tokens: int = 256  # when a request sets no max_tokens
    home: str | None = None  # package home of the Chroma collections used by `retrieval`
    chroma_host: str | None = None
    chroma_port: int | None = None
    poll_s: float = 0.5  # how often a waiting non-streaming request checks that its client is still there
    max_batch: int = 8  # sequences decoded together (continuous batching); 1: one request at a time
    max_body_bytes: int = 8 * 1024**2  # a larger request body gets 413, read no further
    max_documents: int = 256  # documents + chunk_ids of one request; more get 400 before queueing
    header_timeout_s: float = 10.0  # a request's headers must arrive within this (uvicorn protocol, command.py)
    body_timeout_s: float = 60.0  # and its body within this after them (408)
    max_grammar_bytes: int = 128 * 1024  # a request's schema or tool grammar, as text; a larger one gets 400
    grammar_timeout_s: float = 10.0  # a grammar must compile (waiting for a compile thread included) within this
    # answer `usage` without cache facts (cached tokens, the `cacheblend` stats): on a server shared by clients who
    # must not learn what the others sent (docs/serve.md, "What a shared server reveals")
    hide_cache_usage: bool = False
    # the operator's key for /metrics, which then needs it (the clients' keys get 401 there) and opens nothing else:
    # the counters sum every client's cached tokens, so a client reading them around its own request learns whether
    # another client sent the same prompt. Without it /metrics is open to every API key, and off (403) under
    # `hide_cache_usage`
    metrics_key: str | None = None

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ConfigError(f"max_queue must be ≥ 1, got {self.max_queue}")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {self.timeout_s}")
        if self.max_batch < 1:
            raise ConfigError(f"max_batch must be ≥ 1, got {self.max_batch}")
        if self.default_max_tokens < 1:
            raise ConfigError(f"default_max_tokens must be ≥ 1, got {self.default_max_tokens}")
        if not isinstance(self.api_keys, tuple) or not all(isinstance(k, str) and k for k in self.api_keys):
            raise ConfigError(f"api_keys must be a tuple of non-empty keys, got {self.api_keys!r}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be ≥ 1024, got {self.max_body_bytes}")
        if self.max_documents < 1:
            raise ConfigError(f"max_documents must be ≥ 1, got {self.max_documents}")
        if self.max_grammar_bytes < 1024:
            raise ConfigError(f"max_grammar_bytes must be ≥ 1024, got {self.max_grammar_bytes}")
        if not self.grammar_timeout_s > 0:
            raise ConfigError(f"grammar_timeout_s must be > 0 seconds, got {self.grammar_timeout_s}")
        if self.metrics_key is not None and (not isinstance(self.metrics_key, str) or not self.metrics_key):
            raise ConfigError(f"metrics_key must be a non-empty string or None, got {self.metrics_key!r}")
        if self.metrics_key is not None and self.metrics_key in self.api_keys:
            raise ConfigError("the metrics key is also an API key: give the operator a key that no client has "
                              "(--metrics-key)")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ConfigError(f"the header and body timeouts must be > 0 seconds, got {self.header_timeout_s} and "
                              f"{self.body_timeout_s}")


__all__ = ["ServeConfig"]
