#!/usr/bin/env bash
# Mixture-of-experts LoRA training on one GPU, quantmesh against its peers in one call
# (benchmarks/bench_moe.py; docs/benchmarks.md, "Mixtures of experts"):
#
#   bash benchmarks/run_moe_gpu.sh [STAGE ...]
#
# STAGE: unsloth (Unsloth's MoE path, its checkpointing), unsloth-nogc, peft (transformers +
# bitsandbytes + peft), qm (quantmesh, eager blocks), qm-compiled, or qm:FLAG,FLAG... (bench_moe.py's
# flags, e.g. qm:--compile,--loss-chunk=1024,--checkpoint=offload,--profile); default:
# unsloth peft qm-compiled.
# The peers read one folder written by transformers' save_pretrained (made by the first of them).
# Each stage is its own process with its own time limit (STAGE_S, default 240 s) and writes
# OUT/result_moe_*.json. Unsloth's wheels are looked for in .whl-unsloth/ (pandas and pillow from
# .whl-unsloth/ifmissing/ only where the machine lacks them); without them the Unsloth stages say so.
source "$(dirname "$0")/gpu_env.sh" moe
MODEL=${MODEL:-/tmp/qm-moe-model}
STAGE_S=${STAGE_S:-240}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(unsloth peft qm-compiled)

unsloth_site() {  # Unsloth and what it needs beside the image, in a site of its own
  [ -d /tmp/u-site ] && return 0
  ls .whl-unsloth/*.whl >/dev/null 2>&1 || { say "no .whl-unsloth/: Unsloth not installed"; return 1; }
  local w=(.whl-unsloth/*.whl .whl/*.whl)
  python3 -c "import pandas, dateutil" 2>/dev/null || w+=(.whl-unsloth/ifmissing/{pandas,python_dateutil,six}-*.whl)
  python3 -c "import PIL.Image" 2>/dev/null || w+=(.whl-unsloth/ifmissing/pillow-*.whl)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/u-site "${w[@]}" 2>&1 | tail -2
}

for stage in "${stages[@]}"; do
  say "stage $stage"
  log="$OUT/${stage//[^a-z0-9-]/_}.log"
  case $stage in
    unsloth|unsloth-nogc)
      unsloth_site || continue
      gc=unsloth; [ "$stage" = unsloth-nogc ] && gc=off
      (cd /tmp && mkdir -p u-work && cd u-work &&  # Unsloth writes its compiled cache into the cwd
        HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 HF_HOME=/tmp/u-home \
        PYTHONPATH=/tmp/u-site:$ROOT/src timeout "$STAGE_S" python3 "$ROOT/benchmarks/bench_moe.py" \
          --mode unsloth --unsloth-gc $gc --model-dir "$MODEL" --out "$OUT" > "$log" 2>&1)
      ;;
    peft) timeout "$STAGE_S" python3 benchmarks/bench_moe.py --mode peft --model-dir "$MODEL" --out "$OUT" > "$log" 2>&1 ;;
    qm) timeout "$STAGE_S" python3 benchmarks/bench_moe.py --mode qm --out "$OUT" > "$log" 2>&1 ;;
    qm-compiled) timeout "$STAGE_S" python3 benchmarks/bench_moe.py --mode qm --compile --out "$OUT" > "$log" 2>&1 ;;
    qm:*)
      IFS=, read -r -a flags <<< "${stage#qm:}"
      timeout "$STAGE_S" python3 benchmarks/bench_moe.py --mode qm "${flags[@]}" --out "$OUT" > "$log" 2>&1 ;;
    *) say "unknown stage $stage"; continue ;;
  esac
  say "stage $stage: rc=$?"
  tail -1 "$log"
done
say done
