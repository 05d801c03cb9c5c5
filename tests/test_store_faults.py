"""Store faults on real files: FIFOs, hostile headers, killed writers, damaged entries, a store that cannot write."""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, ChunkError, ConfigError
from cacheblend_rag.errors import KVWriteError
from cacheblend_rag.store import ChunkKV, DiskStore, KVKey, MemoryStore, TieredStore, open_store
from cacheblend_rag.store.disk import QUARANTINE_MAX_FILES

from conftest import tiny_model

TEXTS = [
    "Lyon sits where the Rhône meets the Saône, two rivers of eastern France.",
    "Granite forms from slowly cooled magma deep underground and is rich in quartz.",
]
QUESTION = "Which rivers meet in Lyon?"


def make_kv(tokens: int = 6, layers: int = 2) -> ChunkKV:
    g = torch.Generator().manual_seed(0)
    return ChunkKV(tuple(torch.randn(tokens, 2, 4, generator=g) for _ in range(layers)),
                   tuple(torch.randn(tokens, 2, 4, generator=g) for _ in range(layers)),
                   torch.arange(tokens))


KEY = KVKey("model-a", "abcdef01")


def _within(seconds: float, fn):
    """Run fn on a thread; fail (instead of hanging the suite) if it does not return in time."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("value", fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} did not return within {seconds} s"
    return out.get("value")


def test_a_fifo_at_a_kv_path_is_a_bad_entry_not_a_hang(tmp_path):
    store = DiskStore(tmp_path)
    path = store.path_for(KEY)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    assert _within(10, lambda: store.get(KEY)) is None
    assert _within(10, lambda: store.reader(KEY)) is None
    assert not path.exists() and store.stats()["corrupt"] == 1  # moved aside: the next put can write
    store.put(KEY, make_kv())
    assert store.get(KEY) is not None


def test_a_huge_header_is_refused_before_parsing_and_logged_briefly(tmp_path, caplog):
    store = DiskStore(tmp_path)
    path = store.path_for(KEY)
    path.parent.mkdir(parents=True)
    header = b'{"__metadata__": {"format": "' + b"x" * (8 * 1024**2) + b'"}}'
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with caplog.at_level(logging.WARNING):
        assert store.get(KEY) is None
    assert max(len(r.getMessage()) for r in caplog.records) < 2000
    # a header of sane size with a huge value is parsed, and its value is cut in the log
    store.put(KEY, make_kv())
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    patched = raw[8:8 + n].replace(b'"cacheblend-kv"', b'"' + b"y" * 200_000 + b'"')
    path.write_bytes(struct.pack("<Q", len(patched)) + patched + raw[8 + n:])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert store.get(KEY) is None
    assert caplog.records and max(len(r.getMessage()) for r in caplog.records) < 2000


def test_temp_files_of_killed_writers_are_removed_on_open_but_live_ones_stay(tmp_path):
    store = DiskStore(tmp_path)
    store.put(KEY, make_kv())
    folder = store.path_for(KEY).parent
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = folder / f".{KEY.chunk_id}.safetensors.{dead_pid}.0123abcd.tmp"
    live = folder / f".{KEY.chunk_id}.safetensors.{os.getpid()}.4567ef01.tmp"
    stale.write_bytes(b"x" * 1000)
    live.write_bytes(b"y" * 1000)
    DiskStore(tmp_path)  # the next process to open the store
    assert not stale.exists() and live.exists()


def test_the_quarantine_is_bounded(tmp_path):
    store = DiskStore(tmp_path)
    for i in range(QUARANTINE_MAX_FILES + 5):
        key = KVKey("model-a", f"bad{i:04d}")
        path = store.path_for(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"garbage" * 10)
        assert store.get(key) is None
    assert len(list((tmp_path / ".quarantine").glob("*.bad"))) == QUARANTINE_MAX_FILES


def test_contains_checks_the_entry_so_ingest_repairs_a_damaged_file(tokenizer, tmp_path):
    engine = CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer,
                              kv_store=DiskStore(tmp_path, dtype=torch.float32))
    ids = engine.ingest(TEXTS, show_progress=False)
    path = engine.kv_store.path_for(KVKey(engine.namespace, ids[0]))
    os.truncate(path, 1000)
    assert not engine.has_kv(ids[0])  # header and sizes are checked, not just existence
    engine.ingest(TEXTS, show_progress=False)  # re-running ingest repairs it
    assert engine.has_kv(ids[0])
    pre = engine.prefill(ids, QUESTION, method="full_reuse")
    assert pre.stats["chunk_hits"] == ids


def _unwritable_store(tmp_path: Path) -> TieredStore:
    """A tiered store whose disk cannot create entry folders (a file stands where its namespace folder goes)."""
    store = open_store(tmp_path / "kv")
    return store


def test_ingest_fails_with_the_reason_when_no_kv_can_be_saved(tokenizer, tmp_path):
    model = tiny_model("llama", len(tokenizer))
    engine = CacheBlendEngine(model, tokenizer, kv_store=tmp_path / "kv")
    (tmp_path / "kv" / engine.namespace).write_text("not a folder")  # every write into the namespace fails
    with pytest.raises(KVWriteError, match="could not write the KV"):
        engine.ingest(TEXTS, show_progress=False)
    # a request still succeeds (a failing cache never fails a request), and says so in the log once
    out = engine.generate(TEXTS, QUESTION, max_new_tokens=2)
    assert len(out.token_ids) == 2


def test_ingest_fails_on_a_full_file_system(tokenizer, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root, or no mount permission)")
    try:
        engine = CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer, kv_store=mnt / "kv")
        with pytest.raises(KVWriteError, match="No space left"):
            engine.ingest(TEXTS * 1 + [t + " again and again" * i for i, t in enumerate(TEXTS * 20)],
                          show_progress=False)
        assert not list(mnt.rglob("*.tmp"))  # no partial temp file left filling the disk
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_string_is_one_item_never_its_characters(tokenizer):
    engine = CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer)
    ids = engine.ingest("Scipio defeated Hannibal at Zama.", show_progress=False)
    assert len(ids) == 1
    pre = engine.prefill("Scipio defeated Hannibal at Zama.", "Who won at Zama?", method="full_reuse")
    assert pre.stats["chunk_hits"] == ids
    out = engine.generate(ids, "Who won at Zama?", max_new_tokens=4, stop="Hannibal")
    assert out.stats["num_generated"] >= 1  # a one-string stop is one stop string


def test_empty_stop_strings_are_ignored(tokenizer):
    engine = CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer)
    ids = engine.ingest(TEXTS, show_progress=False)
    plain = engine.generate(ids, QUESTION, max_new_tokens=6)
    assert engine.generate(ids, QUESTION, max_new_tokens=6, stop=[""]).token_ids == plain.token_ids
    assert "".join(engine.stream(ids, QUESTION, max_new_tokens=6, stop=[""])) .strip() == plain.text


@pytest.mark.parametrize("kwargs, match", [
    (dict(method=None), "method"),
    (dict(method="full_prefill", recompute_ratio="0.2"), "recompute_ratio"),
    (dict(recompute_ratio=True), "recompute_ratio"),
    (dict(bogus_option=3), "no option 'bogus_option'"),
    (dict(max_new_tokens=1.5), "max_new_tokens"),
    (dict(max_tokens=0), "max_new_tokens"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(stop=[3]), "stop"),
    (dict(method="cacheblend", check_layers=99, filter_layer=100), "check layer"),
    (dict(check_layers=99), "no option 'check_layers'; its options"),  # not an option of the default (relevance)
])
def test_bad_request_options_are_clear_errors(tokenizer, kwargs, match):
    engine = CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer)
    ids = engine.ingest(TEXTS, show_progress=False)
    with pytest.raises(ConfigError, match=match):
        engine.generate(ids, QUESTION, **kwargs)
    with pytest.raises(ConfigError, match=match):
        "".join(engine.stream(ids, QUESTION, **kwargs))


@pytest.mark.parametrize("question", ["", "   ", "bad \ud800 surrogate"])
def test_an_empty_or_invalid_question_is_refused(tokenizer, question):
    engine = CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer)
    with pytest.raises(ConfigError, match="question"):
        engine.generate(TEXTS, question, max_new_tokens=2)


def test_a_chunk_longer_than_the_window_is_refused_with_the_numbers(tokenizer):
    model = tiny_model("llama", len(tokenizer), max_position_embeddings=256)
    engine = CacheBlendEngine(model, tokenizer)
    with pytest.raises(ChunkError, match=r"more than the \d+ that fit the model's context window of 256"):
        engine.ingest(["word " * 2000], show_progress=False)


def test_kv_store_paths_expand_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    store = open_store("~/kv-here")
    assert store.tiers()["disk"] == tmp_path / "kv-here" and not (tmp_path / "~").exists()
    assert isinstance(store.memory, MemoryStore)
    # bounded by default on disk too (LRU), as the README says
    assert store.stats()["disk"]["max_bytes"] == 20 * 1024**3 and store.stats()["memory"]["max_bytes"] == 2 * 1024**3
