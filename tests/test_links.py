"""Learned links (fuse/links, links_training): on tiny random-weight models of the Llama and Qwen families."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, ConfigError, Request
from cacheblend_rag.errors import CacheFormatError
from cacheblend_rag.fuse.links import Links, trained_path
from cacheblend_rag.links_training import Example, distill_loss, initial_links, student_logits, teach, train

TEXTS = [
    "The river Lune flows through Lancaster and reaches the sea at Sunderland Point.",
    "Marie Curie won Nobel prizes in physics and in chemistry, the first person to win two.",
    "The Eiffel Tower was finished in 1889 for the World's Fair in Paris, France.",
    "Basalt is an igneous rock formed from the rapid cooling of lava rich in iron.",
]
QUESTION = "Where does the river Lune reach the sea?"
METHODS = [("full_reuse", None), ("cacheblend", 0.15), ("relevance", 0.15), ("cachecraft", None),
           ("prefix_cache", None), ("full_prefill", None)]


@pytest.fixture(params=["qwen2", "llama"])
def family(request, tokenizer):
    from conftest import tiny_model

    return tiny_model(request.param, len(tokenizer)), tokenizer


def _links(engine: CacheBlendEngine, m: int = 4, seed: int = 0) -> Links:
    torch.manual_seed(seed)
    links = initial_links(engine, m)
    return Links(links.embeds + 0.5 * torch.randn_like(links.embeds), links.fingerprint, links.vocab_size)


def test_without_links_every_method_is_bit_for_bit_unchanged(family):
    model, tokenizer = family
    plain = CacheBlendEngine(model, tokenizer, prefix_reuse=False, links=None)
    linked = CacheBlendEngine(model, tokenizer, prefix_reuse=False, links=None)
    linked.links = _links(linked)
    for engine in (plain, linked):
        engine.ingest(TEXTS, show_progress=False)
    for method, ratio in METHODS:
        a = plain.prefill_request(Request.of(TEXTS, QUESTION, method, ratio))
        b = linked.prefill_request(Request.of(TEXTS, QUESTION, method, ratio, links=False))
        assert torch.equal(a.logits, b.logits), method
        assert torch.equal(a.token_ids, b.token_ids)
        assert "links" not in a.stats and b.stats["links"] == {"ran": False}


def test_links_run_after_the_last_chunk_and_ratio_one_is_full_prefill(family):
    model, tokenizer = family
    engine = CacheBlendEngine(model, tokenizer, prefix_reuse=False, links=None)
    engine.links = links = _links(engine)
    engine.ingest(TEXTS, show_progress=False)
    full = engine.prefill_request(Request.of(TEXTS, QUESTION, "full_prefill"))
    ran = engine.prefill_request(Request.of(TEXTS, QUESTION, "relevance", 0.15))
    assert ran.stats["links"]["ran"] and ran.stats["links"]["num_links"] == links.num_links
    assert ran.token_ids.numel() == full.token_ids.numel() + links.num_links
    first_link = int(links.is_link(ran.token_ids).nonzero()[0])
    assert links.is_link(ran.token_ids).sum() == links.num_links
    fusion = engine.fusion_of(Request.of(TEXTS, QUESTION, "full_prefill"))
    assert first_link == int((fusion.layout.segment_of_row >= 0).nonzero()[-1]) + 1  # right after the last chunk
    assert not torch.allclose(ran.logits, engine.prefill_request(
        Request.of(TEXTS, QUESTION, "relevance", 0.15, links=False)).logits)  # they change the fused prompt
    for method in ("relevance", "cacheblend"):
        one = engine.prefill_request(Request.of(TEXTS, QUESTION, method, 1.0))
        assert one.stats["links"] == {"ran": False}
        torch.testing.assert_close(one.logits, full.logits, atol=1e-4, rtol=1e-4)
    assert full.stats["links"] == {"ran": False}
    gen = engine.generate_request(Request.of(TEXTS, QUESTION, "relevance", 0.15, max_new_tokens=4))
    assert gen.stats["links"]["ran"] and gen.stats["num_generated"] >= 1


def test_a_request_asking_for_links_on_an_engine_without_them_is_refused(family):
    model, tokenizer = family
    engine = CacheBlendEngine(model, tokenizer, links=None)
    with pytest.raises(ConfigError, match="links=True"):
        engine.prefill_request(Request.of(TEXTS, QUESTION, "full_reuse", links=True))
    with pytest.raises(ConfigError, match="links must be"):
        Request.of(TEXTS, QUESTION, links="yes")


def test_links_keep_stored_prefixes_across_turns(family):
    model, tokenizer = family
    engine = CacheBlendEngine(model, tokenizer, links=None)
    engine.links = _links(engine)
    engine.ingest(TEXTS, show_progress=False)
    first = engine.generate_request(Request.of(TEXTS, QUESTION, "relevance", 0.15, max_new_tokens=4))
    history = ({"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.text or "x"})
    second = engine.prefill_request(Request.of(TEXTS, "And Lancaster?", "relevance", 0.15, history=history))
    assert second.stats["num_prefix_rows"] > 0 and second.stats["links"]["ran"]
    # the stored prefix carries the links' rows: a request without them takes it no further than the chunks
    first_link = int(engine.links.is_link(second.token_ids).nonzero()[0])
    plain = engine.prefill_request(Request.of(TEXTS, "And Lancaster?", "relevance", 0.15, history=history,
                                              links=False))
    assert plain.stats["num_prefix_rows"] <= first_link


def test_a_few_training_steps_lower_the_kl_to_full_prefill(family):
    model, tokenizer = family
    engine = CacheBlendEngine(model, tokenizer, prefix_reuse=False, links=None)
    engine.ingest(TEXTS, show_progress=False)
    examples = [Example(tuple(TEXTS), QUESTION), Example(tuple(reversed(TEXTS)), "What did Marie Curie win?")]
    teachers = [teach(engine, e, answer_tokens=4) for e in examples]
    start = initial_links(engine, 4)
    with torch.no_grad():
        before = sum(float(distill_loss(student_logits(engine, start, t), t)) for t in teachers)
    trained, log = train(engine, teachers, links=start, steps=16, lr=0.05, show_progress=False)
    with torch.no_grad():
        after = sum(float(distill_loss(student_logits(engine, trained, t), t)) for t in teachers)
    assert after < 0.8 * before, (before, after, log["losses"])
    assert not torch.equal(trained.embeds, start.embeds)
    assert all(not p.requires_grad or p.grad is None for p in model.parameters())  # the model stayed frozen
    assert all(p.requires_grad for p in model.parameters())  # and is handed back as it came


def test_a_corrupt_or_foreign_links_file_is_refused_naming_it(family, tmp_path):
    model, tokenizer = family
    engine = CacheBlendEngine(model, tokenizer, links=None)
    path = _links(engine).save(tmp_path / "links.safetensors")
    assert CacheBlendEngine(model, tokenizer, links=path).links.num_links == 4
    data = bytearray(path.read_bytes())
    flipped = tmp_path / "flipped.safetensors"
    data[-3] ^= 0x40  # a bit of the embeddings
    flipped.write_bytes(bytes(data))
    with pytest.raises(CacheFormatError, match="flipped.safetensors.*checksum"):
        CacheBlendEngine(model, tokenizer, links=flipped)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CacheFormatError, match="cut.safetensors"):
        CacheBlendEngine(model, tokenizer, links=cut)
    with pytest.raises(CacheFormatError, match="pinned"):
        Links.load(path, sha256="0" * 64)
    from conftest import tiny_model

    other = tiny_model("qwen2", len(tokenizer), seed=1)
    with pytest.raises(ConfigError, match="links.safetensors were trained for model"):
        CacheBlendEngine(other, tokenizer, links=path)


def test_links_trained_on_this_machine_load_automatically(family, tmp_path, monkeypatch):
    model, tokenizer = family
    monkeypatch.setenv("CACHEBLEND_RAG_LINKS", str(tmp_path / "links"))
    engine = CacheBlendEngine(model, tokenizer, links=None)
    _links(engine).save(trained_path(engine.weights_fingerprint))
    assert CacheBlendEngine(model, tokenizer).links is not None  # links="auto": by the weights fingerprint
    assert CacheBlendEngine(model.to(torch.bfloat16), tokenizer).links is not None  # the same weights in bf16
    from conftest import tiny_model

    assert CacheBlendEngine(tiny_model("qwen2", len(tokenizer), seed=2), tokenizer).links is None


def test_train_links_command_writes_resumable_links(tmp_path, tokenizer):
    from conftest import tiny_model

    folder = tmp_path / "tiny-qwen"
    tiny_model("qwen2", len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = tmp_path / "nq.json"
    data.write_text(json.dumps({"items": [{"question": QUESTION, "passages": TEXTS, "answers": ["Sunderland Point"]},
                                          {"question": "Who won two Nobel prizes?", "passages": TEXTS[::-1],
                                           "answers": ["Marie Curie"]}]}))
    out = tmp_path / "out" / "links.safetensors"
    base = [sys.executable, "-m", "cacheblend_rag.cli", "train-links", "--model", str(folder), "--data", str(data),
            "--limit", "2", "--num-links", "4", "--answer-tokens", "3", "--out", str(out), "--home",
            str(tmp_path / "home"), "--dtype", "float32", "--json"]
    first = subprocess.run(base + ["--steps", "3"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "train links" in first.stderr  # the progress bar
    assert json.loads(first.stdout.splitlines()[-1])["steps"] == 3
    assert Links.load(out).recipe["steps"] == 3
    again = subprocess.run(base + ["--steps", "5", "--resume"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming" in again.stdout and Links.load(out).recipe["steps"] == 5
    bad = subprocess.run(base[:-1] + ["--steps", "3", "--num-links", "99"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "--num-links must be within 1..64" in bad.stderr


def test_links_run_on_every_surface_and_say_so(tokenizer):
    """The engine's links run for a prompt in any frame: a string prompt, LangChain's chat model, LlamaIndex's
    LLM, the server's documents; each reports it (stats, response_metadata, additional_kwargs, usage)."""
    from fastapi.testclient import TestClient
    from langchain_cacheblend import ChatCacheBlend
    from llama_index.core.base.llms.types import ChatMessage
    from llama_index.llms.cacheblend import CacheBlendLLM

    from cacheblend_rag.serve.app import ServeConfig, create_app
    from conftest import tiny_model

    engine = CacheBlendEngine(tiny_model("qwen2", len(tokenizer)), tokenizer, links=None)
    engine.links = _links(engine)
    engine.ingest(TEXTS, show_progress=False)
    prompt = "Context:\n\n" + "\n\n".join(TEXTS) + "\n\nQuestion: " + QUESTION
    out = engine.prefill_prompt(prompt, "relevance", 0.15)
    assert out.stats["links"]["ran"] and len(out.stats["chunk_hits"]) == len(TEXTS)
    messages = [{"role": "system", "content": "Use the context.\n\n" + "\n\n".join(TEXTS)},
                {"role": "user", "content": QUESTION}]
    reply = ChatCacheBlend(engine=engine, max_tokens=2, recompute_ratio=0.15).invoke(
        [(m["role"], m["content"]) for m in messages])
    assert reply.response_metadata["cacheblend"]["links"]["ran"]
    llm = CacheBlendLLM(engine=engine, max_new_tokens=2, recompute_ratio=0.15)
    response = llm.chat([ChatMessage(role=m["role"], content=m["content"]) for m in messages])
    assert response.additional_kwargs["links"]["ran"]
    with TestClient(create_app(engine, ServeConfig(model_name="tiny"))) as client:
        body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2,
                "documents": TEXTS, "cacheblend": {"recompute_ratio": 0.15}}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["cacheblend"]["links"]["ran"]
        full = client.post("/v1/chat/completions", json={**body, "cacheblend": {"method": "full_prefill"}}).json()
        assert full["usage"]["cacheblend"]["links"] == {"ran": False}
        assert usage["prompt_tokens"] == full["usage"]["prompt_tokens"]  # the links' rows are not the client's
