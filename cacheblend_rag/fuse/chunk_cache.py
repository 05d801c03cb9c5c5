"""ChunkCache: names, finds and computes the KV of chunks and exact segments, over any KVStore.

A chunk's KV is computed once behind a lead-in (by default the template's system prefix) and stored under a
namespace that fingerprints the model, the tokenizer and that lead-in. Exact segments (prefixes that start at
position 0) are cached by their token ids. Stored KV is handed out as per-layer readers.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence

import torch

from ..errors import KVWriteError
from ..ingest.chunks import Chunk
from ..models.adapter import LlamaFamilyAdapter
from ..store import ChunkKV, KVKey, KVStore, LayerReader, ResidentReader, SlicedReader
from .loop import run_layers
from .policy import RowSelection
from .sequence import FusedSequence, Placement

logger = logging.getLogger(__name__)


def _ids_bytes(token_ids: Sequence[int]) -> bytes:
    return torch.tensor(list(token_ids), dtype=torch.int64).numpy().tobytes()


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
                 prefetch_depth: int = 0) -> None:
        self.adapter = adapter
        self.store = store
        self.fingerprint = fingerprint
        self.lead_in_ids = list(lead_in_ids)
        self.namespace = self.namespace_for(self.lead_in_ids)
        self.prefetch_depth = prefetch_depth
        self._write_failed = False  # a failing store is reported once, then serving goes on without it

    def namespace_for(self, lead_in_ids: Sequence[int]) -> str:
        """Fingerprint of model, tokenizer and lead-in: every KV it names was computed under all three."""
        h = hashlib.sha256(self.fingerprint.encode())
        h.update(_ids_bytes(lead_in_ids))
        return h.hexdigest()[:24]

    def key(self, chunk_id: str, lead_in_ids: Sequence[int] | None = None) -> KVKey:
        """The store key of a chunk's KV behind a lead-in (default: this cache's)."""
        ns = self.namespace if lead_in_ids is None else self.namespace_for(lead_in_ids)
        return KVKey(ns, chunk_id)

    # ---- lookups ------------------------------------------------------------------------

    def reader(self, chunk: Chunk, lead_in_ids: Sequence[int] | None = None) -> LayerReader | None:
        """A reader of the chunk's stored KV whose token ids match the chunk's (a part's rows only), or None."""
        return part_of(self.store.reader(self.key(chunk.chunk_id, lead_in_ids)), chunk)

    def has_kv(self, chunk_id: str) -> bool:
        """Whether the chunk's KV (behind the lead-in) is stored and its header checks out."""
        return self.store.contains(self.key(chunk_id))

    def token_ids(self, chunk_id: str) -> torch.Tensor | None:
        """The stored chunk's token ids (no layer is read), or None."""
        return self.store.token_ids(self.key(chunk_id))

    def drop(self, chunk_ids: Iterable[str]) -> int:
        """Delete the stored KV of these chunks; how many were stored."""
        return sum(self.store.delete(self.key(cid)) for cid in chunk_ids)

    # ---- computing ----------------------------------------------------------------------

    def sequence(self, token_ids: torch.Tensor, segment_of_row: torch.Tensor,
                 placements: list[Placement]) -> FusedSequence:
        """A fused sequence on the model's device, with its cached KV loaded layer by layer."""
        a = self.adapter
        return FusedSequence(token_ids.to(a.device), segment_of_row.to(a.device), placements,
                             a.num_layers, a.num_kv_heads, a.head_dim, a.dtype, self.prefetch_depth)

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

    def exact_segment(self, token_ids: Sequence[int]) -> LayerReader:
        """KV of a segment that starts at position 0 (prefix, lead-in): exact, computed once, then stored."""
        segment_id = "seg-" + hashlib.sha256(_ids_bytes(token_ids)).hexdigest()[:32]
        key = KVKey(self.namespace_for([]), segment_id)
        reader = self.store.reader(key)
        if reader is not None:
            return reader
        kv = self.compute(torch.tensor(list(token_ids), dtype=torch.long), None)
        self._put(key, kv, best_effort=True)
        return ResidentReader(kv, key, "computed")

    def compute_and_store(self, chunk: Chunk, lead_in_ids: Sequence[int] | None = None, *,
                          best_effort: bool = False) -> LayerReader:
        """Compute the chunk's KV behind a lead-in (default: this cache's) and store it.

        A store that cannot keep it raises KVWriteError, unless `best_effort` (a request's path), where the
        failure is logged once and the computed KV still serves the request.
        """
        lead_ids = self.lead_in_ids if lead_in_ids is None else list(lead_in_ids)
        lead = self.exact_segment(lead_ids) if lead_ids else None
        try:
            kv = self.compute(chunk.whole.token_ids, lead)  # a part: the whole chunk is what is stored
        finally:
            if lead is not None:
                lead.close()
        key = self.key(chunk.chunk_id, lead_in_ids)
        self._put(key, kv, best_effort=best_effort)
        return part_of(ResidentReader(kv, key, "computed"), chunk)

    def _put(self, key: KVKey, kv: ChunkKV, *, best_effort: bool) -> None:
        try:
            self.store.put(key, kv)
        except (KVWriteError, OSError) as e:
            if not best_effort:
                raise
            if not self._write_failed:
                logger.warning("the KV store cannot keep new entries (%s); requests go on, recomputing what "
                               "it misses (said once)", e)
            self._write_failed = True
        else:
            self._write_failed = False
