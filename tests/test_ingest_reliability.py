"""Ingestion over real, messy folders: unusable files are skipped and listed, links out of the folder are refused,
stored bytes are counted exactly, a KV store that cannot write fails the run, and the corpus follows its files
(edited, emptied, removed, deleted, pruned)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from cacheblend_rag import chunk_id
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.ingest import load_paths, load_paths_report
from cacheblend_rag.store import KVKey, open_store

GOOD = "Senses of the honeybee\n\nA honeybee has five eyes: two compound eyes and three ocelli."


def _messy_folder(root: Path) -> Path:
    folder = root / "corpus"
    folder.mkdir()
    (folder / "good.txt").write_text(GOOD)
    (folder / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (folder / "empty.md").write_text("")
    (folder / "blank.txt").write_text("  \n\n ")
    (folder / "bad.json").write_text("{not json")
    (folder / "nothing.json").write_text("[]")
    (folder / "image.png").write_bytes(b"\x89PNG")
    (folder / ".hidden.txt").write_text("hidden files are left out")
    return folder


def test_one_unusable_file_does_not_abort_a_folder(tmp_path):
    folder = _messy_folder(tmp_path)
    files, texts = load_paths([folder])  # before: UnicodeDecodeError naming no file, nothing ingested
    assert [f.name for f in files] == ["good.txt"] and [t.text for t in texts] == [GOOD]
    report = load_paths_report([folder])
    reasons = {Path(s.path).name: s.reason for s in report.skipped}
    assert set(reasons) == {"latin1.txt", "empty.md", "blank.txt", "bad.json", "nothing.json", "image.png"}
    assert "not valid UTF-8" in reasons["latin1.txt"] and "0xe9" in reasons["latin1.txt"]
    assert reasons["empty.md"].startswith("empty") and reasons["nothing.json"].startswith("empty")
    assert "invalid JSON" in reasons["bad.json"] and "unsupported" in reasons["image.png"]
    assert {Path(s.path).name for s in report.skipped if s.empty} == {"empty.md", "blank.txt", "nothing.json"}
    assert texts[0].source == str(folder.resolve() / "good.txt")  # absolute: the key for re-ingestion


def test_a_named_unusable_file_is_a_clear_error(tmp_path):
    from cacheblend_rag.ingest.loaders import load_file

    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9")
    with pytest.raises(ConfigError, match="latin1.txt: not valid UTF-8"):
        load_file(bad)
    with pytest.raises(ConfigError, match="no such file"):
        load_paths([tmp_path / "missing.txt"])


def test_links_out_of_the_folder_are_refused_unless_asked(tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("The launch code is 0000.")
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "good.txt").write_text(GOOD)
    (folder / "leak.txt").symlink_to(outside)
    (folder / "outdir").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "more.txt").write_text("Text from another folder.")
    (folder / "sub" / "inside.txt").symlink_to(folder / "good.txt")  # a link within the folder is fine
    (folder / "loop").symlink_to(folder, target_is_directory=True)  # a cycle must not recurse forever
    report = load_paths_report([folder])
    assert "The launch code is 0000." not in [t.text for t in report.texts]
    assert [f.name for f in report.files] == ["good.txt", "inside.txt"]
    refused = {Path(s.path).name: s.reason for s in report.skipped}
    assert set(refused) == {"leak.txt", "outdir"} and "--follow-symlinks" in refused["leak.txt"]
    followed = load_paths_report([folder], follow_symlinks=True)
    assert {"The launch code is 0000.", "Text from another folder."} <= {t.text for t in followed.texts}
    assert followed.skipped == []


def test_a_symlink_loop_is_skipped_not_fatal(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "good.txt").write_text(GOOD)
    (folder / "a.txt").symlink_to(folder / "b.txt")  # a -> b -> a
    (folder / "b.txt").symlink_to(folder / "a.txt")
    (folder / "sub" / "self.md").symlink_to(folder / "sub" / "self.md")
    for follow in (False, True):  # before: RuntimeError "Symlink loop from ..." out of the walk, nothing loaded
        report = load_paths_report([folder], follow_symlinks=follow)
        assert [f.name for f in report.files] == ["good.txt"]
        reasons = {Path(s.path).name: s.reason for s in report.skipped}
        assert set(reasons) == {"a.txt", "b.txt", "self.md"}
        assert all(r.startswith("symbolic link loop") for r in reasons.values())
    with pytest.raises(ConfigError, match="a.txt: symbolic link loop"):  # named on its own: a clear error
        load_paths([folder / "a.txt"])


def test_fifos_never_hang_a_load(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "good.txt").write_text(GOOD)
    os.mkfifo(folder / "pipe.txt")  # nobody ever writes to it: opening it blocking would wait forever
    report = load_paths_report([folder])
    assert [f.name for f in report.files] == ["good.txt"]
    assert [(Path(s.path).name, s.reason.split(" (")[0]) for s in report.skipped] == [("pipe.txt", "not a regular file")]
    named = load_paths_report([folder / "pipe.txt"])  # named on the command line: skipped, not an error
    assert named.files == [] and "not a regular file" in named.skipped[0].reason


def test_html_and_pdf_loaders(tmp_path):
    pytest.importorskip("bs4")
    pypdf = pytest.importorskip("pypdf")
    (tmp_path / "page.html").write_text(
        "<html><head><title>Bee facts</title><style>p {color: red}</style><script>var x = 1;</script></head>"
        "<body><h1>Eyes</h1><p>A honeybee has five eyes.</p></body></html>")
    writer = pypdf.PdfWriter()
    writer.add_blank_page(width=200, height=200)  # a PDF without a text layer (a scan)
    with open(tmp_path / "scan.pdf", "wb") as f:
        writer.write(f)
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.4 garbage")
    report = load_paths_report([tmp_path])
    assert [t.text for t in report.texts] == ["Bee facts\nEyes\nA honeybee has five eyes."]
    reasons = {Path(s.path).name: s.reason for s in report.skipped}
    assert "no text layer" in reasons["scan.pdf"] and "broken.pdf" in reasons


def test_deep_or_large_json_and_huge_html_are_skipped_with_a_bound(tmp_path):
    pytest.importorskip("bs4")
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "good.txt").write_text(GOOD)
    (folder / "deep.json").write_text("[" * 100_000 + "]" * 100_000)  # before: RecursionError, folder aborted
    (folder / "deep.jsonl").write_text('"a fine first line"\n' + "{\"a\": " * 50_000 + "1" + "}" * 50_000 + "\n")
    (folder / "big.json").write_text("[" + ",".join(["{}"] * 12_000_000) + "]")  # 36 MB: ~800 MB parsed
    # 2 MB of tags: BeautifulSoup's tree would take ~270 MB of memory for it (a 20 MB file: ~3 GB)
    (folder / "tags.html").write_text("<html><body>" + "<b>x</b>" * 250_000 + "</body></html>")
    (folder / "page.html").write_text("<html><head><title>Bees</title></head><body><p>Bees see ultraviolet light."
                                      "</p></body></html>")
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": f"Fact {i} about bees."}) + "\n" for i in range(3)))
    report = load_paths_report([folder])
    assert [f.name for f in report.files] == ["docs.jsonl", "good.txt", "page.html"]
    assert len(report.texts) == 5
    reasons = {Path(s.path).name: s.reason for s in report.skipped}
    assert set(reasons) == {"deep.json", "deep.jsonl", "big.json", "tags.html"}, reasons
    assert reasons["deep.json"].startswith("JSON nested too deeply")
    assert reasons["deep.jsonl"].startswith("JSON on line 2 nested too deeply")
    assert reasons["big.json"].startswith("JSON too large") and "JSON Lines" in reasons["big.json"]
    assert reasons["tags.html"].startswith("HTML with 500,004 tags (over 400,000")


def test_an_attribute_heavy_html_page_is_read_within_a_small_memory_bound(tmp_path):
    """#50: `<p a0=x … a999=x>y</p>` tags under the tag bound made BeautifulSoup's tree ~15x the file: an 83 MB
    page raised MemoryError under a 3 GB address-space limit and aborted the folder. Parsed as a stream, a 14 MB
    page takes ~2x its size: read under a limit of 160 MB above the interpreter's, beside ok.txt."""
    pytest.importorskip("bs4")
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "ok.txt").write_text(GOOD)
    tag = "<p " + " ".join(f"a{i}=x" for i in range(1000)) + ">bee</p>\n"
    (folder / "attrs.html").write_text("<html><head><title>Attrs</title></head><body>" + tag * 2000 + "</body></html>")
    script = (
        "import resource, sys\n"
        "import bs4, bs4.dammit\n"
        "from cacheblend_rag.ingest import load_paths_report\n"
        "vm = int(next(l for l in open('/proc/self/status') if l.startswith('VmSize')).split()[1]) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + 160 * 2**20, resource.RLIM_INFINITY))\n"
        "report = load_paths_report([sys.argv[1]])\n"
        "print(sorted(f.name for f in report.files), [s.reason for s in report.skipped], len(report.texts[0].text))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]  # before: MemoryError in BeautifulSoup, exit 1
    assert done.stdout.startswith("['attrs.html', 'ok.txt'] []"), done.stdout
    assert done.stdout.split()[-1] == str(len("Attrs\n" + "\n".join(["bee"] * 2000))), done.stdout


def _pdf(content: bytes, *, pages: int = 1, deflate: bool = False, xref_entries: int | None = None) -> bytes:
    """A PDF whose `pages` pages all draw the one content stream `content` (Helvetica), written by hand: no PDF
    writer needed. `deflate` compresses the stream; `xref_entries` overrides the count the xref table declares."""
    stream = zlib.compress(content, 9) if deflate else content
    kids = b" ".join(b"%d 0 R" % (5 + i) for i in range(pages))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, pages),
               b"<< /Length %d%s >>\nstream\n" % (len(stream), b" /Filter /FlateDecode" if deflate else b"")
               + stream + b"\nendstream",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    objects += [b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 400 200] /Contents 3 0 R "
                b"/Resources << /Font << /F1 4 0 R >> >> >>"] * pages
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (xref_entries or len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def _text_pdf(text: str) -> bytes:
    """A one-page PDF whose text layer is `text`."""
    return _pdf(f"BT /F1 12 Tf 20 100 Td ({text}) Tj ET".encode())


def _lines(count: int) -> bytes:
    """A content stream drawing `count` lines of text."""
    return b"".join(b"BT /F1 12 Tf 20 %d Td (line %d of a page of text) Tj ET\n" % (i % 200, i) for i in range(count))


def test_pdf_text_is_read(tmp_path):
    pytest.importorskip("pypdf")
    (tmp_path / "bees.pdf").write_bytes(_text_pdf("A honeybee has five eyes."))
    report = load_paths_report([tmp_path])
    assert report.skipped == [] and [t.text for t in report.texts] == ["A honeybee has five eyes."]
    assert report.texts[0].title == "bees"


def test_a_pdf_past_pypdfs_limits_is_skipped(tmp_path):
    pytest.importorskip("pypdf")
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "good.txt").write_text(GOOD)
    # 100 MB of text in a ~100 KB stream: pypdf stops decompressing at 75 MB with LimitReachedError, which is not a
    # PdfReadError (before: the error left load_paths_report, and nothing of the folder was read)
    (folder / "bomb.pdf").write_bytes(_pdf(_lines(1) + b" " * 100_000_000, deflate=True))
    (folder / "xref.pdf").write_bytes(_pdf(_lines(1), xref_entries=99_999_999))  # a table larger than the file
    report = load_paths_report([folder])
    assert [f.name for f in report.files] == ["good.txt"]
    reasons = {Path(s.path).name: s.reason for s in report.skipped}
    assert set(reasons) == {"bomb.pdf", "xref.pdf"}
    assert all(r.startswith("PDF past pypdf's safety limits") for r in reasons.values()), reasons


