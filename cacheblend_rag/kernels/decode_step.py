"""A decode step's two memory-bound kernels in C (decode_step.c), built once per machine: attention of one query
row per head over the cache (`decode_attention`) and the few-row matmuls of the projections, MLP and LM head
(`linear_rows`).

Both read their operand once, in place: each KV head's keys split over the threads (flash-decoding), each weight
row dotted with the step's rows; torch's bf16 ops stream the same bytes 1.5-4x slower on these CPUs (see the C
file). The library is compiled with the machine's C compiler on first use into a per-machine cache folder, keyed
by the source, the flags and this CPU's flags, and loaded through ctypes (no torch headers, a build of about a
second; it runs on the OpenMP runtime torch already loaded). Where there is no compiler, the build fails or
`CACHEBLEND_RAG_DECODE_KERNEL=0`, both functions return None and callers keep torch's ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_step.c")
MAX_GROUP = 16  # query heads per KV head, as in the C file
MAX_DIM = 256  # head dim, as in the C file
# rows of a linear_rows call: the loop does one dot product per (weight row, input row), so from ~5 rows it is
# compute-bound and oneDNN's blocked matmul wins (measured on an AVX512-BF16 EPYC: a step of 8 rows 71 ms through
# this loop vs 44 through oneDNN; of 1 row 16-18 vs 26)
MAX_ROWS = 4
MAX_IN = 16384  # input features of a linear_rows call, as in the C file
# reassociating float sums lets the compiler vectorize the dot products (2x faster); no finite-math assumptions
FLAGS = ("-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fopenmp", "-fPIC",
         "-shared", "-std=c11")

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _build(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        proc = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a concurrent process sees no half-written library


def library() -> ctypes.CDLL | None:
    """The compiled kernel (built on first call), or None where it can't be built or is switched off."""
    global _library, _tried
    if _tried:
        return _library
    with _lock:
        if _tried:
            return _library
        _tried = True
        from cacheblend_rag import settings

        if not settings.decode_kernel_enabled():
            return None
        key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
        target = settings.kernels_dir() / f"decode_step-{key}.so"
        try:
            if not target.exists():
                _build(target)
            lib = ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            logger.warning("decode steps run on torch's ops: the C kernels could not be built (%s)", exc)
            return None
        for name in ("decode_attention_bf16", "decode_attention_f32"):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
        for name in ("gemv_bf16", "gemv_f32"):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        _library = lib
        return lib


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: CPU, bf16 or fp32, rows contiguous, K and V alike."""
    heads, d = q.shape
    kv_heads = k.shape[0]
    return (q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float32) and k.dtype == v.dtype == q.dtype
            and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP and d <= MAX_DIM and k.shape == v.shape
            and k.stride() == v.stride() and k.stride(-1) == 1 and k.stride(-2) == d and q.is_contiguous()
            and k.shape[1] > 0)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     out: torch.Tensor) -> torch.Tensor | None:
    """One query row per head, q (H, d), over head-major k, v (KVH, n, d) → out (H, d) in place; None where the
    kernel is unavailable or does not take these tensors (the caller then uses torch's ops)."""
    lib = library()
    if lib is None or not supports(q, k, v) or not out.is_contiguous() or out.dtype != q.dtype:
        return None
    heads, d = q.shape
    fn = lib.decode_attention_bf16 if q.dtype == torch.bfloat16 else lib.decode_attention_f32
    rc = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), heads, k.shape[0], d, k.stride(0), k.shape[1],
            float(scale))
    if rc != 0:
        raise RuntimeError(f"decode_attention failed ({rc}) on q {tuple(q.shape)}, k {tuple(k.shape)}")
    return out


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` for a decode step's few rows, x (M ≤ 4, in), weight (out, in) contiguous, read
    once; None where the kernel is unavailable or does not take these tensors."""
    lib = library()
    if (lib is None or x.dim() != 2 or not 0 < x.shape[0] <= MAX_ROWS or x.shape[1] > MAX_IN or x.device.type != "cpu"
            or x.dtype not in (torch.bfloat16, torch.float32) or weight.dtype != x.dtype or not weight.is_contiguous()
            or weight.dim() != 2 or weight.shape[1] != x.shape[1]
            or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))):
        return None
    x = x.contiguous()
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
    fn = lib.gemv_bf16 if x.dtype == torch.bfloat16 else lib.gemv_f32
    rc = fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0],
            weight.shape[0], x.shape[1])
    if rc != 0:
        raise RuntimeError(f"linear_rows failed ({rc}) on x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    return out
