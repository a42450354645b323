#!/usr/bin/env bash
# Debug GRPO run with a calculator (docs/tools.md "A CPU demo"): SmolLM2-135M-Instruct learns to call
# <calculator>...</calculator> on 4-digit additions and multiplications it cannot compute alone.
# Installs the environment first if needed. Extra arguments go to the trainer and win over the config:
#
#   bash scripts/train/debug/grpo_tools.sh
#   bash scripts/train/debug/grpo_tools.sh --total_episodes 128
#
# Recipe: configs/train_configs/grpo_tools_cpu.yaml (sized for 2 CPU cores; on a GPU it runs the same recipe).
# Results: output/grpo_tools_cpu/ (metrics.jsonl with tools/* and eval/correct_rate with the tool, model/). Measure the
# saved model with a fresh engine:
#
#   python -m open_instruct.evaluate output/grpo_tools_cpu/model embedded --tools calculator --response_length 64 \
#       --dataset_mixer_list embedded_tool_arithmetic 16 --dataset_mixer_eval_list embedded_tool_arithmetic 1.0
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/debug_run.sh" grpo tools "$@"
