"""The CLI's arguments under a property-based fuzzer (issue #53): every subcommand's parse, and the commands that
answer in seconds (`plan`, `delete`, `prune`, `ask`, `ingest`) run in this process on a home of their own.

The property: exit 0, or exit 1 or 2 with an `error:` line saying why; never a traceback, never an exception out of
`main`, within RUN_BOUND_S, and nothing written to the ingested home it was copied from or to the repository's
top folder (relative paths resolve in the example's own). Profiles: tests/fuzzing.py.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from fuzzing import fuzz

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "examples" / "data"

def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from cacheblend_rag.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


SUBCOMMANDS = _subcommands()
JUNK = st.one_of(st.sampled_from(["", " ", "--", "-", "\x00", "auto", "memory", "disk:", "redis://", "cpu", "cuda:9"]),
                 st.text(st.characters(exclude_categories=("Cs",)), max_size=12))
# the far ends first: Hypothesis draws the first entries of a list most often
NUMBERS = st.sampled_from(["9" * 400, "1e999", "nan", "inf", "-inf", "-1", "0", "1", "0.5", "1.5", "0x10", "1_000",
                           " 3", "99999999999999999999"])
SIZES = st.sampled_from(["9" * 400, "99999999999999999999T", "nanGiB", "-1KiB", "0", "1", "1023", "512MiB", "1.5G",
                         "300MB", "1e3", "12 kib", "8MiB "])


def _values(action: argparse.Action):
    """Values for one option: near what its type takes (its choices, numbers, sizes), or anything."""
    if action.choices:
        return st.sampled_from([str(c) for c in action.choices]) | JUNK
    kind = getattr(action.type, "__name__", "")
    if "size" in kind:
        return SIZES
    if action.type is not None and action.type is not str:
        return NUMBERS
    return JUNK | NUMBERS


@st.composite
def argv(draw) -> list[str]:
    command = draw(st.sampled_from(sorted(SUBCOMMANDS)))
    actions = [a for a in SUBCOMMANDS[command]._actions if a.option_strings and "-h" not in a.option_strings]
    out = [command]
    for _ in range(draw(st.integers(0, 6))):
        if actions and draw(st.integers(0, 3)):
            action = draw(st.sampled_from(actions))
            out.append(draw(st.sampled_from(action.option_strings)))
            if action.nargs != 0:
                out.append(draw(_values(action)))
        else:
            out.append(draw(JUNK))  # a positional argument, or one too many
    return out


@fuzz(quick_examples=300, surface="CLI")
@given(args=argv())
def test_fuzzed_command_lines_parse_or_exit_2_with_an_error_line(args):
    """Parsing alone (a parse runs no command: `serve` would serve, `ingest` ingest): every option's type is
    checked by the parser, an argument out of range is an `error:` line and exit 2."""
    from cacheblend_rag.cli import build_parser

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_known_args(args)
        except SystemExit as e:
            assert e.code in (0, 2), (e.code, stderr.getvalue())
            if e.code == 2:
                assert stderr.getvalue().startswith("error: "), stderr.getvalue()
    assert "Traceback" not in stderr.getvalue()


# ---- the commands run ------------------------------------------------------------------------------------------

RUNNABLE = ("plan", "delete", "prune", "ask", "ingest")  # serve serves; calibrate, train-links and bench take minutes
RUN_BOUND_S = 120.0  # one command on the 7-file corpus: loads the model and Chroma, embeds, prefills a few chunks
# what a path, a host or a tier may be: the example's own files, a missing one, or loopback; never a folder of the
# machine a command would walk (`ingest /`) or a host a name lookup would wait on
PLACES = ("corpus", "corpus/01_colony.md", "missing", "empty", "binary.bin", "", ".")
HOSTS = st.sampled_from(["127.0.0.1", "localhost", "", "::1", "127.0.0.1:1"])
MODELS = st.sampled_from(["smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "nope/nope", "", "./missing",
                          "corpus", "empty"])
TIERS = st.sampled_from(["memory", "disk:kv2", "disk:", "redis://127.0.0.1:1/0", "memory?codec=int8",
                         "memory?codec=zstd", "nope://x", "kv3"])
PLACE = st.sampled_from(PLACES)
PLACED = {"--chroma-path": PLACE, "--chroma-ca-bundle": PLACE, "--corpus": PLACE, "--host": HOSTS,
          "--chroma-host": HOSTS, "--model": MODELS, "--kv-store": TIERS}  # --home: the example's own, always


def _run_values(action: argparse.Action):
    """Values for one option of a command that runs: the parser's fuzz values, with places and hosts held local."""
    return PLACED.get(action.option_strings[-1]) or _values(action)


