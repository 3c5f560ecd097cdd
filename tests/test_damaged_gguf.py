"""Damaged GGUFs: every seeded mutation of the SmolLM2 file either loads and runs or fails with one
`LlmxError` line; none hangs and none escapes as another exception.

The mutations hit each part of the file: the fixed header, metadata integers and lengths, the bytes of
the vocabulary and merge strings, the tensor infos (name, rank, dimensions, type, offset), the tensor
data, and the file's length. A worker process (this file run as a script) applies them one at a time
to a copy of the file, loads it with `llmx.load`, generates two tokens and reports the outcome; the
test bounds each case with an alarm and the whole batch with a timeout.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CASES = 96
SEED = 35
CASE_SECONDS = 20
BATCH_SECONDS = 600

_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_INTEGER_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class Field:
    """`size` bytes at `offset` holding one integer of the file's structure."""

    offset: int
    size: int


@dataclass
class Layout:
    """Where a GGUF's parts lie, from its own header (read here with struct, not with llmx)."""

    header: list[Field]  # version, tensor count, key-value count
    meta_ints: list[Field]  # integer metadata values
    meta_lengths: list[Field]  # string lengths, array counts
    meta_strings: list[tuple[int, int]]  # (offset, length) of array strings: vocabulary, merges
    tensor_fields: list[Field]  # rank, dimensions, type, offset of each tensor info
    tensor_names: list[tuple[int, int]]
    data_offset: int
    size: int


