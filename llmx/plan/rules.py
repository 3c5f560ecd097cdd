"""Every tensor-override flag compiled into one ordered list of (regex -> device) rules.

`-ot REGEX=BUFT` rules come first, in the order given; `--cpu-moe` and `--n-cpu-moe N` are sugar
for llama.cpp's expert regexes (common.h `llm_ffn_exps_cpu_regex`, `llm_ffn_exps_block_regex`)
and follow them. The first rule whose regex is found anywhere in a tensor name (re.search, like
std::regex_search) decides its device, before any layer assignment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmx.plan.devices import Inventory
from llmx.plan.options import Options

EXPERTS_REGEX = r"\.ffn_(up|down|gate)_exps"


@dataclass(frozen=True)
class Rule:
    pattern: str
    device: str  # "cpu", "cuda:1", ...
    source: str  # the flag as the user wrote it, for warnings

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None


def experts_of_layers(n: int) -> str:
    """The regex --n-cpu-moe N stands for: the expert tensors of layers 0..N-1."""
    return rf"^blk\.({'|'.join(str(i) for i in range(n))})\.ffn_(up|down|gate)_exps"


def compile_rules(opts: Options, inv: Inventory) -> list[Rule]:
    """The override rules of `opts` for this machine; an unknown BUFT is an error listing the valid ones."""
    rules = [Rule(p, inv.resolve_buft(b), f"-ot {p}={b}") for p, b in opts.override_tensor]
    if opts.cpu_moe:
        rules.append(Rule(EXPERTS_REGEX, "cpu", "--cpu-moe"))
    elif opts.n_cpu_moe:
        rules.append(Rule(experts_of_layers(opts.n_cpu_moe), "cpu", f"--n-cpu-moe {opts.n_cpu_moe}"))
    return rules
