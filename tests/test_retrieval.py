"""Retrieval and ingestion: loaders, token-aware splitting, the prompt string format, Chroma (embedded and server)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cacheblend_rag import chunk_id
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.ingest import ChunkRecord, SourceText, load_paths, split_texts
from cacheblend_rag.retrieval import CHUNK_SEPARATOR, parse_prompt, render_prompt

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"


def test_loaders_read_every_format(tmp_path):
    (tmp_path / "a.txt").write_text("plain text file")
    (tmp_path / "b.md").write_text("# Title\n\nmarkdown body")
    (tmp_path / "c.json").write_text(json.dumps([{"title": "T", "text": "json body"}, "bare string"]))
    (tmp_path / "d.jsonl").write_text('{"content": "line one"}\n"line two"\n\n')
    (tmp_path / "skip.bin").write_bytes(b"\x00")
    files, texts = load_paths([tmp_path])
    assert [f.name for f in files] == ["a.txt", "b.md", "c.json", "d.jsonl"]
    assert [t.text for t in texts] == ["plain text file", "# Title\n\nmarkdown body", "T\njson body",
                                      "bare string", "line one", "line two"]
    with pytest.raises(ConfigError, match="no such file"):
        load_paths([tmp_path / "missing.txt"])


def test_musique_contexts_become_one_chunk_each(tmp_path, musique, tokenizer):
    path = tmp_path / "musique.json"
    path.write_text(json.dumps(musique[:2]))
    _, texts = load_paths([path])
    expected = [f"{c['title']}\n{c['text']}" for item in musique[:2] for c in item["ctxs"]]
    assert [chunk_id(t.text) for t in texts] == [chunk_id(e) for e in expected]  # same ids as the benchmark's
    assert all(t.presplit for t in texts)
    records = split_texts(texts, tokenizer)
    assert {r.chunk_id for r in records} == {chunk_id(t) for t in expected}


def test_split_respects_the_token_budget(tokenizer):
    long = "\n\n".join(f"Paragraph {i}. " + "Bees collect nectar and pollen from flowers. " * 12 for i in range(30))
    records = split_texts([SourceText(long, "long.txt")], tokenizer, chunk_tokens=128)
    assert len(records) > 5
    for r in records:
        assert len(tokenizer(r.text, add_special_tokens=False)["input_ids"]) <= 128
        assert r.chunk_id == chunk_id(r.text) and r.metadata["source"] == "long.txt"
    again = split_texts([SourceText(long, "long.txt")], tokenizer, chunk_tokens=128)
    assert [r.chunk_id for r in again] == [r.chunk_id for r in records]


def test_a_line_without_spaces_is_split_in_linear_time(tokenizer, monkeypatch):
    import random
    import time

    rng = random.Random(0)
    calls = []
    tokenize = tokenizer.tokenize
    monkeypatch.setattr(tokenizer, "tokenize", lambda text, **kw: calls.append(len(text)) or tokenize(text, **kw))
    line = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789", k=1_000_000))  # 1 MB, one line
    started = time.monotonic()
    records = split_texts([SourceText(line, "line.txt")], tokenizer)
    elapsed = time.monotonic() - started
    # before: three tokenizer calls per character (3,000,000 calls; ~28 s here, 188 s/MB on a slower machine)
    assert len(calls) < 100, len(calls)
    assert elapsed < 30  # ~1 s; a generous bound on a shared machine
    assert "".join(r.text for r in records) == line  # cut, nothing lost
    sizes = [len(tokenizer(r.text, add_special_tokens=False)["input_ids"]) for r in records]
    assert max(sizes) <= 512 + 2 and sum(sizes) < len(line)  # chunks of ~512 real tokens (before: 512 characters)

    # a run shorter than that, between words: cut the same way, the words around it kept whole
    run = line[:5_000]
    records = split_texts([SourceText(f"Bees dance. {run} Bees sting.", "mixed.txt")], tokenizer, chunk_tokens=128,
                          overlap_tokens=16)
    texts = [r.text for r in records]
    assert texts[0] == "Bees dance." and texts[-1] == "Bees sting."
    assert all(len(tokenizer(t, add_special_tokens=False)["input_ids"]) <= 128 + 2 for t in texts)
    assert texts[1].startswith(run[:100]) and texts[-2].endswith(run[-100:])


def test_a_long_line_of_words_is_split_with_one_tokenizer_call_per_distinct_word(tokenizer, monkeypatch):
    """#50: the splitter measured every word of a line up to three times (a tokenizer call each: a 1 MB line of
    words took 7.5 s); the lengths are now remembered, and the chunks stay langchain's own."""
    import random

    from langchain_text_splitters import RecursiveCharacterTextSplitter

    from cacheblend_rag.ingest.chunks import normalize_text

    rng = random.Random(0)
    vocabulary = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(2000)]
    words = rng.choices(vocabulary, k=20_000)  # ~120 KB, one line, words repeating as in real text
    line = " ".join(words)
    plain = RecursiveCharacterTextSplitter.from_huggingface_tokenizer(tokenizer, chunk_size=128, chunk_overlap=16)
    expected = list(dict.fromkeys(n for n in map(normalize_text, plain.split_text(line)) if n))
    calls = []
    tokenize = tokenizer.tokenize
    monkeypatch.setattr(tokenizer, "tokenize", lambda text, **kw: calls.append(text) or tokenize(text, **kw))
    records = split_texts([SourceText(line, "line.txt")], tokenizer, chunk_tokens=128, overlap_tokens=16)
    assert [r.text for r in records] == expected
    # before: ~3 calls per word (~60,000); now one per distinct piece (" word" and "word" are two)
    assert len(calls) == len(set(calls)) <= 2 * len(set(words)) + 2, (len(calls), len(set(words)))


