#!/usr/bin/env bash
# One GPU session of quantmesh's benchmarks against its peers, on one machine, inside a time budget.
#
#   bash benchmarks/run_gpu.sh [--cpu] [STAGE...]     STAGE: train tpc pp2 decode load (default:
#                                                     train decode load)
#
#   train   env, bf16 matmul peak, then at the same micro-batch: peer D (accelerate layer split,
#           NF4) / quantmesh tp=2 nf4 eager, then with compiled blocks (+ profile), peer E (DDP of
#           peft + bnb NF4) / quantmesh dp=2 nf4 eager, then compiled (+ profile); every quantmesh
#           run also checks its losses against a CPU reference
#   tpc     peer D and quantmesh tp=2 compiled only (a second micro-batch: MB=4)
#   pp2     at one global batch of MB rows (run it with MB=8): peer D, quantmesh tp=2, and
#           quantmesh pp=2 1F1B over 4 and over 8 micro-batches (qm.train_step)
#   decode  one GPU transformers (dynamic cache, static cache + compile), quantmesh tp=2
#   load    a 7B-shaped sharded safetensors checkpoint: disk read rate vs qm.load_checkpoint
#           into tp=2 nf4 (host RssAnon per rank)
#
# Steps run in the order above (by value); each has its own `timeout` and none starts with less
# than MIN_STEP_S of the budget left, so one failure cannot eat the session. After every step all
# results are bundled into $OUT/results.json and $OUT/summary.md; the full log is $OUT/run.log.
#
# Needs, git-ignored beside the code: bitsandbytes/torchao wheels in .whl/ (installed into a
# temporary folder when present) and the peers' script as .gpu/peer_bench.py (peer steps are
# skipped, and say so, when it is missing).
# Environment: OUT (default .bench/out), QM_BUDGET_S (default 540), MB (default 2), PYTHON,
# VARIANTS (prototype speed-ups timed after the eager tp=2 run, e.g. vp_ce,lora_bf16).
# --cpu: every step with tiny shapes on CPU ranks (gloo), to check this script without a GPU.
set -u

CPU=0
STAGES=()
for arg in "$@"; do
  case "$arg" in
    --cpu) CPU=1 ;;
    train | tpc | tp2 | pp2 | decode | load) STAGES+=("$arg") ;;
    *) echo "unknown argument: $arg (stages: train decode load; flag: --cpu)" >&2; exit 2 ;;
  esac
