"""The one place environment variables are read."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .errors import ConfigError

ENV_HOME = "CACHEBLEND_RAG_HOME"


def home_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The package home: the KV store, Chroma and the profiles live below it (converted models: `models_dir`)."""
    if override is not None:
        return Path(override).expanduser()
    env = os.environ.get(ENV_HOME)
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/cacheblend-rag").expanduser()


ENV_MODELS = "CACHEBLEND_RAG_MODELS"


def models_dir() -> Path:
    """Where converted models (safetensors + tokenizer) are cached: one folder per machine, shared by every home
    (a conversion takes ~30 s and ~0.5 GB), $CACHEBLEND_RAG_MODELS overriding ~/.cache/cacheblend-rag/models."""
    env = os.environ.get(ENV_MODELS)
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/cacheblend-rag/models").expanduser()


ENV_GATES = "CACHEBLEND_RAG_GATES"
ENV_CALIBRATE = "CACHEBLEND_RAG_CALIBRATE"


def gates_dir() -> Path:
    """Where this machine's fidelity-gate decisions are kept ($CACHEBLEND_RAG_GATES, else `<models_dir>/gates`)."""
    env = os.environ.get(ENV_GATES)
    return Path(env).expanduser() if env else models_dir() / "gates"


ENV_LINKS = "CACHEBLEND_RAG_LINKS"


def links_dir() -> Path:
    """Where links trained on this machine are kept, one file per model weights fingerprint
    ($CACHEBLEND_RAG_LINKS, else `<models_dir>/links`); `cacheblend-rag train-links` writes there by default."""
    env = os.environ.get(ENV_LINKS)
    return Path(env).expanduser() if env else models_dir() / "links"


def calibrate_on_first_use(override: bool | None = None) -> bool:
    """Whether loading a model with no fidelity decision measures one (`calibrate=`, else $CACHEBLEND_RAG_CALIBRATE:
    0/false/no/off to only read stored and shipped decisions; default yes)."""
    if override is not None:
        if not isinstance(override, bool):
            raise ConfigError(f"calibrate must be True, False or None, got {override!r}")
        return override
    value = os.environ.get(ENV_CALIBRATE, "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"${ENV_CALIBRATE} must be 1/true/yes/on or 0/false/no/off, got {value!r}")


def home_models_dir(home: str | os.PathLike[str] | None = None) -> Path:
    """Where converted models lived before they were shared (a home's own `models/`); still read, never written."""
    return home_dir(home) / "models"


def kv_dir(home: str | os.PathLike[str] | None = None) -> Path:
    """Default folder of the on-disk KV store."""
    return home_dir(home) / "kv"


def chroma_dir(home: str | os.PathLike[str] | None = None) -> Path:
    """Default folder of the embedded Chroma database."""
    return home_dir(home) / "chroma"


ENV_MUSIQUE = "CACHEBLEND_RAG_MUSIQUE"


def musique_dataset() -> Path | None:
    """The benchmark's MuSiQue-style dataset from $CACHEBLEND_RAG_MUSIQUE; None when it is not set."""
    env = os.environ.get(ENV_MUSIQUE)
    return Path(env).expanduser() if env else None


ENV_API_KEY = "CACHEBLEND_RAG_API_KEY"


def api_keys(overrides: Sequence[str] | None = None) -> tuple[str, ...]:
    """The keys `cacheblend-rag serve` accepts (each `--api-key`, else $CACHEBLEND_RAG_API_KEY; either may list
    several, comma-separated), in order, without repeats; (): no auth."""
    given = list(overrides) if overrides else [os.environ[ENV_API_KEY]] if os.environ.get(ENV_API_KEY) else []
    keys = [key.strip() for value in given for key in value.split(",")]
    if not all(keys):  # `--api-key "$KEY"` with KEY unset must not turn auth off
        raise ConfigError("an API key is empty (an unset variable in --api-key \"$KEY\"? two commas?); pass "
                          "non-empty keys (--api-key KEY, repeated or comma-separated), or none for no auth")
    return tuple(dict.fromkeys(keys))


ENV_METRICS_KEY = "CACHEBLEND_RAG_METRICS_KEY"


def metrics_key(override: str | None = None) -> str | None:
    """The operator's key for `serve`'s /metrics (`--metrics-key`, else $CACHEBLEND_RAG_METRICS_KEY); None: unset."""
    key = override if override is not None else os.environ.get(ENV_METRICS_KEY) or None  # set but empty: unset
    if key is not None and not key.strip():
        raise ConfigError("the metrics key is empty (an unset variable in --metrics-key \"$KEY\"?); pass a "
                          "non-empty key, or none")
    return key.strip() if key is not None else None


ENV_CHROMA_TOKEN = "CACHEBLEND_RAG_CHROMA_TOKEN"
ENV_CHROMA_SSL = "CACHEBLEND_RAG_CHROMA_SSL"
ENV_CHROMA_CA = "CACHEBLEND_RAG_CHROMA_CA_BUNDLE"


def chroma_token(override: str | None = None) -> str | None:
    """Token sent to a Chroma server (`Authorization: Bearer ...`): the override, else $CACHEBLEND_RAG_CHROMA_TOKEN."""
    if override is not None:
        return override or None
    return os.environ.get(ENV_CHROMA_TOKEN) or None


def chroma_ssl(override: bool | None = None) -> bool:
    """Whether to talk https to a Chroma server: the override, else $CACHEBLEND_RAG_CHROMA_SSL (1/true/yes)."""
    if override is not None:
        return override
    return os.environ.get(ENV_CHROMA_SSL, "").strip().lower() in ("1", "true", "yes", "on")


def chroma_ca_bundle(override: str | os.PathLike[str] | None = None) -> str | None:
    """CA bundle that verifies a Chroma server's certificate (a private CA): the override, else
    $CACHEBLEND_RAG_CHROMA_CA_BUNDLE; None uses the system's trust store."""
    if override is not None:
        return os.fspath(Path(override).expanduser())
    env = os.environ.get(ENV_CHROMA_CA)
    return os.fspath(Path(env).expanduser()) if env else None


ENV_DECODE_KERNEL = "CACHEBLEND_RAG_DECODE_KERNEL"


def decode_kernel_enabled() -> bool:
    """Whether decode steps may use the compiled C kernels (set CACHEBLEND_RAG_DECODE_KERNEL=0 for torch's ops)."""
    return os.environ.get(ENV_DECODE_KERNEL, "1").strip().lower() not in ("0", "false", "no", "off")


def kernels_dir() -> Path:
    """Where compiled kernels are cached: per machine rather than per home, so a test's temporary home reuses them."""
    return Path("~/.cache/cacheblend-rag/kernels").expanduser()
