"""Hugging Face hub ids (`org/name`, a revision) resolved through a real HF cache layout, offline: the loader,
the engine's KV namespace, LangChain, LlamaIndex, the CLI and the server."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants as hf_constants

from cacheblend_rag import CacheBlendEngine, ModelNotCachedError, ModelNotFoundError, load_model, settings
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.models.loader import model_folder
from conftest import tiny_model

REPO = Path(__file__).resolve().parents[1]
REPO_ID = "tiny-org/tiny-qwen2"
COMMIT_MAIN = "a" * 40
COMMIT_V2 = "b" * 40

pytestmark = pytest.mark.model  # the tiny models borrow the real SmolLM2 tokenizer


def save_to_hub_cache(cache: Path, repo_id: str, model, tokenizer, commit: str, ref: str = "main") -> Path:
    """Save model + tokenizer into `cache` as huggingface_hub lays out a download: files in blobs/ named by their
    hash, snapshots/<commit>/ holding relative links to them, refs/<ref> naming the commit; the snapshot folder."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    staging = cache / f".staging-{commit}"
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    snapshot = storage / "snapshots" / commit
    for file in sorted(p for p in staging.rglob("*") if p.is_file()):
        blob = storage / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            shutil.move(file, blob)
        link = snapshot / file.relative_to(staging)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    shutil.rmtree(staging)
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tokenizer) -> Path:
    """A HF cache holding REPO_ID twice: `main` and the tag `v2` (other weights)."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    save_to_hub_cache(cache, REPO_ID, tiny_model("qwen2", len(tokenizer), seed=0), tokenizer, COMMIT_MAIN)
    save_to_hub_cache(cache, REPO_ID, tiny_model("qwen2", len(tokenizer), seed=1), tokenizer, COMMIT_V2, ref="v2")
    return cache


@pytest.fixture
def as_hf_cache(hub_cache, monkeypatch) -> Path:
    """Point huggingface_hub's default cache at the test cache, as HF_HUB_CACHE would had it been set before
    huggingface_hub was imported (it reads its environment once, at import)."""
    assert hf_constants.is_offline_mode(), "these tests must never reach the hub (HF_HUB_OFFLINE=1)"
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(hub_cache))
    return hub_cache


def _env(cache: Path) -> dict[str, str]:
    """A child's environment: offline, the test HF cache, no package home from outside."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_CACHE=str(cache), ANONYMIZED_TELEMETRY="False")
    env.pop(settings.ENV_HOME, None)
    return env


def test_the_test_cache_is_a_real_hf_cache(hub_cache):
    """huggingface_hub itself reads the layout: both revisions, and the file lookup transformers starts with."""
    [repo] = [r for r in huggingface_hub.scan_cache_dir(hub_cache).repos if r.repo_id == REPO_ID]
    assert {rev.commit_hash for rev in repo.revisions} == {COMMIT_MAIN, COMMIT_V2}
    found = huggingface_hub.try_to_load_from_cache(REPO_ID, "config.json", cache_dir=hub_cache)
    assert found == str(hub_cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT_MAIN / "config.json")


def test_hub_id_resolves_to_its_snapshot_in_the_cache(hub_cache):
    snapshots = hub_cache / "models--tiny-org--tiny-qwen2" / "snapshots"
    assert model_folder(REPO_ID, cache_dir=hub_cache) == snapshots / COMMIT_MAIN
    assert model_folder(REPO_ID, revision="v2", cache_dir=hub_cache) == snapshots / COMMIT_V2
    assert model_folder(REPO_ID, revision=COMMIT_V2, cache_dir=hub_cache) == snapshots / COMMIT_V2
    model, tokenizer = load_model(REPO_ID, cache_dir=hub_cache, device="cpu", dtype="float32")
    assert model.config.model_type == "qwen2" and model.config.hidden_size == 64 and len(tokenizer) > 0


def test_hub_id_loads_the_same_weights_transformers_loads(hub_cache):
    """The reference: transformers given the id and the cache, offline."""
    import torch
    from transformers import AutoModelForCausalLM

    ours, _ = load_model(REPO_ID, revision="v2", cache_dir=hub_cache, device="cpu", dtype="float32")
    theirs = AutoModelForCausalLM.from_pretrained(REPO_ID, revision="v2", cache_dir=hub_cache, dtype=torch.float32)
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_missing_hub_id_offline_names_the_id_and_the_cache(tmp_path):
    with pytest.raises(ModelNotCachedError, match="HF_HUB_OFFLINE=1") as caught:
        load_model("tiny-org/absent", cache_dir=tmp_path)
    assert "'tiny-org/absent'" in str(caught.value) and str(tmp_path / "models--tiny-org--absent") in str(caught.value)
    with pytest.raises(ModelNotCachedError, match="revision 'nope'"):
        model_folder(REPO_ID, revision="nope", cache_dir=tmp_path)
    assert issubclass(ModelNotCachedError, ModelNotFoundError)


