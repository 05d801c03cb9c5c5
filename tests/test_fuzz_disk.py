"""What the package reads back from disk, under a property-based fuzzer (issue #53): KV-store entries (each codec),
the fidelity gate's decisions, the chunk index, and stored prefixes — bit-flipped, truncated, extended, zeroed,
or replaced by another entry's file — read back by a fresh process's objects on the same folder.

The property: a damaged entry is detected and read as a miss (recomputed by the engine) or refused; what is
served is exactly what was written — never other KV, another decision, another chunk's text — and nothing
raises. Profiles: tests/fuzzing.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cacheblend_rag.store import ChunkKV, DiskStore, KVKey, LayerReadError

from fuzzing import fuzz


@st.composite
def chunk_kv(draw) -> ChunkKV:
    tokens, layers = draw(st.integers(1, 6)), draw(st.integers(1, 3))
    heads, dim = draw(st.integers(1, 2)), draw(st.sampled_from([4, 8]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    return ChunkKV(tuple(torch.randn(tokens, heads, dim, generator=g) for _ in range(layers)),
                   tuple(torch.randn(tokens, heads, dim, generator=g) for _ in range(layers)),
                   torch.randint(0, 50_000, (tokens,), generator=g), positions_start=draw(st.integers(0, 3)))


@st.composite
def damage(draw, raw: bytes, other: bytes) -> bytes:
    """`raw` damaged: bits flipped in its header or its tensors, truncated, extended, a run zeroed, or replaced
    by `other` (another key's valid file)."""
    (header_len,) = struct.unpack("<Q", raw[:8])
    kind = draw(st.sampled_from(["field", "field", "header", "header", "data", "truncate", "extend", "zero", "other",
                                 "length"]))
    if kind == "field":  # one bit of one header value (a digit stays a digit: '0' ^ 1 is '1')
        values = [m.start(1) for m in re.finditer(rb'":"([^"]+)"', raw[8:8 + header_len])]
        i = 8 + draw(st.sampled_from(values))
        return raw[:i] + bytes([raw[i] ^ (1 << draw(st.integers(0, 2)))]) + raw[i + 1:]
    if kind in ("header", "data"):
        lo, hi = (8, 8 + header_len) if kind == "header" else (8 + header_len, len(raw))
        out = bytearray(raw)
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(lo, hi - 1))
            out[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(out)
    if kind == "truncate":
        return raw[:draw(st.integers(0, len(raw) - 1))]
    if kind == "extend":
        return raw + draw(st.binary(min_size=1, max_size=64))
    if kind == "zero":
        start = draw(st.integers(0, len(raw) - 1))
        return raw[:start] + bytes(draw(st.integers(1, 64))) + raw[start + 64:]
    if kind == "length":  # the header length itself
        return struct.pack("<Q", draw(st.integers(0, 2**64 - 1))) + raw[8:]
    return other


def _equal(a: ChunkKV, b: ChunkKV) -> bool:
    return (a.positions_start == b.positions_start and torch.equal(a.token_ids, b.token_ids)
            and len(a.keys) == len(b.keys)
            and all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values)))


def assert_served_exactly_or_not_at_all(store, key: KVKey, expected: ChunkKV) -> None:
    """Whatever `store` serves for `key` (whole, token ids, layer by layer) is `expected`, or a miss / a layer read
    error (the caller recomputes the chunk)."""
    got = store.get(key)
    assert got is None or _equal(got, expected), "a damaged entry was served as other KV"
    ids = store.token_ids(key)
    assert ids is None or torch.equal(ids, expected.token_ids)
    reader = store.reader(key)
    if reader is not None:
        assert reader.positions_start == expected.positions_start and torch.equal(reader.token_ids,
                                                                                  expected.token_ids)
        for layer in range(reader.num_layers):
            try:
                k, v = reader.layer(layer)
            except LayerReadError:
                break  # detected while reading: the caller recomputes the chunk
            assert torch.equal(k, expected.keys[layer]) and torch.equal(v, expected.values[layer])
        reader.close()


