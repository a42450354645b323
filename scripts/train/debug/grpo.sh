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
exec bash "$(dirname "${BASH_SOURCE[0]}")/debug_run.sh" grpo "$@"
