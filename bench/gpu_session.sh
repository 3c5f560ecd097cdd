#!/usr/bin/env bash
# One batch of GPU measurements for bench/RESULTS.md, sized for a 10-minute device call. Run from the
# repository root with the package importable (PYTHONPATH=repo[:gguf wheel]).
#
#   bash bench/gpu_session.sh check     # GPU tests (+ two-GPU tests on a 2-GPU machine), ~4 min
#   bash bench/gpu_session.sh kernels   # kernel table and launch-shape sweep, ~6 min
#   bash bench/gpu_session.sh gemm      # M = 512 for all twelve types (dequantize + matmul, bf16), dequantize launch shapes, ~9 min
#   bash bench/gpu_session.sh e2e       # synthetic Llama-3-8B: -ngl 99 (Q4_K_M, Q8_0), profiles, load time, ~6 min
#   bash bench/gpu_session.sh hybrid    # synthetic Llama-3-8B Q4_K_M at -ngl 24,16,0, then llama.cpp's placement of 24, 16, ~8 min
#   bash bench/gpu_session.sh multi     # two GPUs: row split alone, then one GPU, layer and row split, ~6 min
#   bash bench/gpu_session.sh ncu       # Nsight Compute on the M = 1 GEMVs (where ncu is installed), ~2 min
#   bash bench/gpu_session.sh moe-sweep # the grouped expert GEMVs' tests and launch shapes (/h2 among them), ~6 min
#   bash bench/gpu_session.sh mma-ab    # batched decode's tensor-core GEMMs: mma.sync against wgmma, ~7 min
#   bash bench/gpu_session.sh serve     # `llmx serve -np 64` loaded by `llmx bench-serve` at 8, 32, 64 clients, ~6 min
#   bash bench/gpu_session.sh suite     # the whole test suite with the GPU present (unmarked tests take it too), ~8 min
#   bash bench/gpu_session.sh moe-profile  # synthetic Qwen3-30B-A3B Q4_K_M all on the GPU: decode kernels by name, ~3 min
#   LLAMA_SRC=llama.tar.xz bash bench/gpu_session.sh llama  # llama-bench, llama-batched-bench with CUDA, ~4 min
#   bash bench/gpu_session.sh beside    # issues #36-#38's tables, llmx then llama.cpp per row, ~9 min
#                                       # (ROWS="kv moe batch" by default: which of them)
#   TREES="/tmp/A /tmp/B" bash bench/gpu_session.sh gemv-ab  # M = 1 GEMVs of other trees and this one, ~1.5 min a tree
#   TREES="/tmp/A" bash bench/gpu_session.sh decode-ab  # decode steps (kernel and graph time) of other trees and this one
#   TREES="/tmp/A" bash bench/gpu_session.sh attention-ab  # the decode attention kernel alone, other trees and this one, ~4 min a tree
#   TREES="/tmp/A" bash bench/gpu_session.sh moe-ab  # experts in RAM: GPU checks, then --cpu-moe / -ncmoe 24 decode A/B
#
# Each part writes its output under $OUT (default /tmp/llmx-out) as it goes, and every command has
# its own time limit, so a part that runs long still reports what it measured. CPU kernels take the
# torch.compile path directly (LLMX_CPU_GEMV=jit): on torch builds whose AOTInductor loader crashes,
# auto would first spend a minute building packages it cannot load.
set -u
OUT=${OUT:-/tmp/llmx-out}
mkdir -p "$OUT"
export LLMX_CPU_GEMV=${LLMX_CPU_GEMV:-jit} PYTHONUNBUFFERED=1
PY=${PY:-python3}
SYNTH=${SYNTH:-/tmp/llmx-synth}
mkdir -p "$SYNTH"
LLAMA=${LLAMA:-/tmp/llama-cuda}  # where `llama` builds llama.cpp (build/bin/ holds the tools)

