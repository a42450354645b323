"""run: the run's configuration and bookkeeping. Flags (args), the checks before any model loads, devices and
dtypes, the Ray cluster and its placement groups, checkpoints and resume, preemption, the output folder, free disk
space, the divergence guard, the memory plan, metrics, plots, the console and the hub.
May import: data, rl. Nothing here generates or trains; generation and learner build on it.
"""

from open_instruct.run import console  # noqa: F401, E402  (puts the "open_instruct" logger's lines on the console)
