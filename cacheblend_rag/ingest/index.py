"""ChunkIndex: finds stored chunks inside any prompt, whatever template, numbering or metadata surrounds them.

Each chunk is indexed by its first `HEAD_CHARS` characters (normalized text). A prompt is scanned once: at each
position the next `HEAD_CHARS` characters are looked up in a dict (O(1) whatever the store's size), and a
candidate is verified against the chunk's full text before it counts. The texts persist in SQLite (WAL, safe
under several processes) beside the KV store, so a chunk ingested by one process is found by every other: each
lookup first asks SQLite whether the file changed (`PRAGMA data_version` on a connection kept open, one cheap
statement) and, when it did, loads the rows added since (by rowid); rows removed elsewhere make it reload.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import sqlite3
import threading
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .chunks import CHUNK_ID_LEN

logger = logging.getLogger(__name__)

HEAD_CHARS = 48  # a chunk shorter than this is matched only as a whole (its text is its head)
MIN_CHUNK_CHARS = 16  # shorter texts would match by accident inside ordinary prose
_SCHEMA = "CREATE TABLE IF NOT EXISTS chunks (chunk_id TEXT PRIMARY KEY, head TEXT NOT NULL, text TEXT NOT NULL)"


def normalize_prompt(text: str) -> str:
    """The prompt as chunk texts are normalized (NFC, unix newlines, no trailing spaces on lines), ends kept."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.split("\n"))


def normalize_prompt_map(text: str) -> tuple[str, list[int]]:
    """`normalize_prompt(text)` and, for each of its characters, its index in `text` (text already NFC).

    The scan runs on normalized text; the map takes what it found back to the user's own characters, where the
    prompt is tokenized as the model would tokenize it.
    """
    out: list[str] = []
    index: list[int] = []
    for line in _LINE.finditer(text):
        body = line.group(1).rstrip()
        out.append(body)
        index.extend(range(line.start(), line.start() + len(body)))
        if line.group(2):
            out.append("\n")
            index.append(line.start(2))
    return "".join(out), index


_LINE = re.compile(r"([^\r\n]*)(\r\n|\r|\n|$)")


@dataclass(frozen=True)
class Match:
    """A stored chunk found at prompt[start:end]."""

    start: int
    end: int
    chunk_id: str


@dataclass(frozen=True)
class Scan:
    """What a scan found: matches in order, and chunks whose head appeared but whose text then differed."""

    matches: list[Match]
    changed: list[str]


def _row_intact(cid: object, head: object, text: object) -> bool:
    """Whether a row read from the file is one `add` wrote: its id is its text's content hash (`chunk_id` of a
    normalized text) and its head the text's start. SQLite keeps no checksum of a page: a byte damaged in a text,
    or a row written by something else, would otherwise map a prompt's text (or a request's chunk id) to another
    chunk's text."""
    if not (isinstance(cid, str) and isinstance(head, str) and isinstance(text, str)) or head != text[:HEAD_CHARS]:
        return False
    try:
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:CHUNK_ID_LEN]
    except UnicodeEncodeError:
        return False
    return digest == cid


