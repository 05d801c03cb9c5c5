"""Codecs in the stored format, on real files: engines over coded disk stores, sizes, corrupt and unknown codecs,
old version-1 files, mixed codecs in one store, and the bytes a request reads."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from cacheblend_rag import CacheBlendEngine, ConfigError
from cacheblend_rag.store import ChunkKV, DiskStore, KVKey, token_ids_digest
from cacheblend_rag.store.codecs import CODECS, get_codec
from cacheblend_rag.store.disk import HEADER_CRC, header_crc

from conftest import tiny_model

TEXTS = [
    "Lyon sits where the Rhône meets the Saône, two rivers of eastern France.",
    "Granite forms from slowly cooled magma deep underground and is rich in quartz.",
    "The violin has four strings tuned in perfect fifths: G, D, A and E.",
]
QUESTION = "Which rivers meet in Lyon?"
CODED = ("int8", "cachegen")
KEY = KVKey("model-a", "abcdef01")


def make_kv(tokens: int = 37, layers: int = 4, heads: int = 2, dim: int = 16, seed: int = 0) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(tuple(torch.randn(tokens, heads, dim, generator=g) for _ in range(layers)),
                   tuple(torch.randn(tokens, heads, dim, generator=g) for _ in range(layers)),
                   torch.arange(tokens), positions_start=3)


def _engine(tokenizer, path, codec="fp16"):
    return CacheBlendEngine(tiny_model("qwen2", len(tokenizer)), tokenizer, kv_store=path, kv_codec=codec)


def _meta(path: Path) -> dict:
    with safe_open(path, framework="pt") as f:
        return dict(f.metadata())


def _stored_layer_bytes(path: Path) -> int:
    """Bytes of every tensor in the file except the token ids (what reading all layers costs)."""
    with safe_open(path, framework="pt") as f:
        return sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in f.keys() if n != "token_ids")


def _rewrite(path: Path, meta_edit=None, tensor_edit=None) -> None:
    """Rewrite a stored file with its header and/or tensors edited (a well-formed file, like a foreign writer's)."""
    with safe_open(path, framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {n: f.get_tensor(n).clone() for n in f.keys()}
    if meta_edit:
        meta_edit(meta)
    if tensor_edit:
        tensor_edit(tensors, meta)
    if HEADER_CRC in meta:  # a well-formed file: its header checksum matches the edited header
        meta[HEADER_CRC] = header_crc(meta)
    path.write_bytes(st_save(tensors, meta))


def _tensor_span(path: Path, name: str) -> tuple[int, int]:
    """Byte range of a tensor's data in a safetensors file."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    start, end = json.loads(data[8:8 + n])[name]["data_offsets"]
    return 8 + n + start, 8 + n + end


# ---- the engine over coded stores ----------------------------------------------------------


@pytest.mark.parametrize("codec", ["fp16", *CODED])
def test_engine_over_a_coded_disk_store_hits_and_counts_stored_bytes(tokenizer, tmp_path, codec):
    ids = _engine(tokenizer, tmp_path, codec).ingest(TEXTS, show_progress=False)
    disk = DiskStore(tmp_path)
    paths = [disk.path_for(KVKey(_engine(tokenizer, tmp_path).namespace, cid)) for cid in ids]
    metas = [_meta(p) for p in paths]
    if codec == "fp16":  # today's layout, unchanged: version 1, no codec fields
        assert all(m["format_version"] == "1" and "codec" not in m for m in metas)
    else:
        assert all(m["format_version"] == "2" and m["codec"] == codec for m in metas)
        assert all(json.loads(m["codec_params"]) == get_codec(codec).params() for m in metas)
    fresh = _engine(tokenizer, tmp_path)  # empty memory tier: every chunk is read (and decoded) from disk
    pre = fresh.prefill(ids, QUESTION, method="full_reuse")
    assert pre.stats["chunk_hits"] == ids and pre.stats["chunk_misses"] == []
    assert torch.isfinite(pre.logits).all()
    # every layer of every stored entry (the chunks and the prompt's cached segments) was read: exactly the bytes
    # the files store for them (compressed for coded ones)
    files = list(tmp_path.glob("*/*/*.safetensors"))
    assert len(files) > len(ids) and set(paths) <= set(files)
    assert pre.stats["kv_bytes_loaded"] == sum(_stored_layer_bytes(p) for p in files)
    blended = _engine(tokenizer, tmp_path).prefill(ids, QUESTION, method="cacheblend", recompute_ratio=0.15)
    assert blended.stats["chunk_hits"] == ids and torch.isfinite(blended.logits).all()


def test_coded_kv_read_back_by_the_engine_is_close_to_the_exact_kv(tokenizer, tmp_path):
    ids = _engine(tokenizer, tmp_path / "fp16").ingest(TEXTS, show_progress=False)
    _engine(tokenizer, tmp_path / "int8", "int8").ingest(TEXTS, show_progress=False)
    exact = _engine(tokenizer, tmp_path / "fp16").prefill(ids, QUESTION, method="full_reuse").logits
    coded = _engine(tokenizer, tmp_path / "int8").prefill(ids, QUESTION, method="full_reuse").logits
    assert not torch.equal(exact, coded)  # really read through the codec...
    assert torch.allclose(exact.softmax(-1), coded.softmax(-1), atol=2e-2)  # ...and still the same distribution


def test_fp16_engine_store_keeps_the_exactness_invariant(tokenizer, tmp_path):
    engine = _engine(tokenizer, tmp_path)
    ids = engine.ingest(TEXTS, show_progress=False)
    full = engine.prefill(ids, QUESTION, method="full_prefill").logits
    fresh = _engine(tokenizer, tmp_path)
    assert torch.allclose(fresh.prefill(ids, QUESTION, recompute_ratio=1.0).logits, full, atol=1e-4)


def test_kv_codec_is_validated_with_the_codec_names(tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="cachegen.*fp16.*int8") as e:
        _engine(tokenizer, tmp_path, "zstd")
    assert "'zstd'" in str(e.value)
    with pytest.raises(ConfigError, match="kv_store=PATH"):
        CacheBlendEngine(tiny_model("qwen2", len(tokenizer)), tokenizer, kv_store=None, kv_codec="int8")
    with pytest.raises(ConfigError, match="choose one of"):
        CacheBlendEngine.from_pretrained("no-such-model", kv_store=tmp_path, kv_codec="int4")  # before any load
    with pytest.raises(ConfigError, match="choose one of"):
        DiskStore(tmp_path, codec="lz4")


def test_cli_ingest_rejects_an_unknown_kv_codec_before_loading_a_model(tmp_path):
    from cacheblend_rag.cli import build_parser, main

    assert build_parser().parse_args(["ingest", "a", "--kv-codec", "int8"]).kv_codec == "int8"
    assert build_parser().parse_args(["ingest", "a"]).kv_codec == "fp16"
    corpus = tmp_path / "a.txt"
    corpus.write_text(TEXTS[0])
    assert main(["ingest", str(corpus), "--home", str(tmp_path / "home"), "--model", "no-such-model",
                 "--kv-codec", "zstd", "--quiet"]) != 0


# ---- sizes on real KV ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_chunk_kv(default_model, passages) -> ChunkKV:
    """The KV of ~600 tokens of real MuSiQue text, computed by the real model."""
    engine = CacheBlendEngine(*default_model)
    text = " ".join(passages[:6])
    (cid,) = engine.ingest([text], show_progress=False)
    kv = engine.kv_store.get(KVKey(engine.namespace, cid))
    assert kv is not None and kv.num_tokens >= 400
    return kv


def test_bytes_on_disk_per_codec_on_real_kv(real_chunk_kv, tmp_path):
    sizes = {}
    for codec in ("fp16", *CODED):
        store = DiskStore(tmp_path / codec, codec=codec)
        store.put(KEY, real_chunk_kv)
        sizes[codec] = store.path_for(KEY).stat().st_size
        assert store.stats()["bytes"] == sizes[codec]  # the budget counts what the file takes
        reader = store.reader(KEY)
        assert reader is not None and reader.num_tokens == real_chunk_kv.num_tokens
        for layer in range(reader.num_layers):
            reader.layer(layer)
        assert reader.bytes_read == _stored_layer_bytes(store.path_for(KEY)) < sizes[codec]
        reader.close()
    assert 1.85 <= sizes["fp16"] / sizes["int8"] <= 2.05
    assert sizes["fp16"] / sizes["cachegen"] >= 4.2  # 4.33x on chunks of 600 tokens, file headers included


def test_a_byte_budget_holds_more_compressed_entries(tmp_path):
    kvs = [make_kv(tokens=64, seed=i) for i in range(4)]
    one_fp16 = len(DiskStore(tmp_path / "probe")._serialize(KEY, kvs[0]))
    for codec, kept in (("fp16", 2), ("int8", 4)):
        store = DiskStore(tmp_path / codec, max_bytes=int(2.5 * one_fp16), codec=codec)
        for i, kv in enumerate(kvs):
            store.put(KVKey("model-a", f"c{i}"), kv)
        assert store.stats()["entries"] == kept and store.stats()["evictions"] == 4 - kept
        on_disk = sum(p.stat().st_size for p in (tmp_path / codec).glob("*/*/*.safetensors"))
        assert store.stats()["bytes"] == on_disk <= store.max_bytes


# ---- damaged, unknown and old files ----------------------------------------------------------


@pytest.mark.parametrize("codec", CODED)
def test_a_corrupt_coded_layer_mid_request_is_a_miss_and_recomputed(tokenizer, tmp_path, codec):
    ids = _engine(tokenizer, tmp_path, codec).ingest(TEXTS, show_progress=False)
    fresh = _engine(tokenizer, tmp_path, codec)
    path = fresh.kv_store.disk.path_for(KVKey(fresh.namespace, ids[1]))
    name = "2.payload" if codec == "cachegen" else "2.k"
    start, end = _tensor_span(path, name)
    data = bytearray(path.read_bytes())
    data[(start + end) // 2] ^= 0x5A  # the header and layers 0-1 are intact: the request starts on this entry
    path.write_bytes(bytes(data))
    pre = fresh.prefill(ids, QUESTION, method="full_reuse")
    assert pre.stats["chunk_misses"] == [ids[1]] and torch.isfinite(pre.logits).all()
    assert fresh.kv_store.disk.stats()["corrupt"] == 1 and any((tmp_path / ".quarantine").iterdir())
    again = _engine(tokenizer, tmp_path, codec).prefill(ids, QUESTION, method="full_reuse")
    assert again.stats["chunk_misses"] == []  # the hole was stored again, with the engine's codec
    assert _meta(path)["codec"] == codec


def test_every_entry_of_a_request_corrupt_at_once_is_still_answered(tokenizer, tmp_path):
    """Each bad entry costs one retry: a request whose stored chunks are all damaged is answered from holes."""
    ids = _engine(tokenizer, tmp_path, "int8").ingest(TEXTS, show_progress=False)
    # disk only: a memory tier in front would read every layer when promoting and find all the damage at once
    fresh = CacheBlendEngine(tiny_model("qwen2", len(tokenizer)), tokenizer, kv_store=[f"disk:{tmp_path}?codec=int8"])
    for layer, cid in enumerate(ids):  # a different layer per chunk: each retry finds one more bad entry
        path = tmp_path / fresh.namespace / cid[:2] / f"{cid}.safetensors"
        start, end = _tensor_span(path, f"{layer}.k")
        data = bytearray(path.read_bytes())
        data[(start + end) // 2] ^= 0x5A
        path.write_bytes(bytes(data))
    pre = fresh.prefill(ids, QUESTION, method="full_reuse")
    assert sorted(pre.stats["chunk_misses"]) == sorted(ids) and torch.isfinite(pre.logits).all()
    assert fresh.kv_store.stats()["corrupt"] == len(ids)


@pytest.mark.parametrize("codec", CODED)
def test_a_payload_the_codec_rejects_is_a_miss_even_with_matching_store_checksums(tmp_path, codec):
    store = DiskStore(tmp_path, codec=codec)
    store.put(KEY, make_kv())
    name = "1.payload" if codec == "cachegen" else "1.k"

    def damage(tensors, meta):
        flat = tensors[name].view(-1).view(torch.uint8)
        flat[len(flat) // 2] ^= 0x5A
        meta[f"crc.{name}"] = str(zlib.crc32(flat.numpy()))

    _rewrite(store.path_for(KEY), tensor_edit=damage)  # the store's crc passes; the codec's own check must not
    reader = store.reader(KEY)
    assert reader is not None
    reader.layer(0)
    with pytest.raises(Exception) as e:
        reader.layer(1)
    assert type(e.value).__name__ == "LayerReadError"
    reader.close()
    assert store.get(KEY) is None and store.stats()["corrupt"] == 1


@pytest.mark.parametrize("edit", [
    {"codec": "zstd"},
    {"codec_version": "99"},
    {"codec_version": "1"},  # cachegen v1 (range coder) entries: a miss since v2's ANS payload
    {"codec_version": "2"},  # cachegen v2 entries (no exact rows): a miss since v3 (issue 30)
    {"codec_params": "{not json"},
    {"codec_params": json.dumps({"key_bits": "1"})},
    {"format_version": "3"},
], ids=["name", "version", "version-1", "version-2", "params-json", "params-invalid", "format"])
def test_an_unknown_codec_in_a_header_is_a_miss_never_a_crash(tmp_path, edit):
    store = DiskStore(tmp_path, codec="cachegen")
    store.put(KEY, make_kv())
    _rewrite(store.path_for(KEY), meta_edit=lambda m: m.update(edit))
    fresh = DiskStore(tmp_path)
    assert not fresh.contains(KEY)  # quarantined on the first look
    assert fresh.get(KEY) is None and fresh.reader(KEY) is None and fresh.stats()["corrupt"] == 1
    fresh.put(KEY, make_kv())  # and the key can be written again
    assert fresh.get(KEY) is not None


def test_an_unknown_codec_in_a_header_is_recomputed_by_the_engine(tokenizer, tmp_path):
    ids = _engine(tokenizer, tmp_path, "int8").ingest(TEXTS, show_progress=False)
    fresh = _engine(tokenizer, tmp_path)
    _rewrite(fresh.kv_store.disk.path_for(KVKey(fresh.namespace, ids[0])),
             meta_edit=lambda m: m.update(codec="int4"))
    pre = fresh.prefill(ids, QUESTION, method="full_reuse")
    assert pre.stats["chunk_misses"] == [ids[0]] and torch.isfinite(pre.logits).all()


def _write_v1(path: Path, key: KVKey, kv: ChunkKV) -> None:
    """A version-1 file exactly as the store wrote them before codecs (fp16 tensors k.<l>/v.<l>, crc per tensor)."""
    tensors = {}
    for i, (k, v) in enumerate(zip(kv.keys, kv.values)):
        tensors[f"k.{i}"], tensors[f"v.{i}"] = k.to(torch.float16).contiguous(), v.to(torch.float16).contiguous()
    tensors["token_ids"] = kv.token_ids.to(torch.int64).contiguous()
    meta = {"format": "cacheblend-kv", "format_version": "1", "namespace": key.namespace, "chunk_id": key.chunk_id,
            "kv_digest": token_ids_digest(key.namespace, tensors["token_ids"]), "num_layers": str(kv.num_layers),
            "num_tokens": str(kv.num_tokens), "num_kv_heads": str(kv.keys[0].shape[1]),
            "head_dim": str(kv.keys[0].shape[2]), "v_head_dim": str(kv.values[0].shape[2]), "dtype": "float16",
            "positions_start": str(kv.positions_start)}
    meta.update({f"crc.{n}": str(zlib.crc32(t.view(torch.uint8).numpy())) for n, t in tensors.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(st_save(tensors, meta))


@pytest.mark.parametrize("codec", ["fp16", *CODED])
def test_an_old_version_1_file_still_reads_bit_exact(tmp_path, codec):
    kv = make_kv()
    store = DiskStore(tmp_path, codec=codec)  # whatever the store writes now, it reads what it wrote before
    _write_v1(store.path_for(KEY), KEY, kv)
    back = store.get(KEY)
    assert back is not None and back.positions_start == 3 and torch.equal(back.token_ids, kv.token_ids)
    for a, b in zip(back.keys + back.values, kv.keys + kv.values):
        assert a.dtype == torch.float16 and torch.equal(a, b.to(torch.float16))
    reader = store.reader(KEY)
    assert reader.layer_nbytes == 37 * 2 * 32 * 2
    assert torch.equal(reader.layer(2)[0], kv.keys[2].to(torch.float16)) and reader.bytes_read == reader.layer_nbytes
    reader.close()


def test_mixed_codecs_in_one_store(tokenizer, tmp_path):
    kvs = {codec: make_kv(seed=i) for i, codec in enumerate(("fp16", *CODED))}
    for codec, kv in kvs.items():
        DiskStore(tmp_path, codec=codec).put(KVKey("model-a", f"chunk_{codec}"), kv)
    reader_store = DiskStore(tmp_path, codec="cachegen")  # reads every file by the codec it names
    for codec, kv in kvs.items():
        back = reader_store.get(KVKey("model-a", f"chunk_{codec}"))
        assert back is not None
        tol = {"fp16": 1e-2, "int8": 5e-2, "cachegen": 1.0}[codec]
        for a, b in zip(back.keys + back.values, kv.keys + kv.values):
            assert (a.float() - b).abs().max() <= tol
    assert reader_store.stats()["corrupt"] == 0
    # and an engine over a store whose chunks were written by engines with different codecs
    for text, codec in zip(TEXTS, ("fp16", *CODED)):
        _engine(tokenizer, tmp_path / "mixed", codec).ingest([text], show_progress=False)
    ids = _engine(tokenizer, tmp_path / "mixed").ingest(TEXTS, show_progress=False)  # all stored: nothing new
    metas = {_meta(p).get("codec", "fp16") for p in (tmp_path / "mixed").glob("*/*/*.safetensors")}
    assert metas == {"fp16", *CODED}
    pre = _engine(tokenizer, tmp_path / "mixed").prefill(ids, QUESTION, method="cacheblend", recompute_ratio=0.15)
    assert pre.stats["chunk_hits"] == ids and torch.isfinite(pre.logits).all()


def test_every_codec_name_is_accepted_by_the_store(tmp_path):
    for codec in CODECS:
        store = DiskStore(tmp_path / codec, codec=codec)
        store.put(KEY, make_kv())
        assert store.get(KEY) is not None and store.contains(KEY)
