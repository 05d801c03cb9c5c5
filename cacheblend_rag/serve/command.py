"""The `serve` subcommand: load the engine, then run the app under uvicorn until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import faulthandler
import gc
import ipaddress
import logging
import math
import signal
from pathlib import Path

from .. import settings
from ..arguments import parse_size, positive_int
from ..errors import MissingDependencyError
from ..models.loader import DEFAULT_MODEL, PACKAGED_GGUF, is_hub_id

logger = logging.getLogger(__name__)

KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this
MAX_HEADER_BYTES = 16 * 1024  # request line + headers; more is a 400 from h11


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The serve options."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="port, 1 to 65535 (default 8000)")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help=f"require `Authorization: Bearer KEY` on every route but /health; repeat it or separate keys "
                   f"with commas for several clients, each with a cache namespace of its own "
                   f"(default ${settings.ENV_API_KEY}; unset: no auth)")
    p.add_argument("--home", help=f"package home (models, KV store, Chroma); overrides ${settings.ENV_HOME}")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"packaged model alias, local model folder or Hugging "
                   f"Face hub id org/name, read from the HF cache (default {DEFAULT_MODEL})")
    p.add_argument("--revision", help="branch, tag or commit of a hub id (default: main)")
    p.add_argument("--trust-remote-code", action="store_true", help="run a hub repo's own modelling code (off by "
                   "default: it is code from the repo's authors)")
    p.add_argument("--served-model-name", help="the name clients send as `model`, the only one (default: the "
                   "--model argument as given, or for a path also the folder's name, which /v1/models lists)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--max-queue", type=int, default=16, help="requests that may wait for the engine; more get "
                   "429 (default 16)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together, continuous batching "
                   "(default 8; 1: one at a time)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take, queueing included "
                   "(default 300)")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens when a request sets none (default 256)")
    p.add_argument("--chroma-host", help="Chroma server for `retrieval` (default: the embedded database under --home)")
    p.add_argument("--chroma-port", type=_port, help="Chroma server port")
    p.add_argument("--max-body-bytes", type=_size, default=8 * 1024**2, metavar="SIZE",
                   help="largest request body, e.g. 8MiB (default); a larger one gets 413 and is not read")
    p.add_argument("--max-documents", type=positive_int, default=256, metavar="N",
                   help="documents + chunk_ids one request may send (default 256); more get 400 before queueing")
    p.add_argument("--header-timeout", type=_seconds, default=10.0, metavar="S",
                   help="seconds a client has to send a request's headers (default 10); then the connection closes")
    p.add_argument("--body-timeout", type=_seconds, default=60.0, metavar="S",
                   help="seconds a client has to send a request's body after its headers (default 60); then 408")
    p.add_argument("--max-grammar-bytes", type=_size, default=128 * 1024, metavar="SIZE",
                   help="largest response_format schema or tools grammar, as text; larger gets 400 (default 128KiB)")
    p.add_argument("--grammar-timeout", type=_seconds, default=10.0, metavar="S",
                   help="seconds a request's grammar may take to compile, waiting included; longer gets 400 "
                        "(default 10)")
    p.add_argument("--hide-cache-usage", action="store_true",
                   help="answer `usage` without cache facts (cached tokens, the `cacheblend` stats), so clients of a "
                        "shared server cannot tell what the others sent; /metrics is then off unless --metrics-key "
                        "is given (docs/serve.md, \"What a shared server reveals\")")
    p.add_argument("--metrics-key", metavar="KEY",
                   help=f"the operator's key for /metrics (`Authorization: Bearer KEY`); the clients' --api-key keys "
                        f"then get 401 there, since its counters sum every client's cache hits "
                        f"(default ${settings.ENV_METRICS_KEY}; unset: /metrics takes the API keys, or is off under "
                        f"--hide-cache-usage)")
    p.add_argument("-v", "--verbose", action="store_true", help="log INFO messages and every request to stderr")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1 to 65535, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _size(text: str) -> int:
    value = parse_size(text)
    if value < 1024:
        raise argparse.ArgumentTypeError(f"must be at least 1KiB, got {text}")
    return value


def served_name(model: str, override: str | None = None) -> str:
    """The model name the server lists (/v1/models) and answers with."""
    if override:
        return override
    path = Path(model).expanduser()
    if model in PACKAGED_GGUF or (not path.exists() and is_hub_id(model)):
        return model  # an alias or a hub id is already the name clients know
    return path.name


def served_aliases(model: str, override: str | None = None) -> tuple[str, ...]:
    """Other names a request's `model` may say: the --model argument as given, as vLLM serves it, unless
    --served-model-name replaces it."""
    if override or model == served_name(model):
        return ()
    return (model,)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def uvicorn_server(app, config, host: str, port: int, *, verbose: bool = False):
    """The uvicorn server `serve` runs `app` under (the tests serve through the same one): h11 with a deadline on
    each request's headers; idle keep-alive connections close after KEEP_ALIVE_S; headers larger than
    MAX_HEADER_BYTES are refused by h11 (400)."""
    import uvicorn

    from .limits import header_deadline_protocol

    return uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, log_level="info" if verbose else "warning",
        access_log=verbose, timeout_graceful_shutdown=None,  # wait for in-flight requests, however long
        http=header_deadline_protocol(config.header_timeout_s), timeout_keep_alive=KEEP_ALIVE_S,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    ))


def run_cli(args: argparse.Namespace) -> int:
    """Load the engine and serve until stopped; SIGTERM finishes in-flight requests, then exits 0."""
    try:
        import uvicorn  # noqa: F401 - the server runs on it (uvicorn_server)

        from .app import ServeConfig, create_app
    except ImportError as e:
        raise MissingDependencyError(f"serving needs {e.name}: pip install 'cacheblend-rag[serve]'") from e
    from ..engine import CacheBlendEngine
    from ..store import open_store

    config = ServeConfig(model_name=served_name(args.model, args.served_model_name),
                         model_aliases=served_aliases(args.model, args.served_model_name),
                         metrics_key=settings.metrics_key(args.metrics_key),
                         api_keys=settings.api_keys(args.api_key), max_queue=args.max_queue, timeout_s=args.timeout,
                         default_max_tokens=args.max_tokens, max_batch=args.max_batch, home=args.home,
                         chroma_host=args.chroma_host, chroma_port=args.chroma_port,
                         max_body_bytes=args.max_body_bytes, max_documents=args.max_documents,
                         header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                         max_grammar_bytes=args.max_grammar_bytes, grammar_timeout_s=args.grammar_timeout,
                         hide_cache_usage=args.hide_cache_usage)
    if not _is_loopback(args.host) and not config.api_keys:
        logger.warning("serving on %s without an API key: anyone who can reach it can use it (--api-key)", args.host)
    # --kv-store tiers (cli.py adds the option), else memory over the disk under --home; built before the model
    # loads, so a bad spec fails fast. Replicas share KV by naming the same Redis tier.
    tiers = getattr(args, "kv_store", None)
    kv_store = open_store(list(tiers) if tiers else settings.kv_dir(args.home))
    engine = CacheBlendEngine.from_pretrained(args.model, kv_store=kv_store, device=args.device, dtype=args.dtype,
                                              home=args.home, revision=args.revision,
                                              trust_remote_code=args.trust_remote_code)
    app = create_app(engine, config)
    # the model, tokenizer and libraries leave ~420k objects the cyclic GC would walk on every full collection:
    # ~250 ms holding the GIL (SmolLM2-135M on a 2-core EPYC), so the event loop and the engine's worker stopped
    # whenever requests' garbage (a 368 KB schema is ~10k dicts) set one off. They live as long as the server:
    # frozen out of the collector, a full collection walks what requests made since
    gc.collect()
    gc.freeze()
    server = uvicorn_server(app, config, args.host, args.port, verbose=args.verbose)
    # a crash in native code (torch, tokenizers, llguidance) prints every thread's Python stack to the log
    faulthandler.enable()
    # uvicorn handles SIGTERM/SIGINT (stop accepting, finish in-flight requests, run the lifespan's shutdown),
    # then raises the signal again for the previous handler; a graceful stop is a clean exit, so ignore it here.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1