def test_pdf_extraction_work_is_bounded(tmp_path, monkeypatch):
    pytest.importorskip("pypdf")
    from cacheblend_rag.ingest import loaders

    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "good.txt").write_text(GOOD)
    # 59 KB on disk: 200 pages that each draw one 1.2 MB stream, 235 MB to parse (before: ~3 minutes here)
    (folder / "shared.pdf").write_bytes(_pdf(_lines(20_000), pages=200, deflate=True))
    started = time.monotonic()
    report = load_paths_report([folder])
    assert time.monotonic() - started < 30  # refused from the streams' size, before any page is parsed
    assert [f.name for f in report.files] == ["good.txt"]
    [skipped] = report.skipped
    assert "content streams" in skipped.reason and "64 MiB" in skipped.reason, skipped.reason

    # under the size bound, a slow extraction is stopped by the time bound (lowered here to keep the test short)
    monkeypatch.setattr(loaders, "PDF_SECONDS", 1.0)
    (folder / "shared.pdf").write_bytes(_pdf(_lines(3_000), pages=100, deflate=True))
    started = time.monotonic()
    report = load_paths_report([folder])
    assert time.monotonic() - started < 30  # ~1 s (the whole file: ~15 s)
    [skipped] = report.skipped
    assert "took over 1 s" in skipped.reason, skipped.reason
    (folder / "shared.pdf").write_bytes(_pdf(_lines(10), pages=2))  # a small one is read as before
    assert load_paths_report([folder]).skipped == []


