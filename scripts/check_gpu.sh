#!/usr/bin/env bash
# The GPU self-check: on a GPU node, install what is needed (once, from the requirement files) and run what the CPU
# test suite cannot: vLLM's NCCL and IPC weight transfers, CUDA graphs after a weight load, a bf16 learner step vs
# fp32, the single-GPU debug run. Prints a table (docs/distributed.md, "The GPU self-check").
#
#   bash scripts/check_gpu.sh                        # every check on the embedded model
#   bash scripts/check_gpu.sh --only cuda_graphs     # extra arguments go to scripts/check_gpu.py (--list, --json)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
bash scripts/install.sh ${OPEN_INSTRUCT_CURRENT_ENV:+--current-env}
python="${OPEN_INSTRUCT_VENV:-$REPO/.venv}/bin/python"
[[ -n "${OPEN_INSTRUCT_CURRENT_ENV:-}" ]] && python="$(command -v python3)"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "[check_gpu] no NVIDIA GPU answers nvidia-smi here: the GPU checks will be skipped" >&2
fi
export WANDB_MODE=offline HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" scripts/check_gpu.py "$@"