KEY = KVKey("model-a", "0123456789abcdef0123456789abcdef")
OTHER = KVKey("model-a", "fedcba9876543210fedcba9876543210")


@fuzz(quick_examples=150, surface="stored entries")
@given(codec=st.sampled_from(["fp16", "int8", "cachegen"]), kv=chunk_kv(), other_kv=chunk_kv(), data=st.data())
def test_fuzzed_disk_entries_are_served_exactly_or_not_at_all(tmp_path_factory, codec, kv, other_kv, data):
    root = tmp_path_factory.mktemp("kv")
    writer = DiskStore(root, codec=codec)
    writer.put(KEY, kv)
    writer.put(OTHER, other_kv)
    expected = DiskStore(root).get(KEY)  # what this entry reads back as (its codec's rounding included)
    assert expected is not None
    path, other_path = writer.path_for(KEY), writer.path_for(OTHER)
    path.write_bytes(data.draw(damage(path.read_bytes(), other_path.read_bytes())))

    store = DiskStore(root, codec=codec)  # a process started after the damage
    assert_served_exactly_or_not_at_all(store, KEY, expected)
    # the store goes on: the entry is written again and read back exactly
    store.put(KEY, kv)
    assert _equal(store.get(KEY), expected)
    assert _equal(store.get(OTHER), DiskStore(root).get(OTHER))


# ---- the fidelity gate's decisions ------------------------------------------------------------------------------

JSON_VALUE = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=3), max_leaves=6)


@st.composite
def damaged_json(draw, text: str) -> bytes:
    """A JSON file damaged as bytes (bits flipped, truncated) or as JSON (a field's value swapped for any value,
    a field removed or added)."""
    kind = draw(st.sampled_from(["flip", "flip", "truncate", "swap", "swap", "remove", "add"]))
    raw = text.encode()
    if kind == "flip":
        out = bytearray(raw)
        for _ in range(draw(st.integers(1, 3))):
            out[draw(st.integers(0, len(out) - 1))] ^= 1 << draw(st.integers(0, 7))
        return bytes(out)
    if kind == "truncate":
        return raw[:draw(st.integers(0, len(raw) - 1))]
    data = json.loads(text)
    name = draw(st.sampled_from(sorted(data)))
    if kind == "swap":
        data[name] = draw(JSON_VALUE)
    elif kind == "remove":
        del data[name]
    else:
        data[draw(st.text(max_size=6))] = draw(JSON_VALUE)
    return json.dumps(data).encode()


def _decision(fingerprint: str, method: str, ratio: float):
    from cacheblend_rag import gate

    return gate.GateDecision(model="tiny", fingerprint=fingerprint, method=method, ratio=ratio, met=ratio < 1,
                             target_kl=0.05, min_agreement=0.9, expected_kl=0.01, agreement=1.0,
                             table=({"ratio": ratio, "mean_kl": 0.01, "max_kl": 0.02, "agreement": 1.0},),
                             num_questions=8, mean_tokens=100.0, created=1.0)


@fuzz(quick_examples=200, surface="stored entries")
@given(ratio=st.sampled_from([0.15, 0.2, 0.3, 1.0]), data=st.data())
def test_fuzzed_gate_decisions_are_read_exactly_or_skipped(tmp_path_factory, monkeypatch, ratio, data):
    from cacheblend_rag import gate, settings

    monkeypatch.setenv(settings.ENV_GATES, str(tmp_path_factory.mktemp("gates")))
    decision = _decision("f" * 32, "relevance", ratio)
    path = gate.store(decision)
    assert gate.find("f" * 32, "tiny") == decision
    path.write_bytes(data.draw(damaged_json(path.read_text())))
    found = gate.find("f" * 32, "tiny")
    assert found is None or found == decision, "a damaged decision was read as another one"


# ---- the chunk index ------------------------------------------------------------------------------------------

