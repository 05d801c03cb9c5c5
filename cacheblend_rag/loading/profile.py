"""Measured costs the loading controller needs: recompute time per layer, read throughput per tier.

Measured once per model, device and dtype, cached as JSON under the package home,
re-measured on demand (`cacheblend-rag profile --remeasure`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import settings
from ..errors import ProfileError

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


@dataclass(frozen=True)
class CodecProfile:
    """Size and decode speed of one KV codec on this machine (speeds in fp16-equivalent bytes: the same work unit
    for every codec, so a tier's fetch time is `fp16_bytes * size_ratio / read + fp16_bytes / decode`)."""

    name: str
    size_ratio: float  # stored bytes / fp16 bytes
    decode_bytes_per_s: float  # fp16-equivalent bytes decoded per second (one layer at a time)

    def fetch_time(self, fp16_bytes: float, tier: TierProfile) -> float:
        """Seconds to read `fp16_bytes` worth of KV stored with this codec from `tier` and decode it."""
        decode = fp16_bytes / self.decode_bytes_per_s if self.decode_bytes_per_s > 0 else float("inf")
        return tier.load_time(int(fp16_bytes * self.size_ratio)) + decode


def synthetic_kv(num_layers: int = 4, num_tokens: int = 512, num_kv_heads: int = 3, head_dim: int = 64,
                 seed: int = 0):
    """A seeded KV with what real keys have (per-channel offsets, a few outlier channels) for codec probes."""
    from ..store.base import ChunkKV

    gen = torch.Generator().manual_seed(seed)
    keys, values = [], []
    for _ in range(num_layers):
        offset = torch.randn(1, num_kv_heads, head_dim, generator=gen) * 2
        offset[..., :4] *= 4  # outlier channels, as pre-RoPE keys have
        keys.append(offset + torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen))
        values.append(torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 0.5)
    return ChunkKV(tuple(keys), tuple(values), torch.zeros(num_tokens, dtype=torch.int64))


def measure_codec(name: str, kvs=None, repeats: int = 2) -> CodecProfile:
    """Size ratio and per-layer decode speed of codec `name` on `kvs` (ChunkKVs; default: synthetic_kv())."""
    from ..store.codecs import encode_chunk, get_codec, layer_nbytes

    kvs = kvs if kvs is not None else [synthetic_kv()]
    codec = get_codec(name)
    stored = fp16 = 0
    decode_s = 0.0
    for kv in kvs:
        layers = encode_chunk(codec, kv)
        stored += sum(layer_nbytes(t) for t in layers)
        fp16 += sum(2 * (k.numel() + v.numel()) for k, v in zip(kv.keys, kv.values))
        k0, v0 = kv.keys[0], kv.values[0]
        shape = dict(num_tokens=kv.num_tokens, num_kv_heads=k0.shape[1], head_dim=k0.shape[2],
                     v_head_dim=v0.shape[2], num_layers=kv.num_layers, dtype=k0.dtype)
        best = float("inf")
        for _ in range(repeats):  # the best of a few: the least disturbed by other load
            started = time.perf_counter()
            for i, t in enumerate(layers):
                codec.decode_layer(t, layer=i, **shape)
            best = min(best, time.perf_counter() - started)
        decode_s += best
    return CodecProfile(name, stored / fp16, fp16 / max(decode_s, 1e-9))


def measure_codecs(names=("fp16", "int8", "cachegen"), kvs=None) -> dict[str, CodecProfile]:
    """measure_codec for each name."""
    return {name: measure_codec(name, kvs) for name in names}


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


