#!/usr/bin/env bash
# The GPU self-check: on a GPU node, install what is needed (once, from the requirement files) and run what the CPU
# test suite cannot: vLLM's NCCL and IPC weight transfers, CUDA graphs after a weight load, a bf16 learner step vs
# fp32, the single-GPU debug run. Prints a table (docs/gpu_check.md).
#
#   bash scripts/check_gpu.sh                        # every check on the embedded model
#   bash scripts/check_gpu.sh --only cuda_graphs     # extra arguments go to scripts/check_gpu.py (--list, --json)
#   bash scripts/check_gpu.sh --cpu-checks           # a machine without a GPU: the checks that need none (bf16_step)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
# A machine whose driver shows no GPU is told so at once, before an install that can take minutes; check_gpu.py asks
# again, and also fails where the driver shows GPUs that torch cannot see.
asked_without_gpu=0
for argument in "$@"; do
  case "$argument" in --cpu-checks | --list | -h | --help) asked_without_gpu=1 ;; esac
done
listed="$(timeout 30 nvidia-smi -L 2>/dev/null || true)"  # one "GPU i: NAME (UUID: ...)" line per GPU
if (( ! asked_without_gpu )) && ! compgen -G '/dev/nvidia[0-9]*' >/dev/null && ! grep -q '^GPU [0-9]' <<<"$listed"; then
  echo "[check_gpu] no GPU on this machine (nvidia-smi lists none, no /dev/nvidiaN): nothing was checked. Run it on a" \
    "GPU node, or pass --cpu-checks to run the checks that need no GPU (bf16_step)." >&2
  exit 1
fi
bash scripts/install.sh ${OPEN_INSTRUCT_CURRENT_ENV:+--current-env}
python="${OPEN_INSTRUCT_VENV:-$REPO/.venv}/bin/python"
[[ -n "${OPEN_INSTRUCT_CURRENT_ENV:-}" ]] && python="$(command -v python3)"
export WANDB_MODE=offline HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" scripts/check_gpu.py "$@"
