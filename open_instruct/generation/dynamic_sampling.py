"""GRPO's dynamic sampling (DAPO, Yu et al. 2025, section 3.2): a group whose responses all scored the same has an
advantage of 0 on every token, so it adds nothing to the policy gradient but still costs a forward and backward pass
and dilutes the batch. With --filter_zero_std_groups such groups are dropped and more batches are drawn until a step
has --local_rollout_batch_size groups that differ; the surplus of the last draw is discarded (as DAPO and verl do:
keeping it would make it older at the next step). After --filter_max_extra_batches extra draws the step is filled
with dropped groups instead, so that its shapes (minibatches, ranks) stay what the run was sized for.

The choice needs each response's score before the learner runs: the verifiers score every draw here, and the chosen
batch's scores go to the learner (rl.PrecomputedScores) rather than being computed twice.
"""

from dataclasses import dataclass, field

import torch

from open_instruct.data.batches import PromptBatch
from open_instruct.generation.vllm_engine import Completion


@dataclass
class Group:
    """One prompt and its responses, with their scores."""

    token_ids: list[int]
    ground_truth: str | None
    verifier_name: str | None
    text: str
    completions: list[Completion]
    scores: list[float]

    @property
    def scores_differ(self) -> bool:
        return max(self.scores) != min(self.scores)


def split_groups(prompts: PromptBatch, completions: list[Completion], scores: torch.Tensor) -> list[Group]:
    """The groups of a rollout, in prompt order (completions come grouped by prompt)."""
    groups = [Group(ids, truth, name, text, [], []) for ids, truth, name, text in
              zip(prompts.token_ids, prompts.ground_truths, prompts.verifier_names, prompts.texts)]  # fmt: skip
    for completion, score in zip(completions, scores.tolist()):
        groups[completion.prompt_index].completions.append(completion)
        groups[completion.prompt_index].scores.append(score)
    return groups


def join_groups(groups: list[Group]) -> tuple[PromptBatch, list[Completion], torch.Tensor]:
    """The groups as one batch: their prompts, their completions (prompt_index into the new batch) and scores."""
    prompts = PromptBatch([g.token_ids for g in groups], [g.ground_truth for g in groups],
                          [g.verifier_name for g in groups], [g.text for g in groups])  # fmt: skip
    completions = [
        Completion(index, c.token_ids, c.text, c.finish_reason, c.logprobs, c.versions)
        for index, group in enumerate(groups)
        for c in group.completions
    ]
    return prompts, completions, torch.tensor([s for group in groups for s in group.scores], dtype=torch.float32)


@dataclass
class GroupFilter:
    """The groups drawn for one step: `add` each rollout's groups until `full`; `batch` then gives the step's batch."""

    groups_per_step: int
    max_extra_batches: int
    kept: list[Group] = field(default_factory=list)
    dropped: list[Group] = field(default_factory=list)
    draws: int = 0

    def add(self, groups: list[Group]) -> None:
        self.draws += 1
        for group in groups:
            (self.kept if group.scores_differ else self.dropped).append(group)

    @property
    def full(self) -> bool:
        """Enough groups that differ, or no extra draw left."""
        return len(self.kept) >= self.groups_per_step or self.draws > self.max_extra_batches

    def batch(self) -> tuple[list[Group], dict[str, float]]:
        """The step's groups (kept ones first, then dropped ones if the draws ran out) and the filter's metrics."""
        filled = max(0, self.groups_per_step - len(self.kept))
        chosen = self.kept[: self.groups_per_step] + self.dropped[:filled]
        metrics = {
            "filter/zero_std_groups_dropped": float(len(self.dropped)),
            "filter/extra_batches": float(self.draws - 1),
            "filter/filled_groups": float(filled),
            "filter/discarded_groups": float(max(0, len(self.kept) - self.groups_per_step)),
        }
        return chosen, metrics