PROBE_PREFIX = ".probe-"
CONSERVATIVE_DISK = TierProfile("disk", 100e6)  # a slow disk: "auto" then recomputes more, never less
CONSERVATIVE_MEMORY = TierProfile("memory", 1e9)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_stale_probes(root: str | Path) -> int:
    """Remove probe files left by a killed measurement (their process is gone); returns how many."""
    removed = 0
    for path in Path(root).glob(PROBE_PREFIX + "*"):
        pid = path.name[len(PROBE_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and _pid_alive(int(pid)):
            continue  # a live measurement's (or ours, removed by its own finally)
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("could not remove stale disk probe %s: %s", path, e)
    if removed:
        logger.info("removed %d stale disk probe file(s) under %s", removed, root)
    return removed


def measure_disk(root: str | Path, num_bytes: int = 64 * 1024**2, *, reserve_bytes: int = 256 * 1024**2) -> TierProfile:
    """Cold read throughput of the file system under `root` (page cache dropped for the probe file).

    The probe file (`.probe-<pid>-*`, `num_bytes`) is always removed, and stale ones of killed processes are
    removed first. Needs `num_bytes + reserve_bytes` free: the probe never fills the disk a KV store writes to.
    Raises ProfileError (with the reason and the fix) when it cannot measure.
    """
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_probes(root)
        free = shutil.disk_usage(root).free
    except OSError as e:
        raise ProfileError(f"cannot measure the disk tier under {root}: {e}") from e
    if free < num_bytes + reserve_bytes:
        mib = 1024**2
        raise ProfileError(f"cannot measure the disk tier under {root}: {free / mib:.1f} MiB free, the probe needs "
                           f"{(num_bytes + reserve_bytes) / mib:.0f} MiB ({num_bytes / mib:.0f} MiB file + "
                           f"{reserve_bytes / mib:.0f} MiB left free); free some space there or put the KV store "
                           "elsewhere (--home)")
    path = root / f"{PROBE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    block = 4 * 1024**2
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            written = 0
            while written < num_bytes:
                written += os.write(fd, os.urandom(min(block, num_bytes - written)))
        finally:
            os.close(fd)
        drop_page_cache([path])
        started = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(block):
                pass
        seconds = time.perf_counter() - started
    except OSError as e:
        raise ProfileError(f"cannot measure the disk tier under {root}: {e}; free some space there or put the "
                           "KV store elsewhere (--home)") from e
    finally:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:  # the next measurement removes it (its process will be gone)
            logger.warning("could not remove the disk probe %s: %s", path, e)
    return TierProfile("disk", num_bytes / max(seconds, 1e-9))


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
    """Fit the per-layer time of the fused loop on synthetic chunks (a throwaway engine of the same class on
    the same model, with a memory store)."""
    probe = type(engine)(engine.model, engine.tokenizer, kv_store=None, lead_in=engine.lead_in,
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


def _read_cached(path: Path) -> tuple[ComputeProfile, dict[str, TierProfile]] | None:
    """The profiles cached at `path`; None (and a warning) when the file is damaged."""
    try:
        data = json.loads(path.read_text())
        return ComputeProfile(**data["compute"]), {k: TierProfile(**v) for k, v in data["tiers"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        logger.warning("the cached profile %s is unreadable (%s); measuring again", path, e)
        return None


def _write_cached(path: Path, compute: ComputeProfile, tiers: dict[str, TierProfile]) -> None:
    """Write the profiles atomically (a temporary file renamed over); never leaves a partial file."""
    data = json.dumps({"compute": asdict(compute), "tiers": {k: asdict(v) for k, v in tiers.items()}}, indent=1)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ProfileError(f"cannot cache the profile in {path}: {e}") from e


def load_or_measure(engine, disk_root: str | Path | None = None, *, remeasure: bool = False,
                    home: str | os.PathLike[str] | None = None,
                    strict: bool = False) -> tuple[ComputeProfile, dict[str, TierProfile]]:
    """The cached profiles, measured first if missing, damaged, or if `remeasure`.

    A storage tier that cannot be measured (a full disk, say) raises ProfileError when `strict` (the `profile`
    command); otherwise it logs a warning and takes a conservative default (a slow tier: "auto" recomputes more),
    and nothing is cached, so the next process measures again. A request never fails over its profile.
    """
    path = profile_path(engine, home)
    if path.is_file() and not remeasure:
        cached = _read_cached(path)
        if cached is not None:
            return cached
    logger.info("measuring compute and storage profiles (once; cached in %s)", path)
    tiers: dict[str, TierProfile] = {}
    fell_back = False
    measures = (("disk", lambda: measure_disk(disk_root or settings.kv_dir(home)), CONSERVATIVE_DISK),
                ("memory", lambda: measure_memory(engine.adapter.device, engine.adapter.dtype), CONSERVATIVE_MEMORY))
    for name, measure, default in measures:  # the disk first: the likeliest to fail, and the cheapest
        try:
            tiers[name] = measure()
        except (ProfileError, RuntimeError, OSError) as e:
            if strict and isinstance(e, ProfileError):
                raise
            if strict:
                raise ProfileError(f"cannot measure the {name} tier: {e}") from e
            logger.warning("%s; assuming %.2f GB/s for the %s tier (not cached)", e, default.read_bytes_per_s / 1e9,
                           name)
            tiers[name], fell_back = default, True
    compute = measure_compute(engine)
    tiers = {"memory": tiers["memory"], "disk": tiers["disk"]}
    if not fell_back:
        try:
            _write_cached(path, compute, tiers)
        except ProfileError as e:
            if strict:
                raise
            logger.warning("%s; it will be measured again next time", e)
    return compute, tiers
