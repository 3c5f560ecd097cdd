"""`llmx bench-serve`'s check: each greedy response under load must be the text its prompt gets when
served alone. Batching, chunked prefill and a shared prefix cache change how the work is cut, not
which tokens are chosen. Pure: texts in, mismatches out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SHOWN = 24  # characters shown of each text from the first difference


@dataclass(frozen=True)
class Mismatch:
    request: int
    position: int  # the first character where the two texts differ
    under_load: str
    alone: str

    def line(self) -> str:
        """One line for the user: where the texts part and what each says from there."""
        a = self.under_load[self.position : self.position + SHOWN]
        b = self.alone[self.position : self.position + SHOWN]
        return (
            f"request {self.request}: differs from character {self.position} "
            f"(under load {len(self.under_load)} chars, alone {len(self.alone)}): {a!r} against {b!r}"
        )


def first_difference(a: str, b: str) -> int | None:
    """The first index where `a` and `b` differ (the shorter one's length if one begins the other);
    None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def mismatches(texts: Sequence[str], prompt_of: Sequence[int], alone: Sequence[str]) -> list[Mismatch]:
    """Requests whose text (`texts[i]`, for prompt `prompt_of[i]`) is not the prompt's `alone` text."""
    out = []
    for i, (text, k) in enumerate(zip(texts, prompt_of, strict=True)):
        position = first_difference(text, alone[k])
        if position is not None:
            out.append(Mismatch(i, position, text, alone[k]))
    return out
