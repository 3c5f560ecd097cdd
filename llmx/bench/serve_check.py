"""`llmx bench-serve`'s check: each greedy response under load must be the text its prompt gets when
served alone. Batching, chunked prefill and a shared prefix cache change how the work is cut, not
which tokens are chosen, except at a near tie: where the run alone's two likeliest tokens are within
NEAR_TIE_NATS, the other kernels a batch takes (several rows at once, prompt chunks beside decode rows)
round the logits differently and may pick either, and the texts part there. Such a response is
counted apart, not as a failure; telling it needs the token ids of both runs (the server's
`return_tokens`) and the run alone's logprobs. Pure: replies in, mismatches out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmx.bench.serve_stats import Streamed

SHOWN = 24  # characters shown of each text from the first difference
# Two tokens this close in log-probability (so in logit) are a near tie: within what rounding x to int8 or
# bfloat16 in one kernel and not in another moves a logit through a model's layers (a few percent of it)
NEAR_TIE_NATS = 0.1


@dataclass(frozen=True)
class Mismatch:
    request: int
    position: int  # the first character where the two texts differ
    under_load: str
    alone: str
    token: int | None = None  # the first token where they differ, where both runs' ids are known
    margin: float | None = None  # the run alone's top two logprobs apart there (nats), where known

    @property
    def near_tie(self) -> bool:
        return self.margin is not None and self.margin < NEAR_TIE_NATS

    def line(self) -> str:
        """One line for the user: where the texts part and what each says from there."""
        a = self.under_load[self.position : self.position + SHOWN]
        b = self.alone[self.position : self.position + SHOWN]
        where = "" if self.token is None else f" at token {self.token}"
        if self.margin is not None:
            tie = "a near tie: " if self.near_tie else ""
            where += f", {tie}the top two {self.margin:.3f} nats apart alone"
        return (
            f"request {self.request}: differs from character {self.position}{where} "
            f"(under load {len(self.under_load)} chars, alone {len(self.alone)}): {a!r} against {b!r}"
        )


def first_difference(a: Sequence, b: Sequence) -> int | None:
    """The first index where `a` and `b` differ (the shorter one's length if one begins the other);
    None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def mismatches(
    under_load: Sequence[Streamed], prompt_of: Sequence[int], alone: Sequence[Streamed]
) -> list[Mismatch]:
    """Requests whose reply (`under_load[i]`, for prompt `prompt_of[i]`) is not the prompt's reply
    `alone`, each with how near a tie the run alone's choice was where they part."""
    out = []
    for i, (reply, k) in enumerate(zip(under_load, prompt_of, strict=True)):
        ref = alone[k]
        position = first_difference(reply.text, ref.text)
        if position is None:
            continue
        token = first_difference(reply.ids, ref.ids) if reply.ids and ref.ids else None
        top = ref.tops[token] if token is not None and token < len(ref.tops) else ()
        margin = top[0] - top[1] if len(top) >= 2 else None
        out.append(Mismatch(i, position, reply.text, ref.text, token, margin))
    return out
