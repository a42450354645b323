"""Helpers the test files share (tests/README.md lists them); fixtures live in tests/conftest.py.

- trainer_runs: running the trainer as a subprocess with a timeout, a finished run's files, the small-run flags.
- learner_steps: a fixed rollout and one PPO step on it, the reference for every learner-equivalence test.
- ray_runs: the loopback-namespace guard, a trainer command on the test's Ray cluster, polling with a deadline.
- resume_runs: comparing a resumed run with an uninterrupted one, step by step and weight by weight.
- deepspeed_ranks: two DeepSpeed ranks spawned here over gloo, without Ray.
"""