PASSAGES = ["Lyon sits where the Rhone meets the Saone, two rivers of eastern France.",
            "Granite forms from slowly cooled magma deep underground and is rich in quartz.",
            "A honeybee colony has one queen, a few hundred drones and many workers."]


@pytest.fixture(scope="module")
def tiny(tokenizer):
    from conftest import tiny_model

    return tiny_model("llama", len(tokenizer), num_hidden_layers=2), tokenizer


@pytest.fixture(scope="module")
def ingested_folder(tiny, tmp_path_factory) -> tuple[list[str], Path]:
    """The PASSAGES ingested once into a KV folder (entries and chunk index), copied by each example."""
    from cacheblend_rag import CacheBlendEngine

    root = tmp_path_factory.mktemp("ingested")
    engine = CacheBlendEngine(*tiny, root)
    ids = engine.ingest(PASSAGES, show_progress=False)
    engine.index._reader.close()  # the WAL checkpointed into the file: a copy is the whole index
    return ids, root


@st.composite
def index_damage(draw):
    """A change to the chunk index's SQLite file: its bytes damaged, or rows rewritten by something else (a text
    edited, an id swapped, a row of an unknown id, rows removed)."""
    kind = draw(st.sampled_from(["flip", "truncate", "zero", "text", "swap", "unknown", "delete", "garbage"]))
    return kind, draw(st.integers(0, 2**31)), draw(st.text(min_size=16, max_size=80))


def _damage_index(path: Path, kind: str, seed: int, text: str) -> None:
    import random
    import sqlite3

    rng = random.Random(seed)
    if kind in ("flip", "truncate", "zero", "garbage"):
        for side in path.parent.glob(path.name + "-*"):  # the WAL's pages first: they are the file's too
            side.unlink()
        raw = bytearray(path.read_bytes())
        if kind == "flip":
            for _ in range(rng.randint(1, 8)):
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        elif kind == "truncate":
            raw = raw[:rng.randrange(len(raw))]
        elif kind == "zero":
            start = rng.randrange(len(raw))
            raw[start:start + 512] = bytes(len(raw[start:start + 512]))
        else:
            raw = bytearray(rng.randbytes(len(raw)))
        path.write_bytes(bytes(raw))
        return
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT chunk_id, text FROM chunks ORDER BY rowid").fetchall()
        (a, a_text), (b, b_text) = rng.sample(rows, 2)
        if kind == "text":  # a's text edited in place: a prompt holding it must not get a's KV, nor b's
            db.execute("UPDATE chunks SET text = ?, head = ? WHERE chunk_id = ?", (b_text, b_text[:48], a))
        elif kind == "swap":
            db.execute("UPDATE chunks SET chunk_id = 'x' WHERE chunk_id = ?", (a,))
            db.execute("UPDATE chunks SET chunk_id = ? WHERE chunk_id = ?", (a, b))
            db.execute("UPDATE chunks SET chunk_id = ? WHERE chunk_id = 'x'", (b,))
        elif kind == "unknown":
            db.execute("INSERT INTO chunks VALUES (?, ?, ?)", ("0" * 32, text, text[:48]))
        else:
            db.execute("DELETE FROM chunks WHERE chunk_id = ?", (a,))


@pytest.mark.model
@fuzz(quick_examples=40, surface="stored entries")
@given(damage=index_damage())
def test_fuzzed_chunk_index_never_maps_a_text_to_another_chunk(tiny, ingested_folder, tmp_path_factory, damage):
    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.engine import CHUNK_INDEX_FILE

    model, tokenizer = tiny
    ids, ingested = ingested_folder
    root = tmp_path_factory.mktemp("kv")
    shutil.copytree(ingested, root, dirs_exist_ok=True)
    tokens = {cid: tokenizer(text, add_special_tokens=False)["input_ids"] for cid, text in zip(ids, PASSAGES)}
    _damage_index(root / CHUNK_INDEX_FILE, *damage)

    engine = CacheBlendEngine(model, tokenizer, root)  # a process started after the damage
    for cid in ids:  # a chunk id still stands for its own tokens, or for nothing
        chunk = refused(lambda: engine.resolve_chunk(cid))
        assert chunk is None or (chunk.chunk_id == cid and chunk.token_ids.tolist() == tokens[cid]), cid
    prompt = f"Notes: {PASSAGES[0]}\n{PASSAGES[1]}\nWhich rivers meet in Lyon?"
    prefill = engine.prefill_prompt(prompt, max_new_tokens=1)
    assert set(prefill.chunk_ids) <= set(ids[:2]), prefill.chunk_ids  # only chunks the prompt holds


