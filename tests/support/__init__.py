"""Helpers the test files share (tests/README.md lists them); fixtures live in tests/conftest.py.

- trainer_runs: running the trainer as a subprocess with a timeout, a finished run's files, the small-run flags.
- learner_steps: a fixed rollout and one PPO step on it, the reference for every learner-equivalence test.
- ray_runs: the loopback-namespace guard, a trainer command on the test's Ray cluster, polling with a deadline,
  killing one of a run's actors and waiting for the run to end (`kill_an_actor_and_wait_for_the_run_to_end`).
- resume_runs: comparing a resumed run with an uninterrupted one, step by step and weight by weight.
- deepspeed_ranks: two DeepSpeed ranks spawned here over gloo, without Ray.
- fake_hub: a local stand-in for the Hugging Face Hub's HTTP API (`FakeHub`, the `fake_hub` fixture).
- small_disk: a command run with a small tmpfs mounted on a folder, for full-disk tests.

Scripts a test runs by path in a fresh process (`python tests/support/NAME.py ...`; each docstring gives its usage):
- inject_fault: the PPO trainer with one fault injected (a crash, a stall, a skipped sync, a NaN, a dying actor).
- vllm_greedy: greedy completions of a saved model folder by a fresh vLLM engine.
- engine_prompt_logprobs: prompt logprobs of fixed sequences from vLLM engines, before and after a weight load.
- vllm_transfer_glue: the engine's side of vLLM's own weight-transfer engines, on a CPU.
"""