done
[ ${#STAGES[@]} -eq 0 ] && STAGES=(train decode load)

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
OUT=${OUT:-$ROOT/.bench/out}
BUDGET=${QM_BUDGET_S:-540}
MB=${MB:-2}
PY=${PYTHON:-python3}
MIN_STEP_S=${MIN_STEP_S:-45}
RESERVE_S=10
mkdir -p "$OUT"
WORK=$(mktemp -d)
LOG=$OUT/run.log
: >"$LOG"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# NVLink multicast stays off (it can take a shared host's GPUs down)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node 2)

if [ $CPU = 1 ]; then
  SHAPE=(--cpu --layers 2 --hidden 128 --inter 256 --heads 4 --vocab 512 --seq 64)
  SHAPE+=(--warmup 1 --steps 2)
  OURS=(--smoke)
  VARIANT_STEPS=2
  export OMP_NUM_THREADS=1
else
  SHAPE=()
  OURS=()
  VARIANT_STEPS=10
fi

say() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }

bundle() {
  "$PY" benchmarks/summarize.py --bundle "$WORK" --json "$OUT/results.json" --md "$OUT/summary.md" \
    >>"$LOG" 2>&1 || say "bundle failed (see log)"
}

# record NAME STATUS [WHY RC SECONDS TIMEOUT_S]: one line of $WORK/steps.jsonl
record() {
  printf '{"step": "%s", "status": "%s", "why": "%s", "rc": %s, "seconds": %s, "timeout_s": %s}\n' \
    "$1" "$2" "${3:-}" "${4:-null}" "${5:-null}" "${6:-null}" >>"$WORK/steps.jsonl"
}

# step NAME CAP_S CMD...: run CMD under timeout min(CAP_S, budget left), record its outcome
step() {
  local name=$1 cap=$2
  shift 2
  local left=$((BUDGET - SECONDS - RESERVE_S))
  local t=$((cap < left ? cap : left))
  if [ "$t" -lt "$MIN_STEP_S" ]; then
    say "SKIP $name: ${left}s of the budget left"
    record "$name" skipped "budget: ${left}s left"
    return
  fi
  say "START $name (timeout ${t}s, ${SECONDS}s used of ${BUDGET}s)"
  local t0=$SECONDS
  timeout -k 20 "$t" "$@" >>"$LOG" 2>&1
  local rc=$?
  local status=ok
  [ $rc -ne 0 ] && status=failed
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && status=timeout
  say "END $name: $status (rc $rc, $((SECONDS - t0))s)"
  [ "$status" = ok ] || tail -n 25 "$LOG" | grep -v "^\[" | tail -n 20
  record "$name" "$status" "" "$rc" $((SECONDS - t0)) "$t"
  bundle
}

skip() {
  say "SKIP $1: $2"
  record "$1" skipped "$2"
}

# ---- set-up -----------------------------------------------------------------------------------
if [ $CPU = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
  SITE=$(mktemp -d)
  say "installing $(ls .whl/*.whl | wc -l) carried wheels"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl >>"$LOG" 2>&1 || say "wheel install failed (see log)"
  export PYTHONPATH=$SITE:$ROOT/src
else
  export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
fi
PEER=.gpu/peer_bench.py
say "stages: ${STAGES[*]}; budget ${BUDGET}s; micro-batch $MB; cpu smoke: $CPU"
step env 60 "$PY" benchmarks/qmbench.py --out "$WORK"

for stage in "${STAGES[@]}"; do
  case $stage in
  train | tpc)
    # train: peer D / tp=2 eager / tp=2 compiled, peer E / dp=2 eager / dp=2 compiled
    # tpc:   peer D / tp=2 compiled only (e.g. at another micro-batch: MB=4)
    step matmul_peak 60 "$PY" benchmarks/matmul_peak.py --out "$WORK" ${OURS[@]+"${OURS[@]}"}
    TRAIN=(--mb "$MB" --peak-json "$WORK/matmul_peak.json" --out "$WORK" --check)
    if [ -f $PEER ]; then
      step peer_D 180 "$PY" $PEER D --out "$WORK" --mb "$MB" --tag "_mb$MB" \
        ${SHAPE[@]+"${SHAPE[@]}"}
    else
      skip peer_D "no $PEER"
    fi
    if [ "$stage" = train ]; then
      step qm_tp2 150 "${TORCHRUN[@]}" benchmarks/bench_train.py --tp 2 --quant nf4 "${TRAIN[@]}" \
        ${VARIANTS:+--variants "$VARIANTS" --variant-steps $VARIANT_STEPS} ${OURS[@]+"${OURS[@]}"}
    fi
    step qm_tp2_compiled 240 "${TORCHRUN[@]}" benchmarks/bench_train.py --tp 2 --quant nf4 \
      "${TRAIN[@]}" --compile --profile ${OURS[@]+"${OURS[@]}"}
    [ "$stage" = tpc ] && continue
    if [ -f $PEER ]; then
      step peer_E 180 "${TORCHRUN[@]}" $PEER E --out "$WORK" --mb "$MB" --tag "_mb$MB" \
        ${SHAPE[@]+"${SHAPE[@]}"}
    else
      skip peer_E "no $PEER"
    fi
    step qm_dp2 150 "${TORCHRUN[@]}" benchmarks/bench_train.py --tp 1 --quant nf4 "${TRAIN[@]}" \
      ${OURS[@]+"${OURS[@]}"}
    step qm_dp2_compiled 240 "${TORCHRUN[@]}" benchmarks/bench_train.py --tp 1 --quant nf4 \
      "${TRAIN[@]}" --compile --profile ${OURS[@]+"${OURS[@]}"}
    ;;
  pp2)
    if [ -f $PEER ]; then
      step peer_D 180 "$PY" $PEER D --out "$WORK" --mb "$MB" --tag "_mb$MB" \
        ${SHAPE[@]+"${SHAPE[@]}"}
    else
      skip peer_D "no $PEER"
    fi
    step qm_tp2 150 "${TORCHRUN[@]}" benchmarks/bench_train.py --tp 2 --quant nf4 --mb "$MB" \
      --out "$WORK" ${OURS[@]+"${OURS[@]}"}
    for M in 4 8; do
      step "qm_pp2_m$M" 200 "${TORCHRUN[@]}" benchmarks/bench_train.py --pp 2 --microbatches "$M" \
        --pp-schedule 1f1b --quant nf4 --mb "$MB" --out "$WORK" ${OURS[@]+"${OURS[@]}"}
    done
    ;;
  decode)
    step decode_single ${DECODE_SINGLE_S:-260} "$PY" benchmarks/bench_decode.py --mode single --greedy \
      --temperature 0.8 --top-p 0.95 --out "$WORK" ${OURS[@]+"${OURS[@]}"}
    step decode_tp2 ${DECODE_TP_S:-260} "${TORCHRUN[@]}" benchmarks/bench_decode.py --mode tp \
      ${DECODE_COMPILE---compile} --greedy --temperature 0.8 --top-p 0.95 \
      --out "$WORK" --ref-json "$WORK/result_decode_single.json" ${OURS[@]+"${OURS[@]}"}
    ;;
  load)
    # on the repository's disk (a real disk: the read rate must not come from tmpfs)
    step load ${LOAD_S:-300} "$PY" benchmarks/bench_load.py --dir "$ROOT/.bench/ckpt" --out "$WORK" \
      --nproc 2 --tp 2 --quant nf4 ${OURS[@]+"${OURS[@]}"}
    rm -rf "$ROOT/.bench/ckpt"
    ;;
  esac
done

bundle
say "done in ${SECONDS}s; results in $OUT"
cat "$OUT/summary.md" 2>/dev/null
rm -rf "$WORK"
