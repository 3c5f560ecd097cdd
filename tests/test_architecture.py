"""The layout's rules, checked on the source: who may read the environment, who may import what.

The rules are written down in `llmx/__init__.py`; each test here keeps one of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import llmx

PACKAGE = Path(llmx.__file__).parent


def _sources() -> dict[str, ast.Module]:
    return {
        str(p.relative_to(PACKAGE.parent)): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))
    }


def test_only_the_settings_module_reads_the_environment():
    readers = []
    for path, tree in _sources().items():
        for node in ast.walk(tree):
            environ = isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
            if environ and isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.append(f"{path}:{node.lineno}")
    assert readers and all(r.startswith("llmx/settings.py:") for r in readers), readers


def _module_name(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Each llmx module's imports of llmx modules, wherever they stand: at the top, inside functions,
    under TYPE_CHECKING (`from llmx.x import y` counts as importing `llmx.x.y` when that is a module)."""
    sources = {_module_name(path): tree for path, tree in _sources().items()}
    graph: dict[str, set[str]] = {}
    for module, tree in sources.items():
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in sources else node.module
                          for a in node.names}  # fmt: skip
        graph[module] = {n for n in names if n in sources and n != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (each holds an import circle)."""
    reach = {m: set() for m in graph}
    for start in graph:
        todo = list(graph[start])
        while todo:
            m = todo.pop()
            if m not in reach[start]:
                reach[start].add(m)
                todo += graph[m]
    circles: list[set[str]] = []
    for m in graph:
        component = {m} | {n for n in reach[m] if m in reach[n]}
        if len(component) > 1 and component not in circles:
            circles.append(component)
    return circles


def test_no_import_circles():
    assert _circles(_imports()) == []


def test_no_package_imports_itself_through_another():
    """`llmx.ops` -> `llmx.kernels` -> `llmx.ops` is a circle too, though no module meets itself."""
    packages: dict[str, set[str]] = {}
    for module, imported in _imports().items():
        package = ".".join(module.split(".")[:2])
        packages.setdefault(package, set()).update(".".join(m.split(".")[:2]) for m in imported)
    assert _circles({p: deps - {p} for p, deps in packages.items()}) == []


def test_models_see_only_the_ops_the_config_and_the_type_table():
    """A model file reads like the architecture's equations: it calls `llmx.ops` and never reaches
    for the runtime, the planner, the kernels or a device."""
    allowed = ("llmx.models", "llmx.ops", "llmx.model_config", "llmx.errors")
    graph = _imports()
    # of llmx.quant only its type table (pure data: a model may name the types its tensors take)
    reached = {
        m: sorted(n for n in graph[m] if not n.startswith(allowed) and n != "llmx.quant")
        for m in graph
        if m.startswith("llmx.models")
    }
    assert {m: n for m, n in reached.items() if n} == {}
    sources = _sources()
    devices = [p for p, tree in sources.items() if p.startswith("llmx/models/") for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and node.value in ("cuda", "cpu")]  # fmt: skip
    assert devices == []


def test_circles_are_found():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_bench_never_imports_the_commands():
    graph = _imports()
    wrong = {
        m: sorted(n for n in graph[m] if n.startswith("llmx.commands"))
        for m in graph
        if m.startswith("llmx.bench")
    }
    assert {m: n for m, n in wrong.items() if n} == {}


# llmx/__init__.py's layers, core first: prefixes of module names (the longest prefix places a module).
LAYERS = (
    ("llmx.settings", "llmx.errors"),
    ("llmx.quant", "llmx.gguf", "llmx.model_config", "llmx.cpu_info", "llmx.measured", "llmx.models_on_disk"),
    ("llmx.quant.",),
    ("llmx.plan",),
    ("llmx.kernels", "llmx.ops"),
    ("llmx.models",),
    ("llmx.runtime",),
    ("llmx.engine", "llmx.text", "llmx.api"),
    ("llmx.server", "llmx.bench", "llmx.commands", "llmx.cli", "llmx"),
)


def _layer(module: str) -> int:
    matches = [
        (len(prefix), i)
        for i, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix if prefix.endswith(".") else prefix + ".")
    ]
    assert matches, f"{module} is in no layer of llmx/__init__.py's list"
    return max(matches)[1]


def test_every_module_imports_only_its_own_layer_and_earlier_ones():
    graph = _imports()
    upward = [f"{m} -> {n}" for m in sorted(graph) for n in sorted(graph[m]) if _layer(n) > _layer(m)]
    assert upward == []