# ---- with the real model and a real Chroma ---------------------------------------------------


@pytest.fixture
def engine_factory(default_model, tmp_path):
    from cacheblend_rag import CacheBlendEngine

    model, tokenizer = default_model

    def make(kv_store=None):
        return CacheBlendEngine(model, tokenizer, kv_store if kv_store is not None else tmp_path / "kv")

    return make


def _disk_bytes(engine, ids) -> int:
    disk = engine.kv_store.disk
    return sum(disk.path_for(KVKey(engine.namespace, cid)).stat().st_size for cid in ids)


@pytest.mark.model
def test_ingest_reports_what_it_stored_and_keeps_memory_in_budget(tmp_path, engine_factory):
    from cacheblend_rag.ingest import ingest_paths
    from cacheblend_rag.retrieval.chroma import ChromaChunkStore

    folder = _messy_folder(tmp_path)
    for i in range(3):
        (folder / f"extra{i}.txt").write_text(f"Fact number {i}: bees dance {i + 2} times a minute.")
    budget = 64 * 1024  # smaller than one chunk's KV: the memory tier must hold nothing
    engine = engine_factory(open_store(tmp_path / "kv", memory_bytes=budget))
    store = ChromaChunkStore(tmp_path)
    report = ingest_paths([folder], engine, store, show_progress=False, batch_chunks=2)
    assert (report.files, report.chunks, report.new_kv, report.kv_failed) == (4, 4, 4, ())
    assert {Path(s.path).name for s in report.skipped} >= {"latin1.txt", "empty.md", "bad.json"}
    # exactly the bytes on disk (before: the in-memory fp32 copies, re-read after the run)
    assert report.kv_bytes == _disk_bytes(engine, report.chunk_ids)
    assert engine.kv_store.memory.stats()["bytes"] <= budget
    again = ingest_paths([folder], engine, store, show_progress=False)
    assert (again.new_chunks, again.new_kv, again.kv_bytes, again.removed_chunks) == (0, 0, 0, 0)
    d = json.loads(json.dumps(again.as_dict()))
    assert {s["path"].rsplit("/", 1)[-1] for s in d["skipped"]} >= {"latin1.txt", "empty.md"}


