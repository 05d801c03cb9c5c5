"""CacheBlendEngine: the facade. It keeps the state (model, KV store, known chunks) and calls the pipeline:

    ingest    texts → chunks → KV precomputed behind the lead-in → store        (fuse.chunk_cache)
    prefill   chunks + question → layout → policy → the one layer loop → logits (fuse.prefill)
    generate  prefill → decode over the fused KV                                (decode)
    stream    the same, piece by piece, on a worker that stops when you do      (decode.stream)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .decode.generate import SamplingOptions, decode
from .decode.grammar import GrammarCompiler
from .decode.kv_decode import KVDecoder, KVSequence, kv_decode
from .decode.stream import answer_streamer, stream_decode
from .conveniences import RequestConveniences
from .decode.text import Answer
from . import gate as fidelity_gate
from . import settings
from .errors import ChunkError, ConfigError, PromptTooLongError
from .fuse.chunk_cache import PREFIX_BLOCK, ChunkCache
from .fuse.layout import PromptTemplate, after_last_chunk, assemble, insert_rows
from .fuse.links import Links, find_links
from .fuse.placement import Placements
from .fuse.policies import VARIANT_POLICIES, check_ratio
from .fuse.policy import FusionRequest
from .fuse.prefill import Prefill, RequestStats, fused_prefill, take_pending
from .fuse.prompt_match import NoMatchWarning, prompt_request, prompt_text
from .fuse.sequence import FusedSequence
from .ingest.chunks import Chunk, chunk_id, looks_like_chunk_id, make_chunk
from .ingest.index import ChunkIndex
from .ingest.learner import PassageLearner
from .ingest.neighbors import NEIGHBOR_QUESTION, Embed, default_embed, nearest_neighbors
from .ingest.registry import ChunkRegistry
from .loading.controller import LoadingController, RatioDecision
from .loading.profile import load_or_measure
from .models.adapter import get_adapter
from .models.fingerprint import model_fingerprint, tokenizer_fingerprint, weights_fingerprint
from .models.loader import DEFAULT_MODEL, load_model
from .request import DEFAULT_METHOD, Prompt, Request
from .store import KVStore, MemoryStore, open_store
from .store.codecs import CODECS

BEHIND = ("lead_in", "neighbor")  # what a chunk's stored KV is computed behind (`CacheBlendEngine.ingest`)

logger = logging.getLogger(__name__)

LEAD_INS = ("prefix", "bos", "none")
# "kv": the engine's own decode over a preallocated copy of the fused KV through the model adapter (decode.kv_decode);
# "hf": HF generate over a DynamicCache built from it (decode.generate), the reference: same greedy tokens, slower
DECODERS = ("kv", "hf")
CHUNK_INDEX_FILE = "chunk-index.sqlite"  # beside the disk tier's entries: chunk texts by id, for prompt matching
DEFAULT_PREFIX_BYTES = 1024**3  # the stored prefixes' own memory tier (a 3.7k-token SmolLM2 turn: ≈ 85 MB bf16)

__all__ = ["CacheBlendEngine", "Generation", "Prefill", "Request", "RequestStats", "SamplingOptions"]


@dataclass
class Generation:
    """Generated text with the request's stats."""

    text: str
    token_ids: list[int]
    ttft_s: float
    stats: RequestStats
    logits: torch.Tensor | None = field(default=None, repr=False)  # (vocab,) first-token logits of the prefill
    finish_reason: str = "stop"  # "stop" (EOS, a stop string, a complete grammar) or "length" (max_new_tokens)
    grammar_satisfied: bool | None = None  # with a grammar: whether the text completes it (False: cut by length)


def _check_kv_codec(kv_codec: str, kv_store: object) -> None:
    """ConfigError unless kv_codec names a codec and, if not fp16, kv_store is a path (a disk store it configures)."""
    if not isinstance(kv_codec, str) or kv_codec not in CODECS:
        raise ConfigError(f"unknown kv_codec {kv_codec!r}; choose one of {sorted(CODECS)} "
                          "(fp16: exact, int8: ~2x smaller, cachegen: ~4.3x smaller)")
    if kv_codec != "fp16" and not isinstance(kv_store, (str, os.PathLike)):
        raise ConfigError(f"kv_codec={kv_codec!r} applies to a disk store: pass kv_store=PATH, or build "
                          "DiskStore(root, codec=...) and pass that store")


