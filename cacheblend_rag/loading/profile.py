"""Measured costs the loading controller needs: recompute time per layer, read throughput per tier.

Measured once per model, device and dtype, cached as JSON under the package home,
re-measured on demand (`cacheblend-rag profile --remeasure`).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ComputeProfile:
    """Time of one layer of the fused loop as a line in its active rows, at a context of `num_tokens`."""

    num_tokens: int
    layer_fixed_s: float  # per layer, whatever the rows (cached-KV placement, RoPE, launch overheads)
    layer_per_row_s: float  # per active row per layer (projections, attention over the context, MLP)
    full_prefill_s: float  # a full prefill of num_tokens tokens, for reference

    def layer_time(self, num_rows: int, num_tokens: int | None = None) -> float:
        """Estimated seconds for one layer computing `num_rows` rows (attention scaled to the context)."""
        scale = 1.0 if not num_tokens else (0.5 + 0.5 * num_tokens / self.num_tokens)  # ~half the row cost is attention
        return self.layer_fixed_s + self.layer_per_row_s * num_rows * scale


@dataclass(frozen=True)
class TierProfile:
    """Read throughput of one storage tier into compute memory."""

    name: str
    read_bytes_per_s: float

    def load_time(self, num_bytes: int) -> float:
        """Estimated seconds to read `num_bytes`."""
        return num_bytes / self.read_bytes_per_s if self.read_bytes_per_s > 0 else float("inf")


def drop_page_cache(paths) -> int:
    """Ask the OS to drop cached pages of these files (posix_fadvise DONTNEED); returns how many it could."""
    dropped = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += 1
        except (OSError, AttributeError):
            pass
        finally:
            os.close(fd)
    return dropped


def measure_disk(root: str | Path, num_bytes: int = 64 * 1024**2) -> TierProfile:
    """Cold read throughput of the file system under `root` (page cache dropped for the test file)."""
    Path(root).mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=root, prefix=".probe-", delete=False) as f:
        f.write(os.urandom(num_bytes))
        path = f.name
    try:
        drop_page_cache([path])
        started = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(4 * 1024**2):
                pass
        seconds = time.perf_counter() - started
    finally:
        os.unlink(path)
    return TierProfile("disk", num_bytes / seconds)


def measure_memory(device: torch.device, dtype: torch.dtype, num_bytes: int = 64 * 1024**2) -> TierProfile:
    """Throughput of copying resident (fp16) KV into compute tensors of `dtype` on `device`."""
    src = torch.randn(num_bytes // 2, dtype=torch.float16)
    dst = torch.empty(src.shape, dtype=dtype, device=device)
    dst.copy_(src)
    started = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return TierProfile("memory", 3 * num_bytes / (time.perf_counter() - started))


def measure_compute(engine, num_tokens: int = 2048, ratios: tuple[float, float] = (0.05, 0.4)) -> ComputeProfile:
    """Fit the per-layer time of the fused loop on synthetic chunks (a throwaway memory store)."""
    from ..engine import CacheBlendEngine

    probe = CacheBlendEngine(engine.model, engine.tokenizer, kv_store=None, lead_in=engine.lead_in,
                             template=engine.template)
    gen = torch.Generator().manual_seed(0)
    vocab = min(len(engine.tokenizer), engine.model.config.vocab_size)
    chunk_len = 256
    texts = [engine.tokenizer.decode(torch.randint(100, vocab, (chunk_len,), generator=gen).tolist())
             for _ in range(max(1, num_tokens // chunk_len))]
    ids = probe.ingest(texts, show_progress=False)
    question = "What is this about?"
    probe.prefill(ids, question, recompute_ratio=ratios[0])  # warm up
    full = probe.prefill(ids, question, method="full_prefill")
    points = []
    for r in ratios:
        pre = probe.prefill(ids, question, recompute_ratio=r)
        rows = sum(pre.stats["rows_per_layer"]) / len(pre.stats["rows_per_layer"])
        points.append((rows, pre.stats["timing"]["layers_s"] / engine.adapter.num_layers))
    (x0, y0), (x1, y1) = points
    per_row = max((y1 - y0) / (x1 - x0), 1e-9)
    return ComputeProfile(full.stats["num_tokens"], max(y0 - per_row * x0, 0.0), per_row, full.stats["ttft_s"])


def profile_path(engine, home: str | os.PathLike[str] | None = None) -> Path:
    """Where the profiles of this model, device and dtype are cached."""
    a = engine.adapter
    dtype = str(a.dtype).removeprefix("torch.")
    return settings.home_dir(home) / "profiles" / f"{engine.fingerprint}-{a.device.type}-{dtype}.json"


def load_or_measure(engine, disk_root: str | Path | None = None, *, remeasure: bool = False,
                    home: str | os.PathLike[str] | None = None) -> tuple[ComputeProfile, dict[str, TierProfile]]:
    """The cached profiles, measured first if missing (or if `remeasure`)."""
    path = profile_path(engine, home)
    if path.is_file() and not remeasure:
        data = json.loads(path.read_text())
        return ComputeProfile(**data["compute"]), {k: TierProfile(**v) for k, v in data["tiers"].items()}
    logger.info("measuring compute and storage profiles (once; cached in %s)", path)
    compute = measure_compute(engine)
    tiers = {"memory": measure_memory(engine.adapter.device, engine.adapter.dtype)}
    tiers["disk"] = measure_disk(disk_root or settings.kv_dir(home))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"compute": asdict(compute), "tiers": {k: asdict(v) for k, v in tiers.items()}}, indent=1))
    return compute, tiers
