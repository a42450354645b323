#!/usr/bin/env bash
# A real two-node Ray cluster on this one machine, then a short PPO run on it: the multi-node path
# (ray_node_setup.sh on a head and a worker node, token authentication, --ray_address, learner ranks on both
# nodes at ZeRO-3, vLLM engine actors) without a second machine. Installs the environment first if needed.
# Extra arguments go to the trainer and win over the defaults below:
#
#   bash scripts/train/debug/ppo_multinode_local.sh
#   bash scripts/train/debug/ppo_multinode_local.sh --vllm_num_engines 0 --model_name_or_path tiny
#   CONFIG=configs/train_configs/grpo_agent_cpu.yaml bash scripts/train/debug/ppo_multinode_local.sh   # another recipe
#
# The two nodes are two `ray start` processes on 127.0.0.1 (CPUS_PER_NODE logical CPUs each, default 2;
# HEAD_PORT, default 6379), with their own session folder under /tmp and a fresh auth token. Everything runs in
# a new network namespace that has only loopback (Ray listens on every interface otherwise) and a new PID
# namespace, so the final `ray stop` (always run, on any exit) can only see this cluster's processes.
# CPU only: both nodes get 0 GPUs (two `ray start` on one machine would both claim the same GPUs), and the run
# uses the embedded default's CPU config for 3 steps, no evals, micro-batch 4 (the 8 of the config, halved over
# the 2 ranks).
# Memory: with the embedded model each ZeRO-3 rank grows to 7-8 GB and the trainer process to 4-5.5 GB, about
# 20 GB in all; on a 24 GB machine Ray's memory monitor may kill a rank (the run then fails naming it). Add
# `--model_name_or_path tiny` to check the multi-node path in a few GB.
# Results: output/ppo_multinode_local/; Ray's logs: printed at the end (kept when the run fails).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
SCRIPT="$REPO/scripts/train/debug/ppo_multinode_local.sh"
SCRIPT_NAME=ppo_multinode_local
# shellcheck source=scripts/train/multinode/common.sh
source "$REPO/scripts/train/multinode/common.sh"
cd "$REPO"

if [[ -z "${OPEN_INSTRUCT_IN_LOCAL_CLUSTER_NS:-}" ]]; then
  bash scripts/install.sh ${OPEN_INSTRUCT_CURRENT_ENV:+--current-env}  # here, where the registries are reachable
  if ! unshare -n -p -f --mount-proc true 2>/dev/null; then
    echo "[$SCRIPT_NAME] error: cannot create network and PID namespaces (needs root); Ray would listen on every" \
      "interface and 'ray stop' would stop every Ray on this machine." >&2
    exit 1
  fi
  exec unshare -n -p -f --mount-proc env OPEN_INSTRUCT_IN_LOCAL_CLUSTER_NS=1 bash "$SCRIPT" "$@"
fi

# ---- inside the namespaces: only loopback, and only this script's processes
ip link set lo up
find_python_and_ray
port="${HEAD_PORT:-6379}"
cpus="${CPUS_PER_NODE:-2}"
ray_root="$(mktemp -d /tmp/oi_ray_XXXXXX)"  # short: Ray puts Unix sockets under it
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
export WANDB_MODE="${WANDB_MODE:-offline}" HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$ray_root/auth_token"  # a fresh token, made by the head below
unset RAY_AUTH_TOKEN RAY_ADDRESS
output_dir=output/ppo_multinode_local
for ((i = 1; i <= $#; i++)); do  # the trainer takes the last --output_dir: report that one
  case "${!i}" in
    --output_dir=*) output_dir="${!i#--output_dir=}" ;;
    --output_dir) j=$((i + 1)); output_dir="${!j:-$output_dir}" ;;
  esac
done
[[ "$output_dir" == /* ]] || output_dir="$REPO/$output_dir"

stop_ray() {
  local status=$?
  trap - EXIT
  say "ray stop (this namespace's Ray processes only)"
  "$ray" stop --grace-period 30 >"$ray_root/ray_stop.log" 2>&1 || say "ray stop failed: see $ray_root/ray_stop.log"
  rm -f "$RAY_AUTH_TOKEN_PATH"
  if ((status == 0)); then
    rm -rf "$ray_root"
    say "done. Outputs: $output_dir (metrics.jsonl, summary.json, model/)"
  else
    say "failed (exit $status). Outputs so far: $output_dir; Ray's logs: $ray_root/session_latest/logs"
  fi
  exit "$status"
}
trap stop_ray EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

started=$SECONDS
node_env=(HEAD_PORT="$port" NODE_IP=127.0.0.1 CPUS_PER_NODE="$cpus" GPUS_PER_NODE=0 NODE_TEMP_DIR="$ray_root" BLOCK=0)
env "${node_env[@]}" NODE_ROLE=head bash scripts/train/multinode/ray_node_setup.sh --object-store-memory 2000000000
env "${node_env[@]}" NODE_ROLE=worker HEAD_ADDRESS=127.0.0.1 \
  bash scripts/train/multinode/ray_node_setup.sh --object-store-memory 2000000000
wait_for_nodes "127.0.0.1:$port" 2 120
say "two-node Ray cluster up in $((SECONDS - started))s"

config="${CONFIG:-configs/train_configs/ppo_arithmetic_cpu.yaml}"
trainer_flags=(--ray_address "127.0.0.1:$port" --num_learners_per_node 1 1 --deepspeed_stage 3 --vllm_num_engines 2
               --per_device_train_batch_size 4 --total_episodes 96 --num_evals 0
               --exp_name ppo_multinode_local --output_dir output/ppo_multinode_local)
say "$config ${trainer_flags[*]} $*"
"$python" -m open_instruct.ppo_vllm_thread_ray_gtrl "$config" "${trainer_flags[@]}" "$@"
