#!/usr/bin/env bash
# The server's GPU measurements, one stage per GPU run (each fits its 10-minute limit):
#
#   bash benchmarks/run_serve_gpu.sh STAGE [GRAPHS]     GRAPHS: captured (default) or trees
#                                                      (profile also takes none: no CUDA graphs,
#                                                      its kernels named by op and input shapes)
#
#   serve    the yardstick, qm.fast_decode at batch 1 (bench_decode.py --mode qlora --greedy
#            --no-peer --new 128), then in the same call benchmarks/bench_serve.py on the 7B nf4
#            shape, slot engine, 1/8/32/64 clients, one adapter and mixed (DENSE=1: with
#            --keep-dequantized)
#   profile  benchmarks/slot_step_profile.py: one decode step through SlotBatch.execute against
#            its replays alone, with kernel tables, at 1 and 64 rows
#   peers    the batch peers: peft + bitsandbytes with transformers' static-cache `generate`
#            and qm.fast_decode, 32 rows decoded at once (bench_decode.py --mode qlora --batch 32)
#   test     the CUDA tests of the slot engine (tests/distributed/test_cuda_serve.py; K: a pytest
#            -k selection, e.g. K=sdpa; any QUANTMESH_* switch in the environment applies)
#   dequant  bench_serve as in `serve` with the Triton dequantize on, then `profile` at 32 rows
#   mma      bench_serve as in `serve` with the tensor-core 4-bit kernel on (the default now: 9 to
#            64 rows on the codes, no weight held), then `profile` at 32 rows
#   dense    bench_serve as in `serve` with --keep-dequantized (the 4-bit weights held in bf16 too)
#   gap      where a 32-row step's time goes: held_gemm_bench.py (the held weights' matmuls,
#            separate against siblings fused), then bench_serve with --keep-dequantized, whose
#            phases report the server's own step and host times (server_step_ms, server_host_ms)
#   all      in one call: the slot engine's CUDA test (sdpa), the yardstick, then bench_serve as
#            in `serve` with what is left of 590 s (the start compiles one block: mark_block_regions);
#            DENSE=1: the server with --keep-dequantized
#
# Needs the bitsandbytes wheel and the server's wheels in .whl/ and .whl/extra/ (git-ignored;
# DEVELOPERS.md says how to make them). Results under $OUT (default .bench/serve-gpu).
set -u
STAGE=${1:?stage: serve, profile, peers, test, all, dequant, mma, dense or gap}
GRAPHS=${2:-captured}
# shellcheck source=benchmarks/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh" serve-gpu extra
left() { echo $((590 - ($(date +%s) - T0))); }  # seconds of a 10-minute call left
# bench_serve.py on the 7B nf4 shape, slot engine, 1/8/32/64 clients: serve_bench LIMIT [FLAG...]
serve_bench() {
  timeout "$1" python3 benchmarks/bench_serve.py --shape 7b --quant nf4 --engine slots \
    --cuda-graphs "$GRAPHS" --max-model-len 1024 --concurrency 1,8,32,64 --requests 2 \
    --max-tokens 64 --prompt-tokens 32 --models .bench/models --out "$OUT" "${@:2}" 2>&1 \
    | grep -v "Warning\|warnings.warn"
}
case "$STAGE" in
  serve)
    # the yardstick first: the server's start (three to four minutes for 7B) takes the rest
    say "fast_decode yardstick"
    timeout 100 python3 benchmarks/bench_decode.py --mode qlora --greedy --no-peer --new 128 \
      --out "$OUT" 2>&1 | tail -3
    say "bench_serve ($GRAPHS${DENSE:+, --keep-dequantized})"
    serve_bench "$(left)" ${DENSE:+--keep-dequantized} ;;
  profile)
    # BATCH (default 64): the second measurement's rows; DENSE=1: --keep-dequantized
    timeout 560 python3 benchmarks/slot_step_profile.py --batch "${BATCH:-64}" --cuda-graphs "$GRAPHS" \
      ${DENSE:+--keep-dequantized} --models .bench/models --out "$OUT" 2>&1 \
      | grep -v "Warning\|warnings.warn" ;;
  peers)
    timeout 560 python3 benchmarks/bench_decode.py --mode qlora --greedy --batch 32 --new 64 \
      --out "$OUT" 2>&1 | grep -v "Warning\|warnings.warn" | tail -12 ;;
  all)
    say "CUDA tests of the slot engine (sdpa)"
    timeout 220 python3 -m pytest -q -m cuda tests/distributed/test_cuda_serve.py -k sdpa -s 2>&1 \
      | grep -v "Warning\|warnings.warn" | tail -6
    say "fast_decode yardstick"
    timeout 90 python3 benchmarks/bench_decode.py --mode qlora --greedy --no-peer --new 128 \
      --out "$OUT" 2>&1 | tail -3
    say "bench_serve ($GRAPHS${DENSE:+, --keep-dequantized}), $(left) s left"
    serve_bench "$(left)" ${DENSE:+--keep-dequantized} ;;
  dequant | mma)
    # the server with the Triton dequantize (QUANTMESH_TRITON_DEQUANT=1) or the tensor-core
    # kernel (QUANTMESH_MMA=1) on, then one step at 32 rows profiled outside the server (GPU time
    # against host time), the same setting
    if [ "$STAGE" = mma ]; then export QUANTMESH_MMA=1; else export QUANTMESH_TRITON_DEQUANT=1; fi
    say "bench_serve ($GRAPHS, $STAGE)"
    serve_bench 380
    say "slot step profile at 32 rows, $(left) s left"
    timeout "$(left)" python3 benchmarks/slot_step_profile.py --batch 32 --cuda-graphs "$GRAPHS" \
      --models .bench/models --out "$OUT" 2>&1 | grep -v "Warning\|warnings.warn" | tail -40 ;;
  gap)
    say "held weights' matmuls of a 7B step, separate and fused"
    timeout 120 python3 benchmarks/held_gemm_bench.py --out "$OUT" 2>&1 | tail -5
    say "bench_serve ($GRAPHS, --keep-dequantized), $(left) s left"
    serve_bench "$(left)" --keep-dequantized ;;
  dense)
    # the server with --keep-dequantized (4-bit weights held in bf16 too)
    say "bench_serve ($GRAPHS, --keep-dequantized)"
    serve_bench 560 --keep-dequantized ;;
  test)
    timeout 560 python3 -m pytest -q -m cuda tests/distributed/test_cuda_serve.py -s \
      ${K:+-k "$K"} 2>&1 | tail -15 ;;
  *) echo "unknown stage: $STAGE (serve, profile, peers, test, all, dequant, mma, dense, gap)" >&2; exit 2 ;;
esac
say done
