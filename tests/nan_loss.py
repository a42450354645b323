"""Run the PPO trainer with a NaN injected into one policy loss.

    python tests/nan_loss.py [trainer flags ...]

The NAN_ON_CALL-th call of `rl_utils.policy_loss` (made by the learner) returns a NaN loss; everything else, the
vLLM engine included, is real. tests/test_resume.py checks that the run then stops (or, with
--skip_nonfinite_updates, skips that one update) and that no NaN weight reaches disk.
"""

import sys

from open_instruct import ppo_vllm_thread_ray_gtrl, rl_utils

NAN_ON_CALL = 3

real_policy_loss = rl_utils.policy_loss
calls = 0


def policy_loss_with_one_nan(*args, **kwargs):
    global calls
    calls += 1
    pg_loss, *rest = real_policy_loss(*args, **kwargs)
    if calls == NAN_ON_CALL:
        pg_loss = pg_loss * float("nan")  # still attached to the graph: backward sends NaN into every gradient
    return (pg_loss, *rest)


if __name__ == "__main__":
    rl_utils.policy_loss = policy_loss_with_one_nan  # the learner looks it up on the module at each call
    ppo_vllm_thread_ray_gtrl.cli(sys.argv[1:])
