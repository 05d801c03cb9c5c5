"""Read .txt / .md / .json / .jsonl files and split them into model-token-sized chunks with content-hash ids.

JSON shapes understood:
- MuSiQue-style: a list of `{"ctxs": [{"title", "text"}], "question", "answers"}` — each ctx is one chunk
  `"title\\ntext"`, never re-split (the benchmark's passages stay byte-identical);
- a list of strings, or of objects with `text` (or `content`) and optional `title`;
- an object with a `documents` / `data` list of the above. JSON Lines: one string or object per line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, MissingDependencyError
from ..ingest.chunks import chunk_id, normalize_text

SUFFIXES = (".txt", ".md", ".json", ".jsonl")
DEFAULT_CHUNK_TOKENS = 512


@dataclass(frozen=True)
class SourceText:
    """One text read from a file; `presplit` texts are already chunks (MuSiQue passages)."""

    text: str
    source: str
    title: str = ""
    presplit: bool = False


@dataclass(frozen=True)
class ChunkRecord:
    """A chunk ready for the vector store and the KV store: id = content hash of the normalized text."""

    chunk_id: str
    text: str
    metadata: dict = field(default_factory=dict)  # str/int values only (Chroma's metadata rule)


def iter_files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The readable files under `paths` (folders are walked, sorted); unknown suffixes are skipped."""
    files: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        if path.is_dir():
            files += sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in SUFFIXES)
        elif path.is_file():
            if path.suffix.lower() not in SUFFIXES:
                raise ConfigError(f"{path}: unsupported file type; use one of {', '.join(SUFFIXES)}")
            files.append(path)
        else:
            raise ConfigError(f"{path}: no such file or folder")
    return list(dict.fromkeys(files))


def _from_json_item(item, source: str) -> list[SourceText]:
    if isinstance(item, str):
        return [SourceText(item, source)]
    if not isinstance(item, dict):
        return []
    if isinstance(item.get("ctxs"), list):  # MuSiQue: one chunk per context passage
        return [
            SourceText(f"{c.get('title', '')}\n{c.get('text', '')}".strip(), source, c.get("title", ""), presplit=True)
            for c in item["ctxs"] if isinstance(c, dict) and (c.get("text") or c.get("title"))
        ]
    text = item.get("text", item.get("content"))
    if isinstance(text, str):
        title = str(item.get("title", ""))
        return [SourceText(f"{title}\n{text}" if title else text, source, title)]
    return []


def load_file(path: str | os.PathLike[str]) -> list[SourceText]:
    """The texts in one file."""
    path = Path(path)
    suffix = path.suffix.lower()
    raw = path.read_text(encoding="utf-8")
    source = str(path)
    if suffix in (".txt", ".md"):
        return [SourceText(raw, source, path.stem)]
    try:
        if suffix == ".jsonl":
            items = [json.loads(line) for line in raw.splitlines() if line.strip()]
        else:
            data = json.loads(raw)
            if isinstance(data, dict):
                data = data.get("documents", data.get("data", [data]))
            items = data if isinstance(data, list) else [data]
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from e
    out = [t for item in items for t in _from_json_item(item, source)]
    return [t for t in out if normalize_text(t.text)]


def load_paths(paths: Iterable[str | os.PathLike[str]]) -> tuple[list[Path], list[SourceText]]:
    """(files read, texts) for files and folders."""
    files = iter_files(paths)
    return files, [t for f in files for t in load_file(f)]


def split_texts(
    texts: Sequence[SourceText], tokenizer, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, overlap_tokens: int = 0
) -> list[ChunkRecord]:
    """Split into chunks of at most ~`chunk_tokens` model tokens; duplicates (same id) are kept once."""
    try:
        from langchain_text_splitters import RecursiveCharacterTextSplitter
    except ImportError as e:
        raise MissingDependencyError("splitting needs langchain-text-splitters: pip install 'cacheblend-rag[langchain]'") from e
    if chunk_tokens < 16 or not 0 <= overlap_tokens < chunk_tokens:
        raise ConfigError(f"need chunk_tokens ≥ 16 and 0 ≤ overlap < chunk_tokens, got {chunk_tokens}, {overlap_tokens}")
    splitter = RecursiveCharacterTextSplitter.from_huggingface_tokenizer(
        tokenizer, chunk_size=chunk_tokens, chunk_overlap=overlap_tokens
    )
    records: dict[str, ChunkRecord] = {}
    for t in texts:
        pieces = [t.text] if t.presplit else splitter.split_text(t.text)
        for i, piece in enumerate(pieces):
            norm = normalize_text(piece)
            if not norm:
                continue
            cid = chunk_id(norm)
            records.setdefault(cid, ChunkRecord(cid, norm, {"source": t.source, "title": t.title, "part": i}))
    return list(records.values())
