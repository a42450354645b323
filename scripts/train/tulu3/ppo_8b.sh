#!/usr/bin/env bash
# Tulu 3 8B RLVR with PPO (configs/train_configs/ppo_tulu3_8b.yaml): Llama-3.1-Tulu-3-8B-DPO on GSM8K + MATH,
# 2 nodes x 8 GPUs (80 GB each): 8 learner ranks at ZeRO-3 on one node, 4 vLLM engines x 2 GPUs on the other.
#
#   every node:  bash scripts/install.sh
#   node A:      NODE_ROLE=head bash scripts/train/multinode/ray_node_setup.sh
#   node B:      NODE_ROLE=worker HEAD_ADDRESS=<A's IP> bash scripts/train/multinode/ray_node_setup.sh
#   node A:      HEAD_ADDRESS=<A's IP> bash scripts/train/tulu3/ppo_8b.sh [--with_tracking --push_to_hub ...]
#
# or on SLURM: TRAIN_SCRIPT=scripts/train/tulu3/ppo_8b.sh sbatch scripts/train/multinode/ppo_slurm.sbatch
#
# Needs the Hugging Face Hub (the models, and GSM8K and MATH the first time: written to data/gsm8k and data/math
# by this repo's converters). Extra arguments go to the trainer and win over the recipe.
#
# Memory, as the code stands: each learner rank loads the policy (fp32, 32 GB), the value model (fp32, 32 GB) and
# the reference (bf16, 16 GB) whole onto its GPU before DeepSpeed ZeRO-3 shards them: 80 GB, more than an 80 GB
# H100 holds. Until models load under deepspeed.zero.Init (docs/distributed.md, "Not yet"), run the learner node
# on GPUs with more memory (H200, 141 GB). Not run yet: no GPU cluster was available to this project.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
SCRIPT_NAME=ppo_8b
# shellcheck source=scripts/train/multinode/common.sh
source "$REPO/scripts/train/multinode/common.sh"
cd "$REPO"
find_python_and_ray

for dataset in gsm8k math; do
  if [[ ! -f "data/$dataset/train.parquet" || ! -f "data/$dataset/test.parquet" ]]; then
    say "preparing data/$dataset from the Hub (once)"
    "$python" -m "scripts.data_preprocess.$dataset" --output_dir "data/$dataset"
  fi
done

export CONFIG=configs/train_configs/ppo_tulu3_8b.yaml NUM_NODES="${NUM_NODES:-2}"
exec bash scripts/train/multinode/ppo_2nodes.sh "$@"
