"""The package's import graph has no cycles, lazy imports (inside functions) included.

Every module of `cacheblend_rag` is parsed with `ast`; each import of a
module of the package becomes an edge, wherever it is written. An import runs the `__init__` of every package
on the way to its target that the importer is not already inside, so those count as edges too; `from pkg
import name` is an edge to `pkg.name` when that is a module, else to `pkg` (a re-export from its
`__init__`); `importlib.import_module("...")` with a constant name counts as an import. Imports under
`if TYPE_CHECKING:` never run and are left out.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOP = "cacheblend_rag"
ROOTS = {TOP: REPO / "cacheblend_rag", f"{TOP}.integrations": REPO / "integrations"}


@dataclass(frozen=True)
class Module:
    """A parsed module: its dotted name, whether it is a package `__init__`, and its source file."""

    name: str
    is_package: bool
    path: Path


def discover() -> dict[str, Module]:
    """Every module of the package by dotted name."""
    modules: dict[str, Module] = {}
    for prefix, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            modules[".".join([prefix, *parts])] = Module(".".join([prefix, *parts]), is_package, path)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_import_module(node: ast.AST) -> bool:
    """`importlib.import_module("<constant>", ...)` or `import_module("<constant>", ...)`."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return False
    func = node.func
    return (isinstance(func, ast.Name) and func.id == "import_module") or (
        isinstance(func, ast.Attribute) and func.attr == "import_module")


def _import_nodes(tree: ast.AST):
    """Import statements and `import_module("...")` calls anywhere in the tree (functions, classes, try
    blocks), except under TYPE_CHECKING."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)) or _is_import_module(node):
            yield node
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children = node.orelse
        stack.extend(children)


def _resolve_relative(module: Module, level: int, name: str | None) -> str:
    """The absolute module named by `from <level dots><name> import ...` inside `module`."""
    package = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    if level - 1 > len(package) - 1:
        raise ValueError(f"{module.path}: relative import beyond the top-level package")
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _with_packages(target: str, importer: str, modules: dict[str, Module]) -> list[str]:
    """The target and the package `__init__`s an import of it runs on the way that the importer is not inside."""
    parts = target.split(".")
    own = importer.split(".")
    chain = [".".join(parts[:i]) for i in range(1, len(parts)) if own[:i] != parts[:i]]
    return [name for name in chain if name in modules] + [target]


def imports_of(module: Module, modules: dict[str, Module]) -> dict[str, int]:
    """Modules of the package that `module` imports (target → first line number)."""
    tree = ast.parse(module.path.read_text(), filename=str(module.path))
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        for name in _with_packages(target, module.name, modules):
            if name != module.name:
                found.setdefault(name, line)

    for node in _import_nodes(tree):
        if isinstance(node, ast.Call):  # import_module(name), relative names against this module's package
            name = node.args[0].value
            level = len(name) - len(name.lstrip("."))
            target = _resolve_relative(module, level, name[level:] or None) if level else name
            if target == TOP or target.startswith(TOP + "."):
                add(target, node.lineno)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == TOP or alias.name.startswith(TOP + "."):
                    add(alias.name, node.lineno)
            continue
        base = _resolve_relative(module, node.level, node.module) if node.level else (node.module or "")
        if not (base == TOP or base.startswith(TOP + ".")):
            continue
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            add(sub if sub in modules else base, node.lineno)
    return found


def import_graph() -> tuple[dict[str, Module], dict[str, dict[str, int]]]:
    """All modules and their intra-package import edges."""
    modules = discover()
    return modules, {name: imports_of(m, modules) for name, m in modules.items()}


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0

    def visit(root: str) -> None:  # iterative: no recursion limit on a deep graph
        nonlocal counter
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(components)


def describe(component: list[str], modules: dict[str, Module], graph: dict[str, dict[str, int]]) -> str:
    """A cycle's modules and the import lines that close it."""
    members = set(component)
    lines = [f"cycle of {len(component)} modules: {', '.join(component)}"]
    for name in component:
        for target, line in sorted(graph[name].items()):
            if target in members:
                lines.append(f"  {modules[name].path.relative_to(REPO)}:{line}  {name} -> {target}")
    return "\n".join(lines)


