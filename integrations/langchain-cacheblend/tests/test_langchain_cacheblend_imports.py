"""The package's names load at first use (#41): the CLI's parser pays for no LangChain, `ask` for no chat model."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
import langchain_cacheblend.command  # what `cacheblend-rag` imports to build its parser
print(sorted(m for m in sys.modules if m.startswith(("langchain_core", "langsmith", "chromadb"))))
from langchain_cacheblend import CacheBlendLLM, create_stuff_chain
print("langchain_cacheblend.chat_models" in sys.modules)
from langchain_core.tracers.context import _configure_hooks
print([var.name for var, *_ in _configure_hooks if var is not None])
import langchain_cacheblend
print(langchain_cacheblend.ChatCacheBlend.__name__, sorted(set(langchain_cacheblend.__all__) - set(dir(langchain_cacheblend))))
"""


def test_names_load_at_first_use_and_the_retrieval_hook_still_registers():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    parser_imports, chat_loaded, hooks, last = out.stdout.strip().split("\n")
    assert parser_imports == "[]"  # building the parser imported no LangChain (nor Chroma)
    assert chat_loaded == "False"  # the LLM and the chains without the chat model's classes
    assert "langchain_cacheblend_retrieved" in hooks  # learn_retrieved's hook: registered by the LLM's import
    assert last == "ChatCacheBlend []"  # every public name still there
