#!/usr/bin/env bash
# Start Ray on one node of a cluster, with Ray's token authentication. Run it on every node, the head first:
#
#   NODE_ROLE=head bash scripts/train/multinode/ray_node_setup.sh                            # on the head
#   NODE_ROLE=worker HEAD_ADDRESS=10.0.0.1 bash scripts/train/multinode/ray_node_setup.sh    # on each other node
#
# then start the trainer on the head (scripts/train/multinode/ppo_2nodes.sh). The head returns once Ray is up;
# a worker stays in the foreground (`ray start --block`) until Ray stops, so run it in tmux/screen or under srun.
#
# Environment:
#   NODE_ROLE       head or worker (required)
#   HEAD_ADDRESS    the head's IP or host name as the other nodes reach it (required on workers)
#   HEAD_PORT       the head's Ray (GCS) port, default 6379
#   NODE_IP         this node's IP for Ray (default: Ray picks one; set it on machines with several networks)
#   GPUS_PER_NODE   GPUs Ray may use here (default: all it sees, CUDA_VISIBLE_DEVICES respected)
#   CPUS_PER_NODE   logical CPUs Ray may schedule here (default: all)
#   NODE_TEMP_DIR   root of Ray's session folders and logs (default /tmp/ray; short: it holds Unix sockets)
#   BLOCK           1: stay in the foreground until Ray stops; 0: return (default: 1 on workers, 0 on the head)
#   HEAD_WAIT_S     how long a worker waits for the head's port (default 300)
#   RAY_AUTH_MODE   token (default) or disabled
#   RAY_AUTH_TOKEN_PATH / RAY_AUTH_TOKEN   the shared token (file, default ~/.ray/auth_token; or the token itself).
#                   The head writes a new token file if there is none; copy it to every worker node and to
#                   where the trainer runs (a shared home directory does that by itself).
# Extra arguments go to `ray start` (e.g. --object-store-memory 20000000000, --include-dashboard=true).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
SCRIPT_NAME=ray_node_setup
# shellcheck source=scripts/train/multinode/common.sh
source "$REPO/scripts/train/multinode/common.sh"

role="${NODE_ROLE:-}"
port="${HEAD_PORT:-6379}"
[[ "$role" == head || "$role" == worker ]] ||
  die "NODE_ROLE='$role'; set NODE_ROLE=head on one node and NODE_ROLE=worker on the others."
if ! [[ "$port" =~ ^[0-9]+$ ]] || ((port < 1 || port > 65535)); then
  die "HEAD_PORT='$port' is not a port number (1-65535)."
fi
for name in GPUS_PER_NODE CPUS_PER_NODE HEAD_WAIT_S; do
  value="${!name:-0}"
  [[ "$value" =~ ^[0-9]+$ ]] || die "$name='$value' is not a whole number."
done
if [[ "$role" == worker && -z "${HEAD_ADDRESS:-}" ]]; then
  die "HEAD_ADDRESS is not set; a worker needs the head's IP or host name (the 'Local node IP' the head printed)."
fi
block="${BLOCK:-$([[ "$role" == worker ]] && echo 1 || echo 0)}"
[[ "$block" == 0 || "$block" == 1 ]] || die "BLOCK='$block' is not 0 or 1."

find_python_and_ray
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"  # Ray sends usage statistics home unless told not to
# Ray starts its workers at nice 15; the learner ranks and engines are the run's work, not background tasks: at nice 15
# any other busy process on the node takes the CPU from them (open_instruct/run/cluster.py says what was measured).
export RAY_worker_niceness="${RAY_worker_niceness:-0}"
ray_auth_env "$([[ "$role" == head ]] && echo create)"

flags=()
[[ -n "${NODE_IP:-}" ]] && flags+=(--node-ip-address "$NODE_IP")
[[ -n "${GPUS_PER_NODE:-}" ]] && flags+=(--num-gpus "$GPUS_PER_NODE")
[[ -n "${CPUS_PER_NODE:-}" ]] && flags+=(--num-cpus "$CPUS_PER_NODE")
[[ -n "${NODE_TEMP_DIR:-}" ]] && flags+=(--temp-dir "$NODE_TEMP_DIR")
[[ "$block" == 1 ]] && flags+=(--block)

if [[ "$role" == head ]]; then
  flags=(--head --port "$port" --include-dashboard=false --disable-usage-stats "${flags[@]}")
else
  # Under a scheduler the workers often start before the head is up; `ray start --address` would fail then.
  wait_s="${HEAD_WAIT_S:-300}"
  deadline=$((SECONDS + wait_s))
  # shellcheck disable=SC2016  # $0 and $1 are expanded by the inner bash
  until timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$HEAD_ADDRESS" "$port" 2>/dev/null; do
    if ((SECONDS >= deadline)); then
      echo "[$SCRIPT_NAME] error: the head $HEAD_ADDRESS:$port did not answer within ${wait_s}s; start" \
        "ray_node_setup.sh with NODE_ROLE=head there first, and check HEAD_ADDRESS and that the port is open." >&2
      exit 1
    fi
    sleep 2
  done
  flags=(--address "$HEAD_ADDRESS:$port" "${flags[@]}")
fi

say "$ray start ${flags[*]} $*"
if [[ "$block" == 1 ]]; then
  exec "$ray" start "${flags[@]}" "$@"
fi
status=0
"$ray" start "${flags[@]}" "$@" || status=$?
if ((status != 0)); then
  echo "[$SCRIPT_NAME] error: ray start failed (exit $status), see above; if an earlier Ray runs on this node," \
    "stop it with 'ray stop' first." >&2
  exit 1
fi
if [[ "$role" == head ]]; then
  say "head up on port $port. Next: on every other node, with the same token:"
  say "  NODE_ROLE=worker HEAD_ADDRESS=<this node's IP, 'Local node IP' above> HEAD_PORT=$port bash $0"
  say "then here: bash scripts/train/multinode/ppo_2nodes.sh (or the trainer with --ray_address <IP>:$port)"
fi