# ---- the checker itself, on a package written for the purpose ----------------------------------------------


def _graph_of(tmp_path: Path, files: dict[str, str], monkeypatch) -> dict[str, dict[str, int]]:
    for rel, text in files.items():
        path = tmp_path / "cacheblend_rag" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.setitem(ROOTS, TOP, tmp_path / "cacheblend_rag")
    monkeypatch.delitem(ROOTS, f"{TOP}.integrations")
    return import_graph()[1]


def test_checker_finds_lazy_relative_and_reexport_cycles(tmp_path, monkeypatch):
    graph = _graph_of(tmp_path, {
        "__init__.py": "from .engine import Engine\n",
        "engine.py": "from .loading import profile\nclass Engine: ...\n",
        "loading/__init__.py": "from .layers import read\n",
        "loading/layers.py": "def read(): ...\n",
        "loading/profile.py": "def measure():\n    from ..engine import Engine\n",  # lazy, inside a function
        "bench/__init__.py": "",
        "bench/a.py": "from cacheblend_rag.bench import b\n",  # absolute
        "bench/b.py": "def main():\n    from . import a\n",
        "pkg/__init__.py": "from .user import thing\nVALUE = 1\n",
        "pkg/user.py": "from . import VALUE\nthing = VALUE\n",  # a re-export from the __init__ that imports it
        "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .engine import Engine\n",
        "models/__init__.py": "import importlib\ndef get(name):\n    return importlib.import_module('.adapter', __name__)\n",
        "models/adapter.py": "from importlib import import_module\nimport_module('cacheblend_rag.models')\n",
    }, monkeypatch)
    assert graph["cacheblend_rag.engine"] == {"cacheblend_rag.loading": 1, "cacheblend_rag.loading.profile": 1}
    assert "cacheblend_rag.engine" in graph["cacheblend_rag.loading.profile"]
    assert graph["cacheblend_rag.loading.profile"] == {"cacheblend_rag.engine": 2}  # its own package is running
    assert graph["cacheblend_rag.typed"] == {}
    assert strongly_connected(graph) == [
        ["cacheblend_rag.bench.a", "cacheblend_rag.bench.b"],
        ["cacheblend_rag.engine", "cacheblend_rag.loading.profile"],
        ["cacheblend_rag.models", "cacheblend_rag.models.adapter"],  # a registry imported lazily, by name
        ["cacheblend_rag.pkg", "cacheblend_rag.pkg.user"],
    ]


def test_checker_passes_a_package_that_imports_downstream_only(tmp_path, monkeypatch):
    graph = _graph_of(tmp_path, {
        "__init__.py": "from .engine import Engine\n",
        "engine.py": "from .store import Store\nclass Engine: ...\n",
        "store/__init__.py": "from .disk import Store\n",
        "store/disk.py": "import os\nclass Store: ...\n",
        "bench/__init__.py": "",
        "bench/command.py": "def run():\n    from ..engine import Engine\n    from . import report\n",
        "bench/report.py": "from cacheblend_rag.store.disk import Store\n",
    }, monkeypatch)
    assert strongly_connected(graph) == []


# ---- the package ---------------------------------------------------------------------------------------


def test_every_module_parses_and_is_reached():
    modules, graph = import_graph()
    assert f"{TOP}.engine" in modules and f"{TOP}.kernels" in modules and f"{TOP}.cli" in modules
    assert any(name.endswith(".langchain_cacheblend.chains") for name in modules)  # the partner packages too
    assert f"{TOP}.engine" in graph[TOP]  # the top-level __init__ re-exports the engine


