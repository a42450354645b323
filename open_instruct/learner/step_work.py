"""The learner's work in a step, for the perf/* metrics: which models ran which passes over how many tokens and token
slots (run/flops.py counts their useful FLOPs and makes the metrics of them).

PPOLearner inherits these, as it inherits LearnerState's checkpoint side: `make_experience` starts a step's work with
its forward passes (`experience_work`), `train` adds its forward and backward passes (`add_training_work`) and reports
the step (`perf_metrics`).
"""

from open_instruct.learner.experience import Experience, RolloutTensors
from open_instruct.run import devices
from open_instruct.run.flops import LearnerWork, ModelFlops


class StepWork:
    """The perf/* side of PPOLearner (it provides args, backend, device, compute_dtype, the models, `model_flops` and
    `work`, the step's work so far)."""

    def flops_of_models(self) -> dict[str, ModelFlops]:
        """The FLOP-count shape of each model this learner runs, by role."""
        config_of = lambda model: self.backend.hf_model(model).config  # noqa: E731
        models_by_role = {
            "policy": (self.policy, True), "reference policy": (self.ref_policy, True),
            "reward model": (self.reward_model, False), "value model": (self.value_model, False),
        }  # fmt: skip
        return {role: ModelFlops.of_config(role, config_of(model), causal_lm)
                for role, (model, causal_lm) in models_by_role.items() if model is not None}  # fmt: skip

    def experience_work(self, rollout: RolloutTensors, ran_policy_forward: bool) -> LearnerWork:
        """make_experience's forward passes over the whole rollout (every rank counts the whole batch): the policy's
        (when its old logprobs were computed), the reference's, the reward model's and the value model's."""
        work = LearnerWork(real_tokens=int(rollout.attention_mask.sum()))
        # Packed (--max_tokens_per_micro_batch), the forwards compute on the real tokens alone.
        slots = work.real_tokens if self.args.ppo.max_tokens_per_micro_batch else None
        for role, model in self.model_flops.items():
            if role != "policy" or ran_policy_forward:
                work.add_pass(model, rollout.attention_mask, rollout.response_mask, backward=False, token_slots=slots)
        return work

    def add_training_work(self, exp: Experience, token_slots_per_epoch: int | None = None) -> None:
        """train's passes: each epoch, every row through each trained model forward and backward.
        `token_slots_per_epoch`: the slots the epoch's micro-batches computed; None: padded rows, as wide as the
        batch (a packed micro-batch plan passes its own count)."""
        trained = [self.model_flops[role] for role in ("policy", "value model") if role in self.model_flops]
        for _ in range(self.args.ppo.num_epochs):
            for model in trained:
                self.work.add_pass(model, exp.attention_mask, exp.response_mask, True, token_slots_per_epoch)

    def perf_metrics(self) -> dict[str, float]:
        """The step's perf/* metrics: useful work over the learner's seconds, against the peak of all its devices."""
        peak, _ = devices.peak_flops_per_second(self.device, self.compute_dtype)  # measured once per process
        return self.work.metrics(peak, self.backend.world_size)