def layout(buf: bytes) -> Layout:
    pos = 24
    out = Layout([Field(4, 4), Field(8, 8), Field(16, 8)], [], [], [], [], [], 0, len(buf))

    def u(fmt: str) -> int:
        nonlocal pos
        (v,) = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return v

    def string(strings: list[tuple[int, int]] | None) -> None:
        nonlocal pos
        out.meta_lengths.append(Field(pos, 8))
        n = u("Q")
        if strings is not None:
            strings.append((pos, n))
        pos += n

    def value(vtype: int, in_array: bool) -> None:
        nonlocal pos
        if vtype == _STRING:
            string(out.meta_strings if in_array else None)
        elif vtype == _ARRAY:
            etype = u("I")
            out.meta_lengths.append(Field(pos, 8))
            count = u("Q")
            if etype in _SCALAR_BYTES:
                pos += count * _SCALAR_BYTES[etype]
            else:
                for _ in range(count):
                    value(etype, True)
        else:
            if vtype in _INTEGER_TYPES:
                out.meta_ints.append(Field(pos, _SCALAR_BYTES[vtype]))
            pos += _SCALAR_BYTES[vtype]

    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    for _ in range(n_kv):
        string(None)
        value(u("I"), False)
    for _ in range(n_tensors):
        name_len = struct.unpack_from("<Q", buf, pos)[0]
        out.tensor_names.append((pos + 8, name_len))
        pos += 8 + name_len
        out.tensor_fields.append(Field(pos, 4))
        n_dims = u("I")
        out.tensor_fields += [Field(pos + 8 * i, 8) for i in range(n_dims)]
        pos += 8 * n_dims
        out.tensor_fields += [Field(pos, 4), Field(pos + 4, 8)]
        pos += 12
    out.data_offset = -(-pos // 32) * 32
    return out


# --- mutations ---------------------------------------------------------------------------------------

KINDS = (
    "header", "meta_int", "meta_length", "meta_string", "tensor_field", "tensor_name", "data", "truncate",
)  # fmt: skip


def _integer(rng: random.Random, old: int, size: int) -> int:
    top = (1 << (8 * size)) - 1
    choices = [0, 1, top, old + 1, old - 1, old ^ (1 << rng.randrange(8 * size)), rng.randrange(top + 1)]
    return rng.choice(choices) & top


def mutation(rng: random.Random, lay: Layout, buf: bytes, kind: str) -> dict:
    """One damage of `kind`: bytes to write at an offset, or a length to cut the file to."""
    if kind == "truncate":
        return {"kind": kind, "length": rng.randrange(lay.size)}
    if kind in ("header", "meta_int", "meta_length", "tensor_field"):
        fields = {"header": lay.header, "meta_int": lay.meta_ints, "meta_length": lay.meta_lengths}
        f = rng.choice(fields.get(kind, lay.tensor_fields))
        old = int.from_bytes(buf[f.offset : f.offset + f.size], "little")
        new = _integer(rng, old, f.size).to_bytes(f.size, "little")
        return {"kind": kind, "offset": f.offset, "bytes": new.hex()}
    if kind == "data":
        offset = rng.randrange(lay.data_offset, lay.size - 4)
    else:
        start, n = rng.choice(lay.meta_strings if kind == "meta_string" else lay.tensor_names)
        offset = start + rng.randrange(max(n, 1))
    noise = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
    return {"kind": kind, "offset": offset, "bytes": noise.hex()}


def mutations(path: Path, n: int, seed: int) -> list[dict]:
    buf = path.read_bytes()
    lay, rng = layout(buf), random.Random(seed)
    return [mutation(rng, lay, buf, KINDS[i % len(KINDS)]) for i in range(n)]


# --- the worker --------------------------------------------------------------------------------------


def _alarm(signum, frame):
    raise TimeoutError(f"case took over {CASE_SECONDS} s")


def run_case(path: Path) -> None:
    import llmx

    model = llmx.load(path, ctx_size=64, threads=1)
    model.generate("The capital of France is", max_tokens=2, temperature=0)


def worker(original: Path, scratch: Path, cases: list[dict]) -> None:
    """Apply each case to `scratch` (a copy of `original`), run it, print its outcome as a JSON line,
    and undo it."""
    from llmx.errors import LlmxError

    signal.signal(signal.SIGALRM, _alarm)
    with open(original, "rb") as f:
        pristine = f.read()
    for i, case in enumerate(cases):
        with open(scratch, "r+b") as f:
            if case["kind"] == "truncate":
                f.truncate(case["length"])
            else:
                f.seek(case["offset"])
                f.write(bytes.fromhex(case["bytes"]))
        signal.alarm(CASE_SECONDS)
        try:
            run_case(scratch)
            outcome, message = "ok", ""
        except LlmxError as e:
            outcome, message = "llmx", str(e)
        except Exception as e:  # the test reports whatever escapes
            outcome, message = type(e).__name__, str(e)
        finally:
            signal.alarm(0)
        print(json.dumps({"case": i, **case, "outcome": outcome, "message": message}), flush=True)
        with open(scratch, "r+b") as f:
            if case["kind"] == "truncate":
                f.seek(case["length"])
                f.write(pristine[case["length"] :])
            else:
                f.seek(case["offset"])
                f.write(pristine[case["offset"] : case["offset"] + len(case["bytes"]) // 2])


def run_batch(original: Path, scratch_dir: Path, cases: list[dict], timeout: float) -> list[dict]:
    scratch = scratch_dir / original.name
    shutil.copyfile(original, scratch)
    proc = subprocess.run(
        [sys.executable, __file__, str(original), str(scratch)],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(results) == len(cases), proc.stderr[-2000:]
    return results


def test_every_damaged_file_loads_and_runs_or_gives_one_llmx_error_line(smollm2_path, tmp_path):
    results = run_batch(smollm2_path, tmp_path, mutations(smollm2_path, CASES, SEED), BATCH_SECONDS)
    escaped = [r for r in results if r["outcome"] not in ("ok", "llmx")]
    assert not escaped, "\n".join(json.dumps(r)[:300] for r in escaped)
    failed = [r for r in results if r["outcome"] == "llmx"]
    multi_line = [r for r in failed if "\n" in r["message"].strip()]
    assert not multi_line, multi_line
    unnamed = [r for r in failed if smollm2_path.name not in r["message"]]
    assert not unnamed, "\n".join(r["message"] for r in unnamed)
    assert {r["kind"] for r in failed} >= {"header", "tensor_field", "truncate"}  # the damage was seen


if __name__ == "__main__":
    worker(Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.stdin.read()))
