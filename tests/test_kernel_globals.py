"""Compiled Triton kernels read module globals only when they are `tl.constexpr`s (or functions and
modules); Triton's CPU interpreter, which runs every kernel test here, reads any global, so a plain
int in a kernel passes here and fails to compile on a GPU. This walks every jitted function in llmx
and checks the globals its bytecode loads (jitted: `JITFunction`, or under the interpreter
`InterpretedFunction`; both are `KernelInterface`s)."""

from __future__ import annotations

import builtins
import dis
import importlib
import pkgutil
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
