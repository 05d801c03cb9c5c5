"""The engines users would pick instead, on `bench conversation`'s own turns (`--peers kvboost,llama.cpp`).

    kvboost     PyPI `kvboost` (chunk-level KV reuse for HF models), its `cacheblend` strategy at the bench's ratio,
                on the same converted model folder and dtype as the engine; each conversation's passages warmed
                with its `warm()`; its prefix-hashed chunks carry earlier turns over
    llama.cpp   `llama-cpp-python` on the same weights as GGUF (the packaged Q4_1 file dequantized to the engine's
                dtype), one `Llama` with a `LlamaRAMCache` and the slot's own prefix reuse across calls

Each peer sees the chat-template text the engine renders for the turn, and its TTFT is the wall time from the
call to its first token (a callback for kvboost, the first streamed chunk for llama.cpp), so work a peer does
before its own timer starts (kvboost's CacheBlend recompute) is counted. Both are optional (`[peers]` extra),
imported only when asked; one missing is reported in one line and the bench runs without it.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
import unicodedata
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from cacheblend_rag.errors import ConfigError

logger = logging.getLogger(__name__)

PEERS = ("kvboost", "llama.cpp")
INSTALL_HINT = "pip install -e 'benchmarks[peers]'"
# kvboost's chunk cache: every conversation's chunks fit (10 chats × 4 turns × ~1.2k tokens × 23 kB/token in bf16)
KVBOOST_CACHE_BYTES = 4 << 30
KVBOOST_MAX_CHUNKS = 4096
LLAMA_RAM_CACHE_BYTES = 2 << 30
# GGUF tensor types llama.cpp offers per engine dtype: the closest to what the engine computes in
_GGUF_TYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


@dataclass(frozen=True)
class PeerTurn:
    """One peer's answer to one turn: its TTFT, the prompt tokens it saw and how many it took from its cache."""

    ttft_s: float
    prompt_tokens: int
    cached_tokens: int | None  # None: the peer does not say
    logits: torch.Tensor | None = None  # first-token logits (vocab,), where the peer exposes them


class Peer(Protocol):
    """An engine timed on the bench's turns."""

    name: str

    def warm(self, passages: list[str]) -> None:
        """Precompute what the peer can before a conversation's first turn (untimed)."""

    def first_token(self, text: str) -> PeerTurn:
        """Time the peer's generate on the turn's full prompt text to its first token."""


