"""llama-bench's value lists: `-ngl 0,16,99 -ctk f16,q8_0` means every combination, one row each.

As in llama-bench, a value may be a comma list, an integer range `first-last`, `first-last+step`
or `first-last*mult`, or the flag may be repeated. Two options keep llama-bench's inner separators
because their own syntax needs the comma: `-ts 3/1,1/1` is two splits, and `-ot` separates the
rules of one alternative with ';' (`-ot "exps=CPU;output=CUDA0,exps=CUDA0"` is two alternatives).
The placement flags themselves belong to `llmx.plan.options`; this module only multiplies them out.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import re

from llmx.errors import LlmxError
from llmx.plan.options import Options

# Options whose single value is itself a comma list; they cannot vary across rows.
NOT_LISTS = frozenset({"devices", "gpu_fit_margin"})
_RANGE = re.compile(r"^(\d+)-(\d+)(?:([+*])(\d+))?$")


def expand(text: str) -> list[str]:
    """'0,16,99' -> ['0', '16', '99']; '0-32+8' -> ['0', '8', ..., '32']; '1-8*2' -> ['1', '2', '4', '8']."""
    out: list[str] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        m = _RANGE.match(item)
        if not m:
            out.append(item)
            continue
        first, last, op, arg = int(m[1]), int(m[2]), m[3] or "+", int(m[4] or 1)
        if last < first or (op == "+" and arg < 1) or (op == "*" and arg < 2):
            raise LlmxError(f"bad range {item!r}: want first-last, first-last+step or first-last*mult")
        value = first
        while value <= last:
            out.append(str(value))
            value = value + arg if op == "+" else value * arg
    if not out:
        raise LlmxError(f"empty value list {text!r}")
    return out


def int_list(text: str) -> list[int]:
    """A list of whole numbers (`-p 128,512`, `-d 0-4096*2`)."""
    try:
        return [int(v) for v in expand(text)]
    except ValueError:
        raise LlmxError(f"expected whole numbers like 128,512; got {text!r}") from None


def _alternatives(name: str, value: object) -> list[object] | None:
    """The values one option takes across rows, or None when it does not vary."""
    if name == "override_tensor":
        if not value:
            return None
        # one -ot flag per alternative set of rules, each split on ',' into more alternatives
        alts = [alt.replace(";", ",") for flag in value for alt in str(flag).split(",") if alt]
        return [[alt] for alt in alts]
    if isinstance(value, str) and name not in NOT_LISTS:
        return expand(value)
    return None


def option_grid(args: argparse.Namespace) -> list[argparse.Namespace]:
    """One namespace per combination of the list-valued placement options, in llama-bench's order."""
    fields = [f.name for f in dataclasses.fields(Options) if f.name in vars(args)]
    axes = {name: alts for name in fields if (alts := _alternatives(name, getattr(args, name))) is not None}
    return [
        argparse.Namespace(**{**vars(args), **dict(zip(axes, combo, strict=True))})
        for combo in itertools.product(*axes.values())
    ]
