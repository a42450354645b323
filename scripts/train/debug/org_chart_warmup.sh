#!/usr/bin/env bash
# The supervised warm-up both org-chart demos start from (grpo_native_tools.sh, grpo_agent.sh): 64 demonstrations teach
# SmolLM2-135M-Instruct the `<tool_call>` format (open_instruct/sft_warmup.py). Its model goes to
# output/grpo_native_tools_cpu/warmup, made only when missing (delete it to redo it). Installs the environment first.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$REPO"
bash scripts/install.sh ${OPEN_INSTRUCT_CURRENT_ENV:+--current-env}
python="${OPEN_INSTRUCT_VENV:-$REPO/.venv}/bin/python"
[[ -n "${OPEN_INSTRUCT_CURRENT_ENV:-}" ]] && python="$(command -v python3)"
warmup=output/grpo_native_tools_cpu/warmup
if [[ ! -f "$warmup/sft_warmup.json" ]]; then
  HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" PYTHONUNBUFFERED=1 "$python" -m open_instruct.sft_warmup \
    --split warmup --examples 64 --batch_size 8 --learning_rate 1e-4 --tools org_chart --chat_template_name chatml_tools \
    --output_dir "$warmup"
fi
