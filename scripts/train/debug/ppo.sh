#!/usr/bin/env bash
# Debug PPO run on the embedded default (SmolLM2-135M-Instruct + one-digit addition), offline.
# Installs the environment first if needed. Extra arguments go to the trainer and win over the config:
#
#   bash scripts/train/debug/ppo.sh
#   bash scripts/train/debug/ppo.sh --total_episodes 64 --async_mode false
#
# On a GPU it uses configs/train_configs/ppo_arithmetic_gpu.yaml; on a CPU configs/train_configs/ppo_arithmetic_cpu.yaml
# (2 cores: about 9 minutes with AVX-512, an estimated 13-17 on an AVX2-only CPU). Results: output/ppo_arithmetic_debug/
# (metrics.jsonl, training_curves.png, summary.json, model/).
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/debug_run.sh" ppo "$@"
