#!/usr/bin/env bash
# The debug run behind ppo.sh and grpo.sh: install the environment if needed, pick the embedded-default recipe
# for this machine (configs/train_configs/<algorithm>_arithmetic_gpu.yaml on an NVIDIA GPU, else
# <algorithm>_arithmetic_cpu.yaml) and run that algorithm's trainer offline. Extra arguments go to the trainer.
#
#   bash scripts/train/debug/debug_run.sh ppo|grpo [--flag value ...]
set -euo pipefail
algorithm="${1:?usage: debug_run.sh ppo|grpo [trainer flags]}"
shift
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$REPO"
bash scripts/install.sh ${OPEN_INSTRUCT_CURRENT_ENV:+--current-env}
python="${OPEN_INSTRUCT_VENV:-$REPO/.venv}/bin/python"
[[ -n "${OPEN_INSTRUCT_CURRENT_ENV:-}" ]] && python="$(command -v python3)"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  config=configs/train_configs/${algorithm}_arithmetic_gpu.yaml
else
  config=configs/train_configs/${algorithm}_arithmetic_cpu.yaml
fi
export WANDB_MODE="${WANDB_MODE:-offline}" HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" PYTHONUNBUFFERED=1
echo "[$algorithm.sh] $config $*"
exec "$python" -m "open_instruct.${algorithm}_vllm_thread_ray_gtrl" "$config" "$@"