synth() {  # shape type -> path, written once
    local path="$SYNTH/$1-$2.gguf"
    [ -f "$path" ] || $PY -m llmx.cli synth --shape "$1" --type "$2" -o "$path" >&2
    echo "$path"
}

alternate() {  # $1 LABEL for each tree of $trees (first on PYTHONPATH), then for this tree; two
    # rounds, the trees taking turns (machines differ by 10-20%); LABEL is tree-round, "this-round"
    for round in 1 2; do
        i=0
        for tree in $trees; do
            i=$((i + 1))
            PYTHONPATH="$tree:${PYTHONPATH:-}" "$1" "$i-$round"
        done
        "$1" "this-$round"
    done
}

case "${1:-}" in
check)
    # three groups at once (Triton compiles on every core; the GPU has room for all three), ~4 min
    group() { timeout 290 $PY -m pytest -q -p no:cacheprovider -m gpu "$@"; }
    group tests/test_triton.py > "$OUT/gpu-tests-1.txt" 2>&1 &
    group tests/test_fused_norm.py tests/test_decode_attention.py > "$OUT/gpu-tests-2.txt" 2>&1 &
    group tests/test_gpu.py tests/test_memory_gpu.py tests/test_plan_gpu.py > "$OUT/gpu-tests-3.txt" 2>&1 &
    wait
    for f in "$OUT"/gpu-tests-*.txt; do echo "== $f"; grep -E "passed|failed|FAILED|Error" "$f" | tail -12; done
    ;;
suite)
    # every test file, the GPU present: tests not marked gpu take it too where a user's load would (--fit
    # places the tiny models on it), so their checks must hold on its kernels; files split among workers
    timeout 560 $PY -m pytest -q -p no:cacheprovider -n 8 --dist loadfile -rf 2>&1 | tail -40 | tee "$OUT/suite.txt"
    ;;
moe-profile)
    # #36's all-GPU decode, latency-bound: where a token's kernel time goes now (eager steps, every
    # launch visible) beside the graph-replayed step
    moe=$(synth qwen3-30b-a3b Q4_K_M)
    timeout 200 $PY bench/profile_decode.py "$moe" -ngl 99 --steps 8 --top 25 | tee "$OUT/moe-profile.txt"
    ;;
kernels)
    timeout 230 $PY bench/kernels.py --types Q4_K,Q6_K,Q8_0 --m 1,2,16,512 --json "$OUT/kernels.json" \
        | tee "$OUT/kernels.md"
    timeout 330 $PY bench/kernels.py --types Q4_K --m 1 --sweep Q4_K,Q6_K,Q8_0 | tee "$OUT/sweep.md"
    ;;
gemm)
    # the issue's GEMM goal (50% of the bf16 rate at 512 rows) type by type: what `linear` runs at
    # 512 rows (dequantize + matmul) beside a dense bf16 matmul of the same shape, after a sweep of
    # the dequantize kernel's launch shapes (DEQUANT_SWEEP=0 skips it); half the types a command
    for types in Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q2_K Q3_K,Q4_K,Q5_K,Q6_K,IQ4_NL,IQ4_XS; do
        [ "${DEQUANT_SWEEP:-1}" = 0 ] && sweep="" || sweep="$types"
        timeout 280 $PY bench/kernels.py --types "$types" --m 512 --kernels dequant,dense \
            --dequant-sweep "$sweep" --json "$OUT/gemm-${types%%,*}.json" | tee "$OUT/gemm-${types%%,*}.md"
    done
    ;;
gemv-ab)
    # other trees' llmx (e.g. main and branches, unpacked from `git archive`), listed in $TREES (or
    # $A), timed by this tree's bench/kernels.py against this tree (`alternate`). TYPES narrows the types.
    trees="${TREES:-${A:?set TREES (or A) to the other trees}}"
    gemv() { timeout 100 $PY "$PWD/bench/kernels.py" --types "${TYPES:-Q4_K,Q6_K,Q8_0}" --m 1 --json "$OUT/gemv-$1.json" > /dev/null; }
    alternate gemv
    $PY - "$OUT"/gemv-*-[12].json <<'PY'
