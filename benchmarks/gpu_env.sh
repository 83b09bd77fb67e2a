# The preamble of the GPU stage scripts (run_kernel_gpu.sh, run_serve_gpu.sh), sourced:
#
#   source "$(dirname "$0")/gpu_env.sh" NAME [extra]
#
# Goes to the repository root (ROOT), makes OUT (default .bench/NAME), defines `say` (a line
# with the seconds since the start), installs the carried wheels where there are any (.whl/*.whl,
# and .whl/extra/*.whl with `extra`) and sets PYTHONPATH and the environment of every stage.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
OUT=${OUT:-$ROOT/.bench/$1}
mkdir -p "$OUT"
T0=$(date +%s)
say() { echo "[$(($(date +%s) - T0))s] $*"; }
if ls .whl/*.whl >/dev/null 2>&1; then
  wheels=(.whl/*.whl)
  if [ "${2:-}" = extra ]; then wheels+=(.whl/extra/*.whl); fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/qm-site "${wheels[@]}" 2>&1 | tail -2
  export PYTHONPATH=/tmp/qm-site:$ROOT/src
else
  export PYTHONPATH=$ROOT/src
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
