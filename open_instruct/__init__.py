"""open_instruct: thread-based asynchronous PPO (RLHF / RLVR) for language models.

The package is a stack of layers; each imports only the layers below it (tests/test_layers.py keeps it so):

    ppo_vllm_thread_ray_gtrl.py   entry points: the trainer's recipe (GRPO: grpo_vllm_thread_ray_gtrl.py),
    evaluate.py                   a saved model's eval, memory_plan.py
    learner/                      the training side: models, PPO/GRPO learners, one process or DeepSpeed ranks on Ray
    generation/                   the rollout side: vLLM engines, the generation thread, the weight broadcast
    run/                          configuration and bookkeeping: flags, checks, checkpoints, logs, hub
    data/                         what a run reads: prompt datasets, tokenizer, the embedded model and task
    rl/                           the math (advantages, losses) and the rewards (verifiers)
"""

__version__ = "0.1.0"