import json, sys

for path in sys.argv[1:]:
    rows = [r for r in json.load(open(path))["rows"] if r["kernel"] in ("dot8", "read")]
    print(path.rsplit("/", 1)[-1], " ".join(f"{r['type']} {r['n']}x{r['k']} {r['kernel']}: {r['gbs']:.0f}" for r in rows))
PY
    ;;
decode-ab)
    # decode steps of other trees ($TREES, as gemv-ab) and this one (`alternate`): kernel time a
    # token (eager, profiled), graph-replayed step time, and the host's share
    q4=$(synth llama3-8b Q4_K_M)
    trees="${TREES:?set TREES to the other trees}"
    decode() {
        timeout 100 $PY "$PWD/bench/profile_decode.py" "$q4" --steps 4 --top 2 2>&1 \
            | grep -E "eager decode:|gemv8|graphs=True" | sed "s|^|$1 |"
    }
    alternate decode | tee "$OUT/decode-ab.txt"
    ;;
attention-ab)
    # the one-token attention kernel alone (bench/decode_attention.py: f16, q8_0, q4_0 caches at 512, 8K
    # and 32K keys) of other trees ($TREES, as gemv-ab) and this one (`alternate`), each tree's own
    # bench script (its kernel's launch arguments); then this tree at 2 and 3 pipeline stages
    trees="${TREES:?set TREES to the other trees}"
    attention() {
        local tree=${PYTHONPATH%%:*}
        [ "$1" = "${1#this}" ] || tree=$PWD
        timeout 150 $PY "$tree/bench/decode_attention.py" --types f16,q8_0,q4_0 2>&1 | grep "^| [fq]" \
            | sed "s|^|$1 |"
    }
    alternate attention | tee "$OUT/attention-ab.txt"
    timeout 150 $PY bench/decode_attention.py --types f16,q8_0,q4_0 --stages 2,3 | tee "$OUT/attention-stages.txt"
    ;;
moe-ab)
    # experts in RAM under GPU layers: their GPU checks (trips to the host inside one graph, batched
    # graphs with them), then `--cpu-moe` and `-ncmoe 24` decode of other trees ($TREES, as gemv-ab)
    # and this one (`alternate`), 16 threads
    timeout 230 $PY -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/test_moe.py tests/test_batch_graphs.py \
        -k "trip or experts_in_ram or capture_outlasts or match_eager" 2>&1 | tail -12 | tee "$OUT/moe-tests.txt"
    moe=$(synth qwen3-30b-a3b Q4_K_M)
    trees="${TREES:?set TREES to the other trees}"
    tg() {
        for placement in --cpu-moe "-ncmoe 24"; do
            timeout 100 $PY -m llmx.cli bench -m "$moe" -ngl 99 $placement -p 0 -n 64 -r 2 -t "${THREADS:-16}" \
                2>&1 | grep -E "tg|rror" | sed "s|^|$1 $placement |"
        done
    }
    alternate tg | tee "$OUT/moe-ab.txt"
    ;;
e2e)
    q4=$(synth llama3-8b Q4_K_M) q8=$(synth llama3-8b Q8_0)
    timeout 60 $PY -m llmx.cli bench --ceilings | tee "$OUT/ceilings.txt"  # the floors' bandwidths
    timeout 200 $PY -m llmx.cli bench -m "$q4" -m "$q8" -ngl 99 -p 512 -n 128 -r 5 -o json > "$OUT/e2e.json"
    $PY bench/e2e.py table "$OUT/e2e.json" | tee "$OUT/e2e.md"
    # llama.cpp's third row: 8192 tokens already in the context (-c must hold them and the test)
    timeout 150 $PY -m llmx.cli bench -m "$q4" -ngl 99 -p 512 -n 128 -d 8192 -c 9216 -r 2 -o json \
        > "$OUT/e2e-depth.json"
    $PY bench/e2e.py table "$OUT/e2e-depth.json" | tee "$OUT/e2e-depth.md"
    timeout 120 $PY bench/profile_decode.py "$q4" --top 20 --prefill 512 | tee "$OUT/profile.txt"
    timeout 90 $PY bench/load_time.py "$q4" "$q8" | tee "$OUT/load.md"
    ;;