def test_missing_hub_id_offline_through_the_environment_and_the_cli(tmp_path):
    """HF_HUB_OFFLINE and HF_HUB_CACHE as a user sets them: one `error:` line naming the id and the cache, exit 1."""
    out = subprocess.run([sys.executable, "-m", "cacheblend_rag.cli", "profile", "--model", "tiny-org/absent",
                          "--home", str(tmp_path / "home")], capture_output=True, text=True, timeout=300,
                         env=_env(tmp_path / "hub"), cwd=REPO)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    [line] = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert "'tiny-org/absent'" in line and str(tmp_path / "hub" / "models--tiny-org--absent") in line
    assert "HF_HUB_OFFLINE=1" in line


def test_a_revision_is_for_hub_ids_only(tmp_path):
    with pytest.raises(ConfigError, match="applies to hub ids"):
        model_folder("smollm2-135m", revision="v2")


def test_two_revisions_never_share_kv(as_hf_cache):
    """The KV namespace fingerprints the weights: v2 gets its own; main by name or by commit is the same."""
    main = CacheBlendEngine.from_pretrained(REPO_ID, device="cpu", dtype="float32")
    v2 = CacheBlendEngine.from_pretrained(REPO_ID, revision="v2", device="cpu", dtype="float32")
    by_commit = CacheBlendEngine.from_pretrained(REPO_ID, revision=COMMIT_MAIN, device="cpu", dtype="float32")
    assert main.namespace != v2.namespace
    assert main.namespace == by_commit.namespace
    assert main.model_name == REPO_ID


def test_hub_id_through_langchain(as_hf_cache):
    from langchain_cacheblend import ChatCacheBlend

    chat = ChatCacheBlend(model=REPO_ID, revision="v2", device="cpu", dtype="float32", max_tokens=3)
    reply = chat.invoke("Bees have five eyes. How many eyes does a bee have?")
    assert reply.response_metadata["model_name"] == REPO_ID
    assert chat.get_engine().model.config.model_type == "qwen2"
    assert chat.get_engine().namespace == CacheBlendEngine.from_pretrained(
        REPO_ID, revision="v2", device="cpu", dtype="float32").namespace


def test_hub_id_through_llama_index(as_hf_cache):
    from llama_index.llms.cacheblend import CacheBlendLLM

    llm = CacheBlendLLM(model_name=REPO_ID, device_map="cpu", model_kwargs={"dtype": "float32"}, max_new_tokens=3)
    response = llm.complete("Bees have five eyes. How many eyes does a bee have?")
    assert isinstance(response.text, str) and llm.metadata.model_name == REPO_ID
    assert llm.engine.model.config.model_type == "qwen2"


@pytest.mark.slow
def test_hub_id_through_the_cli(hub_cache, tmp_path):
    """ingest and ask with `--model org/name`, the cache found through HF_HUB_CACHE."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "bees.txt").write_text((REPO / "examples" / "data" / "07_senses.txt").read_text())
    home = tmp_path / "home"

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cacheblend_rag.cli", *args, "--home", str(home), "--model",
                               REPO_ID, "--revision", "v2", "--device", "cpu", "--dtype", "float32"],
                              capture_output=True, text=True, timeout=300, env=_env(hub_cache), cwd=REPO)

    ingest = cli("ingest", str(corpus), "--json", "--quiet")
    assert ingest.returncode == 0, ingest.stderr[-3000:]
    assert json.loads(ingest.stdout)["new_kv"] == 1
    ask = cli("ask", "How many eyes does a honeybee have?", "--k", "1", "--json", "--max-new-tokens", "3")
    assert ask.returncode == 0, ask.stderr[-3000:]
    stats = json.loads(ask.stdout)["stats"]
    assert list(stats["per_chunk"].values()) == ["hit"]  # the KV ingest stored under the same model is reused
    assert not (home / "models").exists()  # nothing converted or copied into the home


@pytest.mark.slow
def test_hub_id_through_the_server(hub_cache, tmp_path):
    """`serve --model org/name`: it answers to the id and generates from the cached model."""
    httpx = pytest.importorskip("httpx")
    from test_serve import ServerProcess

    home = tmp_path / "home"
    home.mkdir()
    server = ServerProcess(home, "--model", REPO_ID, env=_env(hub_cache))  # the last --model wins
    try:
        models = httpx.get(f"{server.url}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [REPO_ID]
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
            "model": REPO_ID, "max_tokens": 3, "messages": [{"role": "user", "content": "How many eyes?"}],
            "documents": ["Honeybees have five eyes."]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == REPO_ID and reply.json()["usage"]["completion_tokens"] > 0
    finally:
        assert server.stop() == 0, server.log.read_text()
