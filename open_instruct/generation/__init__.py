"""generation: the rollout side. The vLLM engine (in this process, or engine actors on Ray), the generation thread
and its bounded queues, the engines' side of the weight transfer from learner rank 0 (gloo buckets, vLLM's NCCL and IPC engines), the learner's rollout requests, eval scoring.
May import: run, data, rl. It never imports the learner: it is given one and calls its methods.
"""
