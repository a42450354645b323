"""The learner's seam: the methods the trainer's loop calls, declared once. One process (ppo.PPOLearner, and
grpo.GRPOLearner, which only changes the advantages) and learner ranks on Ray (ray_group.LearnerGroup) offer them
alike, so the recipe in ppo_vllm_thread_ray_gtrl.py is the same for both; tests/test_seams.py compares each one's
methods with these, parameter by parameter.

How the weights reach the engines is the generation side's seam (generation/seams.py): every learner hands out a copy
(`weights_for_engine`), and Ray learner ranks also broadcast them from rank 0 (`BroadcastsWeights`), which is how
the trainer feeds the engines with Ray learners.
"""

from typing import Protocol

from open_instruct.data.batches import PromptBatch
from open_instruct.generation.seams import HandsOutWeights
from open_instruct.generation.vllm_engine import Completion
from open_instruct.learner.saving import SavedModel
from open_instruct.rl.rewards import Scorer


class Learner(HandsOutWeights, Protocol):
    """Make experience from a rollout, train on it, save the policy, checkpoint and restore itself, stop."""

    @property
    def lr(self) -> float:
        """The policy's learning rate at this step."""
        ...

    def make_experience(
        self, prompts: PromptBatch, completions: list[Completion], reward_manager: Scorer
    ) -> tuple[object, dict[str, float], dict]:
        """Score the rollout (`reward_manager`) and compute logprobs, rewards and advantages: (the experience for
        `train`, kept wherever the learner computes, the step's metrics, per-response scores and lengths)."""
        ...

    def train(self, experience: object) -> dict[str, float]:
        """The PPO epochs over `experience` (what `make_experience` returned); the step's training metrics."""
        ...

    def save(self, output_dir: str, extra_files: dict[str, dict] | None = None) -> SavedModel | None:
        """The policy as a Hugging Face folder in `output_dir`; what was written (None on ranks that do not write)."""
        ...

    def checkpoint_bytes(self) -> int:
        """About how many bytes `write_checkpoint` will write (the free-space check before it)."""
        ...

    def write_checkpoint(self, folder: str) -> int:
        """The learner's state into checkpoint `folder`; the bytes written, fsynced."""
        ...

    def read_checkpoint(self, folder: str) -> None:
        """Restore what `write_checkpoint` wrote."""
        ...

    def shutdown(self) -> None:
        """Stop now, after a failure (Ray learner ranks: kill them and free their placement; one process: nothing)."""
        ...