class CacheBlendEngine(RequestConveniences):
    """A local generator that reuses chunk KV caches, by any method of the policy registry: relevance (the
    default), cacheblend, cachecraft, full_reuse, prefix_cache or full_prefill.

    >>> engine = CacheBlendEngine.from_pretrained("smollm2-135m", kv_store=None)  # doctest: +SKIP
    >>> ids = engine.ingest(["Lyon sits where the Rhône meets the Saône."])      # doctest: +SKIP
    >>> engine.generate(ids, "Which rivers meet in Lyon?", max_new_tokens=8).text  # doctest: +SKIP

    Its own request surface is `prefill_request`, `generate_request`, `stream_request` and `start_request` (a
    `Request`), and `advance` (batched decoding); `generate`, `stream`, `start`, `prefill` and their `*_prompt`
    twins are one-line conveniences over them (`conveniences.RequestConveniences`).
    """

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
        model_name: str | None = None,
        chunk_index: ChunkIndex | str | os.PathLike[str] | None = None,
        kv_codec: str = "fp16",
        decoder: str = "kv",
        prefix_reuse: bool = True,
        prefix_store: KVStore | str | os.PathLike[str] | Sequence | None = None,
        calibrate: bool = False,
        links: Links | str | os.PathLike[str] | None = "auto",
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.adapter = get_adapter(model)
        _check_kv_codec(kv_codec, kv_store)
        self.kv_store: KVStore = open_store(kv_store, codec=kv_codec)
        if template is not None and not isinstance(template, PromptTemplate):
            raise ConfigError(f"template must be a PromptTemplate (or None), got {type(template).__name__}")
        self.template = template or PromptTemplate()
        if decoder not in DECODERS:
            raise ConfigError(f"decoder must be one of {DECODERS}, got {decoder!r} (kv: the fast path, hf: HF generate)")
        self.decoder = decoder
        self._kv_decoder = KVDecoder(self.adapter, tokenizer)
        if lead_in not in LEAD_INS:
            raise ConfigError(f"lead_in must be one of {LEAD_INS}, got {lead_in!r}")
        self.lead_in = lead_in
        if prefetch_depth is None:
            # A prefetch thread hides loads behind GPU compute; on a CPU it steals cores from the layers
            # (bf16 on 2 cores, cold disk vs memory tier: 1.57× TTFT pipelined vs 1.32× on demand, `cacheblend-rag bench loading`).
            prefetch_depth = 2 if self.adapter.device.type == "cuda" else 0
        if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 0:
            raise ConfigError(f"prefetch_depth must be an integer ≥ 0, got {prefetch_depth!r}")
        self.fingerprint = f"{model_fingerprint(model)}{tokenizer_fingerprint(tokenizer)}"
        if not isinstance(prefix_reuse, bool):
            raise ConfigError(f"prefix_reuse must be True or False, got {prefix_reuse!r}")
        # prefix_reuse: a finished request's KV (prompt and answer) is kept as a stored prefix, and a request that
        # starts with one loads it exactly and computes only the rest (fuse.chunk_cache, fuse.placement)
        # prefix_store: where they live, any store spec (a shared disk folder or Redis lets a conversation move
        # between replicas); by default a memory tier of its own, LRU-bounded by DEFAULT_PREFIX_BYTES
        prefixes = MemoryStore(DEFAULT_PREFIX_BYTES) if prefix_store is None else open_store(prefix_store)
        # a policy's per-chunk state (Cache-Craft's variants) lives in the cache: `cache.policy_state(policy)`
        self.cache = ChunkCache(self.adapter, self.kv_store, self.fingerprint, self._lead_in_ids(lead_in),
                                prefetch_depth, prefix_block=PREFIX_BLOCK if prefix_reuse else 0,
                                prefix_store=prefixes)
        self._warned_keep = False
        self._no_match_warning = NoMatchWarning()  # said once per engine (fuse/prompt_match.py)
        # r*: recompute_ratio="auto" never goes below it; the engine's own share, checked here (not on first use)
        self.quality_floor = check_ratio(quality_floor, "quality_floor")
        self.home = home
        if model_name is not None and not isinstance(model_name, str):
            raise ConfigError(f"model_name must be a string (or None), got {type(model_name).__name__}")
        self.model_name = model_name or getattr(model.config, "_name_or_path", None) or type(model).__name__
        # learned links (fuse/links): after the last reused chunk, computed with the question (links_for)
        self.links: Links | None = self._check_links(links)
        self.chunks = ChunkRegistry(max_known_chunks)
        if not isinstance(chunk_index, ChunkIndex):
            folder = self.kv_store.side_car_dir()
            path = chunk_index if chunk_index is not None else (folder / CHUNK_INDEX_FILE if folder else None)
            chunk_index = ChunkIndex(path)
        self.index = chunk_index  # finds stored chunks inside any prompt (generate_prompt, stream_prompt)
        self._controller: LoadingController | None = None
        self._lock = threading.RLock()  # one request at a time on the model: callers serialise
        # the salted cache view of each started sequence, for keeping its KV when `advance` finishes it
        self._sequence_caches: weakref.WeakKeyDictionary[KVSequence, ChunkCache] = weakref.WeakKeyDictionary()
        # what started sequences' prefills left to store (their missed chunks' KV): run at the next `advance` or
        # `start_request`, after the caller has handed out the first piece (`start_request`)
        self._deferred_stores: collections.deque[Callable[[], None]] = collections.deque()
        self.learner = PassageLearner(lambda text: self.ingest([text], show_progress=False))
        # the fidelity gate: per method, the ratio requests that name none run at on this model (gate.py)
        self._gates: dict[str, fidelity_gate.GateDecision | None] = {}
        self._gates_lock = threading.Lock()
        if not isinstance(calibrate, bool):
            raise ConfigError(f"calibrate must be True or False, got {calibrate!r}")
        decision = self.gate(DEFAULT_METHOD)
        if decision is None and calibrate:
            decision = self._calibrate_on_first_use()
        if decision is not None and not decision.met:
            best = min(decision.table, key=lambda row: row["mean_kl"]) if decision.table else None
            logger.warning(
                "%s: chunk reuse (%s) keeps full prefill's first token (mean KL ≤ %s, agreement ≥ %.0f%%) at no "
                "recompute ratio up to %s%s, so requests that name no ratio run at %s (full prefill's answers, "
                "no speed-up from stored chunk KV); name a recompute_ratio to trade fidelity for speed, or use "
                "method='prefix_cache'", self.model_name, decision.method, decision.target_kl,
                100 * decision.min_agreement, max((r["ratio"] for r in decision.table), default=0),
                f" (best: ratio {best['ratio']}, KL {best['mean_kl']:.3f}, agreement {best['agreement']:.0%})"
                if best else "", decision.ratio)

    @functools.cached_property
    def weights_fingerprint(self) -> str:
        """The weights' fingerprint in any dtype (what links are keyed by); read once, when links need it."""
        return weights_fingerprint(self.model, self.tokenizer)

    def _check_links(self, links: Links | str | os.PathLike[str] | None) -> Links | None:
        """Learned links for this model (a `Links`, a links file's path, or "auto": those trained on this machine
        for these weights, else the package's for a packaged model), checked against its weights."""
        if links is None or links is False:
            return None
        if isinstance(links, str) and links == "auto":
            links = find_links(lambda: self.weights_fingerprint, self.model_name)
            if links is None:
                return None
        if isinstance(links, (str, os.PathLike)):
            links = Links.load(links)
        if not isinstance(links, Links):
            raise ConfigError(f"links must be a Links, a links file's path or None, got {type(links).__name__}")
        embed = self.model.get_input_embeddings()
        return links.for_model(self.weights_fingerprint, int(embed.weight.shape[0]), int(embed.weight.shape[1]))

    def links_for(self, request: Request, policy, decision: "fidelity_gate.GateDecision | None" = None
                  ) -> Links | None:
        """The links a request runs with: the engine's, unless the request turns them off, the fidelity gate's
        `decision` its ratio came from was measured without them, its method places no chunk KV computed out of
        context, or it recomputes every reused row (ratio 1 is full prefill)."""
        if request.links is True and self.links is None:
            raise ConfigError("this request asks for links (links=True) but the engine has none: load them with "
                              "CacheBlendEngine(links=PATH) or train them with `cacheblend-rag train-links`")
        if self.links is None or request.links is False or not policy.reuses_chunks:
            return None
        if decision is not None and request.links is None and decision.links is None:
            return None  # the gate chose this ratio without links
        if policy.recompute_ratio is not None and policy.recompute_ratio >= 1:
            return None
        return self.links

    def gate(self, method: str) -> "fidelity_gate.GateDecision | None":
        """The fidelity gate's decision for `method` on this model (measured here or shipped), or None."""
        with self._gates_lock:
            if method not in self._gates:
                self._gates[method] = fidelity_gate.find(
                    self.fingerprint, self.model_name, method, dtype=str(self.adapter.dtype).removeprefix("torch."),
                    links=self.links.digest[:16] if self.links is not None else None)
            return self._gates[method]

    def _calibrate_on_first_use(self) -> "fidelity_gate.GateDecision | None":
        """Calibrate the default method on this model and store the decision; a failure is logged, not raised."""
        logger.warning("%s has no fidelity calibration yet: measuring the recompute ratio that keeps full "
                       "prefill's answers (once per machine; `cacheblend-rag calibrate` does the same)",
                       self.model_name)
        try:
            decision = fidelity_gate.calibrate(self, DEFAULT_METHOD)
            path = fidelity_gate.store(decision)
        except (ConfigError, OSError, RuntimeError, ValueError) as e:
            logger.warning("calibrating %s failed (%s); requests that name no ratio run at the method's default",
                           self.model_name, e)
            return None
        logger.info("fidelity gate for %s: %s at ratio %s (mean KL %.4f), stored in %s", self.model_name,
                    decision.method, decision.ratio, decision.expected_kl, path)
        with self._gates_lock:
            self._gates[DEFAULT_METHOD] = decision
        return decision

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str = DEFAULT_MODEL,
        kv_store: KVStore | str | os.PathLike[str] | None = None,
        *,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        home: str | os.PathLike[str] | None = None,
        kv_codec: str = "fp16",
        revision: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        trust_remote_code: bool = False,
        calibrate: bool | None = None,
        **kwargs,
    ) -> "CacheBlendEngine":
        """Load a packaged model, a local folder or a hub id (`org/name`, at `revision`, through the Hugging Face
        cache as transformers does) and build an engine on it (kv_codec: how a disk store codes KV). `calibrate`:
        on first use of a model with no fidelity decision (measured here or shipped), measure it (gate.py); None:
        $CACHEBLEND_RAG_CALIBRATE, default yes."""
        _check_kv_codec(kv_codec, kv_store)  # before loading the model
        calibrate = settings.calibrate_on_first_use(calibrate)
        model, tokenizer = load_model(name_or_path, device=device, dtype=dtype, home=home, revision=revision,
                                      cache_dir=cache_dir, trust_remote_code=trust_remote_code)
        kwargs.setdefault("model_name", str(name_or_path))
        return cls(model, tokenizer, kv_store, home=home, kv_codec=kv_codec, calibrate=calibrate, **kwargs)

    # ---- facts --------------------------------------------------------------------------

    @property
    def namespace(self) -> str:
        """The namespace of chunk KV in the store (model, tokenizer and lead-in fingerprinted)."""
        return self.cache.namespace

    @property
    def lead_in_ids(self) -> list[int]:
        """The tokens every chunk's KV is precomputed behind."""
        return self.cache.lead_in_ids

    @property
    def prefix_reuse(self) -> bool:
        """Whether finished requests are kept as stored prefixes and later requests start from them."""
        return bool(self.cache.prefix_block)

    @property
    def prefix_store(self) -> KVStore:
        """Where stored prefixes (finished requests' KV) live: its `stats()` counts their bytes and entries."""
        return self.cache.prefix_store

    @property
    def prefetch_depth(self) -> int:
        """Layers of stored KV loaded ahead of the layer loop (0: on demand)."""
        return self.cache.prefetch_depth

    @property
    def has_chat_template(self) -> bool:
        """Whether the model has a chat template (an instruct model: plain completions are wrapped in it)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler of this engine's decoder: a grammar compiled through it (a server's admission
        check) is not compiled again when the request decodes."""
        return self._kv_decoder.grammars

    def count_prompt_tokens(self, prompt: Prompt, tools: Sequence[dict] | None = None) -> int:
        """Tokens of a whole prompt (a string, or chat messages rendered with the chat template, listing `tools`),
        as the prefill will tokenize it."""
        text, add_special_tokens = prompt_text(self.tokenizer, prompt, tools, model_name=self.model_name)
        return len(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    @property
    def context_window(self) -> int:
        """The model's context window in tokens (prompt + generated)."""
        return self.adapter.max_positions

    def _lead_in_ids(self, lead_in: str) -> list[int]:
        if lead_in == "prefix":
            return self.template.prefix_ids(self.tokenizer)
        if lead_in == "bos":
            bos = self.tokenizer.bos_token_id
            return [bos] if bos is not None else []
        return []

    # ---- chunks -------------------------------------------------------------------------

    def ingest(self, texts: str | Iterable[str], *, show_progress: bool = True, variants: str | None = None,
               neighbors: int = 2, embed: Embed | None = None, behind: str = "lead_in") -> list[str]:
        """Precompute and store the KV of each chunk (skipping stored ones); returns their chunk ids.

        A single string is one chunk. A chunk that cannot fit the context window behind the lead-in is refused
        (split it first); a store that cannot keep the KV raises KVWriteError. `variants="neighbors"` also stores
        each chunk computed after its `neighbors` most similar chunks of this call (`ingest_variants`).
        `behind="neighbor"` computes each chunk's KV behind its most similar other chunk of this call (between the
        lead-in and the chunk, not stored), so that it is not the KV of a first document: look-alike documents keep
        their answers under reuse (docs/benchmarks.md, "Which method for my documents"); ingest costs
        about twice the compute, a request nothing more.
        """
        if variants is not None and variants not in VARIANT_POLICIES:
            raise ConfigError(f"variants must be one of {tuple(VARIANT_POLICIES)} or None, got {variants!r}")
        if behind not in BEHIND:
            raise ConfigError(f"behind must be one of {BEHIND}, got {behind!r}")
        if isinstance(texts, str):
            texts = [texts]
        chunks = [self._fitting(self.chunks.add(make_chunk(t, self.tokenizer))) for t in texts]
        before = self._neighbor_ids(chunks, embed) if behind == "neighbor" else {}
        with self._lock:
            for cid, ids in before.items():
                self.cache.set_neighbor(cid, ids)
            for chunk in tqdm(chunks, desc="precompute chunk KV", unit="chunk", disable=not show_progress):
                if not self.cache.has_kv(chunk.chunk_id):
                    self.cache.compute_and_store(chunk, behind=self.cache.neighbor(chunk.chunk_id))
                self.index.add([(chunk.chunk_id, chunk.text)])
        ids = [c.chunk_id for c in chunks]
        if variants is not None:
            self.ingest_variants(ids, k=neighbors, embed=embed, show_progress=show_progress)
        return ids

    def _neighbor_ids(self, chunks: list[Chunk], embed: Embed | None) -> dict[str, list[int]]:
        """Per chunk id: the token ids of its most similar other chunk (by embedding), then a blank line; only
        where both fit the window behind the lead-in."""
        distinct = list({c.chunk_id: c for c in chunks}.values())
        if len(distinct) < 2:
            return {}
        vectors = torch.as_tensor((embed or default_embed)([c.text for c in distinct]), dtype=torch.float32)
        gap = self.tokenizer("\n\n", add_special_tokens=False)["input_ids"]
        room = self.context_window - len(self.cache.lead_in_ids)
        out = {}
        for chunk, (j,) in zip(distinct, nearest_neighbors(vectors, 1)):
            ids = [*distinct[j].token_ids.tolist(), *gap]
            if len(ids) + chunk.num_tokens <= room:
                out[chunk.chunk_id] = ids
        return out

    def learn(self, texts: Iterable[str]) -> int:
        """Queue passages a prompt carried (e.g. what a retriever returned) for ingest on a background thread,
        after the answer: the next prompt that carries one reuses its KV, with no warm step. Stored ones are
        skipped when their turn comes; returns how many were queued (`engine.learner.wait()` waits for them)."""
        fresh = []
        for text in texts:  # one already stored and indexed is skipped here, not by the worker under the model's lock
            if isinstance(text, str):
                cid = chunk_id(text)
                if not (self.has_kv(cid) and self.index.text(cid) is not None):
                    fresh.append(text)
        return self.learner.submit(fresh)

    def ingest_variants(self, chunk_ids: Iterable[str], *, k: int = 2, embed: Embed | None = None,
                        show_progress: bool = True) -> int:
        """Store each chunk's KV as computed after its k most similar of `chunk_ids` (Cache-Craft variants that
        `method="cachecraft"` reuses when those chunks come before it again); returns how many were stored.
        The request run per chunk is the registry's (`fuse.policies.VARIANT_POLICIES["neighbors"]`): the policy
        keeps the chunk in its own per-chunk state, and each prefill says how many entries it kept."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"neighbors must be an integer ≥ 1, got {k!r}")
        ids = list(dict.fromkeys(chunk_ids))
        if len(ids) < 2:
            return 0
        texts = [self.resolve_chunk(c).text for c in ids]
        vectors = torch.as_tensor((embed or default_embed)(texts), dtype=torch.float32)
        policy = VARIANT_POLICIES["neighbors"]()
        stored = 0
        for i, near in enumerate(tqdm(nearest_neighbors(vectors, k), desc="neighbour variants", unit="chunk",
                                      disable=not show_progress)):
            for start in range(len(near)):  # too long for the window: the least similar neighbour goes first
                try:
                    pre = self.prefill([*(ids[j] for j in near[start:]), ids[i]], NEIGHBOR_QUESTION, policy)
                except PromptTooLongError:
                    continue
                stored += pre.kept
                break
        return stored

    def _fitting(self, chunk: Chunk) -> Chunk:
        room = self.context_window - len(self.lead_in_ids)
        if chunk.num_tokens > room:
            raise ChunkError(f"chunk {chunk.chunk_id} has {chunk.num_tokens} tokens, more than the {room} that fit "
                             f"the model's context window of {self.context_window} behind the lead-in; split it into "
                             "smaller chunks (e.g. cacheblend_rag.ingest.loaders.split_texts)")
        return chunk

    def resolve_chunk(self, item: str | Chunk, salt: str | None = None) -> Chunk:
        """A chunk from its text, its id, or a Chunk, remembered under `salt` (a request's `cache_salt`).

        An id resolves from the shared corpus (ingested chunks: this engine's, the chunk index, the store's shared
        KV) or from what requests with the same salt sent; never from another salt's documents, so a salted client
        cannot use an id to ask whether another client sent that document."""
        if isinstance(item, Chunk):
            return self.chunks.add(item, salt)
        if not isinstance(item, str):
            raise ChunkError(f"a chunk must be a str (text or chunk id), got {type(item).__name__}")
        if looks_like_chunk_id(item):
            known = self.chunks.get(item, salt) or (self.chunks.get(item) if salt else None)
            if known is not None:
                return self.chunks.add(known, salt)
            text = self.index.text(item)
            if text is not None:
                return self.chunks.add(make_chunk(text, self.tokenizer), salt)
            token_ids = self.cache.salted(salt).token_ids(item)  # this salt's own stored KV (a hole it sent)
            if token_ids is None and salt:
                token_ids = self.cache.token_ids(item)  # the shared KV the operator ingested
            if token_ids is not None:
                return self.chunks.add(Chunk(item, self.tokenizer.decode(token_ids.tolist()), token_ids), salt)
            raise ChunkError(f"unknown chunk id {item!r}: not in the KV store and no text given; ingest its text first")
        return self.chunks.add(make_chunk(item, self.tokenizer), salt)

    def knows(self, chunk_id: str) -> bool:
        """Whether the chunk id resolves: its text was seen by this engine or its KV is stored."""
        return chunk_id in self.chunks or self.cache.has_kv(chunk_id)

    def has_kv(self, chunk_id: str) -> bool:
        """Whether the chunk's KV is stored (and its entry checks out)."""
        return self.cache.has_kv(chunk_id)

    def kv_nbytes(self, chunk_id: str) -> int | None:
        """Bytes the chunk's KV takes in the store (as stored, e.g. its file), or None if it is not stored."""
        return self.kv_store.entry_nbytes(self.cache.key(chunk_id))

    def drop_kv(self, chunk_ids: str | Iterable[str]) -> int:
        """Forget these chunks (e.g. their source changed): their stored KV, their text and their place in the
        chunk index; how many had KV stored."""
        chunk_ids = [chunk_ids] if isinstance(chunk_ids, str) else list(chunk_ids)
        with self._lock:
            self.chunks.remove(chunk_ids)
            self.index.remove(chunk_ids)
            return self.cache.drop(chunk_ids)

    # ---- prefill ------------------------------------------------------------------------

    def prefill_request(self, request: Request, *, store_holes: bool = True) -> Prefill:
        """Fused prefill of one request: its chunks and question (after its earlier turns), or its whole prompt.

        Holes (chunks not in the store) are computed in context, then stored after the logits unless
        `store_holes=False`, which leaves them in `Prefill.unstored_holes`.
        """
        cache = self.cache.salted(request.cache_salt)
        with self._lock, torch.inference_mode():
            policy, decision = request.policy, None
            if request.calibrated_ratio and (decision := self.gate(policy.name)) is not None:
                policy = dataclasses.replace(policy, recompute_ratio=decision.ratio)  # the model's own ratio
            fusion = self.fusion_of(request, self.links_for(request, policy, decision))
            # counted here, once: a request that retries after a failed read places its chunks again
            fusion = dataclasses.replace(fusion, opening_recurs=cache.opening_recurs(fusion.prefix_ids))
            out = fused_prefill(cache, policy, fusion, store_holes=store_holes,
                                auto_ratio=self._auto_ratio if request.auto_ratio else None)
            if decision is not None:
                out.stats = dataclasses.replace(out.stats, fidelity=decision.stats())
            if self.links is not None:
                ran = fusion.links is not None
                out.stats = dataclasses.replace(out.stats, links=fusion.links.describe() if ran else {"ran": False})
            return out

    def fusion_of(self, request: Request, links: Links | None = None) -> FusionRequest:
        """The request's token layout and the stored chunks placed in it, with `links`' rows after the last chunk
        (none when it carries no chunk)."""
        if request.prompt is not None:
            fusion = prompt_request(self.tokenizer, self.index, self.resolve_chunk, request.prompt, request.tools,
                                    context_window=self.context_window, model_name=self.model_name,
                                    no_match=self._no_match_warning)
        else:
            resolved = [self.resolve_chunk(c, request.cache_salt) for c in request.chunks]
            prefix, separator, suffix = (request.template or self.template).render(self.tokenizer, request.question,
                                                                                   request.history)
            fusion = FusionRequest(resolved, assemble(prefix, [c.token_ids for c in resolved], separator, suffix))
        row = after_last_chunk(fusion.layout) if links is not None else None
        if row is not None:
            fusion = dataclasses.replace(fusion, layout=insert_rows(fusion.layout, row, links.token_ids), links=links)
        n = int(fusion.layout.token_ids.numel())
        if n == 0:  # e.g. a completion prompt of "\u0016": nothing to prefill (a 500 from the layer loop before)
            raise ConfigError("the prompt has no tokens: its text is only characters the tokenizer drops "
                              "(control characters?); send some text")
        if n > self.context_window:
            raise PromptTooLongError(
                f"prompt of {n} tokens ({len(fusion.chunks)} chunks) exceeds the model's context window of "
                f"{self.context_window} tokens; pass fewer or shorter chunks"
            )
        return fusion

    @property
    def controller(self) -> LoadingController:
        """The loading controller, from profiles measured once per model/device/dtype (cached on disk)."""
        if self._controller is None:
            compute, tiers = load_or_measure(self, self.kv_store.tiers().get("disk"), home=self.home)
            self._controller = LoadingController(compute, tiers, self.quality_floor)
        return self._controller

    def _auto_ratio(self, seq: FusedSequence, placed: Placements) -> RatioDecision:
        """The controller's ratio: a layer's recompute matches the next layer's load, never below the floor."""
        controller = self.controller
        by_tier: dict[str, int] = {}
        for p in placed.placements:
            tier = p.kv.tier if p.kv.tier in controller.tiers else "memory"  # just computed: resident
            by_tier[tier] = by_tier.get(tier, 0) + p.kv.layer_nbytes
        return controller.choose_ratio(int(seq.reused.sum()), int((~seq.cached).sum()), seq.num_rows, by_tier)

    # ---- generation ---------------------------------------------------------------------

    def generate_request(self, request: Request) -> Generation:
        """Fused prefill of the request, then its answer decoded as `request.sampling` says."""
        sampling = request.sampling
        with self._decodable(request) as pre:
            started = time.perf_counter()
            answer = self._decode(pre, sampling, self.cache.salted(request.cache_salt))
            decode_s = time.perf_counter() - started
        ids = list(answer.token_ids)
        stats = dataclasses.replace(pre.stats, num_generated=len(ids), timing=dict(pre.stats.timing, decode_s=decode_s))
        return Generation(answer.text.strip(), ids, pre.stats.ttft_s, stats, pre.logits, answer.finish_reason,
                          answer.grammar_satisfied)

    def stream_request(self, request: Request, stats: dict | None = None) -> Generator[str, None, None]:
        """Yield the answer's text pieces as they are decoded; `stats`, if given, gets the prefill's stats, then
        decoding's (`finish_reason` and `grammar_satisfied` included). Stopping the iteration (or closing the
        generator) stops decoding at the next token."""
        if request.prompt is not None:
            # a chat prompt needs a chat template: fail here, not at next()
            prompt_text(self.tokenizer, request.prompt, request.tools, model_name=self.model_name)
        sampling = request.sampling
        cache = self.cache.salted(request.cache_salt)
        return stream_decode(lambda: self._decodable(request),
                             lambda pre, emit, cancel: self._decode(pre, sampling, cache, emit, cancel), stats)

    def start_request(self, request: Request) -> tuple[KVSequence, RequestStats]:
        """Fused prefill, then a sequence ready to decode with `advance` (alone or batched with others), and the
        prefill's stats. Needs the default decoder ("kv")."""
        if self.decoder != "kv":
            raise ConfigError(f'batched decoding needs decoder="kv", this engine uses {self.decoder!r}')
        with self._lock:
            self._run_deferred_stores()
            with self._decodable(request, defer_stores=True) as pre:
                seq = self._kv_decoder.sequence(pre.token_ids, pre.keys, pre.values, request.sampling,
                                                first_logits=pre.logits)
                self._sequence_caches[seq] = self.cache.salted(request.cache_salt)
        return seq, pre.stats

    def advance(self, sequences: Sequence[KVSequence]) -> list[str]:
        """One decode step for every sequence at once (each must be unfinished): the text piece each hands out
        now (stop strings already cut); `seq.finished` / `seq.finish_reason` say which ended."""
        with self._lock:
            self._run_deferred_stores()
            pieces = self._kv_decoder.advance(sequences)
            for seq in sequences:
                if seq.finished:
                    self._keep(seq, self._sequence_caches.pop(seq, self.cache))
            return pieces

    def _decode(self, pre: Prefill, sampling: SamplingOptions, cache: ChunkCache, emit=None, cancel=None) -> Answer:
        """The answer after the prefill, with the chosen decoder (its text pieces handed to `emit` as they come):
        "kv" takes its first token from the prefill's logits (no step recomputes the last prompt token); "hf", the
        reference, recomputes it as generate does and feeds its tokens to an `Answer` as they come. Either way the
        answer's text and finish_reason are decided once, by its `Answer`. The finished KV is kept in `cache` (the
        request's salted view)."""
        if self.decoder == "kv":
            done: list[KVSequence] = []

            def finished(seq: KVSequence) -> None:
                done.append(seq)
                self._keep(seq, cache)

            kv_decode(self.adapter, self.tokenizer, pre.token_ids, pre.keys, pre.values, sampling, cancel=cancel,
                      first_logits=pre.logits, decoder=self._kv_decoder, on_done=finished, on_piece=emit)
            return done[0].answer
        answer = Answer(self.tokenizer, sampling, self.tokenizer.eos_token_id,
                        pieces=bool(sampling.stop) or emit is not None)
        cancel = cancel or threading.Event()
        decode(self.model, self.tokenizer, pre.token_ids, pre.keys, pre.values, sampling,
               answer_streamer(answer, emit, cancel), cancel)
        self._keep(pre, cache)  # the reference decoder's cache is HF's: keep the prompt's rows only
        return answer

    def _keep(self, done: KVSequence | Prefill, cache: ChunkCache) -> None:
        """Keep a finished request's KV (a decoded sequence's filled rows, or a prefill's) as a stored prefix in
        `cache` (the request's salted view), so the next turn of a conversation starts from it. Best effort: a
        failure is logged once, never raised."""
        if not self.prefix_reuse:
            return
        try:
            with torch.inference_mode():
                if isinstance(done, KVSequence):
                    cache.store_prefix(*done.filled())
                else:
                    cache.store_prefix(done.token_ids, done.keys, done.values)
        except Exception as e:  # noqa: BLE001 - the answer is out; keeping its KV is an optimisation
            if not self._warned_keep:
                logger.warning("could not keep the request's KV as a stored prefix (%s: %s); said once",
                               type(e).__name__, e)
            self._warned_keep = True

    def _run_deferred_stores(self) -> None:
        """Store what started requests' prefills left (under the model's lock; best effort, as `store_pending`)."""
        with torch.inference_mode():
            while self._deferred_stores:
                self._deferred_stores.popleft()()

    @contextmanager
    def _decodable(self, request: Request, defer_stores: bool = False) -> Iterator[Prefill]:
        """Under the model's lock: the prefill to decode from, checked for room; its holes are stored after the
        block (best effort), so neither the answer nor its first streamed piece waits for them — with
        `defer_stores`, later still: at the next `advance` or `start_request` (the first piece is handed out by
        the caller of `start_request`, after the block)."""
        sampling = request.sampling
        if sampling.grammar is not None and self.decoder != "kv":
            raise ConfigError(f'constrained decoding (grammar=) needs decoder="kv", this engine uses {self.decoder!r}')
        with self._lock:
            pre = self.prefill_request(request, store_holes=False)
            try:
                total = int(pre.token_ids.numel()) + sampling.max_new_tokens
                if total > self.context_window:
                    raise PromptTooLongError(
                        f"prompt of {pre.token_ids.numel()} tokens + max_new_tokens={sampling.max_new_tokens} "
                        f"exceeds the context window of {self.context_window} tokens"
                    )
                yield pre
            finally:
                stores = take_pending(self.cache.salted(request.cache_salt), pre)
                if defer_stores:
                    self._deferred_stores.append(stores)
                else:
                    with torch.inference_mode():
                        stores()

