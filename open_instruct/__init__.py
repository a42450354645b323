"""open_instruct: thread-based asynchronous PPO (RLHF / RLVR) for language models.

The package is a stack of layers; each imports only the layers below it (tests/test_layers.py keeps it so):

    ppo_vllm_thread_ray_gtrl.py   entry points: the trainer's recipe (GRPO: grpo_vllm_thread_ray_gtrl.py),
    evaluate.py                   a saved model's eval, memory_plan.py, sft_warmup.py (a supervised warm-up)
    learner/                      the training side: models, PPO/GRPO learners, one process or DeepSpeed ranks on Ray
    generation/                   the rollout side: vLLM engines, the generation thread, the weight broadcast
    run/                          configuration and bookkeeping: flags, checks, checkpoints, logs, hub
    environments/                 tools as function schemas, tool-call parsers, token-exact tool turns
    data/                         what a run reads: prompt datasets, tokenizer, the embedded model and task
    rl/                           the math (advantages, losses) and the rewards (verifiers)
    sandbox/                      isolated runs of model-written programs (code rewards, tools)
"""

from typing import Annotated, TypeVar

__version__ = "0.1.0"

_Flag = TypeVar("_Flag")
# The type of a flag that a `--resume` may set to another value: it changes nothing the run computes (where files go,
# logging, timeouts, how often to save). Every other flag must equal the checkpoint's (run/checkpoint.py), and
# docs/flags.md shows which is which. Declared beside the flag: `save_freq: MayChangeOnResume[int] = ...`.
# The argument parser sees the plain type (HfArgumentParser resolves hints without their extras).
MayChangeOnResume = Annotated[_Flag, "may change on resume"]
