"""`llmx perplexity`: the statistics against hand computations, the perplexity of SmolLM2 against one
computed independently with transformers on the same chunks, KL divergence against a saved base, and the
errors a user can hit."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from llmx.bench import quality
from llmx.bench.kld_base import BaseFile, BaseWriter
from llmx.cli import main
from llmx.errors import LlmxError

TEXT = Path(__file__).parent.parent / "bench" / "data" / "kjv-genesis-1-14.txt"
N_CTX, N_CHUNKS = 64, 3


# --- the statistics, by hand ---------------------------------------------------------------------


def test_chunks_are_whole_and_bos_replaces_only_the_first_token():
    tokens = list(range(100, 121))  # 21 tokens: two chunks of 8, a tail of 5 dropped
    assert quality.chunks(tokens, 8) == [list(range(100, 108)), list(range(108, 116))]
    assert quality.chunks(tokens, 8, n_chunks=1) == [list(range(100, 108))]
    assert len(quality.chunks(tokens, 8, n_chunks=-1)) == 2  # llama.cpp: --chunks -1 is all
    assert quality.model_input([5, 6, 7, 8], bos_id=1) == [1, 6, 7, 8]
    assert quality.model_input([5, 6, 7, 8], bos_id=None) == [5, 6, 7, 8]
    # llama.cpp: first = n_ctx/2; the logits at 4, 5, 6 predict the tokens at 5, 6, 7
    assert quality.targets(list(range(100, 108))).tolist() == [105, 106, 107]
    with pytest.raises(LlmxError, match="the text has 7 tokens, fewer than one chunk of -c 8"):
        quality.chunks(tokens[:7], 8)


def test_perplexity_and_its_error_are_llama_cpps():
    nll = np.array([1.0, 2.0, 3.0, 4.0])
    ppl, err = quality.perplexity(nll)
    # mean 2.5; E[x^2] - mean^2 = 7.5 - 6.25 = 1.25; error = sqrt(1.25 / 3)
    assert ppl == pytest.approx(math.exp(2.5))
    assert err == pytest.approx(math.exp(2.5) * math.sqrt(1.25 / 3))
    logprobs = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]))
    assert quality.token_nll(logprobs, np.array([1, 2])) == pytest.approx([math.log(4), -math.log(0.7)])


def test_kl_divergence_by_hand():
    base = np.log(np.array([[0.5, 0.5], [0.9, 0.1]], dtype=np.float32))
    other = np.log(np.array([[0.25, 0.75], [0.9, 0.1]], dtype=np.float32))
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert quality.kld_rows(base, other) == pytest.approx([expected, 0.0], abs=1e-7)
    c = quality.Comparison.of(base, other, np.array([0, 0]), np.zeros(2), np.zeros(2))
    assert c.kld == pytest.approx([expected, 0.0], abs=1e-3)  # at float16's precision
    assert c.same_top.tolist() == [False, True]  # base: a tie, resolved to token 0; other: token 1


def test_comparison_statistics_by_hand():
    nll_base = np.array([1.0, 2.0, 3.0, 2.0, 1.0])
    c = quality.Comparison(
        nll=nll_base + 0.1,  # every token 0.1 nats worse: the ratio is exact, its uncertainty 0
        nll_base=nll_base,
        kld=np.array([0.0, 1.0, 2.0, 3.0, 4.0]),
        same_top=np.array([True, True, True, False, True]),
    )
    ratio, ratio_err = c.log_ppl_ratio()
    assert ratio == pytest.approx(0.1) and ratio_err == pytest.approx(0.0, abs=1e-9)
    assert c.ppl_correlation() == pytest.approx(1.0)
    assert c.ppl_difference()[0] == pytest.approx(math.exp(1.9) - math.exp(1.8))
    assert c.mean_kld() == pytest.approx((2.0, math.sqrt(2.0 / 4)))  # E[x^2] - E[x]^2 = 6 - 4
    percentiles = c.kld_percentiles()
    assert percentiles[0.5] == 2.0 and percentiles[0.9] == pytest.approx(3.6)  # rank 0.9 * 4 = 3.6
    assert percentiles[0.999] == pytest.approx(3.996)
    assert c.same_top_rate() == pytest.approx((0.8, math.sqrt(0.8 * 0.2 / 4)))


def test_a_distribution_at_base_precision_diverges_by_nothing_from_itself():
    logprobs = quality.log_softmax(np.random.default_rng(0).normal(0, 4, (6, 1000)))
    b = quality.at_base_precision(logprobs)
    assert np.all(quality.kld_rows(b, b) == 0)
    assert np.all(quality.kld_rows(b, quality.at_base_precision(logprobs + 0.01 * np.arange(1000))) > 0)


# --- SmolLM2 through the command ------------------------------------------------------------------


def perplexity_run(capsys, smollm2_path, *args: str) -> tuple[int, str, str]:
    code = main(["perplexity", "-m", str(smollm2_path), "-c", str(N_CTX), "--chunks", str(N_CHUNKS), *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_perplexity_equals_transformers_on_the_same_chunks(capsys, smollm2_path):
    import torch
    from transformers import AutoModelForCausalLM

    from llmx.gguf import open_gguf
    from llmx.text.tokenizer import Tokenizer

    code, out, _ = perplexity_run(capsys, smollm2_path, "-f", str(TEXT))
    assert code == 0
    progress = [float(x) for x in re.findall(r"\[\d+\]([\d.]+),", out)]
    ppl, err = map(float, re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", out).groups())
    # -b below the chunk (one call per batch, as llama.cpp): scored rows 32-47 from one call, 48-62 the next
    code, out, _ = perplexity_run(capsys, smollm2_path, "-f", str(TEXT), "-b", "48", "-ub", "16")
    assert code == 0
    ppl_in_batches = float(re.search(r"Final estimate: PPL = ([\d.]+)", out).group(1))

    tokenizer = Tokenizer.from_gguf(open_gguf(smollm2_path))
    ids = tokenizer.encode(TEXT.read_text(), parse_special=False)
    assert not tokenizer.add_bos  # SmolLM2 adds no BOS: the chunks run as they are in the text
    hf = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()
    nll = []
    with torch.no_grad():
        for k in range(N_CHUNKS):
            chunk = torch.tensor([ids[k * N_CTX : (k + 1) * N_CTX]])
            logprobs = torch.log_softmax(hf(chunk).logits[0].double(), dim=-1)
            first = N_CTX // 2  # the logits at first .. N_CTX - 2 predict the tokens after them
            nll += (-logprobs[first:-1].gather(1, chunk[0, first + 1 :, None])[:, 0]).tolist()
            assert progress[k] == pytest.approx(math.exp(np.mean(nll)), rel=1e-3)
    assert len(nll) == N_CHUNKS * (N_CTX - 1 - N_CTX // 2)
    assert ppl == pytest.approx(math.exp(np.mean(nll)), rel=1e-3)
    assert ppl_in_batches == pytest.approx(math.exp(np.mean(nll)), rel=1e-3)
    assert err == pytest.approx(math.exp(np.mean(nll)) * np.std(nll) / math.sqrt(len(nll) - 1), rel=1e-2)


def kld_stats(out: str) -> dict[str, float]:
    """The numbers of llama.cpp's closing statistics, by name."""
    return {
        m[0].strip(): float(m[1]) for m in re.findall(r"^([A-Za-z0-9.%() ]+?)\s*: *(-?[\d.]+)", out, re.M)
    }


