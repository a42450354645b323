#!/usr/bin/env bash
# The debug run behind ppo.sh, grpo.sh and grpo_tools.sh: install the environment if needed, pick the embedded-default
# recipe for this machine (configs/train_configs/<algorithm>_<task>_gpu.yaml on an NVIDIA GPU when there is one, else
# <algorithm>_<task>_cpu.yaml; the task is `arithmetic` unless named) and run that algorithm's trainer offline. Extra
# arguments go to the trainer.
#
#   bash scripts/train/debug/debug_run.sh ppo|grpo [TASK] [--flag value ...]
set -euo pipefail
algorithm="${1:?usage: debug_run.sh ppo|grpo [TASK] [trainer flags]}"
shift
task=arithmetic
if [[ $# -gt 0 && "$1" != --* ]]; then
  task="$1"
  shift
fi
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$REPO"
bash scripts/install.sh ${OPEN_INSTRUCT_CURRENT_ENV:+--current-env}
python="${OPEN_INSTRUCT_VENV:-$REPO/.venv}/bin/python"
[[ -n "${OPEN_INSTRUCT_CURRENT_ENV:-}" ]] && python="$(command -v python3)"

config=configs/train_configs/${algorithm}_${task}_cpu.yaml
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 \
    && [[ -f configs/train_configs/${algorithm}_${task}_gpu.yaml ]]; then
  config=configs/train_configs/${algorithm}_${task}_gpu.yaml
fi
export WANDB_MODE="${WANDB_MODE:-offline}" HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" PYTHONUNBUFFERED=1
echo "[$algorithm.sh] $config $*"
exec "$python" -m "open_instruct.${algorithm}_vllm_thread_ray_gtrl" "$config" "$@"
