"""Weights stay quantized: loading and generating add less than 2.5x the file to the process.

Measured in a fresh interpreter: resident memory after `import torch, llmx` is the baseline; the peak
(VmHWM) after loading SmolLM2 at -c 512 and generating 32 tokens minus that baseline is what llmx
added. Touched mmap pages count (they are resident), so the bound covers the file itself too.
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, sys
import psutil, torch, llmx
import llmx.api
base = psutil.Process().memory_info().rss
model = llmx.load(sys.argv[1], ctx_size=512)
after_load = psutil.Process().memory_info().rss
text = model.generate("Tell me about the moon.", max_tokens=32, temperature=0)
# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a child forked from a big pytest
# process would report the parent's size; VmHWM belongs to this address space alone.
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
peak = int(hwm.split()[1]) * 1024
print(json.dumps({"base": base, "after_load": after_load, "peak": peak, "file": model.file.nbytes}))
"""


def test_memory_added_stays_under_two_and_a_half_files(smollm2_path):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(smollm2_path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    m = json.loads(out.stdout.strip().splitlines()[-1])
    added = m["peak"] - m["base"]
    loaded = (m["after_load"] - m["base"]) / 2**20
    print(
        f"file {m['file'] / 2**20:.1f} MiB; resident after load +{loaded:.1f} MiB; "
        f"peak added {added / 2**20:.1f} MiB ({added / m['file']:.2f}x the file)"
    )
    assert added < 2.5 * m["file"]
