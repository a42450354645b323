"""GRPO for language models with a vLLM generation thread: the PPO trainer's loop with GRPO's learner.

    python -m open_instruct.grpo_vllm_thread_ray_gtrl                       # embedded default, offline
    python -m open_instruct.grpo_vllm_thread_ray_gtrl configs/train_configs/grpo_arithmetic_cpu.yaml

The same loop, queues, engine, data, rewards, checkpoints and Ray learner ranks as
ppo_vllm_thread_ray_gtrl.py; this entry point only makes `--algorithm grpo` the default, which picks
`learner/grpo.py`'s `GRPOLearner` (no value model; each response's advantage is its score against the other
responses to its prompt) and GRPO's defaults for a few flags (`run/args.py`'s `ALGORITHM_DEFAULTS`: the KL to the
reference as a k3 loss term, one epoch per rollout, no batch whitening, output/grpo). See docs/grpo.md.
"""

import sys

from open_instruct.run.command_line import exit_on_bad_command_line

if __name__ == "__main__":  # --help or a mistyped flag: answered before the trainer's imports (run/command_line.py)
    exit_on_bad_command_line(sys.argv[1:], "grpo")

from open_instruct import ppo_vllm_thread_ray_gtrl as trainer
from open_instruct.run import console


def main(argv: list[str] | None = None) -> dict:
    return trainer.main(argv, algorithm="grpo")


def cli(argv: list[str] | None = None) -> None:
    trainer.cli(argv, algorithm="grpo")


if __name__ == "__main__":
    console.exit_without_teardown(cli)
