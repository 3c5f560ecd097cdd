"""`llmx bench-serve`: its statistics and workload by hand, its check failing when a text differs, and
small runs against a real `llmx serve -np 4` on loopback, passing their check."""

from __future__ import annotations

import json
import math
import random
import socket
from dataclasses import replace

import pytest
from test_server_http import Server

from llmx import cli
from llmx.bench import serve_client
from llmx.bench.serve_check import NEAR_TIE_NATS, first_difference, mismatches
from llmx.bench.serve_report import headline, verdict
from llmx.bench.serve_stats import Streamed, distribution, summary
from llmx.bench.serve_steps import step_split
from llmx.bench.serve_workload import WORDS, arrival_times, workload

# --- statistics, by hand ---


def test_distribution_is_in_milliseconds_with_linear_percentiles():
    d = distribution([0.1, 0.2, 0.3, 0.4])
    # p99: rank 0.99 * 3 = 2.97, between 300 and 400 ms
    assert d == pytest.approx({"mean": 250.0, "median": 250.0, "p99": 397.0})
    assert distribution([]) == {"mean": None, "median": None, "p99": None}


def test_summary_of_two_streams():
    a = Streamed(sent=0.0, chunks=(0.5, 0.6, 0.8), done=0.9, prompt_tokens=16, output_tokens=3, text="abc")
    b = Streamed(sent=0.2, chunks=(1.0, 1.4), done=1.8, prompt_tokens=16, output_tokens=2, text="de")
    empty = Streamed(sent=0.3, chunks=(), done=0.4, prompt_tokens=16, output_tokens=1, text="")
    s = summary([a, b, empty], duration_s=2.0)
    assert s["requests"] == 3 and s["prompt_tokens"] == 48 and s["output_tokens"] == 6
    assert (s["requests_per_s"], s["output_tokens_per_s"], s["total_tokens_per_s"]) == (1.5, 3.0, 27.0)
    assert s["ttft_ms"] == pytest.approx({"mean": 750.0, "median": 750.0, "p99": 995.0})
    # a's 400 ms after its first chunk for 2 tokens, b's 800 for 1 (the empty stream has none)
    assert s["tpot_ms"] == pytest.approx({"mean": 500.0, "median": 500.0, "p99": 794.0})
    # gaps 100, 200, 400 ms
    assert s["itl_ms"] == pytest.approx({"mean": 700 / 3, "median": 200.0, "p99": 396.0})
    assert s["e2e_ms"]["median"] == pytest.approx(900.0)


# --- the workload ---


def test_arrivals_are_a_seeded_poisson_process_or_all_at_once():
    assert arrival_times(3, math.inf, random.Random(0)) == (0.0, 0.0, 0.0)
    times = arrival_times(4000, 8.0, random.Random(1))
    gaps = [b - a for a, b in zip((0.0, *times), times, strict=False)]
    assert min(gaps) > 0 and sum(gaps) / len(gaps) == pytest.approx(1 / 8, rel=0.05)
    assert arrival_times(4000, 8.0, random.Random(1)) == times


def test_workload_is_reproducible_and_cycles_its_prompts():
    w = workload(WORDS, 5, 7, 3, 2.0, seed=4)
    assert w == workload(WORDS, 5, 7, 3, 2.0, seed=4)
    assert w.prompts != workload(WORDS, 5, 7, 3, 2.0, seed=5).prompts
    assert w.prompts == workload(WORDS, 5, 7, 3, math.inf, seed=4).prompts  # the rate leaves the prompts
    assert w.prompt_of == (0, 1, 2, 0, 1, 2, 0) and len(w.arrivals) == 7
    assert all(p.startswith(" ") and len(p.split()) == 5 and set(p.split()) <= set(WORDS) for p in w.prompts)


# --- the check fails when a text differs ---


def test_first_difference():
    assert first_difference("abc", "abc") is None
    assert first_difference("abc", "abd") == 2
    assert first_difference("ab", "abc") == 2 and first_difference("", "x") == 0


def reply(text: str, ids: tuple[int, ...] = (), tops: tuple[tuple[float, ...], ...] = ()) -> Streamed:
    return Streamed(0.0, (0.1,), 0.2, 4, len(ids), text, ids, tops)