def refused(call):
    from cacheblend_rag.errors import ChunkError

    try:
        return call()
    except ChunkError:
        return None


# ---- stored prefixes, end to end --------------------------------------------------------------------------------

TURN_1 = [{"role": "user", "content": "Which rivers meet in Lyon, the city of eastern France?"}]


def _turn_2(answer: str) -> list[dict]:
    return TURN_1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And which is longer?"}]


@pytest.fixture(scope="module")
def stored_prefix(tiny, tmp_path_factory) -> tuple[Path, list[dict], str, str]:
    """(a KV folder holding turn 1's stored prefix, turn 2's chat, turn 2's answer over that prefix, and over
    none): a damaged prefix must give one of the two answers."""
    from cacheblend_rag import CacheBlendEngine

    root = tmp_path_factory.mktemp("prefixes")
    engine = CacheBlendEngine(*tiny, root / "kv", prefix_store=root / "kv" / "prefixes")
    engine.ingest(PASSAGES[2:], show_progress=False)  # a chunk entry: a valid file of another key
    turn_2 = _turn_2(engine.generate_prompt(TURN_1, max_new_tokens=4).text)
    assert list((root / "kv" / "prefixes").rglob("*.safetensors")), "turn 1 stored no prefix"
    copy = tmp_path_factory.mktemp("prefixes-copy")
    shutil.copytree(root, copy, dirs_exist_ok=True)  # turn 2 stores a prefix of its own: answer from a copy
    over_prefix = CacheBlendEngine(*tiny, copy / "kv", prefix_store=copy / "kv" / "prefixes")
    with_prefix = over_prefix.generate_prompt(turn_2, max_new_tokens=4)
    assert with_prefix.stats["num_prefix_rows"] > 0, with_prefix.stats
    without = CacheBlendEngine(*tiny, prefix_reuse=False).generate_prompt(turn_2, max_new_tokens=4)
    return root, turn_2, with_prefix.text, without.text


@pytest.mark.model
@fuzz(quick_examples=40, surface="stored entries")
@given(data=st.data())
def test_fuzzed_stored_prefixes_give_the_answer_over_the_prefix_or_over_none(tiny, stored_prefix, tmp_path_factory,
                                                                              data):
    from cacheblend_rag import CacheBlendEngine

    root, turn_2, with_prefix, without = stored_prefix
    folder = tmp_path_factory.mktemp("damaged")
    shutil.copytree(root, folder, dirs_exist_ok=True)
    files = sorted((folder / "kv" / "prefixes").rglob("*.safetensors"))
    path = files[data.draw(st.integers(0, len(files) - 1))]
    other = sorted(p for p in (folder / "kv").glob("*/*/*.safetensors") if "prefixes" not in p.parts)[0]
    path.write_bytes(data.draw(damage(path.read_bytes(), other.read_bytes())))
    engine = CacheBlendEngine(*tiny, folder / "kv", prefix_store=folder / "kv" / "prefixes")
    answer = engine.generate_prompt(turn_2, max_new_tokens=4).text
    assert answer in (with_prefix, without), (answer, with_prefix, without)


# ---- Cache-Craft's variants ------------------------------------------------------------------------------------

# found here: a kv_id that is not a chunk id, a number that is not finite (1e309 in num_tokens), a CCI of 0
VARIANT_COLUMNS = ["kv_id", "context", "lead_digest", "num_tokens", "inter", "intra", "cci", "ranking", "nbytes", "f_r",
                   "crc"]
