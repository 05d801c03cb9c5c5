"""The partner packages keep no process-wide state (#37): a request's facts travel on the framework's record of
the request (LangChain's callback managers, LlamaIndex's span trees), never in a module global.

Every module of `integrations/*/` (tests aside) is imported under its real name; each name its source binds at the
top level must not hold a context variable, a framework handler instance or a mutable container (`__all__`
aside: read-only tables are `MappingProxyType`s, sequences tuples)."""

from __future__ import annotations

import ast
import importlib
import threading
from collections import OrderedDict, defaultdict, deque
from contextvars import ContextVar
from pathlib import Path

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

REPO = Path(__file__).resolve().parents[1]
MUTABLE = (list, dict, set, bytearray, deque, OrderedDict, defaultdict)


def integration_modules() -> dict[str, Path]:
    """Each partner-package module by the name it is imported under (package folder → dotted path)."""
    modules = {}
    for package in sorted((REPO / "integrations").iterdir()):
        for path in sorted(package.rglob("*.py")):
            parts = path.relative_to(package).with_suffix("").parts
            if parts[0] == "tests":
                continue
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def top_level_names(path: Path) -> list[str]:
    """Names bound by assignments at the module's top level (imports, functions and classes left out)."""
    names = []
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        names += [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    return names


def stateful(value: object) -> bool:
    """A context variable, a callback / event / span handler, or a mutable container."""
    from langchain_core.callbacks import BaseCallbackHandler
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.span_handlers import BaseSpanHandler

    return isinstance(value, (ContextVar, BaseCallbackHandler, BaseEventHandler, BaseSpanHandler, *MUTABLE))


def module_state(name: str, path: Path) -> list[str]:
    module = importlib.import_module(name)
    return [f"{name}.{attr}" for attr in top_level_names(path) if attr != "__all__" and hasattr(module, attr)
            and stateful(getattr(module, attr))]


def test_the_checker_finds_each_kind_of_module_state(tmp_path, monkeypatch):
    from langchain_core.callbacks import BaseCallbackHandler

    path = tmp_path / "stateful_probe.py"
    path.write_text("from contextvars import ContextVar\nfrom langchain_core.callbacks import BaseCallbackHandler\n"
                    "import threading\n__all__ = ['x']\nVAR = ContextVar('v', default=())\n"
                    "HANDLER = BaseCallbackHandler()\nSEEN: dict = {}\nROLES = ('a', 'b')\n"
                    "LOCK = threading.Lock()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert module_state("stateful_probe", path) == ["stateful_probe.VAR", "stateful_probe.HANDLER",
                                                     "stateful_probe.SEEN"]
    assert not stateful(("a",)) and stateful(BaseCallbackHandler()) and not stateful(threading.Lock())


def test_no_module_level_mutable_state_in_the_integrations():
    modules = integration_modules()
    assert {"langchain_cacheblend.callbacks", "llama_index.llms.cacheblend.base"} <= set(modules)
    found = [state for name, path in modules.items() for state in module_state(name, path)]
    assert found == []