hybrid)
    q4=$(synth llama3-8b Q4_K_M)
    timeout 60 $PY -m llmx.cli bench --ceilings | tee "$OUT/ceilings.txt"
    # one process per placement, each with its own limit, so a slow row does not lose the others
    for ngl in ${NGL:-24 16 0}; do
        timeout "${HYBRID_LIMIT:-160}" $PY -m llmx.cli bench -m "$q4" -ngl "$ngl" -p 512 -n 128 -r 3 \
            -t "${THREADS:-$(nproc)}" -o json > "$OUT/hybrid-$ngl.json"
        $PY bench/e2e.py table "$OUT/hybrid-$ngl.json" | tee "$OUT/hybrid-$ngl.md"
    done
    # llama.cpp's own placement for its -ngl 24 and 16 rows (its -ngl counts the output layer as the
    # last one; llmx's, like the seed's, keeps the output on the CPU until -ngl exceeds the blocks):
    # one block fewer on the GPU, and the output layer (its norm and matrix: `^`, since -ot regexes
    # are searched anywhere in a name and `output\.weight` also matches every blk.N.attn_output) there
    for ngl in ${NGL_LLAMA_CPP:-23 15}; do
        timeout "${HYBRID_LIMIT:-160}" $PY -m llmx.cli bench -m "$q4" -ngl "$ngl" -ot '^output=CUDA0' \
            -p 512 -n 128 -r 3 -t "${THREADS:-$(nproc)}" -o json > "$OUT/hybrid-$ngl-output-gpu.json"
        $PY bench/e2e.py table "$OUT/hybrid-$ngl-output-gpu.json" | tee "$OUT/hybrid-$ngl-output-gpu.md"
    done
    ;;
multi)
    q4=$(synth llama3-8b Q4_K_M)
    # row split first in a process of its own: its first steps load every kernel while GPUs may wait
    # in exchanges (kernels.exchange), which a process that ran other placements first would not show
    timeout 120 $PY -m llmx.cli bench -m "$q4" -ngl 99 -sm row -p 512 -n 128 -r 3 -o json > "$OUT/multi-row.json"
    $PY bench/e2e.py table "$OUT/multi-row.json" | tee "$OUT/multi-row.md"
    timeout 240 $PY -m llmx.cli bench -m "$q4" -ngl 99 -sm none,layer,row -p 512 -n 128 -r 2 -o json \
        > "$OUT/multi.json"
    $PY bench/e2e.py table "$OUT/multi.json" | tee "$OUT/multi.md"
    timeout 60 $PY bench/exchange.py | tee "$OUT/exchange.txt"  # one exchange inside a graph, us
    ;;
llama)
    # llama.cpp beside llmx: LLAMA_SRC is `../shared/tools/build-llama-bench.sh pack`'s tarball; run it in
    # the background at a call's start (`... llama > $OUT/llama-build.txt 2>&1 &`), llmx's rows meanwhile
    mkdir -p "$LLAMA" && tar -xJf "${LLAMA_SRC:?LLAMA_SRC names the packed llama.cpp source}" -C "$LLAMA"
    cd "$LLAMA/llama.cpp" && cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_APP=OFF -DCMAKE_BUILD_TYPE=Release > /dev/null &&
        nice cmake --build build --target llama-bench llama-batched-bench -j "$(($(nproc) - 2))"
    ;;
