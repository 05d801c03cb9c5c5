"""Every public class's docstring example runs (doctest, with the session's engine and local embeddings)."""

from __future__ import annotations

from langchain_cacheblend_testing import embeddings, engine  # noqa: F401 (fixtures; first: sets the offline environment)
import doctest
import importlib

import pytest

import langchain_cacheblend
from pathlib import Path

DATA = Path(__file__).resolve().parents[3] / "examples" / "data"


pytestmark = pytest.mark.model

MODULES = ["callbacks", "chains", "chat_models", "llms", "prompts", "retrievers", "warm"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name, engine, embeddings, tmp_path):
    data_dir = tmp_path / "data"  # a small corpus: three short files
    data_dir.mkdir()
    for src in sorted(DATA.iterdir())[:3]:
        (data_dir / src.name).write_text(src.read_text()[:400])
    module = importlib.import_module(f"langchain_cacheblend.{name}")
    globs = {**vars(module), **{n: getattr(langchain_cacheblend, n) for n in langchain_cacheblend.__all__},
             "engine": engine, "embeddings": embeddings, "home": tmp_path, "data_dir": data_dir}
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name, globs=globs):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 or name == "chains"
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed (output above)"


def test_every_public_class_has_an_example():
    missing = [n for n in langchain_cacheblend.__all__
               if isinstance(getattr(langchain_cacheblend, n), type) and ">>>" not in (getattr(langchain_cacheblend, n).__doc__ or "")
               and n != "CacheBlendPromptValue"]  # a value type: built by CacheBlendPromptTemplate, shown there
    assert missing == []
