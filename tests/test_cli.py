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
from cacheblend_rag.fuse.policies import DEFAULT_METHOD

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "data"


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop(settings.ENV_HOME, None)  # --home must be enough
    return subprocess.run([sys.executable, "-m", "cacheblend_rag.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=REPO)


def test_parser_has_subcommands_and_a_registrar_slot():
    args = build_parser().parse_args(["ask", "why?", "--k", "2", "--method", "map_rerank", "--json"])
    # no --ratio: None, the model's calibrated ratio (the fidelity gate), else the method's 0.15
    assert (args.command, args.k, args.method, args.json, args.ratio) == ("ask", 2, "map_rerank", True, None)
    assert build_parser().parse_args(["ask", "q", "--ratio", "0.3"]).ratio == 0.3
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


def test_console_script_freezes_the_heap_before_the_interpreter_exits(monkeypatch):
    """The script's entry point runs `main`, then `gc.freeze()`: the interpreter's last collections would walk every
    torch/transformers/Chroma object (1.2-2.0 s of each command's wall time, #41); `main` itself (what tests and
    plugin scripts call) leaves the heap alone."""
    import tomllib

    from cacheblend_rag import cli

    scripts = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["cacheblend-rag"] == "cacheblend_rag.cli:console_main"
    calls = []
    monkeypatch.setattr(cli, "main", lambda: calls.append("main") or 3)
    monkeypatch.setattr(cli.gc, "freeze", lambda: calls.append("freeze"))
    assert cli.console_main() == 3
    assert calls == ["main", "freeze"]


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
    assert stats["method"] == DEFAULT_METHOD and stats["ttft_s"] > 0 and 0 < stats["recompute_ratio_effective"] < 1
    # start-up (process start → engine ready) is reported beside the engine's TTFT, never inside it (#41)
    assert stats["startup_s"] > stats["ttft_s"] and stats["threads"] >= 1 and stats["answer_s"] >= stats["ttft_s"]

    shown = _cli("ask", "How many eyes does a honeybee have?", "--home", str(home), "--k", "3", "--compare",
                 "--max-new-tokens", "4", "--threads", "1")
    assert shown.returncode == 0, shown.stderr[-3000:]
    timing = shown.stdout.strip().splitlines()[-1]  # TTFT, the full prefill's and the speedup, answer, start-up
    assert timing.startswith("TTFT ") and "full prefill of the same prompt" in timing and "x faster" in timing
    assert "start-up" in timing and timing.endswith("1 torch thread(s)")


@pytest.mark.model
def test_ask_on_an_empty_home_says_what_to_do(tmp_path, default_model):
    home = tmp_path / "empty"
    home.mkdir()
    (home / "models").symlink_to(settings.models_dir(), target_is_directory=True)
    out = _cli("ask", "anything", "--home", str(home))
    assert out.returncode == 1 and "cacheblend-rag ingest" in out.stderr


# ---- bad usage and failures: one `error:` line, the right exit code, never a traceback --------


def _one_error_line(out: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    return errors[0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, words", [
    (["ask", "q", "--ratio", "2"], "--ratio"),
    (["ask", "q", "--ratio", "nan"], "--ratio"),
    (["ask", "q", "--ratio", "-1"], "--ratio"),
    (["ask", "q", "--k", "0"], "--k"),
    (["ask", "q", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["ask", "q", "--dtype", "float8"], "--dtype"),
    (["ask", "  "], "question is empty"),
    (["ask", "q", "--device", "cuda:99"], "cuda"),
    (["ask", "q", "--device", "tpu"], "not a device"),
    (["ingest", "x", "--memory-budget", "lots"], "--memory-budget"),
    (["ingest", "definitely/missing/folder"], "no such file"),
    (["ask", "q", "--chroma-token", "t"], "--host"),  # a token without a server
    (["serve", "--port", "99999"], "--port"),  # checked before the model loads
    (["serve", "--port", "0"], "--port"),
    (["serve", "--max-body-bytes", "lots"], "--max-body-bytes"),
    (["serve", "--header-timeout", "0"], "--header-timeout"),
    (["serve", "--api-key", "k1", "--metrics-key", "k1"], "--metrics-key"),  # the operator's key is no client's
    (["serve", "--metrics-key", " "], "--metrics-key"),
])
def test_bad_usage_exits_2_with_one_error_line(tmp_path, capsys, argv, words):
    from cacheblend_rag.cli import main

    # in this process (`main` is what the console script runs; the other tests run that script): 18 interpreters
    # importing torch cost a minute of every test run
    try:
        code = main([*argv, "--home", str(tmp_path)])
    except SystemExit as e:  # the parser's own refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert words in _one_error_line(subprocess.CompletedProcess(argv, code, "", err))
    assert not (tmp_path / "kv").exists()  # rejected before anything was loaded or created


def test_unreachable_chroma_server_is_named(tmp_path):
    port = _free_port()
    out = _cli("ask", "q", "--home", str(tmp_path), "--host", "127.0.0.1", "--port", str(port))
    assert out.returncode == 1
    assert f"cannot reach Chroma at http://127.0.0.1:{port}" in _one_error_line(out)


def test_a_home_that_is_a_file_is_one_error_line(tmp_path):
    home = tmp_path / "not-a-folder"
    home.write_text("a regular file")
    out = _cli("ingest", str(DATA), "--home", str(home))
    assert out.returncode == 1, out.stderr[-3000:]
    assert "cannot open the Chroma database" in _one_error_line(out)


def test_unknown_and_empty_collections_are_named(tmp_path):
    from cacheblend_rag.retrieval.chroma import ChromaChunkStore

    ChromaChunkStore(tmp_path, "empty_one")
    unknown = _cli("ask", "q", "--home", str(tmp_path), "--collection", "not_there")
    assert unknown.returncode == 1
    line = _one_error_line(unknown)
    assert "no collection 'not_there'" in line and "'empty_one'" in line and "cacheblend-rag ingest" in line
    empty = _cli("ask", "q", "--home", str(tmp_path), "--collection", "empty_one")
    assert empty.returncode == 1 and "is empty" in _one_error_line(empty)


def test_sizes_parse():
    from cacheblend_rag.cli import DEFAULT_MEMORY_BUDGET, parse_size

    assert [parse_size(s) for s in ("512MiB", "2G", "300MB", "0", "1.5GiB", "4096")] == \
        [512 * 2**20, 2 * 2**30, 300 * 10**6, 0, 3 * 2**29, 4096]
    assert build_parser().parse_args(["ingest", "x"]).memory_budget == parse_size(DEFAULT_MEMORY_BUDGET)


def _home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(settings.models_dir(), target_is_directory=True)
    return home


@pytest.mark.model
@pytest.mark.slow
def test_cli_ingest_lists_skipped_files(tmp_path, default_model):
    home, corpus, bad = _home(tmp_path), tmp_path / "corpus", tmp_path / "bad"
    corpus.mkdir()
    bad.mkdir()
    (corpus / "07_senses.txt").write_text((DATA / "07_senses.txt").read_text())
    (corpus / "latin1.txt").write_bytes(b"caf\xe9")
    (corpus / "empty.md").write_text("")
    (corpus / "leak.txt").symlink_to(DATA / "04_honey.txt")
    os.mkfifo(corpus / "pipe.txt")
    (bad / "latin1.txt").write_bytes(b"caf\xe9")

    first = _cli("ingest", str(corpus), "--home", str(home), "--json", "--memory-budget", "1MiB")
    assert first.returncode == 0, first.stderr[-3000:]
    report = json.loads(first.stdout)
    assert (report["files"], report["chunks"], report["new_kv"], report["kv_failed"]) == (1, 1, 1, 0)
    assert {Path(s["path"]).name for s in report["skipped"]} == {"latin1.txt", "empty.md", "leak.txt", "pipe.txt"}
    assert f"skipped {corpus / 'latin1.txt'}: not valid UTF-8" in first.stderr

    followed = _cli("ingest", str(corpus), "--home", str(home), "--follow-symlinks")
    assert followed.returncode == 0, followed.stderr[-3000:]
    assert "1 new chunks" in followed.stdout and "holds 2 chunks" in followed.stdout  # the link's target

    nothing = _cli("ingest", str(bad), "--home", str(home))
    assert nothing.returncode == 1
    assert "no file could be ingested" in _one_error_line(nothing) and "latin1.txt" in nothing.stderr


@pytest.mark.model
def test_file_names_cannot_forge_skipped_lines(tmp_path, default_model):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "07_senses.txt").write_text((DATA / "07_senses.txt").read_text())
    (corpus / "x.txt\nskipped passwords.txt: leaked.txt").write_text("")  # an empty file, a newline in its name
    (corpus / "\x1b[2J\x1b[31mred.bin").write_bytes(b"\x00")  # ANSI escapes: clear the screen, turn red
    out = _cli("plan", "--corpus", str(corpus), "--home", str(_home(tmp_path)))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stderr.splitlines()
    assert len(lines) == 2 and all(line.startswith("skipped '") for line in lines), out.stderr  # one line each
    assert "\x1b" not in out.stderr and not any(line.startswith("skipped passwords") for line in lines)
    assert any("\\nskipped passwords.txt: leaked.txt'" in line for line in lines)  # escaped, quoted: visible
    assert any("\\x1b[2J\\x1b[31mred.bin'" in line for line in lines)


def test_a_model_that_needs_its_own_code_is_one_error_line(tmp_path):
    folder = tmp_path / "custom-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "bee_custom", "architectures": ["BeeForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_bee.BeeConfig", "AutoModelForCausalLM": "modeling_bee.BeeModel"}}))
    ran = tmp_path / "the-code-ran"
    for name in ("configuration_bee.py", "modeling_bee.py"):
        (folder / name).write_text(f"open({str(ran)!r}, 'w').close()\n")
    out = _cli("plan", "--model", str(folder), "--home", str(tmp_path))  # before: transformers' ValueError traceback
    assert out.returncode == 2
    line = _one_error_line(out)
    assert "needs its own modelling code" in line and "--trust-remote-code" in line
    assert not ran.exists()  # refused, never run


@pytest.mark.model
@pytest.mark.slow
def test_cli_ingest_fails_when_the_kv_store_cannot_write(tmp_path, default_model):
    import shutil

    prefix: list[str] = []
    if os.geteuid() == 0:  # root writes anywhere: drop the capabilities that let it ignore permissions
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: cannot make a folder read-only")
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]
    home, corpus = _home(tmp_path), tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "07_senses.txt").write_text((DATA / "07_senses.txt").read_text())
    (home / "kv").mkdir()
    (home / "kv").chmod(0o555)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([*prefix, sys.executable, "-m", "cacheblend_rag.cli", "ingest", str(corpus), "--home",
                          str(home), "--json", "--quiet"], capture_output=True, text=True, env=env, timeout=900,
                         cwd=REPO)
    (home / "kv").chmod(0o755)
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]  # before: exit 0 with "new_kv": 1 and no file
    assert "could not be stored" in _one_error_line(out) and str(home / "kv") in out.stderr
    report = json.loads(out.stdout)
    assert (report["new_kv"], report["kv_bytes"], report["kv_failed"]) == (0, 0, 1) and "error" in report
    assert not any(p.suffix == ".safetensors" for p in (home / "kv").rglob("*"))


