"""Run the PPO trainer with a failure injected into the generation thread.

    python tests/crash_generation.py [trainer flags ...]

The second call of `vllm_utils.generate` (made by the generation thread) raises
RuntimeError("injected generation failure"); everything else, the vLLM engine included, is real.
tests/test_ppo_trainer.py checks that the run then ends non-zero, with that cause, without hanging.
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


if __name__ == "__main__":
    vllm_utils.generate = generate_then_fail  # the thread looks it up on the module at each call
    ppo_vllm_thread_ray_gtrl.main(sys.argv[1:])