@st.composite
def run_argv(draw) -> list[str]:
    command = draw(st.sampled_from(RUNNABLE))
    actions = [a for a in SUBCOMMANDS[command]._actions
               if a.option_strings and "-h" not in a.option_strings and a.option_strings[-1] != "--home"]
    out = [command]
    if command in ("ingest", "delete"):
        out += draw(st.lists(PLACE, min_size=1, max_size=2))
    elif command == "ask":
        out.append(draw(st.sampled_from(["How many eyes does a honeybee have?", "", " "]) | JUNK))
    for _ in range(draw(st.integers(0, 5))):
        action = draw(st.sampled_from(actions))
        out.append(draw(st.sampled_from(action.option_strings)))
        if action.nargs != 0:
            out.append(draw(_run_values(action)))
    return out


@pytest.fixture(scope="module")
def ingested_home(tmp_path_factory) -> Path:
    """A home with the corpus ingested once; each example runs on a copy of it."""
    from cacheblend_rag.cli import main

    root = tmp_path_factory.mktemp("cli-fuzz")
    shutil.copytree(CORPUS, root / "corpus")
    with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(io.StringIO()):
        code = main(["ingest", str(root / "corpus"), "--home", str(root / "home"), "-q"])
    assert code == 0, err.getvalue()
    gc.collect()  # the ingestion's chunk index closes when its engine is collected: the template is left as is
    return root


def _example_folder(template: Path, into: Path) -> None:
    shutil.copytree(template / "home", into / "home")
    shutil.copytree(template / "corpus", into / "corpus")
    (into / "empty").mkdir()
    (into / "binary.bin").write_bytes(bytes(range(256)) * 8)


def _listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.model
@fuzz(quick_examples=8, surface="CLI")
@given(args=run_argv())
def test_fuzzed_commands_run_or_exit_with_an_error_line(ingested_home, tmp_path_factory, args):
    """`main(argv)` on a copy of the ingested home, from the example's own folder (relative paths land there)."""
    from cacheblend_rag.cli import main

    folder = tmp_path_factory.mktemp("example")
    _example_folder(ingested_home, folder)
    elsewhere = {ingested_home: _listing(ingested_home), REPO: set(os.listdir(REPO))}
    threads, cwd = torch.get_num_threads(), os.getcwd()
    stderr = io.StringIO()
    start = time.monotonic()
    try:
        os.chdir(folder)
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main([*args, "--home", str(folder / "home")])
            except SystemExit as e:  # the parser's usage errors and --help
                code = e.code
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)  # `ask --threads N` sets the process's
        shutil.rmtree(folder, ignore_errors=True)
    took = time.monotonic() - start
    err = stderr.getvalue()
    event(f"{args[0]} exit {code}")  # how far the examples got (pytest --hypothesis-show-statistics)
    assert code in (0, 1, 2), (code, err)
    if code:
        assert any(line.startswith("error: ") for line in err.splitlines()), err
    assert "Traceback" not in err, err
    assert took < RUN_BOUND_S, f"{args} took {took:.0f} s"
    now = {ingested_home: _listing(ingested_home), REPO: set(os.listdir(REPO))}
    assert now == elsewhere, f"wrote outside: {[sorted(now[k] ^ elsewhere[k]) for k in now]}"


# ---- what the fuzzer found (#53), kept as examples -------------------------------------------------------------


def test_a_size_too_large_for_a_float_is_an_error_line():
    from cacheblend_rag.cli import build_parser

    # 400 digits read as float are infinity: int() raised OverflowError, a traceback instead of exit 2
    for args in (["ingest", "x", "--memory-budget", "9" * 400], ["serve", "--max-body-bytes", "99999999999T"]):
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as e:
            build_parser().parse_known_args(args)
        assert e.value.code == 2 and "larger than any size" in stderr.getvalue(), stderr.getvalue()


def test_a_chunk_size_past_any_context_window_is_an_error_line(tmp_path, capsys):
    from cacheblend_rag.cli import main
    from cacheblend_rag.commands.common import MAX_CHUNK_TOKENS

    # found by the commands' fuzz: the parser took any size, and `plan` raised OverflowError (a traceback) where
    # a chunk's bytes became a float; ingest would have made chunks no model can read
    for command in (["plan"], ["ingest", str(CORPUS)]):
        with pytest.raises(SystemExit) as e:
            main([*command, "--chunk-tokens", "9" * 400, "--home", str(tmp_path)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--chunk-tokens: must be at most 1,048,576 tokens" in err, err
        assert "400 digits" in err and "Traceback" not in err
    assert main(["plan", "--chunk-tokens", str(MAX_CHUNK_TOKENS), "--home", str(tmp_path), "--json"]) == 0
    assert f'"chunk_tokens": {MAX_CHUNK_TOKENS}' in capsys.readouterr().out
