"""Crash safety (issue #53), as SQLite's crash tests do it: a real process writing real files is killed with
SIGKILL mid-work — during disk-store writes, during an ingestion, during stored-prefix writes — and a new process
on the same folder must serve nothing corrupt, keep everything that was committed, and redo what was partial.

Each child reports on stdout what it has committed (a put that returned); the kill lands after a few commits and
a random few milliseconds, so it falls inside a write as often as between two.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cacheblend_rag.store import ChunkKV, DiskStore, KVKey

REPO = Path(__file__).resolve().parents[1]
ROUNDS = 3  # kills of the disk-store writer; each a fresh child (~2 s to import torch)
KEY_SEEDS = 40
TOKENS = 2048  # an entry of ~4 MiB: a write takes long enough to be killed inside it


def kv_of(seed: int) -> ChunkKV:
    """The KV a child writes under key `seed`: the parent rebuilds it to check what it reads back."""
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(tuple(torch.randn(TOKENS, 2, 64, generator=g) for _ in range(4)),
                   tuple(torch.randn(TOKENS, 2, 64, generator=g) for _ in range(4)),
                   torch.randint(0, 50_000, (TOKENS,), generator=g), positions_start=seed % 3)


def key_of(seed: int) -> KVKey:
    return KVKey("crash", f"{seed:032x}")


WRITER = f"""
import sys
sys.path.insert(0, {str(REPO / 'tests')!r})
from test_crash import KEY_SEEDS, key_of, kv_of
from cacheblend_rag.store import DiskStore
store = DiskStore(sys.argv[1])
for seed in range(KEY_SEEDS):
    store.put(key_of(seed), kv_of(seed))
    print(seed, flush=True)
