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


def _imports() -> dict[str, set[str]]:
    """Module -> the llmx modules it imports anywhere in its source (function-level and TYPE_CHECKING
    imports too); the root package, which every module's import passes through, left out."""
    modules = {}
    for path, tree in _sources().items():
        name = path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        modules[name] = tree
    edges = {}
    for name, tree in modules.items():
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        edges[name] = {m for m in found if m in modules and m not in (name, "llmx")}
    return edges


def test_ops_kernels_models_and_runtime_import_no_circle():
    edges = _imports()
    layers = ("llmx.ops", "llmx.kernels", "llmx.models", "llmx.runtime")
    ours = {m for m in edges if m.startswith(layers)}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for m in edges[todo.pop()]:
                if m == goal:
                    return True
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        return False

    assert [m for m in sorted(ours) if reaches(m, m)] == []
