"""Measured speeds below the loading controller: a tier's read throughput, a codec's size and decode speed, and
the per-tier codec choice they give ("?codec=auto" tiers of open_store use it; the controller re-exports it).

Lives in `store` because open_store resolves "auto" tiers; `loading.profile` caches these with the compute profile.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError, ProfileError
from .base import ChunkKV
from .codecs import encode_chunk, get_codec, layer_nbytes

logger = logging.getLogger(__name__)


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
    gen = torch.Generator().manual_seed(seed)
    keys, values = [], []
    for _ in range(num_layers):
        offset = torch.randn(1, num_kv_heads, head_dim, generator=gen) * 2
        offset[..., :4] *= 4  # outlier channels, as pre-RoPE keys have
        keys.append(offset + torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen))
        values.append(torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 0.5)
    return ChunkKV(tuple(keys), tuple(values), torch.zeros(num_tokens, dtype=torch.int64))


def measure_codec_profile(name: str, kvs=None, repeats: int = 2) -> CodecProfile:
    """Size ratio and per-layer decode speed of codec `name` on `kvs` (ChunkKVs; default: synthetic_kv())."""
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


def measure_codec_profiles(names=("fp16", "int8", "cachegen"), kvs=None) -> dict[str, CodecProfile]:
    """measure_codec_profile for each name."""
    return {name: measure_codec_profile(name, kvs) for name in names}


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



RECOMPUTE = "recompute"


@dataclass(frozen=True)
class CodecChoice:
    """The codec a tier should store (or "recompute": fetching any is slower than computing) and the estimates:
    seconds per fp16-equivalent MB of KV for every candidate."""

    codec: str
    seconds_per_mb: dict[str, float]

    def as_dict(self) -> dict:
        """For stats and reports."""
        return {"codec": self.codec, "seconds_per_mb": dict(self.seconds_per_mb)}


def choose_codec(tier: TierProfile, codecs: dict[str, CodecProfile], *, allowed: tuple[str, ...] | None = None,
                 recompute_s_per_mb: float | None = None) -> CodecChoice:
    """The allowed codec (the quality floor: by default every one in `codecs`) with the lowest fetch time (read +
    decode) from `tier`; RECOMPUTE when `recompute_s_per_mb` (computing the same KV) beats them all."""
    names = [n for n in codecs if allowed is None or n in allowed]
    if not names:
        raise ConfigError(f"no codec is allowed: allowed={allowed}, measured={sorted(codecs)}")
    per_mb = {n: codecs[n].fetch_time(1e6, tier) for n in names}
    best = min(names, key=per_mb.__getitem__)
    if recompute_s_per_mb is not None:
        per_mb[RECOMPUTE] = recompute_s_per_mb
        if recompute_s_per_mb < per_mb[best]:
            best = RECOMPUTE
    return CodecChoice(best, per_mb)


@functools.lru_cache(maxsize=None)
def _probe_codecs() -> dict[str, CodecProfile]:
    return measure_codec_profiles()


CONSERVATIVE_REMOTE = TierProfile("redis", 125e6)  # 1 Gbit/s, when a remote tier cannot be measured


def auto_codec(tier: str, root: str | Path | None = None, *, profile: TierProfile | None = None,
               codecs: Mapping[str, CodecProfile] | None = None) -> str:
    """The codec for a "codec=auto" tier: measures the tier (memory copy, or a cold read under `root` for disk;
    a remote tier passes its own measured `profile`, None when it could not measure) and, unless `codecs` gives
    them, the codecs' decode speed once per process, and returns choose_codec's pick."""
    if tier not in ("memory", "disk"):
        if profile is None:
            profile = CONSERVATIVE_REMOTE
            logger.warning("cannot measure the %s tier; assuming %.2f GB/s", tier, profile.read_bytes_per_s / 1e9)
    else:
        try:
            if tier == "disk" and root is not None:
                profile = measure_disk(root, 16 * 1024**2, reserve_bytes=64 * 1024**2)
            else:
                profile = measure_memory(torch.device("cpu"), torch.float32, 16 * 1024**2)
        except (ProfileError, OSError, RuntimeError) as e:
            profile = CONSERVATIVE_DISK if tier == "disk" else CONSERVATIVE_MEMORY
            logger.warning("cannot measure the %s tier (%s); assuming %.2f GB/s", tier, e,
                           profile.read_bytes_per_s / 1e9)
    choice = choose_codec(profile, dict(codecs) if codecs is not None else _probe_codecs())
    logger.info("the %s tier codes KV with %s (estimated s per fp16 MB: %s)", tier, choice.codec,
                {k: round(v, 5) for k, v in choice.seconds_per_mb.items()})
    return choice.codec
