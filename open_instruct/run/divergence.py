"""The divergence guard: a run whose policy has blown up (an absurd learning rate, a broken reward) stops with its
cause instead of training on and ending `completed` with a useless model.

It reads a step's metrics after the update. Each bound is far past anything a working run reaches, so it only
fires on a run that has already gone wrong; NaN and inf losses and gradients are caught earlier, in the learner
(`checkpoint.NonFiniteError`).
"""

import math

# The policy's global L2 weight norm against the run's initial policy (`policy/weight_norm_vs_start`). Fine-tuning
# moves it by a few percent at most. Measured on the tiny model (one minibatch a step, constant lr): 4 steps at lr
# 1e-2, far above any real run's rate, 1.023x; one step at lr 1, 8.9x; at lr 5, 45x.
MAX_WEIGHT_NORM_GROWTH = 4.0
# The KL to the reference per response token (objective/kl is summed over the response's tokens). A working run
# stays well under 1 nat per token; a policy that has forgotten the reference is past 10.
MAX_KL_PER_TOKEN = 20.0
# PPO's approximate KL between the policy being updated and the one that sampled, per token (`policy/approxkl_avg`):
# PPO keeps it near 0.01-0.1 by clipping; 10 means ratios of e^4 on average.
MAX_APPROXKL = 10.0


class DivergedError(RuntimeError):
    """The policy diverged: its weights or its KL are far beyond any working run's; the message says which."""


def check_divergence(metrics: dict, step: int, learning_rate: float) -> None:
    """Raise DivergedError naming the first metric of `metrics` (one step's, after its update) out of bounds."""
    problems = []
    growth = metrics.get("policy/weight_norm_vs_start")
    if growth is not None and not math.isfinite(growth):
        problems.append("the policy's weights hold NaN or inf")
    elif growth is not None and not (1 / MAX_WEIGHT_NORM_GROWTH <= growth <= MAX_WEIGHT_NORM_GROWTH):
        bound = MAX_WEIGHT_NORM_GROWTH
        problems.append(f"the policy's weight norm is {growth:.3g}x the initial policy's (bound {bound:g}x)")
    kl, length = metrics.get("objective/kl"), metrics.get("val/sequence_lengths")
    if kl is not None and length:
        kl_per_token = kl / length  # k1's estimate can be negative; far below zero is as far off as far above
        if not math.isfinite(kl_per_token) or abs(kl_per_token) > MAX_KL_PER_TOKEN:
            bound = MAX_KL_PER_TOKEN
            problems.append(f"the KL to the reference is {kl_per_token:.3g} nats per token (bound {bound:g})")
    approxkl = metrics.get("policy/approxkl_avg")
    if approxkl is not None and (not math.isfinite(approxkl) or approxkl > MAX_APPROXKL):
        problems.append(f"PPO's approximate KL is {approxkl:.3g} per token (bound {MAX_APPROXKL:g})")
    if problems:
        raise DivergedError(
            f"the policy diverged at step {step}: {'; '.join(problems)}. Lower --learning_rate (now {learning_rate:g})"
        )