def test_split_of_ordinary_text_is_langchains(tokenizer):
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    from cacheblend_rag.ingest.chunks import normalize_text

    docs = [p.read_text() for p in sorted(DATA.iterdir())] + [(DATA.parents[1] / "README.md").read_text()]
    for chunk_tokens, overlap in ((512, 0), (64, 16)):
        plain = RecursiveCharacterTextSplitter.from_huggingface_tokenizer(tokenizer, chunk_size=chunk_tokens,
                                                                          chunk_overlap=overlap)
        for doc in docs:
            ours = split_texts([SourceText(doc, "doc")], tokenizer, chunk_tokens=chunk_tokens, overlap_tokens=overlap)
            expected = dict.fromkeys(n for n in map(normalize_text, plain.split_text(doc)) if n)
            assert [r.text for r in ours] == list(expected)


def test_prompt_format_round_trip():
    chunks = ["First passage.\nWith two lines.", "Second passage  \n", "Third."]
    text = render_prompt(chunks, "What is it?")
    parsed = parse_prompt(text)
    assert parsed.question == "What is it?"
    assert [chunk_id(c) for c in parsed.chunk_texts] == [chunk_id(c) for c in chunks]
    assert parse_prompt("just a question") is None
    assert parse_prompt(render_prompt([], "q")).chunk_texts == []


def test_parse_regroups_a_chunk_that_contains_the_separator():
    tricky = "Notes" + CHUNK_SEPARATOR + "more notes"
    chunks = ["alpha", tricky, "omega"]
    known = {chunk_id(c) for c in chunks}
    text = render_prompt(chunks, "q")
    assert len(parse_prompt(text).chunk_texts) == 4  # without the store: the separator splits it
    regrouped = parse_prompt(text, is_known=known.__contains__).chunk_texts
    assert [chunk_id(c) for c in regrouped] == [chunk_id(c) for c in chunks]


# ---- Chroma -------------------------------------------------------------------------------


def _records() -> list[ChunkRecord]:
    _, texts = load_paths([DATA])
    return [ChunkRecord(chunk_id(t.text), t.text, {"source": Path(t.source).name}) for t in texts]


def _check_store(store) -> None:
    records = _records()
    assert len(store.upsert(records)) == len(records)
    assert store.upsert(records) == []  # re-ingestion: nothing new, no duplicates
    assert store.count() == len(records)
    hits = store.query("How many eyes does a honeybee have?", k=3)
    assert len(hits) == 3 and hits[0].metadata["source"] == "07_senses.txt"
    assert hits[0].chunk_id == chunk_id(hits[0].text) == hits[0].metadata["chunk_id"]
    assert 0.0 < hits[0].score <= 1.0 and hits[0].score >= hits[1].score


