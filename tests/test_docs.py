"""The docs stay in step with the code: every option a surface takes is in its page's parameters table, every
link points at a file (and heading) that exists, and the pages stay a manual (no work log, a bounded size).

Options are collected from the code itself — the policies' dataclass fields, the LangChain and LlamaIndex classes'
pydantic fields, the server's request schemas, the CLI's argparse parsers, the engine's and the stores' signatures —
and looked up in the **first column** of the markdown tables of the page (or section) that documents them, so a
mention in running text does not count.
"""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md")) + [REPO / "README.md", REPO / "CHANGELOG.md"]

_SPAN = re.compile(r"`([^`]+)`")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")


def _section(text: str, heading: str | None) -> str:
    """The text under the heading `heading` ("## Title", matched whole), up to the next heading of its level or
    higher; the whole text for None. Fences are skipped when looking for headings."""
    if heading is None:
        return text
    want_level, want_title = len(heading) - len(heading.lstrip("#")), heading.lstrip("#").strip()
    lines, out, level, fenced = text.splitlines(), [], None, False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else _HEADING.match(line)
        if level is None:
            if m and len(m.group(1)) == want_level and m.group(2) == want_title:
                level = len(m.group(1))
            continue
        if m and len(m.group(1)) <= level:
            break
        out.append(line)
    assert level is not None, f"no heading {heading!r}"
    return "\n".join(out)


def table_names(page: str, heading: str | None = None, text: str | None = None) -> set[str]:
    """The names in the first column of every table of a page (or one section): each backticked span's first
    word, e.g. "`--api-key KEY`, `--host`" -> {"--api-key", "--host"}. `text`: the page's text, if not the file's."""
    names: set[str] = set()
    text = (REPO / page).read_text() if text is None else text
    for line in _section(text, heading).splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        first = re.split(r"(?<!\\)\|", line)[1]  # an escaped pipe (`a\|b`) is not a column
        for span in _SPAN.findall(first):
            word = span.split()[0].split("=")[0] if span.split() else ""
            names.add(word)
    return names


def missing(expected, page: str, heading: str | None = None, also: set[str] = frozenset(),
            text: str | None = None) -> list[str]:
    """The expected names that no table row of the page (section) names."""
    found = table_names(page, heading, text) | set(also)
    return sorted(set(expected) - found)


# ---- the policies: docs/engine.md, a table per method ------------------------------------------------------

def test_every_method_and_every_option_of_it_is_in_engine_md():
    from cacheblend_rag.fuse.policies import METHODS, POLICIES, option_names

    assert not missing(METHODS, "docs/engine.md", "## Methods"), "a method is missing from the methods table"
    for method in METHODS:
        options = option_names(POLICIES[method])
        if options:
            lost = missing(options, "docs/engine.md", f"### `{method}`")
            assert not lost, f"docs/engine.md, ### `{method}`: no table row for {lost}"


def test_the_engines_parameters_are_in_engine_md():
    from cacheblend_rag import CacheBlendEngine

    params = set()
    for fn in (CacheBlendEngine.__init__, CacheBlendEngine.from_pretrained):
        params |= {p.name for p in inspect.signature(fn).parameters.values()
                   if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in ("self", "cls")}
    lost = missing(params, "docs/engine.md", "## The engine's parameters")
    assert not lost, f"docs/engine.md's parameters table lacks {lost}"


# ---- LangChain and LlamaIndex: the classes' own pydantic fields -------------------------------------------

def own_fields(cls, *bases) -> set[str]:
    inherited = set().union(*(set(b.model_fields) for b in bases))
    return set(cls.model_fields) - inherited


def test_langchain_fields_are_in_langchain_md():
    pytest.importorskip("langchain_cacheblend")
    from langchain_core.language_models import BaseChatModel, BaseLLM

    from langchain_cacheblend import CacheBlendLLM, ChatCacheBlend

    for cls, base in ((ChatCacheBlend, BaseChatModel), (CacheBlendLLM, BaseLLM)):
        lost = missing(own_fields(cls, base), "docs/langchain.md", "## Parameters")
        assert not lost, f"docs/langchain.md's parameters table lacks {cls.__name__}'s {lost}"


def test_llama_index_fields_are_in_llamaindex_md():
    pytest.importorskip("llama_index.llms.cacheblend")
    from llama_index.core.llms.custom import CustomLLM
    from llama_index.core.llms.function_calling import FunctionCallingLLM
    from llama_index.core.postprocessor.types import BaseNodePostprocessor

    from llama_index.llms.cacheblend import CacheBlendLLM
    from llama_index.postprocessor.cacheblend import KVAwareNodePostprocessor

    lost = missing(own_fields(CacheBlendLLM, CustomLLM, FunctionCallingLLM) | {"engine"}, "docs/llamaindex.md",
                   "## Parameters")
    assert not lost, f"docs/llamaindex.md's CacheBlendLLM table lacks {lost}"
    lost = missing(own_fields(KVAwareNodePostprocessor, BaseNodePostprocessor) | {"engine"}, "docs/llamaindex.md",
                   "## Parameters")
    assert not lost, f"docs/llamaindex.md's KVAwareNodePostprocessor table lacks {lost}"


# ---- the server: request fields and `serve`'s options ------------------------------------------------------

