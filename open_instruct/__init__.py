"""open_instruct: thread-based asynchronous PPO (RLHF / RLVR) for language models."""

__version__ = "0.1.0"
