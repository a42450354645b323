#!/usr/bin/env bash
# PPO on a two-node Ray cluster: learner ranks on both nodes (DeepSpeed ZeRO-3) and vLLM engines as Ray actors.
# Run it on the head node once Ray runs on both nodes (scripts/train/multinode/ray_node_setup.sh):
#
#   node A:  NODE_ROLE=head bash scripts/train/multinode/ray_node_setup.sh
#   node B:  NODE_ROLE=worker HEAD_ADDRESS=<A's IP> bash scripts/train/multinode/ray_node_setup.sh   # same token
#   node A:  HEAD_ADDRESS=<A's IP> bash scripts/train/multinode/ppo_2nodes.sh [--flag value ...]
#
# By default, for 2 nodes x 8 GPUs: the embedded debug task (configs/train_configs/ppo_arithmetic_gpu.yaml, 32
# prompts x 4 samples a step) with 4 learner ranks per node (8 GPUs, each minibatch of 64 split over them) and
# 8 vLLM engines of 1 GPU each (the other 8 GPUs).
#
# Environment:
#   CONFIG                     a YAML recipe instead (its own layout flags stand unless the variables below are set)
#   LEARNERS_PER_NODE          learner ranks per node, one number per node, e.g. "4 4" (--num_learners_per_node)
#   VLLM_NUM_ENGINES           engine actors (--vllm_num_engines)
#   VLLM_TENSOR_PARALLEL_SIZE  GPUs per engine (--vllm_tensor_parallel_size)
#   NUM_NODES                  nodes to wait for before starting (default 2; NODES_WAIT_S, default 300 s)
#   HEAD_ADDRESS, HEAD_PORT    the cluster (default: `auto`, the cluster this node belongs to)
#   RAY_AUTH_TOKEN_PATH / RAY_AUTH_TOKEN  the cluster's token, as on the nodes (default ~/.ray/auth_token)
# Extra arguments go to the trainer, after everything else (they win).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
SCRIPT_NAME=ppo_2nodes
# shellcheck source=scripts/train/multinode/common.sh
source "$REPO/scripts/train/multinode/common.sh"
cd "$REPO"

flags=()
if [[ -z "${CONFIG:-}" ]]; then
  config=configs/train_configs/ppo_arithmetic_gpu.yaml
  LEARNERS_PER_NODE="${LEARNERS_PER_NODE:-4 4}" VLLM_NUM_ENGINES="${VLLM_NUM_ENGINES:-8}"
  # the config's micro-batch of 16 does not split a minibatch of 64 over 8 ranks; engines have GPUs of their own
  flags+=(--deepspeed_stage 3 --per_device_train_batch_size 8 --vllm_gpu_memory_utilization 0.8
          --exp_name ppo_arithmetic_2nodes --output_dir output/ppo_arithmetic_2nodes)
else
  config="$CONFIG"
  [[ -f "$config" ]] || die "CONFIG=$config does not exist; give a YAML recipe from configs/train_configs/."
fi
if [[ -n "${LEARNERS_PER_NODE:-}" ]]; then
  read -r -a learners_per_node <<< "$LEARNERS_PER_NODE"
  flags+=(--num_learners_per_node "${learners_per_node[@]}")
fi
[[ -z "${VLLM_NUM_ENGINES:-}" ]] || flags+=(--vllm_num_engines "$VLLM_NUM_ENGINES")
[[ -z "${VLLM_TENSOR_PARALLEL_SIZE:-}" ]] || flags+=(--vllm_tensor_parallel_size "$VLLM_TENSOR_PARALLEL_SIZE")
address="${HEAD_ADDRESS:+$HEAD_ADDRESS:${HEAD_PORT:-6379}}"
address="${address:-auto}"

find_python_and_ray
ray_auth_env
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}" PYTHONUNBUFFERED=1
wait_for_nodes "$address" "${NUM_NODES:-2}" "${NODES_WAIT_S:-300}"

flags=(--ray_address "$address" "${flags[@]}")
say "$config ${flags[*]} $*"
exec "$python" -m open_instruct.ppo_vllm_thread_ray_gtrl "$config" "${flags[@]}" "$@"
