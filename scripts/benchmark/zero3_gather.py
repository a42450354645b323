"""Time `weights_for_engine` of 2 learner ranks at ZeRO-3: one parameter at a time vs the whole model at once.

    unshare -n bash -c 'ip link set lo up; RAY_USAGE_STATS_ENABLED=0 python scripts/benchmark/zero3_gather.py'

Runs on the embedded default (SmolLM2-135M) unless --model_name_or_path says otherwise; other trainer flags
pass through. Ray listens on every interface: run it in a loopback-only network namespace as above.
"""

import sys
import time

from open_instruct.data.embedded import resolve_model_path
from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
from open_instruct.learner.ray_group import LearnerGroup
from open_instruct.run.args import compute_batch_sizes, parse_args


def main(argv: list[str]) -> None:
    for gather_whole_model in (False, True):
        args = parse_args(
            ["--num_learners_per_node", "2", "--deepspeed_stage", "3", "--per_device_train_batch_size", "4",
             "--gather_whole_model", str(gather_whole_model), *argv]
        )  # fmt: skip
        policy_path = resolve_model_path(args.model.model_name_or_path)
        tokenizer = load_tokenizer(policy_path)
        start = time.time()
        group = LearnerGroup(args, compute_batch_sizes(args), policy_path, stop_token_ids_for(tokenizer, "eos"))
        print(f"[gather] 2 ranks at ZeRO-3 ready in {time.time() - start:.1f}s")
        try:
            seconds = []
            for _ in range(3):
                start = time.time()
                weights = group.weights_for_engine()
                seconds.append(time.time() - start)
            numel = sum(tensor.numel() for _, tensor in weights)
            print(
                f"[gather] gather_whole_model={gather_whole_model}: {numel / 1e6:.1f}M parameters to the driver in "
                f"{', '.join(f'{s:.2f}' for s in seconds)} s"
            )
        finally:
            group.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
