"""Read .txt / .md / .json / .jsonl / .html / .pdf files and split them into model-token-sized chunks with content-hash ids.

JSON shapes understood:
- MuSiQue-style: a list of `{"ctxs": [{"title", "text"}], "question", "answers"}` — each ctx is one chunk
  `"title\\ntext"`, never re-split (the benchmark's passages stay byte-identical);
- a list of strings, or of objects with `text` (or `content`) and optional `title`;
- an object with a `documents` / `data` list of the above. JSON Lines: one string or object per line.

HTML is read as a stream of parser events (the stdlib's HTMLParser, bs4's encoding detection; visible text,
`<title>` as title): no tree, so it takes ~2x the file in memory whatever the markup. PDF with pypdf (the text layer of each page);
both are optional (`pip install 'cacheblend-rag[documents]'`).

A file that cannot be used — not valid UTF-8, invalid JSON, empty, unreadable, of an unsupported type, not a
regular file (a FIFO, a socket, a device), a symbolic link out of the folder being ingested or a link loop, or
one past a per-file bound below — is never fatal to a folder: it is listed in `LoadResult.skipped` with the
reason, and the other files are read.

Per-file bounds (memory and work, as parsing costs a multiple of a file's size): any file ≤ 256 MiB; JSON nested
less deeply than Python's parser allows (~1,000 levels) and a .json ≤ 32 MiB (a .jsonl is parsed a line at a
time, each line ≤ 32 MiB); HTML ≤ 400,000 tags (parsing time); a PDF within pypdf's own limits, with ≤ 64 MiB of page content
streams, extracted within 120 s.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import stat
from html.parser import HTMLParser
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, MissingDependencyError
from ..ingest.chunks import chunk_id, normalize_text

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".json", ".jsonl")
DOCUMENT_SUFFIXES = (".html", ".htm", ".pdf")
SUFFIXES = TEXT_SUFFIXES + DOCUMENT_SUFFIXES
DEFAULT_CHUNK_TOKENS = 512
MAX_FILE_BYTES = 256 * 2**20  # a bigger file is skipped (reading it whole would cost that much memory)
# A PDF's text extraction parses every page's content stream, and a small file can hold a lot of it (200 pages
# sharing one compressed stream): a PDF with more content than this, or whose extraction runs longer, is skipped.
MAX_PDF_CONTENT_BYTES = 64 * 2**20  # a 1,000-page book holds ~10-50 MiB; pypdf extracts ~1-2 MiB/s of it here
PDF_SECONDS = 120.0
# Parsed, a JSON file takes up to ~20x its size in memory (a list of empty objects): bigger ones are skipped; JSON
# Lines are parsed a line at a time, so only each line is bounded. HTML is parsed without a tree (~2x its size).
MAX_JSON_BYTES = 32 * 2**20  # ≤ ~700 MB parsed
MAX_HTML_TAGS = 400_000  # counted as "<" characters: bounds the parsing time (a long Wikipedia article has ~100,000)


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


@dataclass(frozen=True)
class SkippedFile:
    """A file that was not ingested, and why."""

    path: str
    reason: str
    empty: bool = False  # readable, but no text (its previously ingested chunks are stale)

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


class FileSkipped(Exception):
    """Raised by a reader for a file that is skipped (not fatal to an ingestion); the message is the reason.

    `empty` marks a readable file with no text: unlike an unreadable one, it says what the file holds now.
    """

    def __init__(self, reason: str, *, empty: bool = False) -> None:
        super().__init__(reason)
        self.empty = empty


@dataclass
class LoadResult:
    """What loading found: files read (each with at least one text), their texts, and files skipped."""

    files: list[Path] = field(default_factory=list)
    texts: list[SourceText] = field(default_factory=list)
    skipped: list[SkippedFile] = field(default_factory=list)


def source_key(path: str | os.PathLike[str]) -> str:
    """The `source` stored with a file's chunks: its absolute path (not resolved, so a link keeps its name)."""
    return os.path.abspath(os.fspath(Path(path).expanduser()))


