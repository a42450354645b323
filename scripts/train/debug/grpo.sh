#!/usr/bin/env bash
# Debug GRPO run on the embedded default (SmolLM2-135M-Instruct + one-digit addition), offline: the PPO
# trainer's loop with no value model and group-normalised advantages (docs/grpo.md).
# Installs the environment first if needed. Extra arguments go to the trainer and win over the config:
#
#   bash scripts/train/debug/grpo.sh
#   bash scripts/train/debug/grpo.sh --total_episodes 128 --grpo_std_normalize false
#
# On a GPU it uses configs/train_configs/grpo_arithmetic_gpu.yaml; on a CPU the 2-core
# configs/train_configs/grpo_arithmetic_cpu.yaml. Results: output/grpo_arithmetic_debug/
# (metrics.jsonl, training_curves.png, summary.json, model/).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$REPO"
bash scripts/install.sh ${OPEN_INSTRUCT_CURRENT_ENV:+--current-env}
python="${OPEN_INSTRUCT_VENV:-$REPO/.venv}/bin/python"
[[ -n "${OPEN_INSTRUCT_CURRENT_ENV:-}" ]] && python="$(command -v python3)"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  config=configs/train_configs/grpo_arithmetic_gpu.yaml
else
  config=configs/train_configs/grpo_arithmetic_cpu.yaml
fi
export WANDB_MODE="${WANDB_MODE:-offline}" HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" PYTHONUNBUFFERED=1
echo "[grpo.sh] $config $*"
exec "$python" -m open_instruct.grpo_vllm_thread_ray_gtrl "$config" "$@"
