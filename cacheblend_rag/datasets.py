"""Dev questions: MuSiQue-style JSON and the passages of a question (read by `calibrate` and the benchmarks)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from . import settings

# Where the repository's checkout keeps the data, from its root: used only when found from the working folder.
FALLBACK_DATASET = Path("..") / "shared" / "data" / "musique_dev.json"


def resolve_dataset(value: str | os.PathLike[str] | None) -> Path:
    """The dataset to read: `value` (--data), else $CACHEBLEND_RAG_MUSIQUE, else ../shared/data/musique_dev.json
    from the working folder when it exists; FileNotFoundError naming the ways to give one otherwise."""
    if value:
        path = Path(value).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"dataset {path} not found")
        return path
    env = settings.musique_dataset()
    if env is not None:
        if not env.is_file():
            raise FileNotFoundError(f"${settings.ENV_MUSIQUE} is {env}, which is not a file; point it at a "
                                    "MuSiQue-style JSON file or pass --data PATH")
        return env
    fallback = Path.cwd() / FALLBACK_DATASET
    if fallback.is_file():
        return fallback.resolve()
    raise FileNotFoundError(f"no DATASET given: pass --data PATH (a MuSiQue-style JSON file) or set "
                            f"${settings.ENV_MUSIQUE}; {FALLBACK_DATASET} from the working folder ({Path.cwd()}) "
                            "does not exist either")


def load_dataset(path: str | Path, limit: int | None, *, shuffle: bool = False, seed: int = 0,
                 skip: int = 0) -> list[dict]:
    """MuSiQue-style JSON: [{ctxs: [{title, text}], question, answers}]; the first `limit` after the first `skip`
    (a slice kept back for the record), or of a seeded sample."""
    items = json.loads(Path(path).read_text())
    if not isinstance(items, list) or not all(isinstance(i, dict) and "question" in i and "ctxs" in i for i in items):
        raise ValueError(f"{path}: expected a JSON list of {{ctxs: [{{title, text}}], question, answers}}")
    if shuffle:
        items = list(items)
        random.Random(seed).shuffle(items)
    items = items[skip:]
    return items[:limit] if limit else items


def passages_of(item: dict, num_chunks: int | None) -> list[str]:
    """The first passages of a question, as 'title\\ntext' chunks."""
    ctxs = item["ctxs"] if num_chunks is None else item["ctxs"][:num_chunks]
    return [f"{c['title']}\n{c['text']}" if c.get("title") else c["text"] for c in ctxs]
