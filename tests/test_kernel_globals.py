"""What Triton's CPU interpreter, which runs every kernel test here, accepts and the GPU's compiler
refuses, checked on every jitted function in llmx (jitted: `JITFunction`, or under the interpreter
`InterpretedFunction`; both are `KernelInterface`s):
- module globals a kernel reads must be `tl.constexpr`s (or functions and modules): the interpreter
  reads a plain int, the compiler does not;
- a value returned from inside an `if` ends the function (if/else): the compiler also generates the
  statements after a constexpr branch's return and refuses returns of different types."""

from __future__ import annotations

import ast
import builtins
import dis
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest
import triton.language as tl
from triton.runtime.jit import KernelInterface

import llmx


def jitted_functions() -> list[tuple[str, KernelInterface]]:
    found = []
    for info in pkgutil.walk_packages(llmx.__path__, "llmx."):
        if info.name.startswith("llmx.server"):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, KernelInterface) and value.fn.__module__ == info.name:
                found.append((f"{info.name}.{name}", value))
    return found


def compilable(value: object) -> bool:
    """What a compiled kernel may take from its module's globals."""
    if isinstance(value, (tl.constexpr, types.ModuleType, KernelInterface)):
        return True
    return callable(value) and (getattr(value, "__module__", "") or "").startswith("triton")


KERNELS = jitted_functions()


def test_the_walk_finds_the_kernels():
    assert len(KERNELS) > 20


@pytest.mark.parametrize(("name", "fn"), KERNELS, ids=[n for n, _ in KERNELS])
def test_a_kernel_reads_only_constexpr_globals(name, fn):
    scope = fn.fn.__globals__
    loaded = {i.argval for i in dis.get_instructions(fn.fn.__code__) if i.opname == "LOAD_GLOBAL"}
    bad = sorted(g for g in loaded if g in scope and not hasattr(builtins, g) and not compilable(scope[g]))
    assert not bad, f"{name} reads globals a compiled kernel cannot: {bad} (make them tl.constexpr)"


def returns_before_the_end(body: list[ast.stmt]) -> list[int]:
    """Lines of `if`s that return a value and are followed by more statements of the same body."""
    lines = []
    for i, stmt in enumerate(body):
        if isinstance(stmt, ast.If):
            returns = any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(stmt))
            if returns and i < len(body) - 1:
                lines.append(stmt.lineno)
            lines += returns_before_the_end(stmt.body) + returns_before_the_end(stmt.orelse)
    return lines


@pytest.mark.parametrize(("name", "fn"), KERNELS, ids=[n for n, _ in KERNELS])
def test_a_value_returned_in_a_branch_ends_the_function(name, fn):
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn.fn)))
    lines = returns_before_the_end(tree.body[0].body)
    assert not lines, f"{name}: the if at line(s) {lines} of its source returns early (use if/else)"
