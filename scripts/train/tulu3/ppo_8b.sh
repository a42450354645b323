#!/usr/bin/env bash
# Tulu 3 8B RLVR with PPO (configs/train_configs/ppo_tulu3_8b.yaml): Llama-3.1-Tulu-3-8B-DPO on Tulu 3's RLVR mix
# (allenai/RLVR-GSM-MATH-IF-Mixed-Constraints: GSM8K, MATH and instruction-following rows, graded by the gsm8k, math
# and ifeval verifiers), evaluated on the GSM8K and MATH test splits, on
# 2 nodes x 8 GPUs (80 GB each): 8 learner ranks at ZeRO-3 on one node, 4 vLLM engines x 2 GPUs on the other.
#
#   every node:  bash scripts/install.sh
#   node A:      NODE_ROLE=head bash scripts/train/multinode/ray_node_setup.sh
#   node B:      NODE_ROLE=worker HEAD_ADDRESS=<A's IP> bash scripts/train/multinode/ray_node_setup.sh
#   node A:      HEAD_ADDRESS=<A's IP> bash scripts/train/tulu3/ppo_8b.sh [--with_tracking --push_to_hub ...]
#
# or on SLURM: TRAIN_SCRIPT=scripts/train/tulu3/ppo_8b.sh sbatch scripts/train/multinode/ppo_slurm.sbatch
#
# Needs the Hugging Face Hub (the models, and the data the first time: the mix written to data/tulu3_rlvr, GSM8K and
# MATH, for their test splits, to data/gsm8k and data/math, by this repo's converters). The trainer downloads both models into node A's HF cache before Ray starts; node B's
# engines fetch the same commit into node B's cache unless HF_HOME is shared (docs/distributed.md, "Models named by
# a hub id"). Extra arguments go to the trainer and win over the recipe.
#
# Memory (the recipe's header has the whole plan; `python -m open_instruct.memory_plan configs/train_configs/ppo_tulu3_8b.yaml`
# prints it offline): each learner GPU 24.2 GB at load (ZeRO-3: every rank builds only its 1/8 of each model) and
# 52.9 GB in steady state, 27.1 GB (34%) under an 80 GB H100; each engine GPU 68 GB (--vllm_gpu_memory_utilization
# 0.85). The trainer prints the same plan at start. Not run yet: no GPU cluster was available to this project.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
SCRIPT_NAME=ppo_8b
# shellcheck source=scripts/train/multinode/common.sh
source "$REPO/scripts/train/multinode/common.sh"
cd "$REPO"
find_python_and_ray

if [[ ! -f data/tulu3_rlvr/train.parquet ]]; then
  say "preparing data/tulu3_rlvr from the Hub (once)"
  "$python" -m scripts.data_preprocess.tulu3_rlvr --output_dir data/tulu3_rlvr
fi
for dataset in gsm8k math; do
  if [[ ! -f "data/$dataset/test.parquet" ]]; then
    say "preparing data/$dataset from the Hub (once; its test split is the eval set)"
    "$python" -m "scripts.data_preprocess.$dataset" --output_dir "data/$dataset"
  fi
done

export CONFIG=configs/train_configs/ppo_tulu3_8b.yaml NUM_NODES="${NUM_NODES:-2}"
exec bash scripts/train/multinode/ppo_2nodes.sh "$@"