def test_a_response_other_than_the_one_alone_is_a_mismatch():
    alone = [reply("The cat sat"), reply("Once upon")]
    assert (
        mismatches([reply("The cat sat"), reply("Once upon"), reply("The cat sat")], [0, 1, 0], alone) == []
    )
    (wrong,) = mismatches([reply("The cat sat"), reply("Once upon"), reply("The cap sat")], [0, 1, 0], alone)
    assert (wrong.request, wrong.position) == (2, 6)
    assert "request 2" in wrong.line() and "'p sat' against 't sat'" in wrong.line()
    assert (wrong.token, wrong.margin, wrong.near_tie) == (None, None, False)  # no token ids: no tie told


def test_a_response_that_parts_at_a_near_tie_of_the_run_alone_is_told_apart():
    tops = ((-0.1, -3.0), (-1.20, -1.25), (-0.5, -2.0))  # the second token nearly tied alone
    alone = reply("The cat sat", (7, 8, 9), tops)
    tie, other = mismatches(
        [reply("The cap sat", (7, 5, 9)), reply("Thy cat sat", (6, 8, 9))], [0, 0], [alone] * 2
    )
    assert (tie.token, tie.near_tie) == (1, True) and tie.margin == pytest.approx(0.05)
    assert "at token 1, a near tie: the top two 0.050 nats apart alone" in tie.line()
    assert (other.token, other.near_tie) == (0, False) and other.margin == pytest.approx(2.9)
    assert "at token 0, the top two 2.900 nats apart alone" in other.line()
    # the run alone ended (an end-of-turn token, whose logprobs are not shown) where the other went on
    (ended,) = mismatches([reply("The cat sat on", (7, 8, 9, 4))], [0], [alone])
    assert (ended.token, ended.margin, ended.near_tie) == (3, None, False)


def test_the_verdict_lists_every_mismatch_and_counts_near_ties_apart():
    tie = {"near_tie": True, "line": "request 1: t"}
    wrong = {"near_tie": False, "line": "request 2: x"}
    check = {"prompts": 2, "near_tie_nats": 0.1}
    result = {"summary": {"requests": 3}, "check": check | {"mismatches": [wrong]}}
    assert verdict(result) == [
        "check FAILED: 1 of 3 responses differ from their prompt served alone",
        "request 2: x",
    ]
    result["check"]["mismatches"] = [tie, wrong]
    apart = "1 of 3 responses part from their prompt served alone at a near tie "
    apart += "(its top two tokens within 0.1 nats"
    assert verdict(result)[0].startswith(
        "check FAILED: 1 of 3 responses differ from their prompt served alone; " + apart
    )
    result["check"]["mismatches"] = [tie]
    assert verdict(result) == [
        f"check: {apart}, where batched kernels may pick either); the other 2 equal it",
        tie["line"],
    ]
    result["check"]["mismatches"] = []
    assert verdict(result) == ["check: all 3 responses equal their prompt served alone (2 prompts)"]


def _metrics(steps: float, prompt_steps: float, forward: float, prompt_forward: float | None = None) -> str:
    text = (
        "# TYPE llmx_batch_steps counter\n"
        f"llmx_batch_steps_total {steps}\nllmx_batch_prompt_steps_total {prompt_steps}\n"
        f'llmx_batch_step_seconds_total{{part="forward"}} {forward}\n'
        f'llmx_batch_step_seconds_total{{part="wait"}} 0.5\n'
    )
    if prompt_forward is not None:  # a server that counts its prompt steps' time apart
        text += (
            f'llmx_batch_prompt_step_seconds_total{{part="forward"}} {prompt_forward}\n'
            'llmx_batch_prompt_step_seconds_total{part="wait"} 0.25\n'
        )
    return text


def test_the_server_steps_are_the_run_s_difference_of_its_metrics():
    split = step_split(_metrics(10, 2, 1.0), _metrics(30, 5, 3.0), output_tokens=80)
    assert split == {
        "steps": 20, "prompt_steps": 3, "output_tokens_per_step": 4.0,
        "ms_per_step": {"forward": 100.0, "wait": 0.0},
    }  # fmt: skip
    # 20 steps, 3 with a prompt chunk: 1.5 of the 2 s of forward in those 3, 0.5 in the 17 others
    split = step_split(_metrics(10, 2, 1.0, 0.5), _metrics(30, 5, 3.0, 2.0), output_tokens=80)
    assert split["ms_per_step_by_kind"] == {
        "decode": {"forward": pytest.approx(500 / 17), "wait": 0.0},
        "prompt": {"forward": 500.0, "wait": 0.0},
    }
    only_decode = step_split(_metrics(10, 2, 1.0, 0.5), _metrics(30, 2, 3.0, 0.5), output_tokens=80)
    assert only_decode["ms_per_step_by_kind"] == {"decode": {"forward": 100.0, "wait": 0.0}}
    assert step_split(_metrics(10, 2, 1.0), _metrics(10, 2, 1.0), 0) is None  # no batched step ran
    assert step_split("other_total 1\n", "other_total 2\n", 5) is None  # another server's metrics
    assert step_split('{"error": 1}', '{"error": 2}', 5) is None  # no metrics at all