def test_no_import_cycles_inside_the_package():
    modules, graph = import_graph()
    cycles = strongly_connected(graph)
    if cycles:
        pytest.fail("import cycles inside cacheblend_rag (lazy imports included):\n"
                    + "\n".join(describe(c, modules, graph) for c in cycles), pytrace=False)


# ---- the core imports no plugin: partner packages, frameworks and the benchmarks are downstream ----------------

PLUGINS = ("langchain_cacheblend", "llama_index", "langchain", "cacheblend_bench", "benchmarks")
"""Top-level names the core never imports: its partner packages, the frameworks they wrap, the benchmarks."""

ALLOWED = {
    ("cacheblend_rag/ingest/loaders.py", "langchain_text_splitters"):
        "split_texts' documented splitter (the [langchain] extra): a text library with no LangChain runtime, "
        "imported inside the function",
}
"""(module path, imported top-level name) pairs the core may import anyway, each with its reason."""


def _is_plugin(name: str) -> bool:
    top = name.split(".")[0]
    return any(top == p or top.startswith(p + "_") for p in PLUGINS)


def plugin_imports(root: Path, repo: Path) -> list[str]:
    """`path:line name` for every import of a plugin under `root`, wherever written (functions, try blocks and
    TYPE_CHECKING included), less the ALLOWED pairs."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(repo).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else []
            elif _is_import_module(node):
                names = [node.args[0].value]
            else:
                continue
            found += [f"{rel}:{node.lineno} {n}" for n in names
                      if _is_plugin(n) and (rel, n.split(".")[0]) not in ALLOWED]
    return found


def test_plugin_checker_finds_lazy_typed_and_dynamic_imports(tmp_path):
    pkg = tmp_path / "cacheblend_rag"
    (pkg / "ingest").mkdir(parents=True)
    (pkg / "cli.py").write_text("def ask():\n    from langchain_cacheblend.chains import create_stuff_chain\n")
    (pkg / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import llama_index.core\n")
    (pkg / "dyn.py").write_text("import importlib\nimportlib.import_module('cacheblend_bench.command')\n")
    (pkg / "core.py").write_text("from langchain_core.documents import Document\nimport langchainx\nimport os\n")
    (pkg / "ingest" / "loaders.py").write_text("def split():\n    import langchain_text_splitters\n")
    assert plugin_imports(pkg, tmp_path) == [
        "cacheblend_rag/cli.py:2 langchain_cacheblend.chains",
        "cacheblend_rag/core.py:1 langchain_core.documents",
        "cacheblend_rag/dyn.py:2 cacheblend_bench.command",
        "cacheblend_rag/typed.py:3 llama_index.core",
    ]


def test_the_core_imports_no_partner_package_framework_or_benchmark():
    found = plugin_imports(REPO / TOP, REPO)
    if found:
        pytest.fail("the core imports what depends on it (declare a subcommand in the entry-point group "
                    "cacheblend_rag.commands, or move the code downstream):\n  " + "\n  ".join(found), pytrace=False)



def test_the_default_method_is_written_once():
    """Every surface's default method is `fuse.policies.DEFAULT_METHOD`: no module spells a method name as a default."""
    import re

    spelled = re.compile(r"""(method: str( \| Policy)? = (Field\(default=)?|"--method", default=)["']\w+["']""")
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
             for root in (REPO / "cacheblend_rag", REPO / "integrations") for path in root.rglob("*.py")
             if "tests" not in path.parts
             for n, line in enumerate(path.read_text().splitlines(), 1) if spelled.search(line)]
    assert not found, "a default method spelled out instead of DEFAULT_METHOD:\n" + "\n".join(found)


# ---- the engine and the chunk cache name no policy: a policy's per-chunk state is its own ---------------------