def _is_within(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


def _link_target(path: Path) -> Path | None:
    """Where a symbolic link leads, fully resolved; None for a link loop (`a -> b -> a`, or one to itself)."""
    try:
        return path.resolve()
    except (RuntimeError, OSError):  # RuntimeError up to Python 3.12, OSError (ELOOP) from 3.13
        return None


def _walk(root: Path, follow_symlinks: bool, skipped: list[SkippedFile]) -> Iterator[Path]:
    """Candidate files under a folder, sorted; hidden entries are left out; links out of `root` are refused."""
    real_root = root.resolve()
    seen_dirs: set[Path] = set()
    stack = [root]
    while stack:
        folder = stack.pop()
        real = folder.resolve()
        if real in seen_dirs:  # a link cycle
            continue
        seen_dirs.add(real)
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as e:
            skipped.append(SkippedFile(str(folder), f"cannot list folder ({e.strerror or e})"))
            continue
        subfolders = []
        for entry in entries:
            if entry.name.startswith("."):
                continue
            path = Path(entry.path)
            if entry.is_symlink():
                target = _link_target(path)
                if target is None:
                    skipped.append(SkippedFile(str(path), "symbolic link loop (its chain of links never reaches a file)"))
                    continue
                if not follow_symlinks and not _is_within(target, real_root):
                    skipped.append(SkippedFile(str(path), f"symbolic link to {target}, outside {root}; "
                                                          "pass --follow-symlinks (follow_symlinks=True) to read it"))
                    continue
                if not target.exists():
                    skipped.append(SkippedFile(str(path), f"broken symbolic link to {target}"))
                    continue
            try:
                is_dir = entry.is_dir(follow_symlinks=True)
            except OSError:
                is_dir = False
            if is_dir:
                subfolders.append(path)
            else:
                yield path
        stack.extend(reversed(subfolders))


def iter_files(
    paths: Iterable[str | os.PathLike[str]],
    *,
    follow_symlinks: bool = False,
    skipped: list[SkippedFile] | None = None,
) -> list[Path]:
    """The candidate files under `paths` (folders walked in name order), duplicates removed.

    A named path that does not exist, or a named file of an unsupported type, is a `ConfigError`; inside a
    folder, unsupported types, links pointing out of the folder (unless `follow_symlinks`) and hidden entries
    are left out — all but hidden ones are appended to `skipped`.
    """
    skipped = [] if skipped is None else skipped
    files: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        if path.is_dir():
            for f in _walk(path, follow_symlinks, skipped):
                if f.suffix.lower() in SUFFIXES:
                    files.append(f)
                else:
                    skipped.append(SkippedFile(str(f), f"unsupported file type; use one of {', '.join(SUFFIXES)}"))
        elif path.exists():
            if path.suffix.lower() not in SUFFIXES:
                raise ConfigError(f"{path}: unsupported file type; use one of {', '.join(SUFFIXES)}")
            files.append(path)
        elif path.is_symlink():
            target = _link_target(path)
            if target is None:
                raise ConfigError(f"{path}: symbolic link loop (its chain of links never reaches a file)")
            raise ConfigError(f"{path}: broken symbolic link to {target}")
        else:
            raise ConfigError(f"{path}: no such file or folder")
    return list(dict.fromkeys(files))


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, opened without blocking and only if it is a regular file of a sane size."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise FileSkipped(f"cannot open ({e.strerror or e})") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileSkipped("not a regular file (a FIFO, socket or device)")
        if st.st_size > MAX_FILE_BYTES:
            raise FileSkipped(f"too large ({st.st_size / 2**20:.0f} MiB > {MAX_FILE_BYTES // 2**20} MiB)")
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            return f.read()
    except OSError as e:
        raise FileSkipped(f"cannot read ({e.strerror or e})") from e
    finally:
        if fd >= 0:
            os.close(fd)


def _decode(raw: bytes) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileSkipped(f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                          "convert it, e.g. iconv -f latin1 -t utf-8") from e
    return text.removeprefix("\ufeff")


def _title(value) -> str:
    """A JSON item's title as text: a string or a number as written; anything else (null, an object) is no title."""
    if isinstance(value, str):
        return value
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else ""


def _from_json_item(item, source: str) -> list[SourceText]:
    if isinstance(item, str):
        return [SourceText(item, source)]
    if not isinstance(item, dict):
        return []
    if isinstance(item.get("ctxs"), list):  # MuSiQue: one chunk per context passage
        passages = [(_title(c.get("title")), c.get("text")) for c in item["ctxs"] if isinstance(c, dict)]
        return [SourceText(f"{title}\n{text if isinstance(text, str) else ''}".strip(), source, title, presplit=True)
                for title, text in passages if (isinstance(text, str) and text) or title]
    text = item.get("text", item.get("content"))
    if isinstance(text, str):
        title = _title(item.get("title"))
        return [SourceText(f"{title}\n{text}" if title else text, source, title)]
    return []


def _check_text(texts: list[SourceText]) -> None:
    """FileSkipped for a text that cannot be written as UTF-8: a lone surrogate, which a JSON escape (\\ud83d
    without its pair) can hold. Its hash, its tokens and the vector store would all fail on it."""
    for t in texts:
        try:
            t.text.encode("utf-8")
            t.title.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = ord(e.object[e.start])
            raise FileSkipped(f"holds text that is not valid Unicode (a lone surrogate U+{bad:04X}, in JSON the "
                              f"escape \\u{bad:04x} without its pair); remove it or write the character whole") \
                from None


def _parse_json(text: str, where: str = ""):
    """One JSON text, parsed; FileSkipped when it is too large, nested too deeply or not JSON."""
    if len(text) > MAX_JSON_BYTES:  # characters: a lower bound of its bytes
        raise FileSkipped(f"JSON{where} too large to parse ({len(text) / 2**20:.0f} MiB > "
                          f"{MAX_JSON_BYTES // 2**20} MiB; parsed JSON can take ~20x its size in memory): split it, "
                          "or write it as JSON Lines (one document per line)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise FileSkipped(f"invalid JSON{where} ({e})") from e
    except RecursionError:
        raise FileSkipped(f"JSON{where} nested too deeply to parse (Python's parser stops at ~1,000 levels)") from None


class _VisibleText(HTMLParser):
    """The visible text of an HTML page and its first `<title>`, from the parser's events: no tree is built, so the
    memory is the page's text and one tag's attributes at a time, whatever the markup (BeautifulSoup's tree took
    ~15x the file for a page of attribute-heavy tags: `<p a0=x … a999=x>`)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.lines: list[str] = []  # visible text nodes, in order
        self.title: list[str] | None = None  # the first <title>'s text nodes, once one opened
        self._node: list[str] = []  # the text node being read (the parser may hand it over in pieces)
        self._hidden = 0  # depth inside script, style, noscript, template
        self._in_title = False

    def _flush(self) -> None:
        if self._node:
            text = "".join(self._node)
            self._node = []
            if self._in_title:
                self.title.append(text)
            elif not self._hidden:
                self.lines.append(text)

    def handle_starttag(self, tag: str, attrs) -> None:
        self._flush()
        if tag in _HIDDEN_TAGS:
            self._hidden += 1
        elif tag == "title" and self.title is None and not self._hidden:
            self.title, self._in_title = [], True

    def handle_startendtag(self, tag: str, attrs) -> None:
        self._flush()  # a void element (<br/>): ends a text node, opens nothing

    def handle_endtag(self, tag: str) -> None:
        self._flush()
        if tag in _HIDDEN_TAGS and self._hidden:
            self._hidden -= 1
        elif tag == "title":
            self._in_title = False

    def handle_data(self, data: str) -> None:
        self._node.append(data)

    def handle_comment(self, data: str) -> None:
        self._flush()

    def close(self) -> None:
        """Parse what is left, then end the last text node."""
        super().close()
        self._flush()


_HIDDEN_TAGS = frozenset({"script", "style", "noscript", "template"})


def _html_texts(raw: bytes, source: str, path: Path) -> list[SourceText]:
    try:
        from bs4.dammit import UnicodeDammit
    except ImportError as e:
        raise MissingDependencyError("HTML files need beautifulsoup4: pip install 'cacheblend-rag[documents]'") from e
    tags = raw.count(b"<")
    if tags > MAX_HTML_TAGS:
        raise FileSkipped(f"HTML with {tags:,} tags (over {MAX_HTML_TAGS:,}: too costly to parse); convert it to "
                          "text first (e.g. with html2text or pandoc) and ingest the .txt")
    markup = UnicodeDammit(raw, is_html=True).unicode_markup  # bs4's encoding detection (a <meta> charset, BOMs)
    if markup is None:
        raise FileSkipped("HTML in an encoding that could not be detected; convert it to UTF-8")
    page = _VisibleText()
    try:
        page.feed(markup)  # one pass, linear in the markup
        del markup
        page.close()
    except AssertionError as e:  # the stdlib parser's verdict on some markup (`<![BDATA[`): the file, not the run
        raise FileSkipped(f"HTML the parser cannot read ({e}); fix the markup or convert it to text") from None
    title = " ".join(t.strip() for t in page.title if t.strip()) if page.title else ""  # as bs4's get_text(" ", strip)
    title = title or path.stem
    body = "\n".join(line.strip() for text in page.lines for line in text.splitlines() if line.strip())
    return [SourceText(f"{title}\n{body}" if body else "", source, title)]


def _content_bytes(page) -> int:
    """Bytes of a PDF page's content stream(s), decoded: what its text extraction parses (form XObjects aside)."""
    contents = page.get_contents()
    return len(contents.get_data()) if contents is not None else 0


def _pdf_texts(path: Path, raw: bytes, source: str) -> list[SourceText]:
    try:
        from pypdf import PdfReader
        from pypdf.errors import LimitReachedError
    except ImportError as e:
        raise MissingDependencyError("PDF files need pypdf: pip install 'cacheblend-rag[documents]'") from e
    import io
    import time

    hint = "split it (qpdf --split-pages) or convert it to text (pdftotext) and ingest the .txt"
    deadline = time.monotonic() + PDF_SECONDS

    def in_time(*_) -> None:  # pypdf calls it before each operator, those of form XObjects included
        if time.monotonic() > deadline:
            raise FileSkipped(f"PDF text extraction took over {PDF_SECONDS:.0f} s; {hint}")

    try:
        reader = PdfReader(io.BytesIO(raw))
        if reader.is_encrypted:
            raise FileSkipped("encrypted PDF")
        pages = list(reader.pages)
        content = sum(_content_bytes(page) for page in pages)  # decoding is cheap; parsing it is what costs
        if content > MAX_PDF_CONTENT_BYTES:
            raise FileSkipped(f"PDF pages hold {content / 2**20:.0f} MiB of content streams (over "
                              f"{MAX_PDF_CONTENT_BYTES // 2**20} MiB: too costly to extract); {hint}")
        texts = [page.extract_text(visitor_operand_before=in_time) or "" for page in pages]
    except FileSkipped:
        raise
    except LimitReachedError as e:
        raise FileSkipped(f"PDF past pypdf's safety limits ({e})") from e
    except Exception as e:  # a broken or hostile PDF can make pypdf raise nearly anything: skip it, say what
        logger.debug("pypdf failed on %s", path, exc_info=True)
        raise FileSkipped(f"unreadable PDF ({type(e).__name__}: {e})") from e
    body = "\n\n".join(t.strip() for t in texts if t.strip())
    if not body:
        raise FileSkipped("no text layer (a scanned PDF needs OCR first)")
    return [SourceText(body, source, path.stem)]


def read_file(path: str | os.PathLike[str]) -> list[SourceText]:
    """The non-empty texts in one file; raises `FileSkipped` (with the reason) when the file cannot be used."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise FileSkipped(f"unsupported file type; use one of {', '.join(SUFFIXES)}")
    raw = _read_bytes(path)
    source = source_key(path)
    if suffix in (".html", ".htm"):
        out = _html_texts(raw, source, path)
    elif suffix == ".pdf":
        out = _pdf_texts(path, raw, source)
    else:
        text = _decode(raw)
        if suffix in (".txt", ".md"):
            out = [SourceText(text, source, path.stem)]
        elif suffix == ".jsonl":  # a line at a time: only its texts are kept
            out = [t for number, line in enumerate(text.splitlines(), 1) if line.strip()
                   for t in _from_json_item(_parse_json(line, f" on line {number}"), source)]
        else:
            data = _parse_json(text) if text.strip() else []
            if isinstance(data, dict):
                data = data.get("documents", data.get("data", [data]))
            out = [t for item in (data if isinstance(data, list) else [data]) for t in _from_json_item(item, source)]
    out = [t for t in out if normalize_text(t.text)]
    if not out:
        raise FileSkipped("empty: no text to ingest", empty=True)
    _check_text(out)
    return out


def load_file(path: str | os.PathLike[str]) -> list[SourceText]:
    """The texts in one file; a file that cannot be used is a `ConfigError` naming it and the reason."""
    try:
        return read_file(path)
    except FileSkipped as e:
        raise ConfigError(f"{path}: {e}") from e


def iter_loaded(
    files: Iterable[Path], skipped: list[SkippedFile]
) -> Iterator[tuple[Path, list[SourceText] | None]]:
    """(file, texts) per file, lazily; a skipped file yields None as texts and is appended to `skipped`."""
    for f in files:
        try:
            yield f, read_file(f)
        except FileSkipped as e:
            logger.debug("skipping %s: %s", f, e)
            skipped.append(SkippedFile(str(f), str(e), e.empty))
            yield f, None
        except MemoryError:  # beyond the bounds above (a low ulimit): this file is lost, not the folder
            logger.warning("skipping %s: out of memory while reading it", f)
            skipped.append(SkippedFile(str(f), "out of memory while reading it; split it into smaller files or "
                                               "raise the memory limit"))
            yield f, None


def load_paths_report(
    paths: Iterable[str | os.PathLike[str]], *, follow_symlinks: bool = False
) -> LoadResult:
    """Files read, their texts, and the files skipped (each with its reason)."""
    result = LoadResult()
    files = iter_files(paths, follow_symlinks=follow_symlinks, skipped=result.skipped)
    for f, texts in iter_loaded(files, result.skipped):
        if texts is not None:
            result.files.append(f)
            result.texts += texts
    return result


def load_paths(
    paths: Iterable[str | os.PathLike[str]], *, follow_symlinks: bool = False
) -> tuple[list[Path], list[SourceText]]:
    """(files read, texts) for files and folders; files that cannot be used are logged and left out
    (`load_paths_report` lists them)."""
    result = load_paths_report(paths, follow_symlinks=follow_symlinks)
    for s in result.skipped:
        logger.warning("skipped %s", s)
    return result.files, result.texts


# RecursiveCharacterTextSplitter's separators without its last, "": that one splits a run without spaces or
# newlines into single characters and tokenizes each one three times (~30 µs a character, ~60 B of memory each),
# so such a run is cut at the tokenizer's own token boundaries instead (`_token_pieces`), in one pass.
_SEPARATORS = ["\n\n", "\n", " "]
_RUN = re.compile(r"[^ \n]+")
_LONG_RUN_CHUNKS = 16  # a run of over 16 chunks' worth of characters is cut before the splitter sees it
_LENGTHS_KEPT = 1 << 16  # token counts of pieces (words, lines) remembered while splitting
_WINDOW_CHARS = 2**20  # tokenized at a time when cutting a run: bounds the memory of a huge one


def _token_pieces(text: str, tokenizer, chunk_tokens: int, overlap_tokens: int) -> list[str]:
    """`text` in pieces of `chunk_tokens` tokens (neighbours sharing `overlap_tokens`), cut where the tokenizer's
    tokens start: one tokenization per window of the text, so linear in its length."""
    if not getattr(tokenizer, "is_fast", False):  # no offsets: a token per character at most, as the splitter did
        step = chunk_tokens - overlap_tokens
        return [text[i:i + chunk_tokens] for i in range(0, max(len(text) - overlap_tokens, 1), step)]
    step, pieces, pos = chunk_tokens - overlap_tokens, [], 0
    while pos < len(text):
        window = text[pos:pos + _WINDOW_CHARS]
        last = pos + len(window) >= len(text)
        offsets = tokenizer(window, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        starts = [start for start, _ in offsets]
        i = 0
        while i + chunk_tokens < len(starts):
            pieces.append(window[starts[i]:starts[i + chunk_tokens]])
            i += step
        if last or i == 0:  # the rest of the text, or a window without one whole piece (tokens of > 1 KiB)
            pieces.append(window[starts[i]:] if starts else window)
            pos += len(window)
        else:
            pos += starts[i]  # the next piece starts there: tokenized again with what follows
    return pieces


def _long_runs(text: str, min_chars: int) -> Iterator[tuple[str, bool]]:
    """`text` as (segment, whether it is a run without spaces or newlines of `min_chars` or more), in order."""
    start = 0
    for run in _RUN.finditer(text):
        if run.end() - run.start() >= min_chars:
            if run.start() > start:
                yield text[start:run.start()], False
            yield run.group(), True
            start = run.end()
    if start < len(text):
        yield text[start:], False


def split_texts(
    texts: Sequence[SourceText], tokenizer, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, overlap_tokens: int = 0
) -> list[ChunkRecord]:
    """Split into chunks of at most ~`chunk_tokens` model tokens; duplicates (same id) are kept once.

    Paragraphs, lines and words are kept whole as RecursiveCharacterTextSplitter keeps them; a run without spaces
    or newlines longer than a chunk is cut at token boundaries, in time linear in its length."""
    try:
        from langchain_text_splitters import RecursiveCharacterTextSplitter
    except ImportError as e:
        raise MissingDependencyError("splitting needs langchain-text-splitters: pip install 'cacheblend-rag[langchain]'") from e
    if chunk_tokens < 16 or not 0 <= overlap_tokens < chunk_tokens:
        raise ConfigError(f"need chunk_tokens ≥ 16 and 0 ≤ overlap < chunk_tokens, got {chunk_tokens}, {overlap_tokens}")
    # the splitter measures each word (or line) up to three times, each a tokenizer call (~8 µs, most of a split's
    # time): the same lengths as from_huggingface_tokenizer's, remembered, so a repeated word costs one look-up
    token_count = functools.lru_cache(maxsize=_LENGTHS_KEPT)(lambda text: len(tokenizer.tokenize(text)))
    splitter = RecursiveCharacterTextSplitter(chunk_size=chunk_tokens, chunk_overlap=overlap_tokens,
                                              separators=_SEPARATORS, length_function=token_count)

    def cut(piece: str) -> list[str]:  # a piece the splitter could not split (no separator in it) may be too long
        if any(sep in piece.strip() for sep in _SEPARATORS) or \
                len(tokenizer(piece, add_special_tokens=False)["input_ids"]) <= chunk_tokens:
            return [piece]
        return _token_pieces(piece.strip(), tokenizer, chunk_tokens, overlap_tokens)

    def split(text: str) -> list[str]:
        pieces = []
        for segment, long_run in _long_runs(text, _LONG_RUN_CHUNKS * chunk_tokens):
            pieces += _token_pieces(segment, tokenizer, chunk_tokens, overlap_tokens) if long_run else \
                [p for piece in splitter.split_text(segment) for p in cut(piece)]
        return pieces

    records: dict[str, ChunkRecord] = {}
    for t in texts:
        pieces = [t.text] if t.presplit else split(t.text)
        for i, piece in enumerate(pieces):
            norm = normalize_text(piece)
            if not norm or (not any(c.isprintable() and not c.isspace() for c in norm) and not token_count(norm)):
                continue  # nothing, or only characters the tokenizer drops (control characters: "\x16")
            cid = chunk_id(norm)
            records.setdefault(cid, ChunkRecord(cid, norm, {"source": t.source, "title": t.title, "part": i}))
    return list(records.values())
