"""The learner class of each --algorithm, for this process and for every Ray learner rank alike.

The choice sits here, above the algorithms: GRPO's learner is PPO's with another `compute_advantages`, and neither
module knows the other's users.
"""

from open_instruct.learner.grpo import GRPOLearner
from open_instruct.learner.ppo import PPOLearner

LEARNERS: dict[str, type[PPOLearner]] = {"ppo": PPOLearner, "grpo": GRPOLearner}


def learner_class(algorithm: str) -> type[PPOLearner]:
    """The learner of --algorithm (`args.ppo.algorithm`; its choices are LEARNERS' keys)."""
    return LEARNERS[algorithm]