beside)
    # The issues' tables, each row's llmx run then llama.cpp's (built by `llama` on this machine), so the
    # ratios are same-machine; a fresh machine's first llmx run also compiles its kernels (give it time).
    bin=$LLAMA/llama.cpp/build/bin
    [ -x "$bin/llama-bench" ] || { echo "no llama-bench under $bin: run the llama part first" >&2; exit 1; }
    wanted() { case " ${ROWS:-kv moe batch} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
    q4=$(synth llama3-8b Q4_K_M) moe=
    wanted moe && moe=$(synth qwen3-30b-a3b Q4_K_M)
    row() {  # NAME LIMIT -- llmx bench options... -- llama-bench options...
        local name=$1 limit=$2 ours=()
        shift 3
        while [ "$1" != -- ]; do ours+=("$1"); shift; done
        shift
        timeout "$limit" $PY -m llmx.cli bench "${ours[@]}" -o json > "$OUT/$name-llmx.json"
        timeout "$limit" "$bin/llama-bench" "$@" -o json > "$OUT/$name-llama.json" 2> /dev/null
    }
    # #37: cache types and depth (-fa on; -c holds the deepest test)
    wanted kv && for ct in f16 q8_0; do
        row "kv-$ct" 150 -- -m "$q4" -ngl 99 -p 512 -n 128 -d 0,8192,32768 -c 33792 -ctk $ct -ctv $ct -fa on -r 2 \
            -- -m "$q4" -ngl 99 -fa 1 -p 512 -n 128 -d 0,8192,32768 -ctk $ct -ctv $ct -r 2
    done
    # #36: MoE placements (llama-bench spells --cpu-moe as -ncmoe with every layer)
    t=${THREADS:-$(nproc)}
    wanted moe && row moe-gpu 90 -- -m "$moe" -ngl 99 -p 512 -n 128 -r 2 -t "$t" -- -m "$moe" -ngl 99 -p 512 -n 128 -r 2 -t "$t"
    wanted moe && row moe-ncmoe24 120 -- -m "$moe" -ngl 99 -ncmoe 24 -p 512 -n 128 -r 2 -t "$t" \
        -- -m "$moe" -ngl 99 -ncmoe 24 -p 512 -n 128 -r 2 -t "$t"
    wanted moe && row moe-cpumoe 150 -- -m "$moe" -ngl 99 --cpu-moe -p 512 -n 128 -r 2 -t "$t" \
        -- -m "$moe" -ngl 99 -ncmoe 48 -p 512 -n 128 -r 2 -t "$t"
    wanted moe && row moe-cpu 90 -- -m "$moe" -ngl 0 -p 0 -n 32 -r 1 -t "$t" -- -m "$moe" -ngl 0 -p 0 -n 32 -r 1 -t "$t"
    # #38: batched decode, 1-64 sequences at a 520-token depth
    wanted batch && timeout 150 $PY bench/batch_step.py -m "$q4" -ngl 99 -c 40960 --seqs 1,8,16,32,64 --depth 520 --warm 4 \
        --steps 40 --rounds 2 > "$OUT/batch-llmx.txt"
    wanted batch && timeout 90 "$bin/llama-batched-bench" -m "$q4" -ngl 99 -fa 1 -c 45056 -b 2048 -ub 512 -npp 512 -ntg 128 \
        -npl 1,8,32,64 > "$OUT/batch-llama.txt" 2>&1
    for f in "$OUT"/kv-*-llmx.json "$OUT"/moe-*-llmx.json; do  # a row cut off by its limit left no JSON
        [ -s "$f" ] && $PY bench/e2e.py table "$f"
    done | tee "$OUT/beside.md"
    ;;
serve)
    # #38's load benchmark: a real `llmx serve -np 64` on synthetic Llama-3-8B Q4_K_M, then `llmx bench-serve`
    # at 8, 32 and 64 clients (128-token prompts all arriving at once, 64 tokens each, 8 distinct prompts so
    # every reply is checked against the same prompt served alone); a first run compiles and captures.
    # MODEL, NGL and CLIENTS change the model, its placement and the client counts (a CPU try-out)
    q4=${MODEL:-$(synth llama3-8b Q4_K_M)} port=${PORT:-8089}
    $PY -m llmx.cli serve -m "$q4" -ngl "${NGL:-99}" -np 64 -c 16384 --port "$port" > "$OUT/serve-log.txt" 2>&1 &
    server=$!
    for _ in $(seq 180); do
        curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
        kill -0 "$server" 2> /dev/null || { echo "llmx serve ended: see $OUT/serve-log.txt" >&2; exit 1; }
        sleep 1
    done
    load() { timeout 150 $PY -m llmx.cli bench-serve --url "http://127.0.0.1:$port" --distinct 8 --max-tokens 64 "$@"; }
    load -n 64 --clients 64 > "$OUT/bench-serve-warm.txt" 2>&1
    for clients in ${CLIENTS:-8 32 64}; do
        load -n $((2 * clients)) --clients "$clients" 2>&1 | tee "$OUT/bench-serve-$clients.txt"
    done
    kill "$server"
    wait "$server"
    ;;
