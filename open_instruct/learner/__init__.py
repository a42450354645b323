"""learner: the training side. Models (load, forward, save), the experience a rollout becomes, the PPO and GRPO
learners, their backends (one process, or DeepSpeed ranks), learner ranks as Ray actors and their side of the weight
transfer to the engines.
May import: generation (the weight broadcast's sending side, completions), run, data, rl.
"""
