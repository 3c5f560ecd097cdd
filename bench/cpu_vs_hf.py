"""llmx beside Hugging Face transformers on the same GGUF, on this CPU: load, pp512, tg128, peak RSS.

    python bench/cpu_vs_hf.py [MODEL.gguf] [-t THREADS]

Each engine runs in its own fresh process (so peak resident memory is its own), one after the other,
on the same random 512-token prompt; generation is greedy for 128 tokens with no early stop.
transformers dequantizes the GGUF to float32 at load, as its GGUF support does. Prints a markdown
table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llmx.bench.fresh import run_snippet

PROMPT_TOKENS, GEN_TOKENS = 512, 128

COMMON = r"""
import json, resource, sys, time
import torch
path, threads, n_prompt, n_gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
ids = torch.randint(100, 10000, (n_prompt,), generator=torch.Generator().manual_seed(0)).tolist()
def report(load, pp, tg):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"load_s": load, "pp_tps": n_prompt / pp, "tg_tps": n_gen / tg, "peak_rss": peak}))
"""

LLMX = (
    COMMON
    + r"""
import llmx
t0 = time.perf_counter()
model = llmx.load(path, ctx_size=1024, threads=threads)
load = time.perf_counter() - t0
engine = model.engine
engine.prefill(ids[:16]); engine.decode(1); engine.reset()          # warm-up (kernel setup)
t0 = time.perf_counter(); logits = engine.prefill(ids); pp = time.perf_counter() - t0
t0 = time.perf_counter()
for _ in range(n_gen):
    logits = engine.decode(int(logits.argmax()))
tg = time.perf_counter() - t0
report(load, pp, tg)
"""
)

HF = (
    COMMON
    + r"""
from pathlib import Path
from transformers import AutoModelForCausalLM
p = Path(path)
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
load = time.perf_counter() - t0
with torch.no_grad():
    t0 = time.perf_counter(); out = model(torch.tensor([ids]), use_cache=True); pp = time.perf_counter() - t0
    past, token = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
    t0 = time.perf_counter()
    for _ in range(n_gen):
        out = model(token, past_key_values=past, use_cache=True)
        past, token = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
    tg = time.perf_counter() - t0
report(load, pp, tg)
"""
)


def measure(script: str, model: Path, threads: int) -> dict:
    return run_snippet(script, str(model), str(threads), str(PROMPT_TOKENS), str(GEN_TOKENS))


def main() -> None:
    from llmx.models_on_disk import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", type=Path, default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    model = args.model or default_model_path()
    size = model.stat().st_size
    print(
        f"{model.name}: {size / 2**20:.1f} MiB, {args.threads} threads, pp{PROMPT_TOKENS} / tg{GEN_TOKENS}\n"
    )
    print("| engine | load s | pp512 t/s | tg128 t/s | peak RSS MiB | peak RSS / file |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, script in (("llmx", LLMX), ("transformers (float32)", HF)):
        r = measure(script, model, args.threads)
        print(
            f"| {name} | {r['load_s']:.2f} | {r['pp_tps']:.1f} | {r['tg_tps']:.1f} | "
            f"{r['peak_rss'] / 2**20:.0f} | {r['peak_rss'] / size:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
