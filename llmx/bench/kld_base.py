"""The file `llmx perplexity --kl-divergence-base FILE` writes and `--kl-divergence` reads: a base run's
log-probabilities over the whole vocabulary at every scored position, with what they were computed from.

It is a numpy .npz (a zip of .npy arrays), written one chunk at a time so that a long text never holds
all of it in memory:

    vocab       the vocabulary's fingerprint (`vocab_fingerprint`): runs of another vocabulary cannot compare
    model       the base model's description, for messages
    n_ctx       the chunk size
    chunks      [n_chunks, n_ctx] int32: the text's tokens, as in the text (before any BOS replacement)
    nll         [n_chunks, n_scored] float64: the base run's NLL of each scored token
    logprobs_I  [n_scored, vocab] float16: chunk I's log-probabilities
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from llmx.errors import LlmxError


def vocab_fingerprint(tokens: Sequence[str]) -> str:
    """A short hash of a vocabulary's token texts, in order."""
    return hashlib.sha256("\0".join(tokens).encode("utf-8", "surrogatepass")).hexdigest()[:16]


class BaseWriter:
    """Writes a base file chunk by chunk: `add(logprobs, nll)` per chunk, then `close()`. The chunks go
    to `path` + ".partial", renamed to `path` by `close`: a run that stops early leaves any earlier
    file at `path` as it was, never half a base."""

    def __init__(
        self, path: str | os.PathLike, vocab: str, model: str, chunks: Sequence[Sequence[int]]
    ) -> None:
        self.path = Path(path)
        self._partial = self.path.with_name(self.path.name + ".partial")
        try:
            self._zip = zipfile.ZipFile(self._partial, "w", zipfile.ZIP_STORED, allowZip64=True)
        except OSError as e:
            raise LlmxError(f"cannot write {path}: {e.strerror}") from None
        self._nll: list[np.ndarray] = []
        self._put("vocab", np.array(vocab))
        self._put("model", np.array(model))
        self._put("n_ctx", np.array(len(chunks[0])))
        self._put("chunks", np.asarray(chunks, dtype=np.int32))

    def _put(self, name: str, array: np.ndarray) -> None:
        with self._zip.open(f"{name}.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array(f, np.asanyarray(array), allow_pickle=False)

    def add(self, logprobs: np.ndarray, nll: np.ndarray) -> None:
        self._put(f"logprobs_{len(self._nll)}", logprobs.astype(np.float16))
        self._nll.append(np.asarray(nll, dtype=np.float64))

    def close(self) -> None:
        self._put("nll", np.stack(self._nll))
        self._zip.close()
        self._partial.replace(self.path)


class BaseFile:
    """A base file opened for reading; each chunk's log-probabilities load when asked for."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self._npz = np.load(self.path, allow_pickle=False)
            self.vocab = str(self._npz["vocab"])
            self.model = str(self._npz["model"])
            self.n_ctx = int(self._npz["n_ctx"])
            self.chunks: list[list[int]] = self._npz["chunks"].tolist()
            self.nll: np.ndarray = self._npz["nll"]
        except OSError as e:
            raise LlmxError(f"cannot read {path}: {e.strerror or e}") from None
        except (ValueError, KeyError, zipfile.BadZipFile):
            raise LlmxError(
                f"{self.path.name} is not a base file of `llmx perplexity --kl-divergence-base`"
            ) from None

    def logprobs(self, i: int) -> np.ndarray:
        """Chunk i's log-probabilities [n_scored, vocab] (float16)."""
        return self._npz[f"logprobs_{i}"]

    def check(self, vocab: str, model: str, chunks: Sequence[Sequence[int]] | None) -> None:
        """Refuse a comparison that means nothing: another vocabulary, or (when the text was given
        again) other tokens than the base's."""
        if vocab != self.vocab:
            raise LlmxError(
                f"{self.path.name} holds the base of {self.model}, whose vocabulary differs from {model}'s: "
                "KL divergence compares runs of one model (its quantizations, caches, placements)"
            )
        if chunks is not None and [list(c) for c in chunks] != self.chunks[: len(chunks)]:
            raise LlmxError(
                f"{self.path.name} was computed on another text (or another -c): its tokens differ from "
                "this text's; leave out -f to score the base's own tokens"
            )
