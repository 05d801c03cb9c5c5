"""Learned links: a few trained embeddings placed after the reused chunks and computed at question time.

Chunks reused out of context carry KV that never saw the chunks before them, and on small models the question reads
them wrongly. A `Links` set is m soft tokens (KVLink's idea, the model frozen): they sit right after the last reused
chunk, are computed in every layer over the stored KV like the question is, and were trained by distillation so that
the question, attending to them, answers as the model's own full prefill would (`cacheblend_rag.links_training`).

    links = Links.load(path).for_model(fingerprint, vocab, width)  # refused, naming the file, if corrupt or foreign
    ids = links.token_ids                                     # m placeholder ids, past the vocabulary
    hidden = links.embed(embed_tokens, token_ids)             # real tokens embedded, link rows their trained vectors

The placeholder ids are past the vocabulary and carry the links' own digest, so a stored prefix computed with one
links file is never matched by a prompt without them, or with another file. This module imports nothing of the
package above it: the fuse layer reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ... import settings
from ...errors import CacheFormatError, ConfigError

FORMAT = "cacheblend-links/1"
_ID_SPAN = 1 << 20  # placeholder id = vocab_size + slot * 64 + i, slot from the digest: disjoint per links file
_MAX_LINKS = 64

__all__ = ["FORMAT", "SHIPPED", "Links", "find_links", "trained_path"]

SHIPPED: dict[str, str] = {}
"""Links shipped with the package for a packaged model: its alias → the sha256 of `data/links/<alias>.safetensors`
(a shipped file whose bytes differ is refused)."""


@dataclass(frozen=True, eq=False)
class Links:
    """m trained link embeddings for one model (its weights fingerprint), with the recipe that trained them."""

    embeds: torch.Tensor  # (m, hidden) float32, in the model's embedding space (after any embedding scale)
    fingerprint: str  # `models.fingerprint.weights_fingerprint` of the model they were trained for
    vocab_size: int  # the model's embedding rows: placeholder ids start past them
    recipe: dict[str, Any] = field(default_factory=dict)  # how they were trained (data, steps, lr, method, ...)
    source: str = "memory"  # the file they came from, or "memory"

    def __post_init__(self) -> None:
        e = self.embeds
        if not isinstance(e, torch.Tensor) or e.dim() != 2 or not 1 <= e.shape[0] <= _MAX_LINKS:
            raise ConfigError(f"links: embeds must be a (m, hidden) tensor with 1 ≤ m ≤ {_MAX_LINKS}, "
                              f"got {getattr(e, 'shape', type(e).__name__)} ({self.source})")
        if not bool(torch.isfinite(e).all()):
            raise ConfigError(f"links: embeds hold NaN or infinite values ({self.source})")

    @property
    def num_links(self) -> int:
        """m, the link rows a request gains."""
        return int(self.embeds.shape[0])

    @property
    def hidden_size(self) -> int:
        """The model width they were trained for."""
        return int(self.embeds.shape[1])

    @cached_property
    def digest(self) -> str:
        """sha256 of the embeddings' bytes and the fingerprint (what tells two links files apart)."""
        h = hashlib.sha256(self.fingerprint.encode())
        h.update(self.embeds.detach().to(torch.float32).cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    @cached_property
    def id_base(self) -> int:
        """The first placeholder id: past the vocabulary, at a slot the digest picks."""
        return self.vocab_size + (int(self.digest[:8], 16) % (_ID_SPAN // _MAX_LINKS)) * _MAX_LINKS

    @property
    def token_ids(self) -> list[int]:
        """The m placeholder ids of the link rows, in order."""
        base = self.id_base
        return list(range(base, base + self.num_links))

    def is_link(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(N,) bool: which ids are this set's link rows."""
        base = self.id_base
        return (token_ids >= base) & (token_ids < base + self.num_links)

    def embed(self, embed_tokens: Callable[[torch.Tensor], torch.Tensor], token_ids: torch.Tensor) -> torch.Tensor:
        """(M,) ids → (M, hidden): real tokens through the model's embedding, link rows their trained vectors (with
        their gradient, when `embeds` requires one)."""
        mask = self.is_link(token_ids)
        if not bool(mask.any()):
            return embed_tokens(token_ids)
        hidden = embed_tokens(token_ids.masked_fill(mask, 0))
        rows = mask.nonzero().squeeze(1)
        vectors = self.embeds.to(device=hidden.device, dtype=hidden.dtype)[token_ids[rows] - self.id_base]
        return hidden.index_put((rows,), vectors)

    def for_model(self, fingerprint: str, vocab_size: int, hidden_size: int) -> "Links":
        """These links, checked against the model they are about to run on (ConfigError naming the file if not)."""
        if self.fingerprint != fingerprint:
            raise ConfigError(f"links {self.source} were trained for model {self.fingerprint}, not this one "
                              f"({fingerprint}); train links for it with `cacheblend-rag train-links`")
        if self.hidden_size != hidden_size or self.vocab_size != vocab_size:
            raise ConfigError(f"links {self.source}: width {self.hidden_size} and vocabulary {self.vocab_size} do "
                              f"not fit a model of width {hidden_size} and vocabulary {vocab_size}")
        return self

    def describe(self) -> dict[str, Any]:
        """What a request's stats say of the links that ran."""
        return {"ran": True, "num_links": self.num_links, "source": self.source, "digest": self.digest[:16]}

    # ---- the file: safetensors, the embeddings and a metadata header ------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the links as one safetensors file (atomically: a temporary file renamed into place)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        embeds = self.embeds.detach().to(torch.float32).cpu().contiguous()
        meta = {"format": FORMAT, "fingerprint": self.fingerprint, "vocab_size": str(self.vocab_size),
                "recipe": json.dumps(self.recipe, sort_keys=True), "embeds_sha256": _tensor_sha256(embeds)}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file({"embeds": embeds}, str(tmp), metadata=meta)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, sha256: str | None = None) -> "Links":
        """Links from a file `save` wrote; CacheFormatError naming the file if it is unreadable, corrupt, not links
        or (with `sha256`) not the pinned bytes."""
        from safetensors import SafetensorError
        from safetensors.torch import safe_open

        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise CacheFormatError(f"links file {path} cannot be read: {e}") from e
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            raise CacheFormatError(f"links file {path} is not the one pinned (sha256 {sha256[:16]}…): corrupt or "
                                   "replaced; reinstall the package or retrain with `cacheblend-rag train-links`")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT:
                    raise CacheFormatError(f"{path} is not a links file (format {meta.get('format')!r}, "
                                           f"expected {FORMAT!r})")
                embeds = f.get_tensor("embeds").to(torch.float32)
            if meta.get("embeds_sha256") != _tensor_sha256(embeds):  # safetensors checks sizes, not bytes
                raise CacheFormatError(f"links file {path} is corrupt: its embeddings do not match their checksum")
            recipe = json.loads(meta.get("recipe", "{}"))
            return cls(embeds, meta["fingerprint"], int(meta["vocab_size"]), recipe, str(path))
        except CacheFormatError:
            raise
        except (SafetensorError, OSError, KeyError, ValueError, json.JSONDecodeError, ConfigError) as e:
            raise CacheFormatError(f"links file {path} is corrupt or truncated ({type(e).__name__}: {e})") from e


def _tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def trained_path(fingerprint: str) -> Path:
    """Where links trained on this machine for the model with this weights fingerprint live (auto-loaded)."""
    return settings.links_dir() / f"{fingerprint}.safetensors"


def find_links(fingerprint: Callable[[], str], model_name: str) -> Links | None:
    """The links for a model: trained on this machine (by weights fingerprint), else shipped with the package for a
    packaged model (by alias, pinned by sha256) when they were trained for these very weights; None otherwise. A
    file that exists but is corrupt raises CacheFormatError naming it: a user's links are never silently dropped.
    `fingerprint` is called only when there is a file to match (it reads every weight)."""
    folder = settings.links_dir()
    pin = SHIPPED.get(model_name)
    if pin is None and not (folder.is_dir() and any(folder.glob("*.safetensors"))):
        return None
    mine = trained_path(fingerprint())
    if mine.is_file():
        return Links.load(mine)
    if pin is None:
        return None
    from importlib import resources

    with resources.as_file(resources.files("cacheblend_rag").joinpath(f"data/links/{model_name}.safetensors")) as p:
        links = Links.load(p, sha256=pin)
    return links if links.fingerprint == fingerprint() else None