VARIANT_VALUE = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(-1e9, 1e9)
                             | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                             | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)


@pytest.fixture(scope="module")
def deeper(tokenizer):
    """Cache-Craft's checks need a few layers: the default tiny Llama's four."""
    from conftest import tiny_model

    return tiny_model("llama", len(tokenizer)), tokenizer


@pytest.fixture(scope="module")
def variant_folder(deeper, tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """(a KV folder where a Cache-Craft request stored its chunks' variants, full prefill's logits)."""
    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.fuse.policies import CacheCraft

    root = tmp_path_factory.mktemp("variants")
    engine = CacheBlendEngine(*deeper, root)
    engine.prefill(PASSAGES, "Which rivers meet in Lyon?", "cachecraft")
    assert engine.prefill(PASSAGES, "Which rivers meet in Lyon?", "cachecraft").stats["cachecraft"]["variant_hits"]
    full = engine.prefill(PASSAGES, "Which rivers meet in Lyon?", "full_prefill").logits
    # closed now, not whenever the engine is collected: a later close checkpoints the WAL into the file, whose
    # size the examples draw offsets from (Hypothesis saw its data generation change between runs)
    engine.cache.policy_state(CacheCraft).close()
    return root, full


@pytest.mark.model
@fuzz(quick_examples=15, surface="stored entries")
@given(kind=st.sampled_from(["row", "row", "kv", "file"]), column=st.sampled_from(VARIANT_COLUMNS),
       value=VARIANT_VALUE | st.sampled_from(["[]", "{}", "{not json", "0" * 32, "-1", float("inf"), 1e309,
                                              "not a chunk id"]), data=st.data())
def test_fuzzed_variants_are_used_exactly_or_not_at_all(deeper, variant_folder, tmp_path_factory, kind, column,
                                                       value, data):
    import sqlite3

    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.fuse.policies import CacheCraft

    ingested, full = variant_folder
    root = tmp_path_factory.mktemp("damaged-variants")
    shutil.copytree(ingested, root, dirs_exist_ok=True)
    engine = CacheBlendEngine(*deeper, root)  # a process started after the damage
    path = engine.cache.policy_state(CacheCraft).path
    with sqlite3.connect(path) as db:
        kv_ids = [row[0] for row in db.execute("SELECT kv_id FROM variants ORDER BY rowid")]
    if kind == "row":
        stored = value if isinstance(value, (str, int, float)) and not isinstance(value, bool) else json.dumps(value)
        row = data.draw(st.sampled_from(kv_ids))
        with sqlite3.connect(path) as db:
            db.execute(f"UPDATE OR IGNORE variants SET {column} = ? WHERE kv_id = ?", (stored, row))
    elif kind == "kv":
        files = sorted(p for p in root.glob("*/*/*.safetensors") if p.stem in kv_ids)
        target = files[data.draw(st.integers(0, len(files) - 1))]
        target.write_bytes(data.draw(damage(target.read_bytes(), files[0].read_bytes())))
    else:
        raw = bytearray(path.read_bytes())
        for _ in range(data.draw(st.integers(1, 8))):
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
        path.write_bytes(bytes(raw))
    for order in (PASSAGES, PASSAGES[::-1]):
        pre = engine.prefill(order, "Which rivers meet in Lyon?", "cachecraft")
        assert torch.isfinite(pre.logits).all()
    chunks = engine.prefill(PASSAGES, "Which rivers meet in Lyon?", "cachecraft").stats["cachecraft"]["chunks"]
    if all(c["cfo"] == 0.0 and c["budget"] == 0 for c in chunks):  # reused as exact: it must be exact
        again = engine.prefill(PASSAGES, "Which rivers meet in Lyon?", "cachecraft")
        assert torch.allclose(again.logits, full, atol=1e-3), "a damaged variant was reused as exact"


# ---- what the fuzzer found (#53), kept as examples -------------------------------------------------------------


def _kv(tokens: int = 5, positions_start: int = 0) -> ChunkKV:
    g = torch.Generator().manual_seed(1)
    return ChunkKV((torch.randn(tokens, 2, 8, generator=g),), (torch.randn(tokens, 2, 8, generator=g),),
                   torch.arange(tokens), positions_start=positions_start)


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_a_bit_flipped_header_field_is_a_miss_not_other_kv(tmp_path, codec):
    # no checksum covered the header: positions_start '0' (0x30) flipped to '1' (0x31) was served, the KV then
    # placed one position off; every field a read trusts is covered now
    store = DiskStore(tmp_path, codec=codec)
    store.put(KEY, _kv())
    path = store.path_for(KEY)
    raw = path.read_bytes()
    at = raw.index(b'"positions_start":"0"') + len(b'"positions_start":"')
    path.write_bytes(raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1:])
    fresh = DiskStore(tmp_path, codec=codec)
    assert fresh.get(KEY) is None and fresh.reader(KEY) is None and fresh.stats()["corrupt"] == 1