"""


def _child(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=REPO)


def _kill_after(child: subprocess.Popen, commits: int, rng: random.Random, delay_s: tuple[float, float] = (0, 0.05),
                limit_s: float = 300) -> list[str]:
    """SIGKILL the child a random `delay_s` after it reported `commits` lines; the lines it reported."""
    lines: list[str] = []
    deadline = time.monotonic() + limit_s
    while len(lines) < commits:
        line = child.stdout.readline()
        if not line:
            break  # it finished (or failed) first
        lines.append(line.strip())
        assert time.monotonic() < deadline, "the child never got that far"
    time.sleep(rng.uniform(*delay_s))
    child.send_signal(signal.SIGKILL)
    rest, err = child.communicate(timeout=60)
    assert child.returncode in (-signal.SIGKILL, 0), err[-3000:]
    return lines + [line.strip() for line in rest.splitlines()]


def _equal(a: ChunkKV, b: ChunkKV) -> bool:
    return (a.positions_start == b.positions_start and torch.equal(a.token_ids, b.token_ids)
            and all(torch.equal(x, y.to(x.dtype)) for x, y in zip(a.keys + a.values, b.keys + b.values)))


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_disk_store_writer_killed_mid_write_leaves_its_committed_entries_and_nothing_corrupt(tmp_path, round_):
    rng = random.Random(round_)
    committed = _kill_after(_child(WRITER, str(tmp_path)), rng.randint(1, 6), rng)
    assert committed, "the writer committed nothing"
    store = DiskStore(tmp_path)  # the restart: a dead writer's temp files are removed at open
    assert not list(tmp_path.glob("*/*/.*.tmp")), "a killed writer's temp file was left"
    for seed in range(KEY_SEEDS):
        got = store.get(key_of(seed))
        if str(seed) in committed:
            assert got is not None and _equal(got, kv_of(seed)), f"committed entry {seed} lost or changed"
        else:
            assert got is None or _equal(got, kv_of(seed)), f"entry {seed} served other KV"
    assert store.stats()["corrupt"] == 0  # atomic writes: never a partial file at an entry's path
    store.put(key_of(KEY_SEEDS), kv_of(KEY_SEEDS))  # and the store goes on
    assert _equal(store.get(key_of(KEY_SEEDS)), kv_of(KEY_SEEDS))


# ---- an ingestion killed mid-way, then run again ------------------------------------------------------------

INGEST = f"""
import sys
sys.path.insert(0, {str(REPO / 'tests')!r})
from test_crash import crash_engine
from cacheblend_rag.ingest import ingest_paths
engine = crash_engine(sys.argv[1])
print("ready", flush=True)
report = ingest_paths([sys.argv[2]], engine, None, show_progress=False, batch_chunks=2, chunk_tokens=64)
print("done", report.new_kv, flush=True)
"""


def crash_engine(kv_dir: str, **options):
    """A tiny random-weight Llama (the real tokenizer) over a KV folder: the same model in every process."""
    from cacheblend_rag import CacheBlendEngine, load_model
    from conftest import tiny_model

    tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32")[1]
    return CacheBlendEngine(tiny_model("llama", len(tokenizer), num_hidden_layers=2, seed=3), tokenizer, kv_dir,
                            **options)


def _corpus(folder: Path) -> Path:
    folder.mkdir()
    for i in range(12):
        (folder / f"doc{i:02d}.txt").write_text("\n\n".join(
            f"Document {i}, paragraph {j}: bees of hive {i * 7 + j} store {j + 3} kinds of pollen in comb cell "
            f"rows, and the keepers count them every {i + j + 2} days." for j in range(6)))
    return folder


@pytest.mark.slow
@pytest.mark.model
def test_an_ingestion_killed_mid_way_is_redone_and_serves_nothing_corrupt(tmp_path):
    from cacheblend_rag.engine import CHUNK_INDEX_FILE
    from cacheblend_rag.ingest import ingest_paths

    corpus = _corpus(tmp_path / "corpus")
    kv = tmp_path / "kv"
    child = _child(INGEST, str(kv), str(corpus))
    lines = _kill_after(child, 1, random.Random(7), delay_s=(0.3, 1.0))  # "ready", then killed mid-ingestion
    killed_before_the_end = not any(line.startswith("done") for line in lines)

    engine = crash_engine(str(kv))  # the restart
    assert not list(kv.glob("*/*/.*.tmp"))
    stored_before = {p.stem for p in kv.glob("*/*/*.safetensors")}
    report = ingest_paths([corpus], engine, None, show_progress=False, batch_chunks=2, chunk_tokens=64)
    assert report.kv_failed == () and report.skipped == ()
    assert engine.kv_store.disk.stats()["corrupt"] == 0
    # what the killed run stored is kept (not computed again), the rest is computed now
    assert report.new_kv == len(set(report.chunk_ids) - stored_before)
    if killed_before_the_end:
        assert report.new_kv > 0
    # every chunk's KV is what a clean ingestion stores: bit for bit what the killed process stored; what was
    # computed after the restart, behind the lead-in's KV as stored (fp16) rather than as computed, within its
    # rounding
    clean = crash_engine(str(tmp_path / "clean"))
    ingest_paths([corpus], clean, None, show_progress=False, batch_chunks=2, chunk_tokens=64)
    for cid in report.chunk_ids:
        got = engine.kv_store.disk.get(KVKey(engine.namespace, cid))
        want = clean.kv_store.disk.get(KVKey(clean.namespace, cid))
        if cid in stored_before:
            assert _equal(got, want), cid
        else:
            assert got.positions_start == want.positions_start and torch.equal(got.token_ids, want.token_ids)
            for x, y in zip(got.keys + got.values, want.keys + want.values):
                torch.testing.assert_close(x.float(), y.float(), atol=4e-3, rtol=4e-3)
    assert (kv / CHUNK_INDEX_FILE).is_file() and all(engine.index.text(cid) for cid in report.chunk_ids)


# ---- stored prefixes written while the process is killed ----------------------------------------------------

TURNS = f"""
import json, sys
sys.path.insert(0, {str(REPO / 'tests')!r})
from test_crash import crash_engine
engine = crash_engine(sys.argv[1], prefix_store=sys.argv[1] + "/prefixes")
chat = [{{"role": "user", "content": "Which rivers meet in Lyon, the city of eastern France?"}}]
for turn in range(40):
    answer = engine.generate_prompt(chat, max_new_tokens=8).text
    chat += [{{"role": "assistant", "content": answer}}, {{"role": "user", "content": f"And then, step {{turn}}?"}}]
    print(json.dumps(chat), flush=True)  # the next turn's chat: this turn's stored prefix is committed
"""


@pytest.mark.slow
@pytest.mark.model
def test_stored_prefixes_written_when_the_process_is_killed_are_whole_or_absent(tmp_path):
    lines = _kill_after(_child(TURNS, str(tmp_path)), 3, random.Random(11))
    assert len(lines) >= 3, lines
    prefixes = tmp_path / "prefixes"
    store = DiskStore(prefixes)  # the restart
    assert not list(prefixes.glob("*/*/.*.tmp"))
    entries = list(prefixes.glob("*/*/*.safetensors"))
    assert entries, "no prefix was stored"
    for path in entries:  # every stored prefix is a whole, valid entry
        assert store.get(KVKey(path.parent.parent.name, path.stem)) is not None, path
    assert store.stats()["corrupt"] == 0
    # and a restarted engine goes on with the conversation, over what the stored prefixes hold of it (a turn's
    # prefix is written when the next request starts, and a random model's answer re-tokenizes otherwise: how
    # many rows it reuses is not this test's to say)
    engine = crash_engine(str(tmp_path), prefix_store=str(prefixes))
    out = engine.generate_prompt(json.loads(lines[-1]), max_new_tokens=8)
    assert out.stats["num_generated"] > 0 and store.stats()["corrupt"] == 0
