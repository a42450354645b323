#!/usr/bin/env bash
# Debug GRPO run of an agent program (docs/agents.md): scripts/agents/org_chart_agent.py, written only against the
# `openai` package, runs its own tool loop on the org-chart task against the trainer's OpenAI-compatible endpoint, and
# the trainer learns from the exact tokens its calls sampled. The same task, model (the warm-up's), seed and settings as
# grpo_native_tools.sh, whose tool loop runs inside the engine. Extra arguments go to the trainer:
#
#   bash scripts/train/debug/grpo_agent.sh
#
# Recipe: configs/train_configs/grpo_agent_cpu.yaml. Measure the saved model with a fresh engine as grpo_native_tools.sh
# says (the in-engine tools path grades the same answers).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
bash "$REPO/scripts/train/debug/org_chart_warmup.sh"
exec bash "$REPO/scripts/train/debug/debug_run.sh" grpo agent "$@"
