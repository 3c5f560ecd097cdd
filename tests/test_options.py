"""Options: llama.cpp flag spellings, normalization shared by the CLI and the Python API, clear errors."""

from __future__ import annotations

import argparse

import pytest

from llmx.errors import LlmxError
from llmx.plan.options import ALL_LAYERS, Options, add_options, options_from_args, options_from_kwargs


def parse(*argv: str) -> Options:
    parser = argparse.ArgumentParser()
    add_options(parser)
    return options_from_args(parser.parse_args(list(argv)))


def test_defaults_mean_not_given():
    o = parse()
    assert o == Options()
    assert o.n_gpu_layers is None and o.tensor_split is None and o.fit is None
    assert (o.ctx_size, o.batch_size, o.ubatch_size, o.cache_type_k, o.cache_type_v) == (
        4096,
        2048,
        512,
        "f16",
        "f16",
    )
    assert o.given == frozenset()


def test_cli_and_python_api_agree():
    cli = parse(
        "-ngl",
        "all",
        "-sm",
        "tensor",
        "-ts",
        "3,1",
        "-mg",
        "1",
        "-ot",
        r"blk\.0\.=CUDA0,exps=CPU",
        "-ot",
        "output=CUDA1",
        "--cpu-moe",
        "-ncmoe",
        "4",
        "-nkvo",
        "-no-fmoe",
        "-c",
        "8192",
        "-ctk",
        "q8_0",
        "-ctv",
        "Q8_0",
        "-b",
        "4096",
        "-ub",
        "1024",
        "-fa",
        "--no-mmap",
        "--mlock",
        "--fit",
        "--fit-margin",
        "512",
        "-gfm",
        "1=256,0=2048",
        "--devices",
        "cuda0=8GiB",
        "-t",
        "8",
    )
    api = options_from_kwargs(
        n_gpu_layers="all",
        split_mode="row",
        tensor_split=[3, 1],
        main_gpu=1,
        override_tensor=[(r"blk\.0\.", "CUDA0"), "exps=CPU", ("output", "CUDA1")],
        cpu_moe=True,
        n_cpu_moe=4,
        no_kv_offload=True,
        no_fused_moe=True,
        ctx_size=8192,
        cache_type_k="q8_0",
        cache_type_v="q8_0",
        batch_size=4096,
        ubatch_size=1024,
        flash_attn=True,
        no_mmap=True,
        mlock=True,
        fit=True,
        fit_margin_mib=512,
        gpu_fit_margin={0: 2048, 1: 256},
        devices="cuda0=8GiB",
        threads=8,
    )
    assert cli == api
    assert cli.n_gpu_layers == ALL_LAYERS and cli.split_mode == "row"
    assert cli.override_tensor == ((r"blk\.0\.", "CUDA0"), ("exps", "CPU"), ("output", "CUDA1"))
    assert cli.margin_mib(0) == 2048 and cli.margin_mib(1) == 256 and cli.margin_mib(2) == 512
    assert cli.margin_mib(None) == 512 and cli.n_threads == 8


def test_given_records_typed_options_only():
    o = parse("-ngl", "55", "-c", "4096")
    assert o.given == {"n_gpu_layers", "ctx_size"}
    assert options_from_kwargs(ctx_size=4096).given == {"ctx_size"}


@pytest.mark.parametrize(("ngl", "expected"), [("0", 0), ("55", 55), ("-1", ALL_LAYERS), ("ALL", ALL_LAYERS)])
def test_n_gpu_layers(ngl, expected):
    assert parse("-ngl", ngl).n_gpu_layers == expected


def test_fit_default_follows_llama_cpp():
    assert Options().fit_enabled(has_gpu=True)
    assert not Options().fit_enabled(has_gpu=False)
    assert not Options(n_gpu_layers=10).fit_enabled(has_gpu=True)
    assert Options(n_gpu_layers=10, fit="on").fit_enabled(has_gpu=True)
    assert not parse("--fit", "off").fit_enabled(has_gpu=True)


def test_ubatch_is_clamped_to_batch():
    assert Options(batch_size=256, ubatch_size=512).n_ubatch == 256


def test_to_args_round_trips():
    o = parse(
        "-ngl", "40", "-sm", "none", "-ts", "2,1", "-mg", "1", "-ot", "a=CPU,b=CUDA0", "-ncmoe", "3", "-nkvo"
    )
    again = parse(*o.to_args())
    assert again == Options(**{k: getattr(o, k) for k in o.given})
    assert again.override_tensor == (("a", "CPU"), ("b", "CUDA0"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_gpu_layers": "lots"}, "n_gpu_layers"),
        ({"split_mode": "diagonal"}, "split_mode"),
        ({"tensor_split": "3,x"}, "tensor_split"),
        ({"tensor_split": "0,0"}, "tensor_split"),
        ({"override_tensor": ["blk.(0=CPU"]}, "'blk.(0'"),
        ({"override_tensor": ["noequals"]}, "REGEX=BUFT"),
        ({"cache_type_k": "q9_9"}, "cache_type_k"),
        ({"ctx_size": -5}, "ctx_size"),
        ({"ubatch_size": 0}, "ubatch_size"),
        ({"fit": "maybe"}, "fit"),
        ({"gpu_fit_margin": "0:1024"}, "gpu_fit_margin"),
        ({"flash_attn": "sometimes"}, "flash_attn"),
        ({"n_gpu_layer": 3}, "unknown option n_gpu_layer"),
    ],
)
def test_bad_values_are_one_line_errors(kwargs, message):
    with pytest.raises(LlmxError, match=message.replace("(", r"\(").replace(".", r"\.")) as e:
        options_from_kwargs(**kwargs)
    assert "\n" not in str(e.value)