def test_kv_read_from_a_file_truncated_in_place_afterwards_does_not_kill_the_process(tmp_path):
    # the tensors a read returned stayed on the file's memory map: the file truncated in place (a tool, a bad
    # copy), their next use killed the process with SIGBUS. Run apart, so that the old behaviour fails this test
    # instead of ending the test run
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from cacheblend_rag.store import ChunkKV, DiskStore, KVKey\n"
        "store, key = DiskStore(sys.argv[1]), KVKey('m', '0123456789abcdef0123456789abcdef')\n"
        "store.put(key, ChunkKV((torch.randn(4000, 2, 64),), (torch.randn(4000, 2, 64),), torch.arange(4000)))\n"
        "kv = store.get(key)\n"
        "open(store.path_for(key), 'r+b').truncate(16)\n"
        "print(float(kv.keys[0].float().sum() + kv.values[0].float().sum()))\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


def test_a_file_truncated_while_its_reader_is_open_is_a_layer_read_error_not_sigbus(tmp_path):
    # a reader opened the file, then the file was truncated in place before a layer was read: copying the layer
    # out of the file's memory map touched pages past its new end (SIGBUS, the process killed). Reads are
    # preads now: a short read, the layer refused and the file quarantined. Run apart, as above
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from cacheblend_rag.store import ChunkKV, DiskStore, KVKey, LayerReadError\n"
        "store, key = DiskStore(sys.argv[1]), KVKey('m', '0123456789abcdef0123456789abcdef')\n"
        "kv = ChunkKV((torch.randn(4000, 2, 64),) * 2, (torch.randn(4000, 2, 64),) * 2, torch.arange(4000))\n"
        "store.put(key, kv)\n"
        "reader = store.reader(key)\n"
        "assert torch.equal(reader.layer(0)[0], kv.keys[0].half())\n"
        "open(store.path_for(key), 'r+b').truncate(store.entry_nbytes(key) // 2)\n"
        "try:\n"
        "    reader.layer(1)\n"
        "except LayerReadError as e:\n"
        "    print('refused', e)\n"
        "reader.close()\n"
        "assert store.get(key) is None and not store.path_for(key).exists(), store.stats()\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("refused"), done.stdout


def test_a_damaged_or_foreign_gate_decision_is_skipped(tmp_path, monkeypatch):
    from cacheblend_rag import gate, settings

    monkeypatch.setenv(settings.ENV_GATES, str(tmp_path))
    # the ratio's '2' (0x32) flipped to '3' was read as this model's decision (0.3), as was a string for `met`
    path = gate.store(_decision("f" * 32, "relevance", 0.2))
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'"ratio": 0.2,', b'"ratio": 0.3,', 1))
    assert gate.find("f" * 32, "tiny") is None
    data = json.loads(raw)
    del data["checksum"]  # a decision written before checksums: its fields' types are still checked
    path.write_text(json.dumps({**data, "met": "yes"}))
    assert gate.find("f" * 32, "tiny") is None
    path.write_text(json.dumps(data))
    assert gate.find("f" * 32, "tiny") == _decision("f" * 32, "relevance", 0.2)
    # another model's decision copied to this model's file name: not this model's
    other = gate.store(_decision("e" * 32, "relevance", 0.5))
    os.replace(other, path)
    assert gate.find("f" * 32, "tiny") is None


