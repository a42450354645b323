#!/usr/bin/env bash
# Debug GRPO run with native tool calls (docs/tools.md "A native tool-call demo"): a short supervised warm-up teaches
# SmolLM2-135M-Instruct the `<tool_call>` format on 64 demonstrations, then GRPO teaches it to look people up in an org
# chart only the tool can read (who manages a person's manager: two calls, the second built from the first's result).
# Installs the environment first if needed. Extra arguments go to the trainer and win over the config:
#
#   bash scripts/train/debug/grpo_native_tools.sh
#   bash scripts/train/debug/grpo_native_tools.sh --total_episodes 96
#
# Recipe: configs/train_configs/grpo_native_tools_cpu.yaml. The warm-up's model goes to
# output/grpo_native_tools_cpu/warmup (made again only when missing: delete it to redo it). Measure a saved model with a
# fresh engine on the 64 held-out questions:
#
#   python -m open_instruct.evaluate output/grpo_native_tools_cpu/model output/grpo_native_tools_cpu/warmup \
#       --tools org_chart --tool_call_parser hermes --chat_template_name chatml_tools --max_tool_calls 3 \
#       --response_length 128 --dataset_mixer_list embedded_org_chart 16 --dataset_mixer_eval_list embedded_org_chart 1.0
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
bash "$REPO/scripts/train/debug/org_chart_warmup.sh"
exec bash "$REPO/scripts/train/debug/debug_run.sh" grpo native_tools "$@"