mma-ab)
    # the batched decode's tensor-core GEMMs (#38: an 8-row step costs three 1-row steps) on Triton's mma.sync
    # path against wgmma: Q4_K and Q6_K at 8 and 16 rows of x, dot8_rows, then mmh's and mmq's tiles of 4-8
    # warps (wgmma; with DISABLE_MMA_V3=1, mma.sync) and of 1-2 warps (mma.sync either way: wgmma takes
    # warp groups); a big difference is the question, so each setting runs once
    for v3 in 0 1; do
        if [ "$v3" = 1 ]; then export DISABLE_MMA_V3=1; else unset DISABLE_MMA_V3; fi
        for kernel in mmh mmq; do
            timeout 100 $PY bench/kernels.py --types Q4_K,Q6_K --m 8,16 --kernels dot8_rows --tile-kernel $kernel \
                --tile-sweep 16/64/256/4/3,16/64/256/2/3,16/32/256/2/3,16/32/256/1/3,32/128/256/8/3 \
                --json "$OUT/mma-$kernel-$v3.json" 2>&1 |
                grep -E "^\| Q|tile sweep" | sed "s|^|DISABLE_MMA_V3=$v3 |" | tee -a "$OUT/mma-ab.txt"
        done
    done
    ;;
moe-sweep)
    # the grouped expert GEMVs of a decode step: the MoE kernel tests on this GPU (all of
    # tests/test_triton_moe.py: it runs on CUDA where there is one, the two-program sums included),
    # then every gate+up and down launch shape of `bench/moe_kernels.py --dot8-sweep` (the /h2 ones: a
    # token's slots in two programs), experts from HBM
    timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_triton_moe.py 2>&1 | tail -4 | tee "$OUT/moe-tests.txt"
    timeout 300 $PY bench/moe_kernels.py --dot8-sweep 2>&1 | tee "$OUT/dot8-sweep.txt"
    ;;
ncu)
    command -v ncu >/dev/null || { echo "ncu is not installed here" >&2; exit 1; }
    # every section (memory throughput, pipe use, instruction mix, stall reasons) of each M = 1 GEMV
    timeout 300 ncu --set full --clock-control none -k regex:gemv $PY bench/ncu_gemv.py > "$OUT/ncu.txt" 2>&1
    grep -E "^  [a-z_0-9]+gemv|Duration|DRAM Throughput|Memory Throughput|Issue Slots Busy|Registers Per|Achieved Occupancy|Executed Ipc A" "$OUT/ncu.txt" | head -150
    ;;
*)
    echo "usage: bash bench/gpu_session.sh check|suite|moe-profile|kernels|gemm|gemv-ab|decode-ab|attention-ab|moe-ab|e2e|hybrid|multi|llama|beside|serve|mma-ab|moe-sweep|ncu" >&2
    exit 2
    ;;
esac
