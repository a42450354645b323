"""The GRPO learner: PPO's learner without a value model, with group-normalised advantages.

GRPO (Shao et al., 2024, "DeepSeekMath", section 4.1) samples several responses per prompt and uses their
mean score as the baseline that PPO's value model would otherwise learn: a response's advantage is its
score against the other responses to the same prompt (`rl.group_advantages`), on every token of the response
(outcome supervision). The KL to the reference is a k3 loss term (`--kl_in_loss`, run/flag_combinations.py), not a reward.

Everything else is PPOLearner's: the forward passes that give old and reference logprobs, the clipped policy
loss over shuffled minibatches, the weight handover to vLLM, saving, and checkpoints (which hold no value model).
"""

import torch

from open_instruct import rl
from open_instruct.generation.vllm_engine import Completion
from open_instruct.learner.experience import Experience
from open_instruct.learner.ppo import PPOLearner


class GRPOLearner(PPOLearner):
    """No value model is loaded, trained or checkpointed; `compute_advantages` normalises scores within groups."""

    uses_value_model = False

    def compute_advantages(
        self, exp: Experience, score: torch.Tensor, reward: torch.Tensor, completions: list[Completion], timings: dict
    ) -> dict[str, float]:
        """The group advantage of each response (its prompt's responses are its group), the same on each of its
        real tokens; sets exp.advantage. `reward` (per token, for GAE) is not used: with the KL in the loss it only
        holds the score."""
        group = torch.tensor([c.prompt_index for c in completions], device=score.device)
        share = run_shares(completions)
        advantage, group_std = rl.group_advantages(score, group, self.args.ppo.grpo_std_normalize,
                                                   run_share=None if share is None else share.to(score.device))  # fmt: skip
        exp.advantage = torch.where(exp.response_mask, advantage.unsqueeze(1), 0.0)  # [batch, response_len]
        return {
            # Groups whose responses all scored the same: their advantage is 0, so they teach nothing this step.
            "grpo/zero_std_groups_frac": (group_std == 0).float().mean().item(),
            "grpo/group_score_std_mean": group_std.mean().item(),
        }


def run_shares(completions: list[Completion]) -> torch.Tensor | None:
    """[batch]: each response's share of its run, 1/k for each of the k samples an agent rollout split into (they
    share its reward); None where every run is one response (dataset prompts, agents that never split)."""
    if all(c.agent is None for c in completions):
        return None
    samples_of: dict[tuple[int, int], int] = {}
    for c in completions:
        run = (c.prompt_index, c.agent["rollout"])
        samples_of[run] = samples_of.get(run, 0) + 1
    if all(count == 1 for count in samples_of.values()):
        return None
    return torch.tensor([1.0 / samples_of[(c.prompt_index, c.agent["rollout"])] for c in completions])