@pytest.mark.model
def test_a_chunk_index_row_that_is_not_what_was_written_is_skipped(tiny, ingested_folder, tmp_path):
    import sqlite3

    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.engine import CHUNK_INDEX_FILE

    # SQLite keeps no checksum of a page: a flipped bit in a text ('colony' read as 'coLony') made the chunk id
    # of that passage resolve to the damaged text, a chunk of another id and other tokens
    ids, ingested = ingested_folder
    shutil.copytree(ingested, tmp_path, dirs_exist_ok=True)
    with sqlite3.connect(tmp_path / CHUNK_INDEX_FILE) as db:
        db.execute("UPDATE chunks SET text = replace(text, 'colony', 'coLony') WHERE chunk_id = ?", (ids[2],))
    engine = CacheBlendEngine(*tiny, tmp_path)
    assert engine.index.text(ids[2]) is None and engine.index.text(ids[0]) == PASSAGES[0]
    chunk = engine.resolve_chunk(ids[2])  # from its stored KV's own tokens instead
    assert chunk.chunk_id == ids[2] and chunk.token_ids.tolist() == \
        tiny[1](PASSAGES[2], add_special_tokens=False)["input_ids"]


def test_a_variant_row_changed_to_a_value_of_its_own_type_is_skipped(deeper, variant_folder, tmp_path):
    import sqlite3

    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.fuse.policies import CacheCraft
    from cacheblend_rag.fuse.policies.cachecraft.variants import VARIANTS_FILE, Variant

    # a CCI rewritten as 0 (text '000...0', which SQLite stores as the number 0) passed every type and range
    # check: the variant was reused with no recomputation, logits far from the full prefill's. Rows carry a crc32
    ingested, full = variant_folder
    shutil.copytree(ingested, tmp_path, dirs_exist_ok=True)
    path, = tmp_path.rglob(VARIANTS_FILE)
    with sqlite3.connect(path) as db:
        (chunk_id, kv_id), *_ = db.execute("SELECT chunk_id, kv_id FROM variants ORDER BY rowid").fetchall()
        db.execute("UPDATE variants SET cci = ? WHERE kv_id = ?", ("0" * 32, kv_id))
    engine = CacheBlendEngine(*deeper, tmp_path)
    variants = engine.cache.policy_state(CacheCraft)
    assert kv_id not in {v.kv_id for v in variants.lookup(engine.namespace, chunk_id)}
    # a database written before rows had a checksum: the column is added, its rows are skipped, new ones kept
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE variants DROP COLUMN crc")
    fresh = CacheBlendEngine(*deeper, tmp_path)
    store = fresh.cache.policy_state(CacheCraft)
    assert not any(store.lookup(fresh.namespace, c) for c, in sqlite3.connect(path).execute(
        "SELECT chunk_id FROM variants"))
    assert torch.isfinite(fresh.prefill(PASSAGES, "Which rivers meet in Lyon?", "cachecraft").logits).all()
    kv = fresh.kv_store.get(KVKey(fresh.namespace, kv_id))
    written = Variant(chunk_id, kv_id, ("a" * 32,), "b" * 32, kv.num_tokens, {"a" * 32: 0.5}, 0.25, 0.75, [0], 0)
    assert store.add(fresh.namespace, written, kv)
    (back,) = store.lookup(fresh.namespace, chunk_id)
    assert (back.context, back.cci, back.inter, back.ranking) == (("a" * 32,), 0.75, {"a" * 32: 0.5}, [0])
