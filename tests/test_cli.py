"""The `cacheblend-rag` CLI end to end: ingest + ask --json in subprocesses, on a fresh home."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cacheblend_rag import chunk_id, settings
from cacheblend_rag.cli import REGISTRARS, build_parser

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "data"


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop(settings.ENV_HOME, None)  # --home must be enough
    return subprocess.run([sys.executable, "-m", "cacheblend_rag.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=REPO)


def test_parser_has_subcommands_and_a_registrar_slot():
    args = build_parser().parse_args(["ask", "why?", "--k", "2", "--method", "map_rerank", "--json"])
    assert (args.command, args.k, args.method, args.json, args.ratio) == ("ask", 2, "map_rerank", True, 0.15)
    assert args.stop is None  # → a blank line ends the answer; --stop TEXT replaces it
    assert build_parser().parse_args(["ask", "q", "--stop", "", "--stop", "."]).stop == ["", "."]
    assert build_parser().parse_args(["ingest", "a", "b", "--home", "H"]).paths == ["a", "b"]

    def _add_hello(subparsers):
        subparsers.add_parser("hello").set_defaults(func=lambda args: 0)

    REGISTRARS.append(_add_hello)
    try:
        assert build_parser().parse_args(["hello"]).func(None) == 0
    finally:
        REGISTRARS.remove(_add_hello)


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "cacheblend-rag"
    if not script.exists():
        pytest.skip("console script not installed in this environment (pip install -e .)")
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ingest" in out.stdout and "ask" in out.stdout


@pytest.mark.model
@pytest.mark.slow
def test_ingest_then_ask_json(tmp_path, default_model):
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(settings.models_dir(), target_is_directory=True)  # skip a second conversion
    corpus = tmp_path / "corpus"  # a third of the sample corpus keeps the test quick
    corpus.mkdir()
    for name in ("01_colony.md", "04_honey.txt", "07_senses.txt"):
        (corpus / name).write_text((DATA / name).read_text())

    first = _cli("ingest", str(corpus), "--home", str(home), "--json", "--quiet")
    assert first.returncode == 0, first.stderr[-3000:]
    report = json.loads(first.stdout)
    assert (report["files"], report["chunks"], report["new_chunks"], report["new_kv"]) == (3, 3, 3, 3)
    assert report["kv_bytes"] > 0 and report["tokens"] > 0 and report["stored_chunks"] == 3
    assert (home / "kv").is_dir() and (home / "chroma").is_dir()

    second = _cli("ingest", str(corpus), "--home", str(home))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "0 new" in second.stdout and "nothing new" in second.stdout and "holds 3 chunks" in second.stdout

    example = subprocess.run([sys.executable, str(REPO / "examples" / "ingest_corpus.py"), str(corpus),
                              "--home", str(home)], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert example.returncode == 0, example.stderr[-3000:]
    assert example.stdout.count("(0 new, 0 KV computed)") == 2  # the example reuses what the CLI stored

    ask = _cli("ask", "How many eyes does a honeybee have?", "--home", str(home), "--k", "3", "--json",
               "--max-new-tokens", "8")
    assert ask.returncode == 0, ask.stderr[-3000:]
    result = json.loads(ask.stdout)  # exactly one JSON object on stdout
    assert set(result) == {"answer", "chunks", "stats"} and result["answer"]
    assert len(result["chunks"]) == 3
    assert chunk_id((DATA / "07_senses.txt").read_text()) == result["chunks"][0]
    stats = result["stats"]
    assert stats["per_chunk"] == {cid: "hit" for cid in result["chunks"]}
    assert stats["method"] == "cacheblend" and stats["ttft_s"] > 0 and 0 < stats["recompute_ratio_effective"] < 1


@pytest.mark.model
def test_ask_on_an_empty_home_says_what_to_do(tmp_path, default_model):
    home = tmp_path / "empty"
    home.mkdir()
    (home / "models").symlink_to(settings.models_dir(), target_is_directory=True)
    out = _cli("ask", "anything", "--home", str(home))
    assert out.returncode == 1 and "cacheblend-rag ingest" in out.stderr
