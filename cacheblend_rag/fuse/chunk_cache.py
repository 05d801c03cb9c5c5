"""ChunkCache: names, finds and computes the KV of chunks and exact segments, over any KVStore.

A chunk's KV is computed once behind a lead-in (by default the template's system prefix) and stored under a
namespace that fingerprints the model, the tokenizer and that lead-in. Exact segments (prefixes that start at
position 0) are cached by their token ids. Stored KV is handed out as per-layer readers.

Stored prefixes (a finished request's KV, prompt and answer, kept for the next turn of a conversation or the next
step of an agent) are named by a hash chain over fixed-size token blocks from position 0, as vLLM's automatic
prefix caching and SGLang's radix cache name theirs:

    tokens   [ block 1 ][ block 2 ][ block 3 ] ...      (prefix_block tokens each; a partial last block is dropped)
    hash     h1 = H(0, b1)   h2 = H(h1, b2)   h3 = H(h2, b3)
    entry    "pfx-<h_k>": the KV of blocks 1..k, keys before RoPE, like chunk KV

A request's block hashes find the longest stored prefix in O(blocks): first through this process's index (every
h_i of an entry it stored → that entry), else by probing the store for "pfx-<h_i>" from the longest down (entries
another process put in a shared tier). The stored token ids are compared before the KV is used, so a hash
collision or a stale index entry is a miss; so is an evicted or corrupt entry.

A cache salt (a request's `cache_salt`, a server's per-API-key namespace) keeps clients apart, as vLLM's salt does
for its prefix cache: `ChunkCache.salted(salt)` is a view of the same cache whose stored prefixes (the salt seeds
the hash chain), exact segments, chunk KV learned from requests (holes, chunks behind a prompt's own opening,
Cache-Craft variants) and opening counts are all named under the salt, so requests with different salts never
find each other's. Chunk KV behind the lead-in that the operator ingested is content-addressed and shared: a salted
view reads it after its own (a hit says only that the document was ingested), but never writes there.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..errors import KVWriteError
from ..ingest.chunks import Chunk
from ..models.adapter import LlamaFamilyAdapter, RopeTables
from ..store import ChunkKV, KVKey, KVStore, LayerReader, ResidentReader, SlicedReader
from .links import Links
from .loop import run_layers
from .policy import Policy, RowSelection
from .sequence import FusedSequence, Placement

logger = logging.getLogger(__name__)

PREFIX_BLOCK = 16  # tokens per block of a stored prefix (vLLM's default block size)
_MAX_INDEXED_BLOCKS = 1 << 18  # block hashes this process remembers (≈ 40 MB); older ones are found by probing
_MAX_NEIGHBORS = 8192  # chunks whose look-alike neighbour is remembered (as many as the engine's known chunks)
_MAX_OPENINGS = 64  # openings other than the lead-in counted (an app has a few prompt templates; one-offs age out)
# entries this process stored that it remembers as its own (a store evicts without telling this cache, so without
# a bound a long-running server would keep one name per request it ever answered)
_MAX_OWN_PREFIXES = 1 << 16


@dataclass
class _WriteHealth:
    """Whether the store last failed a write, and whether an oversized prefix was reported: one record shared by a
    cache and its salted views, so a failing store is still reported once per process."""

    write_failed: bool = False
    warned_prefix_size: bool = False


def _ids_bytes(token_ids: Sequence[int]) -> bytes:
    return torch.tensor(list(token_ids), dtype=torch.int64).numpy().tobytes()


def _inverse_rope(tables: RopeTables) -> RopeTables:
    """fp32 tables that undo a rotation by `tables` exactly as rounded: R⁻¹ = Rᵀ / (cos² + sin²), since bf16's
    cos and sin are not on the unit circle (plain Rᵀ would scale keys by up to ~0.8 %)."""
    out = {}
    for kind, (cos, sin) in tables.tables.items():
        c, s = cos.float(), sin.float()
        norm = c * c + s * s
        out[kind] = (c / norm, -s / norm)
    return RopeTables(out, tables.kinds)


def part_of(reader: LayerReader | None, chunk: Chunk) -> LayerReader | None:
    """The rows of `reader` that `chunk` places (all of them, or a part's), or None (closing the reader) when the
    stored tokens are not the chunk's."""
    if reader is None:
        return None
    if not torch.equal(reader.token_ids.cpu(), chunk.whole.token_ids.cpu()):
        reader.close()
        return None
    if not chunk.is_part:
        return reader
    return SlicedReader(reader, chunk.kv_start, chunk.kv_start + chunk.num_tokens)


class ChunkCache:
    """The KV of chunks and exact segments for one model, tokenizer and lead-in, kept in `store`."""

    def __init__(self, adapter: LlamaFamilyAdapter, store: KVStore, fingerprint: str, lead_in_ids: Sequence[int],
                 prefetch_depth: int = 0, prefix_block: int = PREFIX_BLOCK,
                 prefix_store: KVStore | None = None) -> None:
        self.adapter = adapter
        self.store = store
        # method name → the per-chunk state that method keeps over `store` (`Policy.chunk_state`: Cache-Craft's
        # variants), made on first use and shared by the salted views
        self._policy_states: dict[str, object | None] = {}
        self._policy_states_lock = threading.Lock()
        self.fingerprint = fingerprint
        self.salt = ""  # "" unsalted (shared); a salted view's own salt (`salted`)
        self.lead_in_ids = list(lead_in_ids)
        self.namespace = self.namespace_for(self.lead_in_ids)
        self.prefetch_depth = prefetch_depth
        self._health = _WriteHealth()  # a failing store is reported once, then serving goes on without it
        self.prefix_block = prefix_block  # tokens per block of stored prefixes; 0: no prefix is stored or looked up
        self.prefix_store = store if prefix_store is None else prefix_store  # where stored prefixes live
        self._prefix_index: OrderedDict[str, str] = OrderedDict()  # block hash → name of an entry holding it
        self._prefix_entries: OrderedDict[str, int] = OrderedDict()  # entries this process stored → their blocks
        # Openings of prompts other than the lead-in (a plain string to a chat model, a chat with its own system
        # message), counted by (salt, opening): one seen again gets its chunks' KV (or its first chunk's) computed
        # behind it. Counted per salt: another client's opening must not change what this one's request stores
        self._openings: OrderedDict[tuple[str, tuple[int, ...]], int] = OrderedDict()
        # chunk id → the tokens its KV is computed behind after the lead-in or an opening (`ingest(behind=...)`)
        self._neighbors: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def salted(self, salt: str | None) -> "ChunkCache":
        """This cache as requests with `salt` see it: the same stores and indexes, every entry a request stores or
        reads of its own named under the salt (the module's docstring); itself for no salt."""
        if not salt:
            return self
        view = copy.copy(self)  # shallow: the stores, indexes, counters and write health stay shared
        view.salt = salt
        view.namespace = view.namespace_for(view.lead_in_ids)
        return view

    def policy_state(self, policy: Policy | type[Policy]) -> object | None:
        """The per-chunk state `policy`'s method keeps beside this cache's store (`Policy.chunk_state`), made the
        first time it is asked for: one per method name, shared by the salted views (the state names its entries by
        the namespace it is given). None for a method that keeps none."""
        cls = policy if isinstance(policy, type) else type(policy)
        with self._policy_states_lock:
            if cls.name not in self._policy_states:
                self._policy_states[cls.name] = cls.chunk_state(self.store)
            return self._policy_states[cls.name]

    def namespace_for(self, lead_in_ids: Sequence[int], salt: str | None = None) -> str:
        """Fingerprint of model, tokenizer, lead-in and salt (default: this cache's): every KV it names was
        computed under all three, for requests with that salt."""
        salt = self.salt if salt is None else salt
        h = hashlib.sha256(self.fingerprint.encode())
        h.update(_ids_bytes(lead_in_ids))
        if salt:  # unsalted names stay as they were: what is stored already is still found
            h.update(b"\0salt\0" + salt.encode())
        return h.hexdigest()[:24]

    def key(self, chunk_id: str, lead_in_ids: Sequence[int] | None = None) -> KVKey:
        """The store key of a chunk's KV behind a lead-in (default: this cache's), under this cache's salt."""
        ns = self.namespace if lead_in_ids is None else self.namespace_for(lead_in_ids)
        return KVKey(ns, chunk_id)

    # ---- lookups ------------------------------------------------------------------------

    def reader(self, chunk: Chunk, lead_in_ids: Sequence[int] | None = None) -> LayerReader | None:
        """A reader of the chunk's stored KV whose token ids match the chunk's (a part's rows only), or None.

        A salted view reads its own entry first, then, behind the lead-in, the shared one the operator ingested;
        behind any other lead-in (a prompt's own opening, learned from requests) only its own."""
        own = part_of(self.store.reader(self.key(chunk.chunk_id, lead_in_ids)), chunk)
        shared_lead_in = lead_in_ids is None or list(lead_in_ids) == self.lead_in_ids
        if own is not None or not self.salt or not shared_lead_in:
            return own
        return part_of(self.store.reader(KVKey(self.namespace_for(self.lead_in_ids, salt=""), chunk.chunk_id)),
                       chunk)

    def has_kv(self, chunk_id: str) -> bool:
        """Whether the chunk's KV (behind the lead-in) is stored and its header checks out."""
        return self.store.contains(self.key(chunk_id))

    def foreign_opening(self, opening: Sequence[int]) -> bool:
        """Whether a prompt's text before its first chunk begins with another token than the lead-in: another kind
        of frame (a plain string prompt where chunks were computed behind the chat template's system turn), where
        chunk KV computed behind the lead-in deviates most (docs/benchmarks.md, "How right")."""
        return bool(opening) and bool(self.lead_in_ids) and opening[0] != self.lead_in_ids[0]

    def opening_recurs(self, opening: Sequence[int]) -> bool:
        """Count an opening other than the lead-in; whether it was seen before (an app's own prompt template, not a
        one-off), so its chunks' KV is worth computing behind it. The lead-in and an empty opening are not counted."""
        if not opening or list(opening) == self.lead_in_ids:
            return False
        key = (self.salt, tuple(opening))
        seen = self._openings.pop(key, 0) + 1
        self._openings[key] = seen
        while len(self._openings) > _MAX_OPENINGS:
            self._openings.popitem(last=False)
        return seen > 1

    def set_neighbor(self, chunk_id: str, token_ids: Sequence[int]) -> None:
        """Remember what the chunk's KV is computed behind (after a lead-in or an opening) when it is learned again."""
        self._neighbors.pop(chunk_id, None)
        self._neighbors[chunk_id] = tuple(token_ids)
        while len(self._neighbors) > _MAX_NEIGHBORS:
            self._neighbors.popitem(last=False)

    def neighbor(self, chunk_id: str) -> tuple[int, ...]:
        """The tokens the chunk's KV is computed behind after its lead-in (its look-alike neighbour), or ()."""
        return self._neighbors.get(chunk_id, ())

    def token_ids(self, chunk_id: str) -> torch.Tensor | None:
        """The stored chunk's token ids (no layer is read), or None."""
        return self.store.token_ids(self.key(chunk_id))

    def drop(self, chunk_ids: Iterable[str]) -> int:
        """Delete the stored KV of these chunks; how many were stored."""
        return sum(self.store.delete(self.key(cid)) for cid in chunk_ids)

    # ---- computing ----------------------------------------------------------------------

    def sequence(self, token_ids: torch.Tensor, segment_of_row: torch.Tensor,
                 placements: list[Placement], links: Links | None = None) -> FusedSequence:
        """A fused sequence on the model's device, with its cached KV loaded layer by layer (and the learned links
        whose placeholder rows it carries)."""
        a = self.adapter
        return FusedSequence(token_ids.to(a.device), segment_of_row.to(a.device), placements,
                             a.num_layers, a.num_kv_heads, a.head_dim, a.dtype, self.prefetch_depth, links)

    def compute(self, token_ids: torch.Tensor, lead_in: LayerReader | None) -> ChunkKV:
        """KV of `token_ids` prefilled right after the lead-in whose KV is given (or from position 0)."""
        lead_ids = lead_in.token_ids if lead_in is not None else torch.empty(0, dtype=torch.long)
        ids = torch.cat([lead_ids.cpu(), token_ids.cpu()]).to(self.adapter.device)
        placements = [Placement(0, lead_in, exact=True)] if lead_in is not None else []
        seq = self.sequence(ids, torch.full_like(ids, -1), placements)
        try:
            result = run_layers(self.adapter, seq, RowSelection(~seq.cached), record_fresh=True)
        finally:
            seq.close()
        # KV stays on the model's device: a memory tier keeps it there (on a GPU, loading it back is a device
        # copy, not a transfer over PCIe, which costs as much as the prefill it saves); slower tiers move it.
        return ChunkKV(
            keys=tuple(k.contiguous() for k in result.fresh_keys),  # not a view holding a fused q|k|v buffer
            values=tuple(v.contiguous() for v in result.fresh_values),
            token_ids=token_ids.cpu(),
            positions_start=int(lead_ids.numel()),
        )

    def _segment_key(self, token_ids: Sequence[int]) -> KVKey:
        # the salt is in the namespace: a client's system prompt cached for one salt is a miss for another
        return KVKey(self.namespace_for([]), "seg-" + hashlib.sha256(_ids_bytes(token_ids)).hexdigest()[:32])

    def has_segment(self, token_ids: Sequence[int]) -> bool:
        """Whether `exact_segment(token_ids)` would read stored KV (not compute it)."""
        return self.store.contains(self._segment_key(token_ids))

    def exact_segment(self, token_ids: Sequence[int]) -> LayerReader:
        """KV of a segment that starts at position 0 (prefix, lead-in): exact, computed once, then stored."""
        key = self._segment_key(token_ids)
        reader = self.store.reader(key)
        if reader is not None:
            return reader
        kv = self.compute(torch.tensor(list(token_ids), dtype=torch.long), None)
        self._put(key, kv, best_effort=True)
        return ResidentReader(kv, key, "computed")

    # ---- stored prefixes ----------------------------------------------------------------

    def block_hashes(self, token_ids: Sequence[int] | torch.Tensor) -> list[str]:
        """The hash chain of the whole blocks of `token_ids` from position 0: h_i = H(h_{i-1}, block i), seeded
        with the salt (h_0 = H(salt), as vLLM salts its first block) so that no two salts share an index entry."""
        b = self.prefix_block
        ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu().numpy()
        out, h = [], (hashlib.sha256(b"salt\0" + self.salt.encode()).digest() if self.salt else b"")
        for i in range(len(ids) // b if b else 0):
            h = hashlib.sha256(h + ids[i * b:(i + 1) * b].tobytes()).digest()
            out.append(h.hex()[:32])
        return out

    def _prefix_key(self, block_hash: str) -> KVKey:
        return KVKey(self.namespace_for([]), "pfx-" + block_hash)

    def stored_prefix(self, token_ids: torch.Tensor) -> LayerReader | None:
        """A reader of the longest stored prefix of `token_ids` (whole blocks, leaving at least the last row to
        compute), or None. Its rows are exact: the KV of those very tokens from position 0."""
        if not self.prefix_block:
            return None
        n = int(token_ids.numel())
        hashes = self.block_hashes(token_ids[: (n - 1) // self.prefix_block * self.prefix_block])
        known = 0
        while known < len(hashes) and hashes[known] in self._prefix_index:
            known += 1
        if known:
            reader = self._prefix_reader(self._prefix_index[hashes[known - 1]], hashes[:known], token_ids)
            if reader is not None:
                return reader
        for k in range(len(hashes), 0, -1):  # not seen here (or gone): entries another process stored
            reader = self._prefix_reader("pfx-" + hashes[k - 1], hashes[:k], token_ids)
            if reader is not None:
                return reader
        return None

    def _prefix_reader(self, name: str, hashes: Sequence[str], token_ids: torch.Tensor) -> LayerReader | None:
        """The first len(hashes) blocks of entry `name` if it holds exactly those tokens, else None."""
        reader = self.prefix_store.reader(KVKey(self.namespace_for([]), name))
        rows = len(hashes) * self.prefix_block
        if reader is None or reader.num_tokens < rows or not torch.equal(
                reader.token_ids[:rows].cpu(), token_ids[:rows].cpu()):
            if reader is not None:
                reader.close()
            self._forget_prefix(name, hashes)
            return None
        return reader if reader.num_tokens == rows else SlicedReader(reader, 0, rows)

    def _forget_prefix(self, name: str, hashes: Sequence[str]) -> None:
        """Drop an entry that is gone (evicted, corrupt, replaced) from the index, at the hashes given."""
        self._prefix_entries.pop(name, None)
        for h in hashes:
            if self._prefix_index.get(h) == name:
                del self._prefix_index[h]

    def store_prefix(self, token_ids: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                     ) -> int:
        """Keep the KV of a finished request (prompt and answer) as a stored prefix; the rows kept (whole blocks).

        keys[layer], values[layer]: (N, num_kv_heads, head_dim) for the rows of `token_ids`, keys *after* RoPE at
        positions 0..N-1 (as the loop and the decoder hold them); RoPE is undone here, so the entry is stored like
        chunk KV. Entries this process stored that the new one extends are deleted (it holds them). Best effort: a
        store that cannot keep it is logged once.
        """
        hashes = self.block_hashes(token_ids)
        if not hashes:
            return 0
        name = "pfx-" + hashes[-1]
        if name in self._prefix_entries and self.prefix_store.contains(self._prefix_key(hashes[-1])):
            return 0  # the same tokens again (a repeated request): already kept
        rows = len(hashes) * self.prefix_block
        a = self.adapter
        unrotate = _inverse_rope(a.rotary(torch.arange(rows, device=keys[0].device)))
        kv = ChunkKV(
            keys=tuple(a.rope(layer, k[:rows].float(), unrotate).to(a.dtype) for layer, k in enumerate(keys)),
            values=tuple(v[:rows].clone(memory_format=torch.contiguous_format) for v in values),
            token_ids=token_ids[:rows].cpu().clone(),
        )
        self._put(self._prefix_key(hashes[-1]), kv, best_effort=True, store=self.prefix_store)
        if self._health.write_failed or not self.prefix_store.contains(self._prefix_key(hashes[-1])):
            budget = self.prefix_store.stats().get("max_bytes")
            health = self._health
            if not health.write_failed and not health.warned_prefix_size and budget is not None and kv.nbytes > budget:
                logger.warning("a stored prefix of %d tokens (%.1f MiB) is larger than the prefix store's budget "
                               "(%.1f MiB), so it was not kept and the next turn recomputes it; give the engine a "
                               "larger prefix_store (said once)", rows, kv.nbytes / 2**20, budget / 2**20)
                self._health.warned_prefix_size = True
            return 0  # not kept (a failing store; an entry larger than the budget): the older entries stay
        for h in hashes[:-1]:  # a shorter entry of the same chain: the new one holds it (the index moves below)
            if self._prefix_entries.pop("pfx-" + h, None) is not None:
                self.prefix_store.delete(self._prefix_key(h))
        self._prefix_entries[name] = len(hashes)
        self._prefix_entries.move_to_end(name)
        while len(self._prefix_entries) > _MAX_OWN_PREFIXES:  # the oldest: most likely evicted long ago
            self._prefix_entries.popitem(last=False)
        for h in hashes:
            self._prefix_index[h] = name
            self._prefix_index.move_to_end(h)
        while len(self._prefix_index) > _MAX_INDEXED_BLOCKS:
            self._prefix_index.popitem(last=False)
        return rows

    def compute_and_store(self, chunk: Chunk, lead_in_ids: Sequence[int] | None = None, *,
                          behind: Sequence[int] = (), best_effort: bool = False) -> LayerReader:
        """Compute the chunk's KV behind a lead-in (default: this cache's) and store it.

        `behind`: tokens computed between the lead-in and the chunk but not stored (a look-alike neighbour, so the
        chunk's KV is not that of a first document); the KV is still stored under the lead-in's key. A store that
        cannot keep it raises KVWriteError, unless `best_effort` (a request's path), where the failure is logged
        once and the computed KV still serves the request.
        """
        lead_ids = self.lead_in_ids if lead_in_ids is None else list(lead_in_ids)
        if behind:  # computed for this chunk alone, not stored: each chunk has its own neighbour
            ids = torch.tensor([*lead_ids, *behind], dtype=torch.long)
            lead = ResidentReader(self.compute(ids, None), self._segment_key(ids), "computed")
        else:
            lead = self.exact_segment(lead_ids) if lead_ids else None
        try:
            kv = self.compute(chunk.whole.token_ids, lead)  # a part: the whole chunk is what is stored
        finally:
            if lead is not None:
                lead.close()
        key = self.key(chunk.chunk_id, lead_in_ids)
        self._put(key, kv, best_effort=best_effort)
        return part_of(ResidentReader(kv, key, "computed"), chunk)

    def delete(self, key: KVKey) -> None:
        """Drop an entry (a chunk's, a segment's or a stored prefix's) that failed to read."""
        self.store.delete(key)
        if self.prefix_store is not self.store:
            self.prefix_store.delete(key)

    def _put(self, key: KVKey, kv: ChunkKV, *, best_effort: bool, store: KVStore | None = None) -> None:
        try:
            (self.store if store is None else store).put(key, kv)
        except (KVWriteError, OSError) as e:
            if not best_effort:
                raise
            if not self._health.write_failed:
                logger.warning("the KV store cannot keep new entries (%s); requests go on, recomputing what "
                               "it misses (said once)", e)
            self._health.write_failed = True
        else:
            self._health.write_failed = False
