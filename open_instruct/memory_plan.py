"""Print the memory plan of a recipe's learner ranks, offline, before renting the cluster it is meant for.

    python -m open_instruct.memory_plan configs/train_configs/ppo_tulu3_8b.yaml
    python -m open_instruct.memory_plan configs/train_configs/ppo_tulu3_8b.yaml --per_device_train_batch_size 4
    python -m open_instruct.memory_plan configs/train_configs/ppo_arithmetic_cpu.yaml --device cpu

Takes the trainer's flags (a YAML recipe, flags that override it) plus `--device gpu|cpu` (default gpu) and
`--device_memory_gb` (default: 80 on a GPU, this machine's memory on a CPU). The models' sizes come from their
configs alone (run/model_shapes.py: a local folder, a `config.json`, a config shipped under configs/model_configs/
for a hub id, or the hub), built on the meta device: no weights are read, and the recipes' hub models need no hub.
Prints the table `run/memory_budget.py` computes (the trainer prints the same one at start) and, on GPUs with engine
actors of their own, what vLLM takes of each engine GPU. Exits with 2 and one `error: ...` line naming the biggest
item and the flag that changes it when the peak is over the device's memory.
"""

import argparse
import sys

from open_instruct.run.args import ConfigError, parse_args
from open_instruct.run.engine_memory import engine_gpu_lines
from open_instruct.run.memory_budget import plan_memory
from open_instruct.run.model_shapes import run_model_shapes
from open_instruct.run.validation import one_line

DEFAULT_GPU_GB = 80.0


def machine_memory_bytes() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    options, trainer_argv = parser.parse_known_args(argv)
    if "-h" in trainer_argv or "--help" in trainer_argv:
        print(__doc__)
        return 0
    try:
        args = parse_args(trainer_argv)
        if args.dist.device_memory_gb is not None:
            capacity, where = args.dist.device_memory_gb * 1e9, f"--device_memory_gb {args.dist.device_memory_gb:g}"
        elif options.device == "gpu":
            capacity, where = DEFAULT_GPU_GB * 1e9, f"an {DEFAULT_GPU_GB:g} GB GPU (--device_memory_gb)"
        else:
            capacity, where = machine_memory_bytes(), "this machine (MemTotal)"
        shapes = run_model_shapes(args)
        plan = plan_memory(args, shapes, options.device, capacity)
        print("\n".join(plan.lines() + engine_gpu_lines(args, shapes[0], options.device, capacity)))
        for shape in shapes:
            print(f"  {shape.role}: {shape.num_params:,} parameters, config from {shape.source}")
        plan.check(capacity, where)
    except ConfigError as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
