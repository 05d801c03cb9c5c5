"""CacheBlendEngine: ingest chunks (precompute their KV), then answer with fused KV + selective recompute."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .decode.generate import SamplingSettings, cut_at_stop, decode
from .errors import ChunkError, ConfigError, PromptTooLongError
from .fuse.layout import PromptTemplate, assemble
from .fuse.loop import LoopResult, run_layers
from .fuse.policies import CacheBlend, FullReuse, Policy, Reuse, make_policy
from .fuse.sequence import FusedSequence, Placement
from .ingest.chunks import Chunk, looks_like_chunk_id, make_chunk
from .models.adapter import get_adapter
from .models.fingerprint import model_fingerprint, tokenizer_fingerprint
from .models.loader import DEFAULT_MODEL, load_model
from .loading import DiskLayers, LayerReader, LayerReadError
from .loading.controller import LoadingController
from .loading.profile import load_or_measure
from .store import ChunkKV, DiskStore, KVKey, KVStore, TieredStore, open_store

logger = logging.getLogger(__name__)

LEAD_INS = ("prefix", "bos", "none")


@dataclass
class Prefill:
    """A fused prefill: next-token logits after the prompt, the fused KV for decoding, and stats."""

    logits: torch.Tensor  # (vocab,) float32
    stats: dict
    token_ids: torch.Tensor  # (N,)
    keys: list[torch.Tensor] = field(repr=False)  # per layer (N, kv_heads, d), after RoPE
    values: list[torch.Tensor] = field(repr=False)
    chunk_ids: list[str] = field(default_factory=list)
    unstored_holes: list[Chunk] = field(default_factory=list, repr=False)  # holes left to store (store_holes=False)


@dataclass
class Generation:
    """Generated text with the prefill's stats."""

    text: str
    token_ids: list[int]
    ttft_s: float
    stats: dict
    logits: torch.Tensor | None = field(default=None, repr=False)  # (vocab,) first-token logits of the prefill