POLICY_MODULES = f"{TOP}.fuse.policies."
"""Each policy's own modules (and its state: Cache-Craft's variants live in `fuse.policies.cachecraft`)."""
SHARED_CHECKS = f"{TOP}.fuse.policies.checks"
"""No policy: the range checks every policy shares (and the engine's own ratio option), free to import."""


def _is_policy_module(name: str) -> bool:
    return name.startswith(POLICY_MODULES) and not name.startswith(SHARED_CHECKS)


def policy_imports(module: Module, modules: dict[str, Module]) -> list[str]:
    """`line target` for every import in `module` (TYPE_CHECKING and functions included) of a policy's own module
    (under `fuse.policies.`, or the old `fuse.variants`), or of a name defined in one (a policy class re-exported
    by the registry); the registry itself (`fuse.policies`: make_policy, DEFAULT_METHOD...) and `fuse.policy`
    (the `Policy` ABC) are the boundary, free to import."""
    import importlib

    found = []
    for node in ast.walk(ast.parse(module.path.read_text(), filename=str(module.path))):
        if isinstance(node, ast.Import):
            targets = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(module, node.level, node.module) if node.level else (node.module or "")
            targets = [(f"{base}.{a.name}", None) if f"{base}.{a.name}" in modules else (base, a.name)
                       for a in node.names]
        elif _is_import_module(node):
            targets = [(node.args[0].value, None)]
        else:
            continue
        for target, name in targets:
            if _is_policy_module(target) or target == f"{TOP}.fuse.variants":
                found.append(f"{node.lineno} {target}")
            elif name is not None and target.startswith(TOP):
                defined_in = getattr(getattr(importlib.import_module(target), name, None), "__module__", "") or ""
                if _is_policy_module(defined_in):
                    found.append(f"{node.lineno} {target}.{name} (from {defined_in})")
    return found


def test_policy_import_checker_finds_modules_and_re_exported_classes(tmp_path, monkeypatch):
    modules = {
        f"{TOP}.engine": Module(f"{TOP}.engine", False, tmp_path / "engine.py"),
        f"{TOP}.fuse.policies.cachecraft": Module(f"{TOP}.fuse.policies.cachecraft", True, tmp_path / "x.py"),
    }
    (tmp_path / "engine.py").write_text(
        "from .fuse.policies import CacheCraft, make_policy, DEFAULT_METHOD\n"
        "from .fuse.policy import Policy\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .fuse.variants import VariantStore\n"
        "def f():\n    from .fuse.policies import cachecraft\n")
    assert policy_imports(modules[f"{TOP}.engine"], modules) == [
        f"1 {TOP}.fuse.policies.CacheCraft (from {TOP}.fuse.policies.cachecraft.selection)",
        f"5 {TOP}.fuse.variants",
        f"7 {TOP}.fuse.policies.cachecraft",
    ]


@pytest.mark.parametrize("name", ["engine", "fuse.chunk_cache", "fuse.prefill", "fuse.policy"])
def test_the_engine_and_the_cache_import_no_policy(name):
    """They reach policies through the registry and the `Policy` ABC only (what the prefill may ask of any policy,
    `chunk_state` included), so a policy with per-chunk state is one module and one registry line."""
    modules = discover()
    found = policy_imports(modules[f"{TOP}.{name}"], modules)
    assert not found, f"{TOP}.{name} imports a policy's own module or class:\n  " + "\n  ".join(found)


# ---- each option is checked in one place: the policy's own constructor (or the registry's make_policy) ---------

OWN_RANGE_CHECKS = {"cacheblend_rag/engine.py": {"quality_floor"}}
"""Shares checked with `check_ratio` outside the policies: the engine's own options (where the engine defines them),
no policy's."""