@pytest.mark.model
def test_ingest_fails_when_no_kv_could_be_stored(tmp_path, engine_factory):
    from cacheblend_rag.ingest import IngestError, ingest_paths

    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "good.txt").write_text(GOOD)
    engine = engine_factory()
    # The chunk's folder cannot be created (a file is in the way): every disk write fails, even as root.
    (tmp_path / "kv" / engine.namespace).write_text("in the way")
    with pytest.raises(IngestError, match="could not be stored|ingest stopped") as info:
        ingest_paths([folder], engine, None, show_progress=False)
    report = info.value.report
    assert (report.new_kv, report.kv_bytes) == (0, 0) and report.kv_failed == (chunk_id(GOOD),)


@pytest.mark.model
def test_reingest_follows_edited_emptied_and_removed_files(tmp_path, engine_factory):
    from cacheblend_rag.ingest import delete_sources, ingest_paths, prune_sources
    from cacheblend_rag.retrieval.chroma import ChromaChunkStore

    folder = tmp_path / "corpus"
    folder.mkdir()
    code, gone, emptied, kept = (folder / n for n in ("code.txt", "gone.txt", "emptied.txt", "kept.txt"))
    code.write_text("The door code of the hive office is 4711.")
    gone.write_text("Drones die after mating with the queen.")
    emptied.write_text("Propolis is a resin that bees collect from trees.")
    kept.write_text(GOOD)
    engine, store = engine_factory(), ChromaChunkStore(tmp_path)
    first = ingest_paths([folder], engine, store, show_progress=False)
    assert first.chunks == 4 and store.count() == 4
    old_ids = {p.name: chunk_id(p.read_text()) for p in (code, gone, emptied)}

    code.write_text("The door code of the hive office is 9876.")
    gone.unlink()
    emptied.write_text("")
    second = ingest_paths([folder], engine, store, show_progress=False)
    assert (second.removed_chunks, second.dropped_kv) == (3, 3)
    assert store.count() == 2 and store.existing_ids(list(old_ids.values())) == set()
    assert not any(engine.kv_store.contains(KVKey(engine.namespace, cid)) for cid in old_ids.values())
    hits = store.query("What is the door code of the hive office?", k=2)
    assert "9876" in hits[0].text and not any("4711" in h.text for h in hits)

    # a passage shared by two files stays while one of them still has it
    shared = folder / "copy.txt"
    shared.write_text(GOOD)
    ingest_paths([folder], engine, store, show_progress=False)
    shared.unlink()
    third = ingest_paths([folder], engine, store, show_progress=False)
    assert store.existing_ids([chunk_id(GOOD)]) == {chunk_id(GOOD)} and third.removed_chunks == 0

    deleted = delete_sources([code], engine, store)
    assert (deleted.sources, deleted.removed_chunks, deleted.dropped_kv) == ((str(code),), 1, 1)
    kept.unlink()
    pruned = prune_sources(engine, store)
    assert pruned.sources == (str(kept),) and store.count() == 0
