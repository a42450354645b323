"""Wait until a Ray cluster has a number of live nodes, then list them; the launch scripts run it before the trainer.

    python scripts/train/multinode/wait_for_nodes.py --address HEAD_IP:6379 --nodes 2 [--timeout_s 300]

It connects as the trainer does (`ray.init(address=...)`), so it also checks the token authentication: it needs
RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN) like every node.
Exit code 0: the nodes are there; 1: they did not come, or the cluster cannot be reached (one line says why).
"""

import argparse
import os
import sys
import time


def describe(node: dict) -> str:
    resources = node["Resources"]
    head = " (head)" if "node:__internal_head__" in resources else ""
    return (
        f"node {node['NodeID'][:12]} at {node['NodeManagerAddress']}{head}: {resources.get('CPU', 0):g} CPU, "
        f"{resources.get('GPU', 0):g} GPU"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="the head's IP:port, or 'auto' on a node of the cluster")
    parser.add_argument("--nodes", type=int, required=True, help="live nodes to wait for")
    parser.add_argument("--timeout_s", type=float, default=300.0, help="give up after this many seconds")
    args = parser.parse_args()

    import ray

    started = time.time()
    try:
        ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
    except Exception as error:  # ConnectionError, AuthenticationError, ...
        first_line = next(iter(str(error).strip().splitlines()), "")
        print(
            f"error: cannot connect to the Ray cluster at {args.address}: {type(error).__name__}: {first_line} "
            f"(RAY_AUTH_MODE={os.environ.get('RAY_AUTH_MODE', 'unset')}); start it with "
            f"scripts/train/multinode/ray_node_setup.sh, and give this process the cluster's token "
            f"(RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN).",
            file=sys.stderr,
        )
        return 1
    try:
        while True:
            alive = [node for node in ray.nodes() if node["Alive"]]
            if len(alive) >= args.nodes:
                break
            if time.time() - started > args.timeout_s:
                print(
                    f"error: {len(alive)} of {args.nodes} Ray nodes joined {args.address} in {args.timeout_s:.0f}s; "
                    f"run NODE_ROLE=worker HEAD_ADDRESS=... scripts/train/multinode/ray_node_setup.sh on the others "
                    f"and look at its output there.",
                    file=sys.stderr,
                )
                return 1
            time.sleep(2)
        for node in alive:
            print(f"[cluster] {describe(node)}")
        print(f"[cluster] {len(alive)} nodes up at {args.address} (waited {time.time() - started:.1f}s)")
        return 0
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