def ratio_checks() -> list[tuple[str, str, str]]:
    """(file, enclosing function, option) for every `check_ratio(...)` call in the package and the integrations
    (tests aside); the option is the call's `name` argument, `recompute_ratio` by default."""
    found = []
    for root in (REPO / TOP, REPO / "integrations"):
        for path in sorted(root.rglob("*.py")):
            if "tests" in path.parts:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            for func in ast.walk(tree):
                if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(func):
                    if not isinstance(node, ast.Call):
                        continue
                    callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
                    if callee != "check_ratio":
                        continue
                    named = node.args[1] if len(node.args) > 1 else next(
                        (k.value for k in node.keywords if k.arg == "name"), None)
                    option = named.value if isinstance(named, ast.Constant) else "recompute_ratio"
                    found.append((path.relative_to(REPO).as_posix(), func.name, option))
    return sorted(set(found))


def test_each_option_is_checked_by_the_policy_alone():
    """A surface (CLI, LangChain, LlamaIndex, the request) builds a policy and lets its constructor refuse a bad
    option; it checks no range and no method name of its own (issue #49: a ratio was checked 3–4 times a call)."""
    checks = ratio_checks()
    outside = [c for c in checks if not c[0].startswith(f"{TOP}/fuse/policies/")
               and c[2] not in OWN_RANGE_CHECKS.get(c[0], ())]
    assert not outside, f"check_ratio called outside fuse/policies/: {outside}"
    by_option: dict[str, list[tuple[str, str]]] = {}
    for path, func, option in checks:
        by_option.setdefault(option, []).append((path, func))
    # recompute_ratio: each policy that has one, in its constructor; make_policy for the methods that have none
    assert sorted(by_option["recompute_ratio"]) == [
        (f"{TOP}/fuse/policies/__init__.py", "make_policy"),
        (f"{TOP}/fuse/policies/cacheblend.py", "__post_init__"),
        (f"{TOP}/fuse/policies/relevance.py", "__post_init__"),
    ]
    assert sorted(by_option["lookalike"]) == [(f"{TOP}/fuse/policies/cacheblend.py", "__post_init__"),
                                              (f"{TOP}/fuse/policies/relevance.py", "__post_init__")]
    assert by_option["guard_ratio"] == [(f"{TOP}/fuse/policies/checks.py", "check_guard_options")]
    assert by_option["quality_floor"] == [(f"{TOP}/engine.py", "__init__")]
    assert set(by_option) == {"recompute_ratio", "lookalike", "guard_ratio", "quality_floor"}


def test_no_surface_validates_a_method_or_its_ratio_itself():
    """No pydantic validator of `method` or `recompute_ratio` and no `not in POLICIES` test in the integrations or
    the CLI: `make_policy` names an unknown method, the policy a bad ratio (the server's schemas are its own)."""
    found = []
    paths = [*(REPO / "integrations").rglob("*.py"), REPO / TOP / "cli.py", *(REPO / TOP / "commands").rglob("*.py")]
    for path in paths:
        if "tests" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "field_validator"
                    and any(isinstance(a, ast.Constant) and a.value in ("method", "recompute_ratio") for a in node.args)):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} field_validator")
            if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                    and any(isinstance(op, ast.NotIn) for op in node.test.ops)
                    and any(getattr(c, "id", "") == "POLICIES" for c in node.test.comparators)
                    and any(isinstance(n, ast.Raise) for n in node.body)):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} not in POLICIES")
    assert not found, "a surface checks a method or ratio itself (build the policy instead):\n" + "\n".join(found)