@pytest.mark.model
@pytest.mark.slow
def test_cli_delete_prune_and_an_emptied_collection(tmp_path, default_model):
    home, corpus = _home(tmp_path), tmp_path / "corpus"
    corpus.mkdir()
    for name in ("04_honey.txt", "07_senses.txt"):
        (corpus / name).write_text((DATA / name).read_text())
    assert _cli("ingest", str(corpus), "--home", str(home), "--quiet").returncode == 0

    (corpus / "04_honey.txt").unlink()
    pruned = _cli("prune", "--home", str(home), "--json")
    assert pruned.returncode == 0, pruned.stderr[-3000:]
    assert json.loads(pruned.stdout) | {"collection": None} == {
        "sources": [str(corpus / "04_honey.txt")], "removed_chunks": 1, "dropped_kv": 1, "collection": None,
        "stored_chunks": 1}

    deleted = _cli("delete", str(corpus / "07_senses.txt"), "--home", str(home))
    assert deleted.returncode == 0 and "1 chunks removed, 1 KV entries dropped" in deleted.stdout
    assert not any(p.suffix == ".safetensors" and p.stem == chunk_id((DATA / "07_senses.txt").read_text())
                   for p in (home / "kv").rglob("*"))
    again = _cli("delete", str(corpus / "07_senses.txt"), "--home", str(home))
    assert again.returncode == 1 and "no chunk" in _one_error_line(again)

    ask = _cli("ask", "How many eyes does a honeybee have?", "--home", str(home))
    assert ask.returncode == 1 and "is empty" in _one_error_line(ask)  # not an answer from no context