def test_chroma_embedded_upsert_query(tmp_path):
    from cacheblend_rag.retrieval.chroma import ChromaChunkStore

    store = ChromaChunkStore(tmp_path)
    _check_store(store)
    assert store.location == str(tmp_path / "chroma")
    assert store.collection.configuration["hnsw"]["space"] == "cosine"
    reopened = ChromaChunkStore(tmp_path)  # same embedding function: reopening is accepted
    assert reopened.count() == store.count()
    with pytest.raises(ConfigError, match="3 to 512"):
        ChromaChunkStore(tmp_path, "kb")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def chroma_server(tmp_path):
    exe = Path(sys.executable).parent / "chroma"
    if not exe.exists():
        exe = shutil.which("chroma")
        if exe is None:
            pytest.skip("the `chroma` CLI (chromadb's server) is not installed next to this Python or on PATH")
    import urllib.request

    port = _free_port()
    log = open(tmp_path / "chroma.log", "wb")
    proc = subprocess.Popen([str(exe), "run", "--path", str(tmp_path / "db"), "--host", "127.0.0.1",
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v2/heartbeat", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"chroma server did not start: {(tmp_path / 'chroma.log').read_text()[-2000:]}")
                time.sleep(0.3)
        yield "127.0.0.1", port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.mark.slow
def test_chroma_server_on_loopback(chroma_server):
    from cacheblend_rag.retrieval.chroma import ChromaChunkStore

    host, port = chroma_server
    store = ChromaChunkStore(host=host, port=port, collection="cacheblend_server_test")
    assert store.location == f"http://{host}:{port}"
    _check_store(store)


# ---- warming the KV from a vector store the user already has ----------------------------------------------------


def _users_chroma(path: Path, passages: list[str], name: str = "user_docs"):
    """A collection made the way a user's own code makes one: its own ids and (here 3-d) embeddings."""
    import chromadb
    from chromadb.config import Settings

    client = chromadb.PersistentClient(path=str(path), settings=Settings(anonymized_telemetry=False))
    collection = client.get_or_create_collection(name)
    docs = [*passages, passages[0], "  ", "too short", "word " * 9000]  # a duplicate, empty, short, too long
    collection.add(ids=[f"doc-{i}" for i in range(len(docs))], documents=docs,
                   embeddings=[[float(i), 1.0, 0.5] for i in range(len(docs))])
    client.get_or_create_collection("empty_docs")
    return docs


@pytest.mark.model
def test_warm_from_chroma_precomputes_a_users_collection(tmp_path, default_model, passages):
    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.errors import VectorStoreError
    from cacheblend_rag.retrieval import warm_from_chroma

    docs = _users_chroma(tmp_path / "db", passages[:2])
    model, tokenizer = default_model
    engine = CacheBlendEngine(model, tokenizer, tmp_path / "kv")
    report = warm_from_chroma(engine, "user_docs", path=tmp_path / "db")
    assert (report.documents, report.chunks, report.new_kv, report.already_stored) == (len(docs), 2, 2, 0)
    assert report.kv_bytes > 0 and report.chunk_ids == tuple(chunk_id(p) for p in passages[:2])
    reasons = {s.doc_id: s.reason for s in report.skipped}
    assert set(reasons) == {"doc-3", "doc-4", "doc-5"}
    assert "empty" in reasons["doc-3"] and "shorter" in reasons["doc-4"] and "re-split" in reasons["doc-5"]

    # The user's own prompt around a stored document reuses its KV; a second warm-up computes nothing.
    prompt = f"Context:\n{passages[1]}\n\nQ: {passages[1].split(chr(10))[0]}?\nA:"
    stats = engine.generate_prompt(prompt, max_new_tokens=1).stats
    assert stats["chunk_hits"] == [chunk_id(passages[1])] and stats["num_reused"] > 0
    again = warm_from_chroma(engine, "user_docs", path=tmp_path / "db")
    assert (again.new_kv, again.already_stored) == (0, 2)
    with pytest.raises(VectorStoreError, match="empty"):
        warm_from_chroma(engine, "empty_docs", path=tmp_path / "db")
    with pytest.raises(VectorStoreError, match="no collection 'nope'.*user_docs"):
        warm_from_chroma(engine, "nope", path=tmp_path / "db")


@pytest.mark.model
def test_cli_ingest_from_chroma(tmp_path, default_model, passages, capsys):
    from cacheblend_rag import settings
    from cacheblend_rag.cli import main

    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(settings.models_dir(), target_is_directory=True)  # no second conversion
    _users_chroma(tmp_path / "db", passages[:2])
    argv = ["ingest", "--from-chroma", "user_docs", "--chroma-path", str(tmp_path / "db"), "--home", str(home)]

    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert (report["chunks"], report["new_kv"], report["collection"]) == (2, 2, "user_docs")
    assert [s["id"] for s in report["skipped"]] == ["doc-3", "doc-4", "doc-5"]
    assert (home / "kv").is_dir() and not (home / "chroma").exists()  # the user's database is only read
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "0 KV computed, 2 already stored" in out.out and "skipped document doc-5" in out.err

    for bad, code, words in (
        ([*argv, str(tmp_path)], 2, "no files or folders"),
        (["ingest", "--chroma-path", str(tmp_path / "db"), "--home", str(home)], 2, "goes with --from-chroma"),
        ([*argv, "--port", "8000"], 2, "give one of them"),
        (["ingest", "--home", str(home)], 2, "--from-chroma COLLECTION"),
        (["ingest", "--from-chroma", "empty_docs", "--chroma-path", str(tmp_path / "db")], 1, "is empty"),
    ):
        assert main(bad) == code, bad
        assert words in capsys.readouterr().err
