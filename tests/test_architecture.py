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