# ---- subcommands of other distributions: the entry-point group cacheblend_rag.commands -------------------------


def test_a_subcommand_registered_by_an_installed_distribution(tmp_path, monkeypatch, capsys):
    from cacheblend_rag.cli import PLUGIN_GROUP, main

    (tmp_path / "hello_plugin.py").write_text(
        "def add(subparsers):\n"
        "    p = subparsers.add_parser('hello', help='say hello')\n"
        "    p.add_argument('--name', default='world')\n"
        "    p.set_defaults(func=lambda args: print(f'hello {args.name}') or 0)\n")
    dist = tmp_path / "hello_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hello-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\nhello = hello_plugin:add\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["hello", "--name", "bees"]) == 0 and capsys.readouterr().out == "hello bees\n"
    assert build_parser().parse_args(["hello"]).command == "hello"
    # the package's own plugins come from the distributions make install puts beside it
    parser = build_parser()
    assert parser.parse_args(["bench", "methods", "--limit", "1"]).limit == 1 and parser.parse_args(["ask", "q"]).k == 6
    assert parser.parse_args(["codec-bench", "--questions", "1"]).questions == 1


def test_a_well_known_subcommand_not_installed_says_what_to_install(monkeypatch, capsys):
    from cacheblend_rag import cli

    monkeypatch.setitem(cli.PLUGIN_HINTS, "bench-gpu", "the GPU benchmarks: pip install -e 'benchmarks[gpu]'")
    assert cli.main(["bench-gpu", "--limit", "3", "--out", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install -e 'benchmarks[gpu]'" in err and "bench-gpu" in err
    with pytest.raises(SystemExit) as bad:  # the known-arguments parse still refuses a core command's unknown flag
        cli.main(["prune", "--no-such-flag"])
    assert bad.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_ask_threads_leave_busy_cores_to_others(monkeypatch):
    import torch

    from cacheblend_rag.cli import cpu_threads, process_age

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (4.0, 4.0, 4.0))
    assert cpu_threads(None) == 1 and cpu_threads(2) == 2  # busy: one thread; asked: as asked
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.2, 0.2))
    assert cpu_threads(None) == 2  # idle: torch's choice
    age = process_age()
    assert age is None or age > 0