class CacheBlendEngine:
    """A local generator that reuses chunk KV caches: full prefill, prefix cache, full reuse or CacheBlend."""

    def __init__(
        self,
        model,
        tokenizer,
        kv_store: KVStore | str | os.PathLike[str] | None = None,
        *,
        template: PromptTemplate | None = None,
        lead_in: str = "prefix",
        prefetch_depth: int | None = None,
        quality_floor: float = 0.15,
        home: str | os.PathLike[str] | None = None,
        max_known_chunks: int = 8192,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.adapter = get_adapter(model)
        self.kv_store: KVStore = open_store(kv_store)
        self.template = template or PromptTemplate()
        if lead_in not in LEAD_INS:
            raise ConfigError(f"lead_in must be one of {LEAD_INS}, got {lead_in!r}")
        self.lead_in = lead_in
        if prefetch_depth is None:
            # A prefetch thread hides loads behind GPU compute; on a CPU it steals cores from the layers
            # (bf16 on 2 cores, cold disk vs memory tier: 1.57× TTFT pipelined vs 1.32× on demand, docs/benchmarks.md).
            prefetch_depth = 2 if self.adapter.device.type == "cuda" else 0
        if prefetch_depth < 0:
            raise ConfigError(f"prefetch_depth must be ≥ 0, got {prefetch_depth}")
        self.prefetch_depth = prefetch_depth  # layers of stored KV loaded ahead of the layer loop
        self.lead_in_ids = self._lead_in_ids(lead_in)
        self.fingerprint = f"{model_fingerprint(model)}{tokenizer_fingerprint(tokenizer)}"
        self.namespace = self._namespace(self.lead_in_ids)
        self.quality_floor = quality_floor  # r*: recompute_ratio="auto" never goes below it
        self.home = home
        self._controller: LoadingController | None = None
        if max_known_chunks < 1:
            raise ConfigError(f"max_known_chunks must be ≥ 1, got {max_known_chunks}")
        # chunk id → text and tokens of recently seen chunks, least recently used first; an evicted id is
        # still found through its stored KV, so this only bounds memory in a long-lived process
        self._chunks: OrderedDict[str, Chunk] = OrderedDict()
        self.max_known_chunks = max_known_chunks
        self._lock = threading.RLock()  # one request at a time on the model: callers serialise

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str = DEFAULT_MODEL,
        kv_store: KVStore | str | os.PathLike[str] | None = None,
        *,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        home: str | os.PathLike[str] | None = None,
        **kwargs,
    ) -> "CacheBlendEngine":
        """Load a packaged or local model offline and build an engine on it."""
        model, tokenizer = load_model(name_or_path, device=device, dtype=dtype, home=home)
        return cls(model, tokenizer, kv_store, home=home, **kwargs)

    # ---- keys and namespaces ------------------------------------------------------------

    def _lead_in_ids(self, lead_in: str) -> list[int]:
        if lead_in == "prefix":
            return self.template.prefix_ids(self.tokenizer)
        if lead_in == "bos":
            bos = self.tokenizer.bos_token_id
            return [bos] if bos is not None else []
        return []

    def _namespace(self, lead_in_ids: Sequence[int]) -> str:
        """Fingerprint of model, tokenizer and lead-in: every KV it names was computed under all three."""
        h = hashlib.sha256(self.fingerprint.encode())
        h.update(torch.tensor(list(lead_in_ids), dtype=torch.int64).numpy().tobytes())
        return h.hexdigest()[:24]

    @staticmethod
    def _segment_id(token_ids: Sequence[int]) -> str:
        return "seg-" + hashlib.sha256(torch.tensor(list(token_ids), dtype=torch.int64).numpy().tobytes()).hexdigest()[:32]

    # ---- precompute ---------------------------------------------------------------------

    def _compute_kv(self, token_ids: torch.Tensor, lead_in: ChunkKV | None) -> ChunkKV:
        """KV of `token_ids` prefilled right after the lead-in whose KV is given (or from position 0)."""
        lead_ids = lead_in.token_ids if lead_in is not None else torch.empty(0, dtype=torch.long)
        ids = torch.cat([lead_ids.cpu(), token_ids.cpu()]).to(self.adapter.device)
        placements = [Placement(0, lead_in, exact=True)] if lead_in is not None else []
        seq = self._sequence(ids, torch.full_like(ids, -1), placements)
        try:
            selection = FullReuse().start(self.adapter, seq)
            result = run_layers(self.adapter, seq, selection, selection.active, record_fresh=True)
        finally:
            seq.close()
        return ChunkKV(
            keys=tuple(k.cpu() for k in result.fresh_keys),
            values=tuple(v.cpu() for v in result.fresh_values),
            token_ids=token_ids.cpu(),
            positions_start=int(lead_ids.numel()),
        )

    def _exact_segment(self, token_ids: Sequence[int]) -> ChunkKV:
        """KV of a segment that starts at position 0 (prefix, lead-in): exact, cached in the store."""
        key = KVKey(self._namespace([]), self._segment_id(token_ids))
        kv = self.kv_store.get(key)
        if kv is None:
            kv = self._compute_kv(torch.tensor(list(token_ids), dtype=torch.long), None)
            self.kv_store.put(key, kv)
        return kv

    def _stored(self, key: KVKey) -> LayerReader | None:
        """A stored KV: resident in memory, or a per-layer reader of its file (loaded during the loop)."""
        store = self.kv_store
        if isinstance(store, TieredStore):
            return store.memory.get(key) or DiskLayers.open(store.disk, key)
        if isinstance(store, DiskStore):
            return DiskLayers.open(store, key)
        return store.get(key)

    def _chunk_kv(self, chunk: Chunk, lead_in_ids: Sequence[int], namespace: str, *,
                  compute: bool) -> LayerReader | None:
        """The chunk's KV after a lead-in: from the store, else computed and stored (if `compute`)."""
        key = KVKey(namespace, chunk.chunk_id)
        kv = self._stored(key) if not compute else self.kv_store.get(key)
        if kv is not None and torch.equal(kv.token_ids, chunk.token_ids):
            return kv
        if not compute:
            return None
        lead = self._exact_segment(lead_in_ids) if lead_in_ids else None
        kv = self._compute_kv(chunk.token_ids, lead)
        self.kv_store.put(key, kv)
        return kv

    def ingest(self, texts: Iterable[str], *, show_progress: bool = True) -> list[str]:
        """Precompute and store the KV of each chunk (skipping stored ones); returns their chunk ids."""
        chunks = [self._register(make_chunk(t, self.tokenizer)) for t in texts]
        with self._lock:
            for chunk in tqdm(chunks, desc="precompute chunk KV", unit="chunk", disable=not show_progress):
                if not self.kv_store.contains(KVKey(self.namespace, chunk.chunk_id)):
                    self._chunk_kv(chunk, self.lead_in_ids, self.namespace, compute=True)
        return [c.chunk_id for c in chunks]

    def _register(self, chunk: Chunk) -> Chunk:
        with self._lock:
            self._chunks[chunk.chunk_id] = chunk
            self._chunks.move_to_end(chunk.chunk_id)
            while len(self._chunks) > self.max_known_chunks:
                self._chunks.popitem(last=False)
        return chunk

    def resolve_chunk(self, item: str | Chunk) -> Chunk:
        """A chunk from its text, its id (known to this engine or its store), or a Chunk."""
        if isinstance(item, Chunk):
            return self._register(item)
        if not isinstance(item, str):
            raise ChunkError(f"a chunk must be a str (text or chunk id), got {type(item).__name__}")
        if looks_like_chunk_id(item):
            known = self._chunks.get(item)
            if known is not None:
                return self._register(known)
            kv = self.kv_store.get(KVKey(self.namespace, item))
            if kv is not None:
                text = self.tokenizer.decode(kv.token_ids.tolist())
                return self._register(Chunk(item, text, kv.token_ids))
            raise ChunkError(f"unknown chunk id {item!r}: not in the KV store and no text given; ingest its text first")
        return self._register(make_chunk(item, self.tokenizer))

    # ---- prefill ------------------------------------------------------------------------

    def _sequence(self, token_ids: torch.Tensor, segment_of_row: torch.Tensor, placements: list[Placement]) -> FusedSequence:
        a = self.adapter
        return FusedSequence(token_ids.to(a.device), segment_of_row.to(a.device), placements,
                             a.num_layers, a.num_kv_heads, a.head_dim, a.dtype, self.prefetch_depth)

    def prefill(
        self,
        chunks: Sequence[str | Chunk],
        question: str,
        method: str | Policy = "cacheblend",
        recompute_ratio: float | str | None = None,
        *,
        template: PromptTemplate | None = None,
        store_holes: bool = True,
        **policy_options,
    ) -> Prefill:
        """Fused prefill of [prefix][chunks][question]; `method` picks the token-selection policy.

        Holes (chunks not in the store) are computed in context, then stored after the logits unless
        `store_holes=False`, which leaves them in `Prefill.unstored_holes`.
        """
        started = time.perf_counter()
        auto = recompute_ratio == "auto"
        policy = make_policy(method, None if auto else recompute_ratio, **policy_options)
        if auto and not isinstance(policy, CacheBlend):
            raise ConfigError('recompute_ratio="auto" needs method="cacheblend"')
        if not isinstance(question, str):
            raise ConfigError(f"question must be a str, got {type(question).__name__}")
        with self._lock, torch.inference_mode():
            resolved = [self.resolve_chunk(c) for c in chunks]
            prefix, separator, suffix = (template or self.template).render(self.tokenizer, question)
            layout = assemble(prefix, [c.token_ids for c in resolved], separator, suffix)
            n = int(layout.token_ids.numel())
            if n > self.adapter.max_positions:
                raise PromptTooLongError(
                    f"prompt of {n} tokens ({len(resolved)} chunks) exceeds the model's context window of "
                    f"{self.adapter.max_positions} tokens; pass fewer or shorter chunks"
                )

            for attempt in range(3):  # a stored layer that fails to read turns its chunk into a hole
                try:
                    seq, result, logits, hits, misses, timing, decision = self._fused_prefill(
                        policy, resolved, prefix, layout, auto)
                    break
                except LayerReadError as e:
                    logger.warning("%s; retrying with it as a hole", e)
                    self.kv_store.delete(e.key)
            else:
                raise RuntimeError("stored KV kept failing to read; giving up")
            ttft = time.perf_counter() - started
            kv_bytes_loaded = sum(p.kv.bytes_read if isinstance(p.kv, DiskLayers) else p.kv.nbytes
                                  for p in seq.placements)  # before promotion reads the layers the loop skipped

            # Holes are stored after the first token's logits: they cost TTFT once, then hit.
            holes = [c for c in resolved if c.chunk_id in misses] if policy.reuse is Reuse.ALL else []
            if store_holes:
                self._store_holes(holes)
                holes = []
            self._promote(seq)

        stats = self._stats(seq, result, hits, misses, resolved)
        stats.update(method=policy.name, ttft_s=ttft, timing=timing, kv_bytes_loaded=kv_bytes_loaded)
        if isinstance(policy, CacheBlend):
            stats["recompute_ratio"] = decision.recompute_ratio if decision else policy.recompute_ratio
        if decision is not None:
            stats["controller"] = decision.as_dict()
        return Prefill(logits, stats, layout.token_ids, result.keys, result.values, [c.chunk_id for c in resolved],
                       holes)

    def _store_holes(self, holes: list[Chunk], *, best_effort: bool = False) -> None:
        """Compute and store the KV of chunks that were holes, behind the lead-in, so the next request hits.

        Best effort after an answer: a failure to store (disk full, say) is logged, never raised over it.
        """
        try:
            for chunk in holes:
                self._chunk_kv(chunk, self.lead_in_ids, self.namespace, compute=True)
        except Exception:
            if not best_effort:
                raise
            logger.warning("could not store the KV of a hole; it will be computed again next time", exc_info=True)

    @property
    def controller(self) -> LoadingController:
        """The loading controller, from profiles measured once per model/device/dtype (cached on disk)."""
        if self._controller is None:
            store = self.kv_store
            disk = store.disk if isinstance(store, TieredStore) else store if isinstance(store, DiskStore) else None
            compute, tiers = load_or_measure(self, disk.root if disk else None, home=self.home)
            self._controller = LoadingController(compute, tiers, self.quality_floor)
        return self._controller

    def _fused_prefill(self, policy: Policy, resolved: list[Chunk], prefix: list[int], layout, auto: bool = False):
        """Place cached KV, select rows, run the loop; the next-token logits and what it took."""
        load_started = time.perf_counter()
        placements, hits, misses = self._placements(policy.reuse, resolved, prefix, layout.chunk_starts)
        seq = self._sequence(layout.token_ids, layout.segment_of_row, placements)
        kv_open_s = time.perf_counter() - load_started
        decision = None
        if auto:  # match the recompute of a layer to the load of the next, never below the quality floor
            by_tier: dict[str, int] = {}
            for p in placements:
                tier = "disk" if isinstance(p.kv, DiskLayers) else "memory"
                by_tier[tier] = by_tier.get(tier, 0) + p.kv.layer_nbytes
            decision = self.controller.choose_ratio(int(seq.reused.sum()), int((~seq.cached).sum()),
                                                    seq.num_rows, by_tier)
            policy = dataclasses.replace(policy, recompute_ratio=decision.recompute_ratio)
        try:
            layers_started = time.perf_counter()
            selection = policy.start(self.adapter, seq)
            result = run_layers(self.adapter, seq, selection, selection.active, num_output_rows=1)
            if result.output_rows is None or int(result.output_rows[-1]) != seq.num_rows - 1:
                raise RuntimeError("the last prompt row was not computed; a policy dropped it")
            logits = self.adapter.logits(result.hidden[-1:])[0].float()
            layers_s = time.perf_counter() - layers_started
        finally:
            seq.close()
        check_s = sum(result.layer_s[:selection.full_layers])  # the layers every row went through
        timing = {"kv_load_s": kv_open_s + seq.loader.load_s, "kv_wait_s": seq.loader.wait_s,
                  "check_s": check_s, "layers_s": layers_s - check_s}
        return seq, result, logits, hits, misses, timing, decision

    def _promote(self, seq: FusedSequence) -> None:
        """Chunks read from disk layer by layer move into the memory tier (LRU)."""
        if not isinstance(self.kv_store, TieredStore):
            return
        for p in seq.placements:
            if isinstance(p.kv, DiskLayers) and (kv := p.kv.complete()) is not None:
                self.kv_store.memory.put(p.kv.key, kv)

    def _placements(self, reuse: Reuse, chunks: list[Chunk], prefix: list[int], starts: tuple[int, ...]):
        """Cached KV to place, by the policy's reuse mode; chunk hits and misses (holes) by id."""
        placements: list[Placement] = []
        hits: list[str] = []
        misses: list[str] = []
        if reuse is Reuse.NONE:
            return placements, hits, [c.chunk_id for c in chunks]
        placements.append(Placement(0, self._exact_segment(prefix), exact=True))
        if reuse is Reuse.PREFIX:
            if chunks:  # the first chunk exactly as it follows this prefix: computed once, then hit
                ns = self._namespace(prefix)
                was_cached = self.kv_store.contains(KVKey(ns, chunks[0].chunk_id))
                kv = self._chunk_kv(chunks[0], prefix, ns, compute=True)
                placements.append(Placement(starts[0], kv, exact=True))
                (hits if was_cached else misses).append(chunks[0].chunk_id)
            misses += [c.chunk_id for c in chunks[1:]]
            return placements, hits, misses
        follows_lead_in = list(prefix) == list(self.lead_in_ids)
        for i, (chunk, start) in enumerate(zip(chunks, starts)):
            kv = self._chunk_kv(chunk, self.lead_in_ids, self.namespace, compute=False)
            if kv is None:
                misses.append(chunk.chunk_id)
                continue
            hits.append(chunk.chunk_id)
            # The first chunk after the very prefix it was precomputed behind is exact.
            placements.append(Placement(start, kv, exact=(i == 0 and follows_lead_in)))
        return placements, hits, misses

    @staticmethod
    def _stats(seq: FusedSequence, result: LoopResult, hits, misses, chunks) -> dict:
        reused = seq.reused
        num_reused = int(reused.sum())
        num_uncached = int((~seq.cached).sum())
        hole_rows = sum(c.num_tokens for c in chunks if c.chunk_id in misses)
        recomputed = result.reused_rows_per_layer
        return {
            "num_tokens": seq.num_rows,
            "num_reused": num_reused,
            "num_exact_cached": int(seq.exact.sum()),
            "num_recomputed": int(reused[result.rows].sum()),  # reused rows recomputed through the last layer
            "num_hole_tokens": hole_rows,
            "num_computed": num_uncached - hole_rows,
            "recompute_ratio_effective": (sum(recomputed) / (len(recomputed) * num_reused)) if num_reused else 0.0,
            "chunk_hits": list(hits),
            "chunk_misses": list(misses),
            "rows_per_layer": result.rows_per_layer,
            "attention_pairs_per_layer": result.pairs_per_layer,  # query-key pairs each layer attended
            "layer_s": result.layer_s,  # seconds per layer, KV waits included
        }

    # ---- generation ---------------------------------------------------------------------

    def generate(
        self,
        chunks: Sequence[str | Chunk],
        question: str,
        method: str = "cacheblend",
        recompute_ratio: float | None = None,
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
        template: PromptTemplate | None = None,
        **policy_options,
    ) -> Generation:
        """Fused prefill, then decode: greedy by default, sampling with temperature/top_p."""
        settings = SamplingSettings(max_new_tokens, temperature, top_p, tuple(stop or ()), seed)
        with self._prefill_to_decode(chunks, question, method, recompute_ratio, template, settings,
                                     policy_options) as pre:
            started = time.perf_counter()
            new_ids = decode(self.model, self.tokenizer, pre.token_ids, pre.keys, pre.values, settings)
            decode_s = time.perf_counter() - started
        text, _ = cut_at_stop(self.tokenizer.decode(new_ids, skip_special_tokens=True), settings.stop)
        stats = dict(pre.stats, num_generated=int(new_ids.numel()))
        stats["timing"] = dict(pre.stats["timing"], decode_s=decode_s)
        return Generation(text.strip(), new_ids.tolist(), pre.stats["ttft_s"], stats, pre.logits)

    def stream(
        self,
        chunks: Sequence[str | Chunk],
        question: str,
        method: str = "cacheblend",
        recompute_ratio: float | None = None,
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
        template: PromptTemplate | None = None,
        stats: dict | None = None,
        **policy_options,
    ) -> Iterator[str]:
        """Yield text pieces as they are decoded; `stats`, if given, gets the prefill's stats, then decoding's."""
        from transformers import TextIteratorStreamer

        settings = SamplingSettings(max_new_tokens, temperature, top_p, tuple(stop or ()), seed)
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        errors: queue.Queue[BaseException] = queue.Queue()
        decoded = threading.Event()  # set once the stats are final (or an error is queued)

        def work() -> None:  # prefill and decode on one thread, holding the model's lock throughout
            try:
                with self._prefill_to_decode(chunks, question, method, recompute_ratio, template, settings,
                                             policy_options) as pre:
                    if stats is not None:  # readable as soon as the first piece arrives
                        stats.update(pre.stats)
                    started = time.perf_counter()
                    new_ids = decode(self.model, self.tokenizer, pre.token_ids, pre.keys, pre.values, settings,
                                     streamer)
                    if stats is not None:
                        stats["num_generated"] = int(new_ids.numel())
                        stats["timing"] = dict(pre.stats["timing"], decode_s=time.perf_counter() - started)
                    decoded.set()  # the consumer may finish while the holes are stored
            except BaseException as e:  # surfaced to the consumer below
                errors.put(e)
                streamer.end()
            finally:
                decoded.set()

        threading.Thread(target=work, daemon=True).start()
        yield from _stop_filtered(streamer, settings.stop)
        decoded.wait()  # the streamer ends before decode returns: wait for the final stats (and any error)
        if not errors.empty():
            raise errors.get()

    @contextmanager
    def _prefill_to_decode(self, chunks, question, method, recompute_ratio, template, settings: SamplingSettings,
                           policy_options: dict) -> Iterator[Prefill]:
        """Under the model's lock: the prefill to decode from, checked for room; its holes are stored after the
        block (best effort), so neither the answer nor its first streamed piece waits for them."""
        with self._lock:
            pre = self.prefill(chunks, question, method, recompute_ratio, template=template, store_holes=False,
                               **policy_options)
            try:
                self._check_room(pre, settings)
                yield pre
            finally:
                self._store_holes(pre.unstored_holes, best_effort=True)

    def _check_room(self, pre: Prefill, settings: SamplingSettings) -> None:
        total = int(pre.token_ids.numel()) + settings.max_new_tokens
        if total > self.adapter.max_positions:
            raise PromptTooLongError(
                f"prompt of {pre.token_ids.numel()} tokens + max_new_tokens={settings.max_new_tokens} exceeds "
                f"the context window of {self.adapter.max_positions} tokens"
            )

    def drop_kv(self, chunk_ids: Iterable[str]) -> int:
        """Delete the stored KV of these chunks (and forget their text); returns how many entries were removed."""
        if isinstance(chunk_ids, str):
            chunk_ids = [chunk_ids]
        removed = 0
        with self._lock:
            for cid in chunk_ids:
                self._chunks.pop(cid, None)
                removed += bool(self.kv_store.delete(KVKey(self.namespace, cid)))
        return removed


def _stop_filtered(pieces: Iterable[str], stop: tuple[str, ...]) -> Iterator[str]:
    """Pass text pieces through, holding back enough to cut at a stop string that spans pieces."""
    if not stop:
        yield from (p for p in pieces if p)
        return
    hold = max(len(s) for s in stop) - 1
    buffer = ""
    for piece in pieces:
        buffer += piece
        text, found = cut_at_stop(buffer, stop)
        if found:
            if text:
                yield text
            for _ in pieces:  # drain so the decoding thread can finish
                pass
            return
        if len(buffer) > hold:
            out, buffer = buffer[: len(buffer) - hold], buffer[len(buffer) - hold :]
            yield out
    if buffer:
        yield buffer
