"""learner: the training side. Models (load, forward, save), the experience a rollout becomes, the PPO and GRPO
learners, their backends (one process, or DeepSpeed ranks) and learner ranks as Ray actors.
May import: generation (the weight broadcast's sending side, completions), run, data, rl.
"""
