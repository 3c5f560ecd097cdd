"""SentencePiece BPE (GGUF `tokenizer.ggml.model` = `llama`): Llama 2, Gemma, Mistral v1, ...

The vocabulary carries a score per token instead of a merge list. Encoding a fragment starts from
its characters (spaces spelled `▁`) and keeps merging the adjacent pair whose concatenation is the
highest-scoring token, leftmost on ties, until no pair is a token (`llm_tokenizer_spm` in llama.cpp,
sentencepiece's BPE mode). A character that never became a token is written as its UTF-8 bytes with
the `<0xNN>` tokens ("byte fallback").
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

SPACE = "▁"  # U+2581, how SentencePiece spells a space inside tokens


class SentencePieceBPE:
    """Encodes text that holds no special tokens; `normal_bytes` turns a normal token back into bytes."""

    def __init__(self, tokens: Sequence[str], scores: Sequence[float], unk_id: int | None) -> None:
        self._ids = {t: i for i, t in enumerate(tokens)}
        self._scores = scores
        self._byte_ids = [self._byte_token(b, unk_id) for b in range(256)]

    def _byte_token(self, b: int, unk_id: int | None) -> int | None:
        """`<0xNN>`, else the one-byte token itself (vocabularies without byte tokens), else unk."""
        found = self._ids.get(f"<0x{b:02X}>")
        if found is None and b < 0x80:
            found = self._ids.get(chr(b))
        return unk_id if found is None else found

    def encode(self, text: str) -> list[int]:
        syms = list(text.replace(" ", SPACE))  # syms[i] == "" once merged into its left neighbour
        n = len(syms)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []  # (-score, left, right, merged length)

        def push(left: int, right: int) -> None:
            if left < 0 or right >= n:
                return
            merged = syms[left] + syms[right]
            tid = self._ids.get(merged)
            if tid is not None:
                heapq.heappush(heap, (-self._scores[tid], left, right, len(merged)))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            # Stale entry: one side was merged away or grew since the pair was queued.
            if not syms[left] or not syms[right] or len(syms[left]) + len(syms[right]) != size:
                continue
            syms[left] += syms[right]
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[left] < n:
                prv[nxt[left]] = left
            push(prv[left], left)
            push(left, nxt[left])

        out: list[int] = []
        i = 0
        while i < n:
            tid = self._ids.get(syms[i])
            if tid is not None:
                out.append(tid)
            else:
                out.extend(t for t in (self._byte_ids[b] for b in syms[i].encode("utf-8")) if t is not None)
            i = nxt[i]
        return out

    @staticmethod
    def normal_bytes(token: str) -> bytes:
        return token.replace(SPACE, " ").encode("utf-8")
