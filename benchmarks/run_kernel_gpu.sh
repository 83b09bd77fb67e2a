#!/usr/bin/env bash
# The 4-bit kernel's GPU measurements (quant/kernel4.py), one stage per GPU run:
#
#   bash benchmarks/run_kernel_gpu.sh STAGE
#
#   sweep    benchmarks/nf4_rows_bench.py --sweep: one nf4 linear of each 7B shape at 1..64 rows,
#            the kernel's candidate tiles (checked against dequantize + matmul) against
#            bitsandbytes, dequantize + matmul, bf16 and torchao's int4, CUDA-graphed
#   test     the kernels' CUDA tests (but the gemv's rows tests and the tensor-core kernel's: see
#            rows and mma) and the decode loop's
#   probe    Nsight Compute's counters (speed of light, memory, warp stalls) for one call of
#            each 4-bit kernel on the q_proj shape (benchmarks/nf4_kernel_probe.py), then the
#            slot engine's 64-row step on 7b's layers (4 of them) profiled without CUDA graphs,
#            its kernels named by op and input shapes (slot_step_profile.py --cuda-graphs none)
#   warps    Nsight Compute on the one-row gemv alone (PROBE_SHAPE, default 22016x4096: gate and
#            up joined; nf4_kernel_probe.py): where its warps wait (warp states, scheduler,
#            instruction mix, the pipes' utilization: is the shuffle/LSU (MIO) pipe the bound?),
#            the question the twenty-fifth sitting left (docs/benchmarks.md, "The one-row gemv's
#            limit")
#   dequant  the opt-in Triton dequantize's checks: the CUDA decode test twice with it on
#            (QUANTMESH_TRITON_DEQUANT=1) and once off, then the kernel tests with it on
#   gemv     the lines gemv's CUDA tests, then benchmarks/nf4_gemv_bench.py: the gemv's tiles against
#            bitsandbytes at one row (hot and cold weights, ranked cold), then Nsight Compute on
#            the best tile and on bitsandbytes' 1-row kernel (q_proj shape)
#   rows     the lines gemv at a few rows: its CUDA tests at 2-16 rows (NOTEST=1: not), then
#            benchmarks/nf4_gemv_bench.py --rows (ROWS, default 2,4,8,16): each 7B shape at each
#            row count, the library's tile and ROW_CONFIGS against bitsandbytes' matmul_4bit and
#            Triton's dequantize + matmul, hot and cold
#   decode   qm.fast_decode on the 7B nf4 + LoRA shape at batch 1 with bitsandbytes' kernels and
#            with the gemv, in one process, profiled (bench_decode.py --gemv --profile); then the
#            CUDA decode tests with the gemv on
#   peer     the same shape at batch 1: peft + bitsandbytes with transformers' generate (dynamic
#            cache, then the compiled static cache), then qm.fast_decode, in one process; then,
#            with TILES (a JSON list), the lines gemv's CUDA tests and nf4_gemv_bench.py on
#            those gemv tiles (NOPEER=1: those alone)
#   gaps     qm.fast_decode with the gemv only, profiled: the GPU's idle time between kernels,
#            by the kind of kernel before and after each gap
#   batches  qm.fast_decode on the same shape at each batch of BATCHES (default 4 8), with the
#            gemv and with bitsandbytes' path, in one process (bench_decode.py --gemv --batch)
#   mma      the tensor-core kernel (9 to 64 rows, on by default): its CUDA tests (NOTEST=1: not), then
#            benchmarks/nf4_gemv_bench.py --rows (ROWS, default 32,64,16): its library tile and
#            MMA_CONFIGS (and the gemv's library tile at 16) against bitsandbytes' matmul_4bit,
#            Triton's dequantize + matmul and torchao's int4, hot and cold; mma.ptx / mma.sass:
#            the best tile's at 64 rows
#   train    training: the CUDA tests of Triton's dequantize under autograd and of `finetune
#            --cuda-graphs` (the layers replayed from CUDA graphs, accumulated micro-batches), then
#            bench_train.py on the 7B nf4 + LoRA shape (seq 2048, micro-batch 2, compiled blocks)
#            with TRAIN_VARIANTS, each between runs of the default (default:
#            cuda_graphs+triton_dequant, pdl (inductor's programmatic dependent launch), both; a
#            variant's figure means something only beside its neighbours: docs/benchmarks.md,
#            thirty-fifth sitting)
#   b32      qm.fast_decode on the same shape at batch 32 (BATCH), by the default path, with the
#            tensor-core kernel and with Triton's dequantize + matmul, in one process, profiled
#            (bench_decode.py --mma --dequant --profile). (The decode test's 16 sequences through
#            the tensor-core kernel run in the test and decode stages.)
#   join     the sibling layers' codes read as one weight (QUANTMESH_JOIN_CODES, on by default on a
#            GPU): qm.fast_decode on the same shape at batch 1 with and without it, in one
#            process, profiled (bench_decode.py --join --profile), then nf4_gemv_bench.py on the joined q/k/v and
#            gate/up shapes against their members (1, 4, 16 and 32 rows, the library's tiles),
#            then the trained model's CUDA decode test (which decodes it joined too)
#   attention the split-KV decode attention (QUANTMESH_DECODE_ATTENTION, on by default on a GPU):
#            its CUDA tests, decode_attention_bench.py (the kernel against SDPA, 512 and 2048 cache
#            slots, batch 1 and 32), then qm.fast_decode at batch 1 with and without it, profiled
#            (bench_decode.py --attention --profile), then the trained model's CUDA decode test
#            with it on
#   attrows  the decode attention against SDPA at ATTROWS_BATCHES rows (default
#            1,2,4,8,16,32), its tiles swept (decode_attention_bench.py --sweep; ATTROWS_S
#            seconds, default 300; the JSON is rewritten after each case): the measurements
#            `attention.MAX_ROWS` (one row since the thirty-seventh sitting; 2-31 never timed)
#            and `decode_config` should come from
#   pdl      inductor's programmatic dependent launch (TORCHINDUCTOR_ENABLE_PDL, read when inductor
#            is imported: one process each): qm.fast_decode at batch 1 with it off, on, off, on
#            (bench_decode.py --no-peer --timed-runs 3), then the trained model's CUDA decode test
#            with it on. A Hopper kernel launched so may start while the one before it ends, and
#            waits (griddepcontrol.wait) before it reads what that one wrote; a decode step is ~700
#            kernels of 1-25 us, so their starts and ends are a share of it worth measuring
#   inductor torch._inductor.config options for the compiled decode step (INDUCTOR, default
#            "combo_kernels=True": independent kernels of a region launched as one): qm.fast_decode
#            at batch 1 (bench_decode.py --no-peer --timed-runs 3) without and with them, one
#            process each, in the order of INDUCTOR_RUNS (default "0 1 0 1"; 1: with them). For
#            training, in one process: TRAIN_VARIANTS=default,inductor:combo_kernels=True,default
#            with the train stage
#   graphs   the prefill replayed as a CUDA graph (QUANTMESH_CAPTURED_PREFILL, on by default): the
#            trained model's CUDA decode test and the refused recording's (both turn it on),
#            then qm.fast_decode at batch 1 with peft's runs, with and without it in one process
#            (bench_decode.py --graphs: the run without them against the defaults)
#   gc       benchmarks/decode_gc_check.py: the default decode path, then what BETWEEN says (a
#            list of its --between values; default "gc prefill": gc.collect() and empty_cache(),
#            what torch.cuda.graph does as it starts recording; then a recorded prefill), then a
#            third call, each in its own process, on GC_LAYERS layers (default 32): does a
#            compiled step read memory nothing keeps alive? (the fault after a prefill graph)
#   pairs    the pair-table experiment (benchmarks/nf4_pairs.py, CUDA through NVRTC): its layouts
#            "pairs_k" and "pairs32" (all three layouts slower; twenty-eighth sitting) against the
#            library's one-row tile and bitsandbytes on the five 7B shapes, hot and cold
#            (nf4_gemv_bench.py)
#   lora     the adapters' B products inside the gemv's launch (QUANTMESH_GEMV_LORA, opt-in): the
#            gemv's low-rank CUDA test, the trained model's CUDA decode test (which decodes with
#            the switch on too), then qm.fast_decode on the 7B shape at batch 1 with peft's runs
#            (NOPEER=1: not), the defaults, the switch flipped (LORA_GRAPHS=1: the prefill
#            graphs flipped too) and the defaults again, in one process, profiled
#            (bench_decode.py --gemv-lora --again --profile; BENCH_S: its limit, default 420 s
#            with peft's runs, 260 without). NOTEST=1: not the kernel's test; NOTRAINED=1: not
#            the decode test; NOBENCH=1: not the benchmark (one call of 600 s holds the tests or
#            the benchmark with peft's runs, not both)
#   step     the step recorded by hand as one CUDA graph (infer/step_graph.py, on by default):
#            the trained model's CUDA decode test (which decodes with it and with CUDA graph
#            trees), then qm.fast_decode on the 7B shape at batch 1 after peft's compiled static
#            cache (NOPEER=1: not), the defaults, CUDA graph trees, the gemv's low-rank switch
#            flipped and the defaults again, in one process, profiled (bench_decode.py
#            --step-graph --gemv-lora --again --profile; BENCH_S, default 330 s). NOTRAINED=1:
#            not the test; NOBENCH=1: not the benchmark. With QUANTMESH_GEMV_LORA=1 in the
#            environment the test runs every path with the adapters' B products in the launch
#            (the check before that switch becomes the default)
#   xtab     the product-table gemv (benchmarks/nf4_xtab.py, CUDA through NVRTC: each byte of
#            codes looks up its two inputs' products in a table made per slice of K; its fastest
#            tile, the same with sums of the same bits every call (DET), tiles of 16) against the
#            library's one-row tile and bitsandbytes on the five 7B shapes, hot and cold
#            (nf4_gemv_bench.py; XTAB_BUDGET, default 200 s); then, unless NODECODE=1,
#            qm.fast_decode on the 7B shape at batch 1 after peft's compiled static cache
#            (bench_decode.py --peer-static-only --timed-runs 3: the best of three runs each).
#            XTAB_NCU=1: Nsight Compute on the product-table kernel's first call (22016 x 4096)
#            after the bench (XTAB_NCU_TILE: the tile's keys after KERNEL, default "TR":32)
#   host     benchmarks/decode_host_probe.py: qm.fast_decode on the 7B shape at batch 1 with CUDA
#            graph trees, with the step recorded by hand and with the trees again, in one
#            process: the host's time in each step, cProfile of one call
#   phases   benchmarks/decode_phases.py: qm.fast_decode on the 7B shape at batch 1, each call's
#            prefill and first step timed apart from its replayed steps (the fixed cost a call
#            pays), with the prefill replayed as a CUDA graph (the default) and without, then
#            the eager prefill
#            under cProfile (PHASES_FLAGS, e.g. --compiled-prefill: the compiled prefill too)
#   prologue the dequantization inside a training GEMM's prologue: the tensor-core kernel's CUDA
#            test at a training batch's rows, then benchmarks/nf4_prologue_bench.py (forward and
#            input gradient at ROWS, default 4096,2048, against dequantize + cuBLAS and the bf16
#            weight; PROLOGUE_BUDGET, default 150 s)
#
# Needs the bitsandbytes (and torchao) wheels in .whl/ (git-ignored; DEVELOPERS.md says how to
# make them). Results under $OUT (default .bench/kernel-gpu).
set -u
STAGE=${1:?stage: sweep, probe, warps, dequant, test, gemv, rows, mma, decode, peer, gaps, batches, train, b32, join, attention, inductor, graphs, gc, pairs, lora, step, xtab, host, phases or prologue}
# shellcheck source=benchmarks/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh" kernel-gpu
# a kernel's CUDA tests (-k $1, timeout $2 s; NOTEST=1: not), then nf4_gemv_bench.py at each row
# count of ROWS (default $3) within a budget of $4 s
rows_stage() {
  if [ -z "${NOTEST:-}" ]; then
    say "CUDA tests: $1"
    timeout "$2" python3 -m pytest -q -x -m cuda tests/distributed/test_cuda_kernel4.py -k "$1" \
      2>&1 | tail -6
  fi
  timeout $(($4 + 40)) python3 benchmarks/nf4_gemv_bench.py --rows "${ROWS:-$3}" --budget-s "$4" \
    --out "$OUT" 2>&1 | grep -v "Warning\|warnings.warn" | grep -v "^skipped" | tail -110
}
# the trained model's CUDA decode test (timeout $1 s), its failure lines shown
trained_test() {
  say "the trained model's CUDA decode test"
  timeout "$1" python3 -m pytest -q -x -m cuda tests/distributed/test_cuda_decode.py \
    -k trained 2>&1 | grep -v "^E *\[rank0\]:W" | grep -E "Error|assert|passed|failed" \
    | tail -12
}
case "$STAGE" in
  sweep)
    timeout 560 python3 benchmarks/nf4_rows_bench.py --sweep --budget-s 480 --out "$OUT" 2>&1 \
      | grep -v "Warning\|warnings.warn" | tail -40 ;;
  test)
    timeout 250 python3 -m pytest -q -m cuda tests/distributed/test_cuda_kernel4.py \
      -k "not gemv_lines_rows and not mma_is" 2>&1 | tail -15  # (the rows', mma's: their stages)
    timeout 300 python3 -m pytest -q -m cuda tests/distributed/test_cuda_decode.py 2>&1 | tail -8 ;;
  warps)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    PROBE_SHAPE=${PROBE_SHAPE:-22016x4096} PROBE_ONLY=ours_gemv \
      timeout 200 "$NCU" --clock-control none -k "regex:qm_gemv" \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --section InstructionStats --section ComputeWorkloadAnalysis --section Occupancy \
      --section LaunchStats \
      python3 benchmarks/nf4_kernel_probe.py > "$OUT/ncu_warps.txt" 2>&1
    grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Issued|Eligible|Stall|Warp Cycles|Executed Ipc|Active Warps|Pipe|pipe|MIO|LSU" \
      "$OUT/ncu_warps.txt" | head -80 ;;
  probe)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    timeout 200 "$NCU" --clock-control none -k "regex:4bit|Dequantize" --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis \
      python3 benchmarks/nf4_kernel_probe.py > "$OUT/ncu.txt" 2>&1
    grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Stall|Issued Ipc|Executed Ipc" "$OUT/ncu.txt" | head -90
    say "slot step, 7b4, no CUDA graphs"
    timeout 330 python3 benchmarks/slot_step_profile.py --shape 7b4 --batch 64 --cuda-graphs none \
      --steps 10 --models .bench/models --out "$OUT" 2>&1 | grep -v "Warning\|warnings.warn" | tail -5
    grep -A45 "Input Shapes" "$OUT"/slot_step_none_b64.txt | cut -c1-220 | head -50 ;;
  dequant)
    for on in 1 1 0; do
      say "decode test, QUANTMESH_TRITON_DEQUANT=$on"
      QUANTMESH_TRITON_DEQUANT=$on timeout 110 python3 -m pytest -q -m cuda \
        tests/distributed/test_cuda_decode.py -k eager_step --tb=short 2>&1 \
        | grep -E "Error|assert|passed|failed" | head -8
    done
    QUANTMESH_TRITON_DEQUANT=1 timeout 150 python3 -m pytest -q -m cuda \
      tests/distributed/test_cuda_kernel4.py 2>&1 | tail -6 ;;
  gemv)
    say "gemv tests"
    timeout 240 python3 -m pytest -q -x -m cuda tests/distributed/test_cuda_kernel4.py \
      -k "gemv_lines_is or takes_the_gemv" 2>&1 | tail -6
    timeout 210 python3 benchmarks/nf4_gemv_bench.py --budget-s 170 --out "$OUT" 2>&1 \
      | grep -v "Warning\|warnings.warn" | tail -75
    TILE=$(python3 -c "import json; r = json.load(open('$OUT/nf4_gemv.json'))['results'][0]; print(json.dumps(r['best']['cfg']))")
    say "ncu, gemv tile $TILE"
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    GEMV_TILE="$TILE" timeout 90 "$NCU" --clock-control none -k "regex:qm_gemv|gemm_4bit|gemv_4bit" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section LaunchStats --section Occupancy --section InstructionStats \
      python3 benchmarks/nf4_kernel_probe.py > "$OUT/ncu_gemv.txt" 2>&1
    grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Executed Instructions  |Issued Ipc|Stall Long|Stall Short|Stall Wait|Stall MIO|Stall LG|No Eligible" "$OUT/ncu_gemv.txt" | head -60 ;;
  rows) rows_stage "gemv_lines_rows" 240 "2,4,8,16" 260 ;;
  join)
    say "decode, 7B nf4 + LoRA, batch 1: separate launches, then the siblings' codes joined (profiled)"
    timeout 270 python3 benchmarks/bench_decode.py --mode qlora --greedy --profile --join --no-peer \
      --new 256 --out "$OUT" 2>&1 | grep -v "Warning\|warnings.warn" | tail -4
    say "one linear: the 7B shapes and the joined ones"
    timeout 170 python3 benchmarks/nf4_gemv_bench.py --rows 1,4,16,32 --shapes 0,3,1,4 --budget-s 140 \
      --tiles '[{"KERNEL": "lines", "BLOCK_N": 2, "SB": 32, "LUT": 1, "num_warps": 1, "num_stages": 1}]' \
      --out "$OUT" 2>&1 | grep -v "Warning\|warnings.warn" | grep -v "^skipped" | tail -30
    say "the trained model's CUDA decode test"
    timeout 150 python3 -m pytest -q -x -m cuda tests/distributed/test_cuda_decode.py -k trained 2>&1 | tail -4 ;;
  attention)
    say "decode attention CUDA tests"
    timeout 150 python3 -m pytest -q -x -m cuda tests/distributed/test_cuda_attention.py 2>&1 | tail -6
    say "decode attention against SDPA, one layer"
    timeout 120 python3 benchmarks/decode_attention_bench.py --out "$OUT" --batches 1,32 2>&1 \
      | grep -v "Warning\|warnings.warn" | tail -20
    say "decode, 7B nf4 + LoRA, batch 1: sdpa, then the decode attention (profiled)"
    timeout 240 python3 benchmarks/bench_decode.py --mode qlora --greedy --profile --attention --no-peer \
      --new 256 --out "$OUT" 2>&1 | grep -v "Warning\|warnings.warn" | tail -4
    say "the trained model's CUDA decode test, QUANTMESH_DECODE_ATTENTION=1"
    QUANTMESH_DECODE_ATTENTION=1 timeout 200 python3 -m pytest -q -x -m cuda \
      tests/distributed/test_cuda_decode.py -k trained 2>&1 | tail -4 ;;
  attrows)
    say "decode attention against SDPA at ${ATTROWS_BATCHES:-1,2,4,8,16,32} rows, its tiles swept"
    timeout "${ATTROWS_S:-300}" python3 benchmarks/decode_attention_bench.py --out "$OUT" \
      --batches "${ATTROWS_BATCHES:-1,2,4,8,16,32}" --replays 10 --sweep 2>&1 \
      | grep -v "Warning\|warnings.warn\|Configuration class" | tail -20 ;;
  pdl)
    python3 -c "import torch._inductor.config as c; print('inductor has enable_pdl:', hasattr(c.triton, 'enable_pdl'))"
    for pdl in 0 1 0 1; do
      say "decode, 7B nf4 + LoRA, batch 1, TORCHINDUCTOR_ENABLE_PDL=$pdl"
      TORCHINDUCTOR_ENABLE_PDL=$pdl timeout 150 python3 benchmarks/bench_decode.py --mode qlora \
        --greedy --no-peer --timed-runs 3 --out "$OUT/pdl$pdl" 2>&1 | grep "qm_greedy" | tail -1
    done
    say "the trained model's CUDA decode test with PDL on"
    TORCHINDUCTOR_ENABLE_PDL=1 timeout 200 python3 -m pytest -q -x -m cuda \
      tests/distributed/test_cuda_decode.py -k trained 2>&1 | tail -4 ;;
  inductor)
    i=0
    for on in ${INDUCTOR_RUNS:-0 1 0 1}; do  # 0: the defaults, 1: with INDUCTOR
      i=$((i + 1)) flags=()
      if [ "$on" = 1 ]; then for kv in ${INDUCTOR:-combo_kernels=True}; do flags+=(--inductor "$kv"); done; fi
      say "decode, 7B nf4 + LoRA, batch 1, inductor options: ${flags[*]:-(none)}"
      timeout 140 python3 benchmarks/bench_decode.py --mode qlora --greedy --no-peer --timed-runs 3 \
        "${flags[@]}" --out "$OUT/inductor$i-$on" 2>&1 | grep -E "qm_greedy|Error" | tail -2
    done ;;
  graphs)
    say "CUDA decode tests: the trained model's (prefill graphs recorded and replayed), the refused recording's"
    timeout 240 python3 -m pytest -v -m cuda tests/distributed/test_cuda_decode.py \
      -k "trained or record" --tb=short --durations=3 2>&1 | grep -v "Warning\|warnings.warn" | tail -30
    say "decode, 7B nf4 + LoRA, batch 1: peft's runs, then quantmesh's with and without the prefill graphs"
    timeout 300 python3 benchmarks/bench_decode.py --mode qlora --greedy --graphs --new 256 \
      --out "$OUT" 2>&1 | grep -v "Warning\|warnings.warn" | tail -8 ;;
  mma) rows_stage "mma" 250 "32,64,16" 220 ;;
  lora)
    if [ -z "${NOTEST:-}" ]; then
      say "the gemv's low-rank delta: its CUDA test"
      timeout 180 python3 -m pytest -q -x -m cuda tests/distributed/test_cuda_kernel4.py \
        -k low_rank 2>&1 | tail -4
    fi
    if [ -z "${NOTRAINED:-}" ]; then trained_test 240; fi
    if [ -z "${NOBENCH:-}" ]; then
      PEERS=" peft's runs,"
      say "decode, 7B nf4 + LoRA, batch 1:${NOPEER:-$PEERS} the defaults, the switch${LORA_GRAPHS:+, the prefill graphs}, the defaults again"
      LIMIT=420
      if [ -n "${NOPEER:-}" ]; then LIMIT=260; fi
      timeout "${BENCH_S:-$LIMIT}" python3 benchmarks/bench_decode.py --mode qlora --greedy \
        --profile --gemv-lora --again ${LORA_GRAPHS:+--graphs} ${NOPEER:+--no-peer} --new 256 \
        --out "$OUT" 2>&1 | grep -v "Warning\|warnings.warn" | tail -12
    fi ;;
  step)
    if [ -z "${NOTRAINED:-}" ]; then trained_test 260; fi
    if [ -z "${NOBENCH:-}" ]; then
      say "decode, 7B nf4 + LoRA, batch 1: (peft's static cache,) the defaults, trees, the low-rank switch, the defaults again"
      timeout "${BENCH_S:-330}" python3 benchmarks/bench_decode.py --mode qlora --greedy \
        --profile --step-graph --gemv-lora --again --peer-static-only ${NOPEER:+--no-peer} \
        --new 256 --out "$OUT" 2>&1 | grep -v "Warning\|warnings.warn" | tail -12
    fi ;;
  host)
    say "decode, 7B nf4 + LoRA, batch 1: the host's time a step (trees, recorded by hand, trees)"
    timeout 450 python3 benchmarks/decode_host_probe.py --mode qlora --out "$OUT" 2>&1 \
      | grep -v "Warning\|warnings.warn" | grep "^\[" | tail -12 ;;
  phases)
    say "decode, 7B nf4 + LoRA, batch 1: a call's prefill and first step against its replays"
    timeout 300 python3 benchmarks/decode_phases.py --mode qlora --out "$OUT" --graphs-phase \
      --profile-prefill ${PHASES_FLAGS:-} 2>&1 | grep -v "Warning\|warnings.warn" | grep "^\[" \
      | tail -12 ;;
  gc)
    # BETWEEN (default "gc prefill"): decode_gc_check.py --between, each in its own process
    for b in ${BETWEEN:-gc prefill}; do
      say "the default decode, then $b, then a third call: 7B (${GC_LAYERS:-32} layers)"
      timeout 240 python3 benchmarks/decode_gc_check.py --between "$b" --layers "${GC_LAYERS:-32}" \
        2>&1 | grep -v "Warning\|warnings.warn" | tail -3
    done ;;
  prologue)
    say "the tensor-core kernel at a training batch's rows: its CUDA test"
    timeout 120 python3 -m pytest -q -m cuda -p no:cacheprovider tests/distributed/test_cuda_kernel4.py \
      -k training_batch 2>&1 | tail -3
    say "the prologue kernels against dequantize + matmul"
    timeout $((${PROLOGUE_BUDGET:-150} + 60)) python3 benchmarks/nf4_prologue_bench.py \
      --rows "${ROWS:-4096,2048}" --budget-s "${PROLOGUE_BUDGET:-150}" --out "$OUT/prologue" \
      2>&1 | grep -v "Warning\|warnings.warn" | tail -14 ;;
  xtab)
    say "the product-table gemv against the library's tile and bitsandbytes, one row"
    timeout $((${XTAB_BUDGET:-200} + 60)) python3 benchmarks/nf4_gemv_bench.py \
      --budget-s "${XTAB_BUDGET:-200}" --shapes 0,1,2,3,4 --out "$OUT/xtab" --tiles '[
        {"KERNEL":"lines","LUT":1,"SB":32,"BLK":null,"num_warps":1,"num_stages":1,"BLOCK_N":2},
        {"KERNEL":"xtab","BLOCK_N":32,"BLK":1,"TR":8,"THREADS":1024},
        {"KERNEL":"xtab","BLOCK_N":32,"BLK":1,"TR":8,"THREADS":1024,"DET":1},
        {"KERNEL":"xtab","BLOCK_N":32,"BLK":1,"TR":16,"THREADS":512}]' \
      2>&1 | grep -v "Warning\|warnings.warn" | tail -60
    if [ -n "${XTAB_NCU:-}" ]; then  # Nsight Compute on the product-table kernel's first call
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
      say "Nsight Compute: the product-table kernel on 22016 x 4096"
      timeout 200 "$NCU" --clock-control none -k "regex:qm_gemv_xtab" --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section InstructionStats --section MemoryWorkloadAnalysis --section Occupancy \
        --section LaunchStats python3 benchmarks/nf4_gemv_bench.py --budget-s 30 --shapes 4 \
        --out "$OUT/xtab_ncu" --tiles "[{\"KERNEL\":\"xtab\",\"BLOCK_N\":32,\"BLK\":1,${XTAB_NCU_TILE:-\"TR\":32}}]" \
        > "$OUT/ncu_xtab.txt" 2>&1
      grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Issued|Eligible|Stall|Warp Cycles|Executed Ipc|Active Warps|Shared|Bank|L1/TEX Hit|L2 Hit|Executed Instructions" \
        "$OUT/ncu_xtab.txt" | head -60
    fi
    if [ -z "${NODECODE:-}" ]; then
      say "decode, 7B nf4 + LoRA, batch 1: peft's static cache, then the defaults"
      timeout "${BENCH_S:-260}" python3 benchmarks/bench_decode.py --mode qlora --greedy \
        --peer-static-only --timed-runs 3 --new 256 --out "$OUT" 2>&1 | grep -v "Warning\|warnings.warn" | tail -8
    fi ;;
  pairs)
    say "the pair-table gemv (pairs_k, pairs32) against the library's tile and bitsandbytes, one row"
    timeout $((${PAIRS_BUDGET:-260} + 40)) python3 benchmarks/nf4_gemv_bench.py \
      --budget-s "${PAIRS_BUDGET:-260}" --shapes 0,1,2,3,4 --out "$OUT/pairs" --tiles '[
        {"KERNEL":"lines","LUT":1,"SB":32,"BLK":null,"num_warps":1,"num_stages":1,"BLOCK_N":2},
        {"KERNEL":"pairs32","BLOCK_N":8,"BLK":1}, {"KERNEL":"pairs32","BLOCK_N":8,"BLK":1,"BPS":4},
        {"KERNEL":"pairs_k","BLOCK_N":8,"BLK":1}]' \
      2>&1 | grep -v "Warning\|warnings.warn" | tail -60 ;;
  decode)
    say "decode, 7B nf4 + LoRA, batch 1: bitsandbytes' kernels and the gemv (profiled)"
    timeout 330 python3 benchmarks/bench_decode.py --mode qlora --greedy --gemv --profile \
      --no-peer --out "$OUT" 2>&1 | grep -v "Warning\|warnings.warn" | tail -6
    python3 -c "import json; r = json.load(open('$OUT/result_decode_qlora.json')); print(json.dumps({k: r.get(k, {}).get('call') for k in ('qm_profile', 'qm_profile_gemv')}))"
    say "the CUDA decode tests with the gemv (QUANTMESH_GEMV=1)"
    QUANTMESH_GEMV=1 timeout 300 python3 -m pytest -q -m cuda tests/distributed/test_cuda_decode.py 2>&1 | tail -4 ;;
  peer)
    if [ -z "${NOPEER:-}" ]; then
      say "decode, 7B nf4 + LoRA, batch 1: peft + bitsandbytes (dynamic, static cache), then ours"
      timeout 400 python3 benchmarks/bench_decode.py --mode qlora --greedy --out "$OUT" 2>&1 \
        | grep -v "Warning\|warnings.warn" | tail -6
    fi
    if [ -n "${TILES:-}" ]; then
      say "the lines gemv's CUDA tests"
      timeout 170 python3 -m pytest -q -x -m cuda tests/distributed/test_cuda_kernel4.py \
        -k gemv_lines_is 2>&1 | tail -3
      say "gemv tiles: $TILES"
      timeout 130 python3 benchmarks/nf4_gemv_bench.py --budget-s 100 --tiles "$TILES" \
        --out "$OUT/tiles" 2>&1 | grep -v "Warning\|warnings.warn" | grep -v "^skipped" | tail -24
    fi ;;
  gaps)
    say "decode with the gemv only (QUANTMESH_GEMV=1), profiled: where the GPU idles"
    QUANTMESH_GEMV=1 timeout 200 python3 benchmarks/bench_decode.py --mode qlora --greedy --profile \
      --no-peer --new 64 --out "$OUT" 2>&1 | grep -v "Warning\|warnings.warn" | tail -3
    python3 -c "import json; p = json.load(open('$OUT/result_decode_qlora.json')).get('qm_profile', {}); print(json.dumps(p.get('gaps'), indent=1)); print(p.get('gpu_us_per_step'), p.get('host_per_step'))" ;;
  batches)
    for b in ${BATCHES:-4 8}; do
      say "decode, 7B nf4 + LoRA, batch $b: the gemv (GEMV_MAX_ROWS rows) and bitsandbytes' path"
      timeout 280 python3 benchmarks/bench_decode.py --mode qlora --greedy --gemv --no-peer \
        --batch "$b" --new 128 --out "$OUT/b$b" 2>&1 | grep -v "Warning\|warnings.warn" | tail -4
    done ;;
  train)
    say "training with Triton's dequantize and with CUDA graphs of the blocks: the CUDA tests"
    timeout 280 python3 -m pytest -q -m cuda tests/distributed/test_cuda_kernel4.py \
      tests/distributed/test_cuda.py -k "training_takes or many_rows or whole_weights or cuda_graphs" \
      2>&1 | tail -3
    say "7B nf4 + LoRA, seq 2048, mb 2, compiled: the variants, each between runs of the default"
    timeout 290 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
      benchmarks/bench_train.py --quant nf4 --mb 2 --warmup 5 --steps 20 --compile \
      --variants "${TRAIN_VARIANTS:-default,cuda_graphs+triton_dequant,default,pdl,default,cuda_graphs+triton_dequant+pdl,default}" \
      --variant-steps 20 --out "$OUT/train" 2>&1 | grep -v "Warning\|warnings.warn" | grep "variant\|RESULT" ;;
  b32)
    say "decode, batch ${BATCH:-32}: the default path, the tensor-core kernel, Triton's dequantize"
    timeout 420 python3 benchmarks/bench_decode.py --mode qlora --greedy --no-peer --mma \
      --dequant --profile --batch "${BATCH:-32}" --new 64 --out "$OUT/b${BATCH:-32}" 2>&1 \
      | grep -v "Warning\|warnings.warn" | tail -5
    python3 -c "import json; r = json.load(open('$OUT/b${BATCH:-32}/result_decode_qlora.json')); print(json.dumps({k: [v.get('gpu_us_per_step'), v.get('kinds_us_per_step')] for k, v in r.items() if k.startswith('qm_profile') and isinstance(v, dict)})[:3000])" ;;
  *) echo "unknown stage: $STAGE (sweep, probe, warps, dequant, test, gemv, rows, mma, decode, peer, gaps, batches, train, b32, join, attention, pdl, inductor, graphs, gc, pairs, xtab, lora, step, host)" >&2; exit 2 ;;
esac
say done