def test_no_policy_imports_another():
    """Policies share checks through `fuse/policies/checks.py`, never by importing each other."""
    modules = discover()
    root = f"{TOP}.fuse.policies"
    own = {name.split(".")[3] for name in modules if name.startswith(root + ".") and name != f"{root}.checks"}
    found = []
    for name, module in modules.items():
        if not name.startswith(root + ".") or name == f"{root}.checks":
            continue
        mine = name.split(".")[3]
        for node in ast.walk(ast.parse(module.path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                target = _resolve_relative(module, node.level, node.module)
                targets = [target] + [f"{target}.{a.name}" for a in node.names]
                other = {t.split(".")[3] for t in targets if t.startswith(root + ".") and len(t.split(".")) > 3}
                if (other & own) - {mine}:
                    found.append(f"{name}:{node.lineno} imports {sorted((other & own) - {mine})}")
    assert not found, "\n".join(found)


# ---- the engine's own surface: four request methods (and `advance`); conveniences live in their own module ----

def test_the_engine_runs_requests_through_four_methods():
    """The engine class body defines the four `*_request` methods and `advance`; the one-line conveniences
    (`generate`, `stream`, ..., `*_prompt`) are inherited from `conveniences.py`, prompt matching is
    `fuse/prompt_match.py`'s, and no module global holds request state (`global` statements)."""
    from cacheblend_rag.conveniences import RequestConveniences

    tree = ast.parse((REPO / TOP / "engine.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CacheBlendEngine")
    own = {n.name for n in engine.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    conveniences = {name for name in vars(RequestConveniences) if not name.startswith("_")}
    surface = {name for name in own if name.endswith("_request") and not name.startswith("_")} | (
        own & (conveniences | {"advance"}))
    assert surface == {"prefill_request", "generate_request", "stream_request", "start_request", "advance"}
    assert len(surface) <= 6
    assert not own & {"_prompt_request", "_prompt_text"}, "prompt matching is fuse/prompt_match.py's"
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], "engine state held in a module global"


# ---- the server: one policy and one `Request` per request, built where its body is read (issue #49) -------------

SERVE = REPO / TOP / "serve"
APP_MAX_LINES = 450


def serve_calls(callee: str, owner: str | None = None) -> list[str]:
    """`file:line` of every call of `callee` (`owner.callee` when `owner` is given) in the server's modules."""
    found = []
    for path in sorted(SERVE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if owner is None and (getattr(func, "id", None) == callee or getattr(func, "attr", None) == callee):
                found.append(f"{path.name}:{node.lineno}")
            elif owner is not None and isinstance(func, ast.Attribute) and func.attr == callee \
                    and getattr(func.value, "id", None) == owner:
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_the_server_builds_one_policy_and_one_request_per_request():
    """The body's validation builds the policy (`schemas.CacheBlendOptions`, the one `make_policy` of serve/) and
    keeps it; the engine's `Request` is built once, where the body is read (`Request.of` in calls.py alone, one per
    path: a whole prompt or a question with chunks); `EngineCall` carries that request and its retrieval query, with
    no policy or default of its own; no module global holds request state."""
    assert [site.split(":")[0] for site in serve_calls("make_policy")] == ["schemas.py"]
    request_of = serve_calls("of", owner="Request")
    assert {site.split(":")[0] for site in request_of} == {"calls.py"} and len(request_of) == 2, request_of
    runner = ast.parse((SERVE / "runner.py").read_text())
    call = next(n for n in runner.body if isinstance(n, ast.ClassDef) and n.name == "EngineCall")
    fields = {n.target.id: n for n in call.body if isinstance(n, ast.AnnAssign)}
    assert list(fields) == ["request", "retrieval"], list(fields)
    assert fields["request"].value is None, "an EngineCall's request is the route's, never a default"
    retrieval = fields["retrieval"].value
    assert isinstance(retrieval, ast.Constant) and retrieval.value is None, "no retrieval unless the body asks"
    for path in sorted(SERVE.glob("*.py")):
        tree = ast.parse(path.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], f"{path.name}: a module global's state"


def test_the_server_app_is_its_routes():
    """app.py holds the app and its routes; reading bodies into calls, admission and answering are modules of
    their own (calls.py, admission.py, responses.py)."""
    lines = len((SERVE / "app.py").read_text().splitlines())
    assert lines <= APP_MAX_LINES, f"serve/app.py has {lines} lines, more than {APP_MAX_LINES}"
    for name in ("calls", "admission", "responses", "config"):
        assert (SERVE / f"{name}.py").exists(), name