class ChunkIndex:
    """Chunk texts by id and by head; persisted in `path` (SQLite) when given, else in this process only."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._heads: dict[str, list[str]] = {}  # first HEAD_CHARS characters → chunk ids
        self._short: dict[int, dict[str, str]] = {}  # texts shorter than a head: length → text → chunk id
        self._texts: dict[str, str] = {}
        self._lock = threading.Lock()
        self._loaded = False  # without a file: nothing to load; with one, `_version` says what was seen
        self._reader: sqlite3.Connection | None = None  # kept open: data_version is per connection
        self._version: int | None = None  # the file's data_version when last read
        self._rowid = 0  # the largest rowid loaded
        self._rows = 0  # rows of the file loaded (fewer there than loaded: some were removed)

    def add(self, items: Iterable[tuple[str, str]]) -> None:
        """Index (chunk_id, normalized text) pairs, persisting them."""
        rows = [(cid, text[:HEAD_CHARS], text) for cid, text in items if len(text) >= MIN_CHUNK_CHARS]
        if not rows:
            return
        self._load()
        with self._lock:
            for cid, head, text in rows:
                self._insert(cid, head, text)
        self._persist(rows)

    def remove(self, chunk_ids: Iterable[str]) -> None:
        """Forget these chunks (their source changed or was deleted)."""
        ids = list(chunk_ids)
        self._load()
        with self._lock:
            for cid in ids:
                text = self._texts.pop(cid, None)
                if text is None:
                    continue
                bucket = self._heads.get(text[:HEAD_CHARS], [])
                if cid in bucket:
                    bucket.remove(cid)
                self._short.get(len(text), {}).pop(text, None)
        with self._db() as db:
            if db is not None:
                db.executemany("DELETE FROM chunks WHERE chunk_id = ?", [(cid,) for cid in ids])

    def text(self, chunk_id: str) -> str | None:
        """The indexed text of a chunk, or None."""
        self._load()
        return self._texts.get(chunk_id)

    def __len__(self) -> int:
        self._load()
        return len(self._texts)

    def scan(self, prompt: str) -> Scan:
        """Every indexed chunk whose full text appears in `prompt` (normalized), left to right, non-overlapping."""
        self._load()
        matches: list[Match] = []
        changed: set[str] = set()
        i, n = 0, len(prompt)
        while i < n:
            found = self._longest_at(prompt, i, changed)
            if found is None:
                i += 1
                continue
            matches.append(found)
            i = found.end
        found_ids = {m.chunk_id for m in matches}
        return Scan(matches, sorted(changed - found_ids))

    # ---- internals ----------------------------------------------------------------------

    def _longest_at(self, prompt: str, i: int, changed: set[str]) -> Match | None:
        """The longest indexed chunk starting at prompt[i]; heads that matched a changed text go to `changed`."""
        best: Match | None = None
        for cid in self._heads.get(prompt[i:i + HEAD_CHARS], ()):
            text = self._texts[cid]
            if not prompt.startswith(text, i):
                changed.add(cid)
            elif best is None or len(text) > best.end - best.start:
                best = Match(i, i + len(text), cid)
        for length, by_text in self._short.items():  # chunks shorter than a head are matched whole
            cid = by_text.get(prompt[i:i + length])
            if cid is not None and (best is None or length > best.end - best.start):
                best = Match(i, i + length, cid)
        return best

    def _insert(self, cid: str, head: str, text: str) -> None:
        if cid in self._texts:
            return
        self._texts[cid] = text
        if len(text) >= HEAD_CHARS:
            self._heads.setdefault(head, []).append(cid)
        else:
            self._short.setdefault(len(text), {})[text] = cid

    def _load(self) -> None:
        """Bring the in-memory index up to the file: nothing to do (one PRAGMA) unless another connection wrote."""
        if self.path is None or self._loaded:
            return
        with self._lock:
            if self._reader is None:
                self._reader = self._connect(check_same_thread=False)  # used under self._lock only
                if self._reader is None:
                    self._loaded = True  # the file cannot be used: this process's chunks only (logged)
                    return
            try:
                self._sync(self._reader)
            except sqlite3.Error as e:
                logger.warning("chunk index %s: %s; new chunks of other processes are not seen yet", self.path, e)

    def _sync(self, db: sqlite3.Connection) -> None:
        """Under the lock: load the rows added since the last sync, or everything again when rows were removed."""
        version = db.execute("PRAGMA data_version").fetchone()[0]
        if version == self._version:
            return
        new = db.execute("SELECT rowid, chunk_id, head, text FROM chunks WHERE rowid > ? ORDER BY rowid",
                         (self._rowid,)).fetchall()
        (count,) = db.execute("SELECT count(*) FROM chunks").fetchone()
        if count != self._rows + len(new):  # rows were removed (here or elsewhere): start over from the file
            self._heads, self._short, self._texts = {}, {}, {}
            self._rowid = self._rows = 0
            new = db.execute("SELECT rowid, chunk_id, head, text FROM chunks ORDER BY rowid").fetchall()
        for rowid, cid, head, text in new:
            if _row_intact(cid, head, text):
                self._insert(cid, head, text)
            else:
                logger.warning("chunk index %s: row %d is not what was written (its id is not its text's hash); "
                               "skipping it", self.path, rowid)
            self._rowid = max(self._rowid, rowid)
        self._rows += len(new)
        self._version = version

    def _persist(self, rows: list[tuple[str, str, str]]) -> None:
        with self._db() as db:
            if db is not None:
                db.executemany("INSERT OR IGNORE INTO chunks VALUES (?, ?, ?)", rows)

    @contextlib.contextmanager
    def _db(self):
        """A connection to the index file in a transaction; None without a file or when it cannot be used (then
        chunks are found in this process only, logged)."""
        db = self._connect()
        if db is None:
            yield None
            return
        try:
            with db:
                yield db
        except sqlite3.Error as e:
            logger.warning("chunk index %s: %s; chunks are found in this process only", self.path, e)
        finally:
            db.close()

    def _connect(self, check_same_thread: bool = True) -> sqlite3.Connection | None:
        if self.path is None:
            return None
        db = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=5.0, check_same_thread=check_same_thread)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(_SCHEMA)
            return db
        except (sqlite3.Error, OSError) as e:
            if db is not None:
                db.close()
            logger.warning("chunk index %s unavailable (%s); chunks are found in this process only", self.path, e)
            return None