def parse_peers(text: str | None) -> tuple[str, ...]:
    """`--peers kvboost,llama.cpp` → the names, checked against PEERS."""
    names = tuple(n.strip() for n in (text or "").split(",") if n.strip())
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ConfigError(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    return names


def chat_text(tokenizer, messages: list[dict[str, str]]) -> str:
    """The text the engine's generate_prompt renders for chat messages (its chat template, NFC)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return unicodedata.normalize("NFC", text)


class KVBoostPeer:
    """kvboost's InferenceEngine with recompute_strategy='cacheblend' on the engine's model folder and dtype."""

    name = "kvboost"

    def __init__(self, folder: Path, dtype: torch.dtype, recompute_ratio: float) -> None:
        from kvboost import KVBoost
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # kvboost's from_pretrained loads in float16 whatever the model; build it on our own load instead
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.engine = KVBoost(model, tokenizer, max_cache_bytes=KVBOOST_CACHE_BYTES, max_chunks=KVBOOST_MAX_CHUNKS,
                              recompute_strategy="cacheblend", recompute_ratio=recompute_ratio, device="cpu")

    def warm(self, passages: list[str]) -> None:
        """Each passage's fixed-size chunks, as kvboost's README warms documents."""
        for passage in passages:
            self.engine.warm(passage)

    def first_token(self, text: str) -> PeerTurn:
        """kvboost's generate in its chunk-reuse mode; its first token's callback stops the clock."""
        stamps: list[float] = []
        start = time.perf_counter()
        out = self.engine.generate(text, max_new_tokens=1, on_token=lambda _tok: stamps.append(time.perf_counter()))
        logits = torch.from_numpy(out.first_token_logits) if out.first_token_logits is not None else None
        return PeerTurn(stamps[0] - start, out.prompt_tokens, out.cached_tokens, logits)


class LlamaCppPeer:
    """llama-cpp-python on one `Llama`: its RAM prompt cache plus the slot's reuse of the last prompt's prefix."""

    name = "llama.cpp"

    def __init__(self, gguf: Path, num_threads: int, context_window: int) -> None:
        from llama_cpp import Llama, LlamaRAMCache

        self.llm = Llama(model_path=str(gguf), n_ctx=context_window, n_threads=num_threads,
                         n_threads_batch=num_threads, verbose=False)
        self.llm.set_cache(LlamaRAMCache(capacity_bytes=LLAMA_RAM_CACHE_BYTES))

    def warm(self, passages: list[str]) -> None:
        """Nothing: llama.cpp reuses exact prefixes only, so passages cannot be precomputed apart from a prompt."""

    def first_token(self, text: str) -> PeerTurn:
        """A streamed completion of one token; the first chunk stops the clock, the rest (cache save) is drained."""
        prompt_tokens = len(self.llm.tokenize(text.encode("utf-8"), special=True))
        start = time.perf_counter()
        stream = self.llm.create_completion(text, max_tokens=1, temperature=0.0, stream=True)
        next(iter(stream))
        ttft = time.perf_counter() - start
        for _ in stream:  # let it finish: the RAM cache saves the state after the completion
            pass
        return PeerTurn(ttft, prompt_tokens, None)


def gguf_in_dtype(alias: str, dtype: torch.dtype, folder: Path) -> Path:
    """A packaged model's GGUF with its quantized tensors dequantized to `dtype`'s GGUF type, written once beside
    its converted folder `folder` (the same weights the engine loaded, dequantized the same way)."""
    from cacheblend_rag.models.loader import PACKAGED_GGUF

    kind = _GGUF_TYPES.get(dtype)
    if kind is None:
        raise ConfigError(f"llama.cpp has no GGUF type for {dtype}; use --dtype bfloat16, float16 or float32")
    target = folder.parent / f"{folder.name}.{kind.lower()}.gguf"
    if target.is_file():
        return target
    with PACKAGED_GGUF[alias].gguf(folder.parent) as source:
        tmp = folder.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            _write_dequantized(source, tmp, kind)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    logger.info("wrote %s for the llama.cpp peer", target)
    return target


def _write_dequantized(source: Path, target: Path, kind: str) -> None:
    """Copy a GGUF's metadata; quantized tensors become `kind` (BF16/F16/F32), F32 ones (norms) stay F32."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(target, arch=arch, endianess=reader.endianess)
    file_types = {"BF16": gguf.LlamaFileType.MOSTLY_BF16, "F16": gguf.LlamaFileType.MOSTLY_F16,
                  "F32": gguf.LlamaFileType.ALL_F32}
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(file_types[kind])
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
    target_type = gguf.GGMLQuantizationType[kind]
    for tensor in reader.tensors:
        if tensor.tensor_type == gguf.GGMLQuantizationType.F32 or tensor.tensor_type == target_type:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if kind == "F32":
            writer.add_tensor(tensor.name, values.astype(np.float32))
        elif kind == "F16":
            writer.add_tensor(tensor.name, values.astype(np.float16))
        else:
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, target_type), raw_dtype=target_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def open_peers(names: tuple[str, ...], *, model: str, folder: Path, dtype: torch.dtype, recompute_ratio: float,
               context_window: int) -> tuple[list[Peer], list[str]]:
    """The named peers that can run here on `model` (loaded from `folder`), and one line for each that cannot."""
    from cacheblend_rag.models.loader import PACKAGED_GGUF

    modules = {"kvboost": "kvboost", "llama.cpp": "llama_cpp"}
    peers: list[Peer] = []
    skipped: list[str] = []
    for name in names:
        try:
            importlib.import_module(modules[name])
        except (ImportError, OSError) as e:  # OSError: llama_cpp found but its shared library would not load
            skipped.append(f"peer {name}: not available ({e}); {INSTALL_HINT} — running without it")
            continue
        if name == "kvboost":
            peers.append(KVBoostPeer(folder, dtype, recompute_ratio))
        elif model not in PACKAGED_GGUF:
            skipped.append(f"peer llama.cpp: needs a packaged model's GGUF ({', '.join(sorted(PACKAGED_GGUF))}), "
                           f"not {model!r} — running without it")
        else:
            peers.append(LlamaCppPeer(gguf_in_dtype(model, dtype, folder), torch.get_num_threads(), context_window))
    return peers, skipped
