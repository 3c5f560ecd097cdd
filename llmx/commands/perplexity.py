"""`llmx perplexity -m MODEL -f TEXT [-c 512] [--chunks N]`: llama-perplexity's perplexity of a text, and
the KL divergence of one configuration's next-token distributions from a saved base run's.

    llmx perplexity -f text.txt                                # [1]12.3456,... Final estimate: PPL = ...
    llmx perplexity -f text.txt --kl-divergence-base base.npz  # the same, saving the base
    llmx perplexity --kl-divergence-base base.npz --kl-divergence -ctk bf16  # compare a configuration

The chunking and statistics are `llmx.bench.quality`'s, the base file `llmx.bench.kld_base`'s.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from llmx.commands.common import add_model_argument, print_load_report, print_timings, read_prompt
from llmx.errors import LlmxError
from llmx.plan.options import add_options, options_from_args

if TYPE_CHECKING:
    import numpy as np

    from llmx.bench.quality import Comparison
    from llmx.engine import Engine

DEFAULT_CTX = 512  # llama-perplexity's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        f"-c is the chunk size, {DEFAULT_CTX} unless given (llama-perplexity's default); the second half of "
        "each chunk is scored."
    )
    add_model_argument(parser)
    parser.add_argument("-f", "--file", default=None, metavar="TEXT", help="the text to score")
    parser.add_argument(
        "--chunks",
        type=int,
        default=0,
        metavar="N",
        help="score at most N chunks of -c tokens (default: all)",
    )
    parser.add_argument(
        "--kl-divergence-base",
        type=Path,
        default=None,
        metavar="FILE",
        help="save the run's log-probabilities to FILE (.npz); with --kl-divergence, read them from it",
    )
    parser.add_argument(
        "--kl-divergence",
        action="store_true",
        help="compare this run with the base in --kl-divergence-base (-f may be left out: the base holds "
        "its tokens)",
    )
    add_options(parser)


def run(args: argparse.Namespace) -> int:
    import numpy as np
    from tqdm import tqdm

    from llmx.api import load_with_options
    from llmx.bench import quality
    from llmx.bench.kld_base import BaseFile, BaseWriter, vocab_fingerprint
    from llmx.commands.progress import load_progress
    from llmx.engine import Timings

    if args.kl_divergence and args.kl_divergence_base is None:
        raise LlmxError("--kl-divergence compares with a base: name it with --kl-divergence-base FILE")
    base = BaseFile(args.kl_divergence_base) if args.kl_divergence else None
    if base is None and args.file is None:
        raise LlmxError("no text: pass -f FILE")
    text = read_prompt(args) if args.file is not None else None
    if args.ctx_size is None:
        args.ctx_size = base.n_ctx if base else DEFAULT_CTX
    if base and int(args.ctx_size) != base.n_ctx:
        raise LlmxError(f"{base.path.name} was computed with -c {base.n_ctx}; run with -c {base.n_ctx}")

    opts = options_from_args(args)
    model = load_with_options(args.model, opts, progress=load_progress())
    print_load_report(model)
    n_ctx = opts.ctx_size or model.config.n_ctx_train  # -c 0: the model's own context
    tokenizer = model.tokenizer
    vocab = vocab_fingerprint(model.file.metadata.get("tokenizer.ggml.tokens", []))
    name = model.file.path.name
    # As llama.cpp: the text is tokenized with BOS (when the model adds one) and no special-token parsing.
    texts = quality.chunks(tokenizer.encode(text, parse_special=False), n_ctx, args.chunks) if text else None
    if base:
        base.check(vocab, name, texts)
        chunks = base.chunks[: args.chunks] if args.chunks > 0 else base.chunks
    else:
        assert texts is not None
        chunks = texts
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    writer = (
        BaseWriter(args.kl_divergence_base, vocab, name, chunks)
        if args.kl_divergence_base and not base
        else None
    )

    what = f"KL divergence from {base.model}" if base else "perplexity"
    print(
        f"perplexity: calculating {what} over {len(chunks)} chunks, n_ctx={n_ctx}, "
        f"batch_size={opts.batch_size}",
        file=sys.stderr,
    )
    total, nlls, parts = Timings(), [], []
    for i, chunk in enumerate(tqdm(chunks, desc="chunks", unit="chunk", leave=False, disable=None)):
        logprobs = scored_logprobs(model.engine, quality.model_input(chunk, bos), opts.batch_size)
        total.prompt_tokens += model.engine.timings.prompt_tokens
        total.prompt_seconds += model.engine.timings.prompt_seconds
        ids = quality.targets(chunk)
        nlls.append(quality.token_nll(logprobs, ids))
        if writer:
            writer.add(logprobs, nlls[-1])
        if base:
            parts.append(quality.Comparison.of(base.logprobs(i), logprobs, ids, nlls[-1], base.nll[i]))
            print(_chunk_row(i, quality.Comparison.join(parts)), flush=True)
        else:
            print(f"[{i + 1}]{quality.perplexity(np.concatenate(nlls))[0]:.4f},", end="", flush=True)
    if base:
        print("\n".join(_summary(quality.Comparison.join(parts))))
    else:
        print()
        ppl, err = quality.perplexity(np.concatenate(nlls))
        print(f"Final estimate: PPL = {ppl:.4f} +/- {err:.5f}")
    if writer:
        writer.close()
        size = writer.path.stat().st_size / 2**20
        print(f"perplexity: saved the log-probabilities to {writer.path} ({size:.1f} MiB)", file=sys.stderr)
    print_timings(model.load_seconds, total)
    return 0


def scored_logprobs(engine: Engine, ids: list[int], n_batch: int) -> np.ndarray:
    """Run one chunk from an empty context in batches of `n_batch` tokens (as llama.cpp's `-b`); the
    log-probabilities [n_ctx/2 - 1, vocab] (float32) of the scored positions n_ctx/2 .. n_ctx - 2."""
    import numpy as np

    from llmx.bench.quality import first_scored, log_softmax

    engine.reset()
    first, rows = first_scored(len(ids)), []
    for start in range(0, len(ids), n_batch):
        logits = engine.prefill(ids[start : start + n_batch], all_logits=True)
        lo, hi = max(first - start, 0), min(len(ids) - 1 - start, len(logits))
        if lo < hi:
            rows.append(logits[lo:hi].float().numpy())
    return log_softmax(np.concatenate(rows))


# --- llama.cpp's KL divergence output ---------------------------------------------------------------

CHUNK_HEADER = (
    "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Same top p"
)


def _chunk_row(i: int, c: Comparison) -> str:
    """One row of llama.cpp's per-chunk table (every statistic over the chunks so far)."""
    (ppl, ppl_err), (ratio, ratio_err) = c.ppl(), c.log_ppl_ratio()
    (kld, kld_err), (top, top_err) = c.mean_kld(), c.same_top_rate()
    row = (
        f"{i + 1:4d}    {ppl:9.4f} ± {ppl_err:9.4f}    {ratio:10.5f} ± {ratio_err:10.5f}"
        f"    {kld:10.5f} ± {kld_err:10.5f}    {100 * top:6.3f} ± {100 * top_err:6.3f} %"
    )
    return f"{CHUNK_HEADER}\n{row}" if i == 0 else row


def _summary(c: Comparison) -> list[str]:
    """llama.cpp's closing statistics, under its names."""
    (ppl, ppl_err), (base, base_err) = c.ppl(), c.ppl_base()
    ratio, ratio_err = c.log_ppl_ratio()
    diff, diff_err = c.ppl_difference()
    kld, kld_err = c.mean_kld()
    top, top_err = c.same_top_rate()
    lines = [
        "",
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {ppl:10.6f} ± {ppl_err:10.6f}",
        f"Mean PPL(base)                : {base:10.6f} ± {base_err:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * c.ppl_correlation():6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {ratio:10.6f} ± {ratio_err:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {math.exp(ratio):10.6f} ± {math.exp(ratio) * ratio_err:10.6f}",
        f"Mean PPL(Q)-PPL(base)         : {diff:10.6f} ± {diff_err:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {kld:10.6f} ± {kld_err:10.6f}",
        f"Maximum KLD: {float(c.kld.max()):10.6f}",
    ]
    for fraction, value in c.kld_percentiles().items():
        label = "Median " if fraction == 0.5 else f"{100 * fraction:4.1f}%  "
        lines.append(f"{label} KLD: {value:10.6f}")
    lines += [
        f"Minimum KLD: {float(c.kld.min()):10.6f}",
        "",
        "====== Token probability statistics ======",
        f"Same top p: {100 * top:6.3f} ± {100 * top_err:5.3f} %",
    ]
    return lines
