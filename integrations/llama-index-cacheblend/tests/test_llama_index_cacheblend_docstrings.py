"""Every public class's docstring example runs (doctest, with the session's engine)."""

from __future__ import annotations

from llama_index_cacheblend_testing import li_engine, settings_llm  # noqa: F401 (fixtures; first: sets the offline environment)
import doctest
import importlib

import pytest

import llama_index.llms.cacheblend as llms
import llama_index.postprocessor.cacheblend as postprocessor


pytestmark = pytest.mark.model

MODULES = ["llama_index.llms.cacheblend.base", "llama_index.llms.cacheblend.indexing",
           "llama_index.llms.cacheblend.synthesizer", "llama_index.llms.cacheblend.warm",
           "llama_index.postprocessor.cacheblend.base"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name, li_engine):
    module = importlib.import_module(name)
    globs = {**vars(module), "engine": li_engine}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder().find(module, name, globs=globs):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0, f"{result.failed} docstring example(s) of {name} failed"


def test_every_public_class_has_an_example():
    public = {n: getattr(llms, n) for n in llms.__all__} | {"KVAwareNodePostprocessor": postprocessor.KVAwareNodePostprocessor}
    missing = [n for n, obj in public.items() if isinstance(obj, type) and ">>>" not in (obj.__doc__ or "")
               ]
    assert missing == []