# --- against a real server ---

N_SLOTS = 4
RUN = ["-n", "6", "--clients", "3", "--distinct", "3", "--prompt-tokens", "16", "--max-tokens", "8"]


@pytest.fixture(scope="module")
def server():
    # One thread: on a loaded machine a team of threads that spin-wait collapses (bench/RESULTS.md's
    # open problems), 10x slower at a load of 8 on 2 cores; one thread keeps these tests' time.
    s = Server("-np", str(N_SLOTS), "-t", "1")
    yield s
    s.stop()


def test_a_small_run_measures_every_request_and_passes_its_check(server, capsys):
    assert cli.main(["bench-serve", "--url", server.url, *RUN, "--rate", "50", "-o", "json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    s = result["summary"]
    assert s["requests"] == 6 and s["prompt_tokens"] == 6 * 16 and 6 <= s["output_tokens"] <= 6 * 8
    assert s["output_tokens_per_s"] > 0 and s["ttft_ms"]["median"] > 0 and s["itl_ms"]["p99"] > 0
    assert s["ttft_ms"]["median"] < s["e2e_ms"]["median"] <= s["e2e_ms"]["p99"]
    assert result["check"] == {"prompts": 3, "near_tie_nats": NEAR_TIE_NATS, "mismatches": []}
    steps = result["server_steps"]  # the load's batched steps only, not the runs alone after it
    assert 1 <= steps["prompt_steps"] <= steps["steps"] <= s["output_tokens"] + 6
    assert steps["output_tokens_per_step"] == s["output_tokens"] / steps["steps"]
    assert set(steps["ms_per_step"]) == {"plan", "forward", "sample", "wait", "text", "hand_over"}
    assert all(ms >= 0 for ms in steps["ms_per_step"].values()) and steps["ms_per_step"]["forward"] > 0
    kinds = steps["ms_per_step_by_kind"]  # the prompt steps' time apart from the decode-only steps'
    counts = {"decode": steps["steps"] - steps["prompt_steps"], "prompt": steps["prompt_steps"]}
    assert set(kinds) == {kind for kind, n in counts.items() if n > 0}
    forward = sum(kinds[kind]["forward"] * counts[kind] for kind in kinds)
    assert forward == pytest.approx(steps["ms_per_step"]["forward"] * steps["steps"])
    assert "check: all 6 responses equal" in err
    assert headline(result).endswith("arriving 50.0 a second (Poisson); 16 prompt tokens, up to 8 out")


def test_a_reply_that_differs_from_the_one_alone_fails_the_command(server, capsys, monkeypatch):
    served_alone = serve_client.alone

    async def one_wrong(*args, **kwargs):
        replies = await served_alone(*args, **kwargs)
        first = replies[0]
        assert first.ids and len(first.tops) == len(first.ids)  # the server's ids, and two logprobs a token
        return [replace(first, text="?" + first.text), *replies[1:]]

    monkeypatch.setattr(serve_client, "alone", one_wrong)
    run = ["-n", "3", "--distinct", "2", "--prompt-tokens", "8", "--max-tokens", "4"]
    assert cli.main(["bench-serve", "--url", server.url, *run]) == 1
    out = capsys.readouterr().out
    assert "time to first token" in out and "check FAILED: 2 of 3 responses differ" in out
    assert "request 0: differs from character 0" in out and "request 2: differs" in out


def test_errors_are_one_line(server, capsys):
    closed = f"http://127.0.0.1:{_closed_port()}"
    assert cli.main(["bench-serve", "--url", closed, "-n", "1"]) == 1
    assert capsys.readouterr().err.startswith(f"error: cannot reach a server at {closed} (")
    too_long = ["-n", "1", "--prompt-tokens", "600"]
    assert cli.main(["bench-serve", "--url", f"{server.url}/v1", *too_long]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: request 0: the server answered 400: the prompt has 600 tokens")
    assert err.count("\n") == 1


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
