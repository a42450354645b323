"""generation: the rollout side. The vLLM engine (in this process, or engine actors on Ray), the generation thread
and its bounded queues, the weight broadcast from learner rank 0 to the engines, the learner's rollout requests, eval scoring.
May import: run, data, rl. It never imports the learner: it is given one and calls its methods.
"""