def test_server_request_fields_and_options_are_in_serve_md():
    pytest.importorskip("pydantic")
    from cacheblend_rag.serve import schemas
    from cacheblend_rag.serve.command import add_arguments

    fields = set(schemas.ChatCompletionRequest.model_fields) | set(schemas.CompletionRequest.model_fields)
    lost = missing(fields, "docs/serve.md")
    assert not lost, f"docs/serve.md's request tables lack {lost}"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    lost = missing(long_options(parser), "docs/serve.md")
    assert not lost, f"docs/serve.md's options table lacks {lost}"


# ---- the CLI: every subcommand's options in docs/cli.md ----------------------------------------------------

def long_options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


CLI_SECTIONS = {"ingest": "## ingest", "delete": "## ingest", "prune": "## ingest", "ask": "## ask",
                "plan": "## plan", "profile": "## profile", "calibrate": "## calibrate",
                "train-links": "## train-links"}


def test_every_cli_option_is_in_cli_md():
    from cacheblend_rag.cli import build_parser

    commands = subparsers(build_parser())
    common = table_names("docs/cli.md", "## Common options")
    for name, heading in CLI_SECTIONS.items():
        if name == "ask" and name in commands and not long_options(commands[name]):
            continue  # langchain-cacheblend not installed: the stub has no options of its own
        lost = missing(long_options(commands[name]), "docs/cli.md", heading, also=common)
        assert not lost, f"docs/cli.md: `{name}`'s options {lost} are in no table of {heading!r} or Common options"


def test_every_bench_option_is_in_cli_md():
    command = pytest.importorskip("cacheblend_bench.command")
    codec_bench = pytest.importorskip("cacheblend_bench.codec_bench")

    bench = argparse.ArgumentParser()
    command.add_arguments(bench)
    studies = subparsers(bench)
    assert not missing(studies, "docs/cli.md", "## bench"), "a bench study is missing from docs/cli.md"
    for name, study in studies.items():
        lost = missing(long_options(study), "docs/cli.md", "## bench")
        assert not lost, f"docs/cli.md, ## bench: `bench {name}`'s options {lost} are in no table"
    parser = argparse.ArgumentParser()
    codec_bench.add_arguments(parser)
    lost = missing(long_options(parser), "docs/cli.md", "## codec-bench")
    assert not lost, f"docs/cli.md, ## codec-bench: no table row for {lost}"


# ---- deployment: stores and codecs ------------------------------------------------------------------------

def test_store_parameters_and_codecs_are_in_deploy_md():
    from cacheblend_rag.store import open_store
    from cacheblend_rag.store.codecs import CODECS
    from cacheblend_rag.store.redis import RedisStore

    params = {p.name for fn in (open_store, RedisStore.__init__) for p in inspect.signature(fn).parameters.values()
              if p.name not in ("self", "path")}
    lost = missing(params | set(CODECS), "docs/deploy.md")
    assert not lost, f"docs/deploy.md's tables lack {lost}"


# ---- the tables test itself: a row taken out is caught ----------------------------------------------------

def test_a_removed_row_is_caught():
    page = (DOCS / "engine.md").read_text()
    without = "\n".join(line for line in page.splitlines() if not line.startswith("| `filter_layer`"))
    assert without != page
    assert missing(["filter_layer"], "docs/engine.md", "### `cacheblend`") == []
    assert missing(["filter_layer"], "docs/engine.md", "### `cacheblend`", text=without) == ["filter_layer"]
    mentioned = without + "\n\nIn prose: `filter_layer` (not a table row)."
    assert missing(["filter_layer"], "docs/engine.md", "### `cacheblend`", text=mentioned) == ["filter_layer"]


# ---- links, and what a page is not ------------------------------------------------------------------------

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings (lower case, punctuation dropped, spaces as hyphens, -1, -2 for
    repeats)."""
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else _HEADING.match(line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(2).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        seen.setdefault(f"{slug}-{n}" if n else slug, 1)
    return set(seen)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_point_at_files_and_headings_that_exist(page):
    broken = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in github_anchors(file.read_text()):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.name}: broken links {broken}"


def test_every_docs_path_named_anywhere_exists():
    """A `docs/<page>.md` named in any text file of the repository (code comments, READMEs) is a file that exists."""
    named = re.compile(r"docs/[\w./-]+\.md")
    stale = []
    for path in REPO.rglob("*"):
        skip = {".venv", ".git"} & set(path.parts) or path.name == "CHANGELOG.md"  # history names old pages
        if path.suffix not in (".py", ".md", ".toml") or skip:
            continue
        for ref in set(named.findall(path.read_text(errors="ignore"))):
            if not (REPO / ref).exists():
                stale.append(f"{path.relative_to(REPO)}: {ref}")
    assert not stale, f"names of docs pages that do not exist: {stale}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_are_a_manual_not_a_work_log(page):
    text = page.read_text()
    for pattern in (r"(?i)session \d", r"(?i)ad hoc", r"(?i)not in the repo", r"/tmp/s\d"):
        assert not re.search(pattern, text), f"{page.name} says {re.search(pattern, text).group(0)!r}"


def test_docs_and_readme_stay_small():
    pages = sorted(DOCS.rglob("*.md")) + [REPO / "README.md"]
    total = sum(p.stat().st_size for p in pages)
    assert total <= 150_000, f"docs/ and README.md hold {total:,} bytes; keep them within 150,000 bytes (history " \
                             "goes in CHANGELOG.md and the git log)"
