"""PPO's value side: the critic, a value model V(s) trained beside the policy, that GAE takes its baseline from.

It is loaded from --value_model_path, else the reward model, else the policy (a backbone with a scalar score head:
models.TokenScores; --value_model_num_layers keeps only the first layers), trained by its own optimizer at
--value_learning_rate on PPO's clipped value loss (`rl.value_loss`), and run once over each rollout for the values GAE
needs (`rollout_values`). The policy and the critic share no parameter, so their separate backward passes give the
gradients of the summed loss. GRPO has no critic: its baseline is the group's mean score (grpo.py).
"""

import torch
from peft import PeftModel

from open_instruct import rl
from open_instruct.learner import lora, models
from open_instruct.learner.experience import Experience, MicroBatch
from open_instruct.learner.lora import LoraSettings
from open_instruct.learner.models import ModelSpec
from open_instruct.learner.seams import LearnerBackend
from open_instruct.learner.single_process import OptimizerSettings
from open_instruct.run import devices
from open_instruct.run.args import Args


class Critic:
    """The value model (`model`: a TokenScores, or what the backend built around it once trainable) and its optimizer
    (`trainer`: None until `make_trainable`)."""

    def __init__(
        self, args: Args, tokenizer, policy_path: str, backend: LearnerBackend, lora_settings: LoraSettings | None
    ):
        """Load the value model (under ZeRO-3 every rank only ever holds its share of it). With --lora_rank it gets
        adapters of its own, its base frozen and its score head trained in full (lora.py)."""
        self.args = args
        model_args = args.model
        path = model_args.value_model_path or model_args.reward_model_path or policy_path
        spec = ModelSpec("value model", path, scalar_head=True, pad_token_id=tokenizer.pad_token_id,
                         num_layers=model_args.value_model_num_layers)  # fmt: skip
        hf_model = backend.load_model(spec)
        self.adapter: PeftModel | None = None  # peft keeps the wrapper
        if lora_settings is not None:
            self.adapter = lora.add_adapters(hf_model, lora_settings, args.run.seed + 1, True)
        self.model = models.TokenScores(hf_model)
        self.trainer = None

    def make_trainable(self, backend: LearnerBackend, settings: OptimizerSettings) -> None:
        """Build the value model's optimizer (after the policy's, as the models were loaded); from here on its forward
        passes go through what the backend built (a DeepSpeed engine, or the module itself)."""
        if self.args.model.gradient_checkpointing:
            models.enable_gradient_checkpointing(self.model.hf_model)
        self.model.train()
        self.trainer = backend.trainable(self.model, settings)
        self.model = self.trainer.model

    def rollout_values(self, exp: Experience, forward_on_all_rows) -> torch.Tensor:
        """V(s) before each response token of the whole rollout, no gradients  # [batch, response_len]
        (`forward_on_all_rows`: the learner's, each rank computing its share of the rows)."""
        return forward_on_all_rows(
            lambda qr, am: models.response_values(self.model, qr, am, exp.context_length),
            exp.query_response, exp.attention_mask,
            packed_fn=lambda packed: models.packed_response_values(self.model, packed),
            context_length=exp.context_length,
        )  # fmt: skip

    def train_micro_batch(
        self, exp: Experience, micro: MicroBatch, last: bool, record, device: torch.device, compute_dtype: torch.dtype
    ) -> torch.Tensor:
        """One micro-batch's value forward, clipped value loss and backward, its stats recorded with its weight.
        Returns its part of the total loss, --vf_coef * the value loss (detached)."""
        ppo, rows = self.args.ppo, micro.rows
        with devices.autocast(device, compute_dtype):
            if micro.packed is None:
                qr, am = exp.query_response[rows], exp.attention_mask[rows]
                new_value = models.response_values(self.model, qr, am, exp.context_length)
            else:
                new_value = models.packed_response_values(self.model, micro.packed)
        vf_loss, vf_clipfrac = rl.value_loss(
            new_value.float(), exp.value[rows], exp.return_[rows], exp.response_mask[rows], ppo.cliprange_value,
            whole=micro.whole,
        )  # fmt: skip
        self.trainer.backward(ppo.vf_coef * vf_loss, last)
        record(micro.weight, vf_loss=vf_loss, vf_clipfrac=vf_clipfrac)  # vf_loss is logged unweighted
        return ppo.vf_coef * vf_loss.detach()

    @staticmethod
    def metrics(mean) -> dict[str, float]:
        """The value side of `train`'s metrics (`mean`: a recorded stat's mean over the step)."""
        return {"loss/value_avg": mean("vf_loss"), "val/clipfrac_avg": mean("vf_clipfrac")}