def test_kl_divergence_of_a_run_from_its_own_base_is_zero_and_from_a_bf16_cache_small(
    capsys, smollm2_path, tmp_path
):
    base = tmp_path / "base.npz"
    code, out, _ = perplexity_run(capsys, smollm2_path, "-f", str(TEXT), "--kl-divergence-base", str(base))
    assert code == 0 and base.exists()
    ppl = float(re.search(r"Final estimate: PPL = ([\d.]+)", out).group(1))

    code, out, _ = perplexity_run(capsys, smollm2_path, "--kl-divergence-base", str(base), "--kl-divergence")
    assert code == 0
    same = kld_stats(out)
    assert same["Mean    KLD"] == 0 and same["Maximum KLD"] == 0 and same["Same top p"] == 100
    assert same["Mean PPL(Q)"] == same["Mean PPL(base)"] == pytest.approx(ppl, abs=1e-4)

    code, out, _ = perplexity_run(
        capsys, smollm2_path, "-f", str(TEXT), "--kl-divergence-base", str(base), "--kl-divergence",
        "-ctk", "bf16", "-ctv", "bf16",
    )  # fmt: skip
    assert code == 0
    bf16 = kld_stats(out)
    assert 0 < bf16["Mean    KLD"] < 1e-2 and bf16["Maximum KLD"] > 0
    assert bf16["Same top p"] > 90
    assert bf16["Mean PPL(base)"] == same["Mean PPL(base)"] and bf16["Mean PPL(Q)"] != bf16["Mean PPL(base)"]


# --- errors ---------------------------------------------------------------------------------------


def test_a_text_too_short_for_one_chunk_is_one_line(capsys, smollm2_path, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("In the beginning God created the heaven and the earth.")
    code, _, err = perplexity_run(capsys, smollm2_path, "-f", str(short))
    assert code == 1
    assert re.search(r"^error: the text has \d+ tokens, fewer than one chunk of -c 64; ", err, re.M)
    assert "Traceback" not in err


def test_a_base_of_another_text_vocabulary_or_format_is_one_line(capsys, smollm2_path, tmp_path):
    other_text = tmp_path / "other.txt"
    other_text.write_text(TEXT.read_text()[5000:])
    base = tmp_path / "base.npz"
    assert perplexity_run(capsys, smollm2_path, "-f", str(TEXT), "--kl-divergence-base", str(base))[0] == 0
    compare = ("--kl-divergence-base", str(base), "--kl-divergence")
    code, _, err = perplexity_run(capsys, smollm2_path, "-f", str(other_text), *compare)
    assert code == 1 and "error: base.npz was computed on another text" in err

    alien = tmp_path / "alien.npz"  # a base as another model's vocabulary would write it
    writer = BaseWriter(alien, "0123456789abcdef", "other.gguf", [[1] * N_CTX])
    writer.add(np.zeros((N_CTX // 2 - 1, 10)), np.zeros(N_CTX // 2 - 1))
    writer.close()
    code, _, err = perplexity_run(capsys, smollm2_path, "--kl-divergence-base", str(alien), "--kl-divergence")
    assert code == 1 and "error: alien.npz holds the base of other.gguf, whose vocabulary differs" in err

    code, _, err = perplexity_run(capsys, smollm2_path, "--kl-divergence-base", str(TEXT), "--kl-divergence")
    assert code == 1 and "is not a base file of `llmx perplexity --kl-divergence-base`" in err
    code, _, err = perplexity_run(capsys, smollm2_path, "-c", "128", *compare)
    assert code == 1 and "base.npz was computed with -c 64; run with -c 64" in err


def test_a_base_file_appears_only_once_written_whole(tmp_path):
    path = tmp_path / "base.npz"
    writer = BaseWriter(path, "vocab", "model", [[1, 2, 3, 4]])
    writer.add(np.zeros((1, 8)), np.zeros(1))
    assert not path.exists()  # a run stopped here would leave no half base under the name asked for
    writer.close()
    assert BaseFile(path).chunks == [[1, 2, 3, 4]] and not list(tmp_path.glob("*.partial"))
