#!/usr/bin/env bash
# The debug PPO run of ppo.sh with 2 learner ranks as Ray actors on DeepSpeed ZeRO-2, on a local Ray instance.
# Installs the environment first if needed. Extra arguments go to the trainer and win over the config:
#
#   bash scripts/train/debug/ppo_ray.sh
#   bash scripts/train/debug/ppo_ray.sh --deepspeed_stage 3 --total_episodes 64
#
# Ray listens on every network interface, even when told to use 127.0.0.1 (docs/cluster.md). On a CPU machine
# (these development machines) the run therefore goes into a network namespace that has only loopback.
# The micro-batch is 4 (the config's 8 halved): each minibatch of 8 responses is split over the 2 ranks.
# It is ppo.sh (same config choice, install check and environment) with the learner flags below.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$REPO"
bash scripts/install.sh ${OPEN_INSTRUCT_CURRENT_ENV:+--current-env}  # here, where the package registries are reachable
export RAY_USAGE_STATS_ENABLED=0
ray_flags=(--num_learners_per_node 2 --deepspeed_stage 2 --per_device_train_batch_size 4
           --exp_name ppo_arithmetic_debug_ray --output_dir output/ppo_arithmetic_debug_ray)
echo "[ppo_ray.sh] ${ray_flags[*]} $*"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  exec bash scripts/train/debug/ppo.sh "${ray_flags[@]}" "$@"
fi
if ! unshare -n true 2>/dev/null; then
  echo "[ppo_ray.sh] cannot create a loopback-only network namespace (needs root); Ray would listen on every interface" >&2
  exit 1
fi
exec unshare -n bash -c 'ip link set lo up && exec bash "$@"' _ scripts/train/debug/ppo.sh "${ray_flags[@]}" "$@"
