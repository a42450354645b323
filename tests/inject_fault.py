"""Run the PPO trainer with one fault injected; everything else, the vLLM engine included, is real.

    python tests/inject_fault.py FAULT [trainer flags ...]

Faults:
- `generation_crash`: the second call of `vllm_utils.generate` (made by the generation thread) raises
  RuntimeError("injected generation failure").
- `skip_weight_sync`: `vllm_utils.load_weights` returns without loading anything, so the engine keeps
  generating with its start weights while the learner moves on.

tests/test_ppo_trainer.py checks that each ends the run non-zero, with its cause, without hanging.
"""

import sys

from open_instruct import ppo_vllm_thread_ray_gtrl, vllm_utils

INJECTED_MESSAGE = "injected generation failure"
FAIL_ON_CALL = 2

real_generate = vllm_utils.generate
calls = 0


def generate_then_fail(*args, **kwargs):
    global calls
    calls += 1
    if calls == FAIL_ON_CALL:
        raise RuntimeError(INJECTED_MESSAGE)
    return real_generate(*args, **kwargs)


def load_nothing(llm, named_tensors) -> float:
    return 1e-3  # a plausible sync time, so nothing but the weights themselves gives the skip away


FAULTS = {"generation_crash": ("generate", generate_then_fail), "skip_weight_sync": ("load_weights", load_nothing)}

if __name__ == "__main__":
    name, replacement = FAULTS[sys.argv[1]]
    setattr(vllm_utils, name, replacement)  # the generation thread looks it up on the module at each call
    ppo_vllm_thread_ray_gtrl.main(sys.argv[2:])
