"""Two commits' CPU decode and prompt speed, measured alternately: A, B, A, B, ...

    python bench/ab.py REV_A REV_B [--model PATH] [--rounds 3] [--threads 2]

On a shared machine the speed moves by tens of percent within minutes (bench/RESULTS.md), so two
runs made one after the other compare the machine's moods as much as the code. Here each commit is
checked out once (git worktree, in a temporary folder) and every round runs A then B, each in a
fresh process: load, a 512-token prompt timed twice, 20 decode steps, then the best of three times
64 steps. The table gives each round's numbers side by side and the median ratio B / A.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from llmx.bench.fresh import run_snippet

REPO = Path(__file__).resolve().parent.parent

# Runs inside a worktree: prints {"prompt_tps": ..., "decode_tps": ...}.
PAYLOAD = """
import json, sys, time, torch, llmx
torch.set_num_threads(int(sys.argv[2]))
model = llmx.load(sys.argv[1] or None, ctx_size=1024)
engine = model.engine
prompt = list(range(1, 513))
best_prompt = 0.0
for _ in range(2):
    engine.reset()
    t0 = time.perf_counter()
    engine.prefill(prompt)
    best_prompt = max(best_prompt, len(prompt) / (time.perf_counter() - t0))
engine.reset()
engine.prefill(prompt[:8])
for _ in range(20):
    engine.decode(1)
best_decode = 0.0
for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(64):
        engine.decode(1)
    best_decode = max(best_decode, 64 / (time.perf_counter() - t0))
print(json.dumps({"prompt_tps": best_prompt, "decode_tps": best_decode}))
"""


def measure(tree: Path, model: str, threads: int) -> dict[str, float]:
    return run_snippet(PAYLOAD, model, str(threads), cwd=tree, env=os.environ | {"PYTHONPATH": str(tree)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev_a")
    ap.add_argument("rev_b")
    ap.add_argument("--model", default="", help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    git = ["git", "-C", str(REPO), "worktree"]
    with tempfile.TemporaryDirectory() as tmp:
        trees = []
        for name, rev in (("a", args.rev_a), ("b", args.rev_b)):
            tree = Path(tmp) / name
            subprocess.run([*git, "add", "-q", "--detach", str(tree), rev], check=True)
            trees.append(tree)
        try:
            rows = []
            for r in range(args.rounds):
                a, b = (measure(t, args.model, args.threads) for t in trees)
                rows.append((a, b))
                print(
                    f"round {r + 1}: prompt {a['prompt_tps']:.1f} -> {b['prompt_tps']:.1f} t/s, "
                    f"decode {a['decode_tps']:.1f} -> {b['decode_tps']:.1f} t/s",
                    flush=True,
                )
        finally:
            for tree in trees:
                subprocess.run([*git, "remove", "--force", str(tree)], check=False)
    for key in ("prompt_tps", "decode_tps"):
        ratio = statistics.median(b[key] / a[key] for a, b in rows)
        print(f"{key.split('_')[0]}: median B / A = {ratio:.3f} over {len(rows)} rounds")


if __name__ == "__main__":
    main()
