#!/usr/bin/env bash
# Debug PPO run on the embedded default (SmolLM2-135M-Instruct + one-digit addition), offline.
# Installs the environment first if needed. Extra arguments go to the trainer and win over the config:
#
#   bash scripts/train/debug/ppo.sh
#   bash scripts/train/debug/ppo.sh --total_episodes 64 --async_mode false
#
# On a GPU it uses configs/train_configs/ppo_arithmetic_gpu.yaml; on a CPU the 2-core ~14 minute
# configs/train_configs/ppo_arithmetic_cpu.yaml. Results: output/ppo_arithmetic_debug/
# (metrics.jsonl, training_curves.png, summary.json, model/).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$REPO"
bash scripts/install.sh ${OPEN_INSTRUCT_CURRENT_ENV:+--current-env}
python="${OPEN_INSTRUCT_VENV:-$REPO/.venv}/bin/python"
[[ -n "${OPEN_INSTRUCT_CURRENT_ENV:-}" ]] && python="$(command -v python3)"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  config=configs/train_configs/ppo_arithmetic_gpu.yaml
else
  config=configs/train_configs/ppo_arithmetic_cpu.yaml
fi
export WANDB_MODE="${WANDB_MODE:-offline}" HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" PYTHONUNBUFFERED=1
echo "[ppo.sh] $config $*"
exec "$python" -m open_instruct.ppo_vllm_thread_ray_gtrl "$config" "$@"
