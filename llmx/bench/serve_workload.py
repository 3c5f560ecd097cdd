"""What `llmx bench-serve` sends, reproducible from a seed: prompts of a chosen number of tokens, which
prompt each request carries, and when each request arrives. Pure: no network (the words are checked
against the server's tokenizer by `llmx.bench.serve_client`).

A prompt is common English words, each with its leading space: byte-level BPE tokenizers (llama's,
Qwen's, SmolLM2's) cut text at spaces first, so a word that is one token alone is one token in any
such prompt, and a prompt of n one-token words is n tokens (plus any BOS the server adds).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

WORDS = (  # noqa: SIM905 (a paragraph reads better than a column of quoted words)
    "the of and to in is was for on with as by at from that this it he she they we you his her their one "
    "two three time year day man world life hand part child eye woman place work week case point home "
    "water room mother area money story fact month lot right study book word business issue side kind "
    "head house service friend father power hour game line end member law car city name team minute idea "
    "body back parent face level office door health person art war history party result change morning "
    "reason research girl moment air teacher force education"
).split()


@dataclass(frozen=True)
class Workload:
    """`prompts[prompt_of[i]]` is request i's prompt; it is sent `arrivals[i]` seconds after the start."""

    prompts: tuple[str, ...]
    prompt_of: tuple[int, ...]
    arrivals: tuple[float, ...]


def prompt_text(words: Sequence[str], n_words: int, rng: random.Random) -> str:
    """`n_words` words drawn from `words`, each after a space."""
    return "".join(" " + w for w in rng.choices(words, k=n_words))


def arrival_times(n: int, rate: float, rng: random.Random) -> tuple[float, ...]:
    """Seconds from the start at which `n` requests arrive: a Poisson process of `rate` a second
    (exponential gaps), or all at 0 when the rate is infinite."""
    if math.isinf(rate):
        return (0.0,) * n
    t, times = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return tuple(times)


def workload(
    words: Sequence[str], n_words: int, n_requests: int, n_distinct: int, rate: float, seed: int
) -> Workload:
    """`n_requests` requests over `n_distinct` prompts in turn; prompts and arrivals each draw from their
    own generator, so changing the rate keeps the prompts."""
    prompt_rng, arrival_rng = random.Random(f"prompts {seed}"), random.Random(f"arrivals {seed}")
    prompts = tuple(prompt_text(words, n_words, prompt_rng) for _ in range(n_distinct))
    prompt_of = tuple(i % n_distinct for i in range(n_requests))
    return Workload(prompts, prompt_of, arrival_times(n_requests, rate, arrival_rng))
