"""Generate reference logits with Hugging Face transformers loading the same GGUF (float32).

The independent reference for `tests/test_logits.py`: transformers dequantizes the GGUF itself and
runs its own implementation of the architecture. Its outputs are slow to produce (~1 min), so they are
generated once by this script and committed as a small .npz:

    python scripts/make_logits_reference.py MODEL.gguf tests/data/NAME_logits.npz

Stored per prompt: the prompt ids, the top-K reference logits (ids and values) at every position, and
the greedy continuation of `--n-greedy` tokens. Provenance (versions, file sha256) goes in the file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

# Four prompts of 64+ tokens: prose, code, a list with numbers, and chat-formatted text.
PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from wine making. Within fifty years, "
    "printing shops had spread to more than two hundred cities across Europe, and the price of books fell "
    "so sharply that literacy began to rise among merchants and craftsmen.",
    'def fibonacci(n: int) -> list[int]:\n    """Return the first n Fibonacci numbers."""\n'
    "    numbers = [0, 1]\n    while len(numbers) < n:\n        numbers.append(numbers[-1] + numbers[-2])\n"
    '    return numbers[:n]\n\n\nif __name__ == "__main__":\n    for i, value in enumerate(fibonacci(12)):\n'
    '        print(f"{i:3d}: {value}")\n',
    "Shopping list for the week:\n1. 2 kg of potatoes (about 3.50 EUR)\n2. 12 eggs\n3. 1.5 litres of milk\n"
    "4. 250 g of butter\n5. 3 loaves of bread\n6. 500 g of coffee beans\nTotal budget: 42.75 EUR, "
    "which is 7% more than last week because prices rose again in March 2024.",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nExplain in a few "
    "sentences why the sky is blue during the day and red or orange at sunset. Mention Rayleigh scattering "
    "and the length of the path that sunlight travels through the atmosphere. Keep the answer short enough "
    "for a curious ten-year-old to follow.<|im_end|>\n<|im_start|>assistant\n",
]
TOP_K = 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--n-greedy", type=int, default=32)
    ap.add_argument("--add-bos", action="store_true", help="prepend BOS (models whose GGUF asks for it)")
    args = ap.parse_args()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(args.model.parent), gguf_file=args.model.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(args.model.parent), gguf_file=args.model.name, dtype=torch.float32
    )
    model.eval()
    data: dict[str, np.ndarray] = {}
    for i, text in enumerate(PROMPTS):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if args.add_bos:
            ids = [tok.bos_token_id, *ids]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
            top = logits.topk(TOP_K, dim=-1)
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=args.n_greedy,
                do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
        data[f"ids_{i}"] = np.array(ids, dtype=np.int32)
        data[f"top_ids_{i}"] = top.indices.numpy().astype(np.int32)
        data[f"top_values_{i}"] = top.values.numpy().astype(np.float32)
        data[f"greedy_{i}"] = out[0, len(ids) :].numpy().astype(np.int32)
        print(f"prompt {i}: {len(ids)} tokens, greedy {tok.decode(data[f'greedy_{i}'])!r}")
    provenance = {
        "generator": "scripts/make_logits_reference.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model": args.model.name,
        "sha256": hashlib.sha256(args.model.read_bytes()).hexdigest(),
        "dtype": "float32",
        "top_k": TOP_K,
    }
    data["provenance"] = np.array(json.dumps(provenance))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **data)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
