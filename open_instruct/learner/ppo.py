"""The PPO learner: turns a rollout into training tensors (`make_experience`) and runs the update (`train`).

It holds the trainable policy, PPO's critic (critic.py: the value model and its optimizer), the frozen reference
policy, and the reward model when one is used. All the math it calls lives in `rl` (pure and tested); this module
only arranges tensors and models around it. It inherits its checkpoint side (learner_state.py) and its count of a
step's work (step_work.py). GRPO's learner (grpo.py) is this one without the critic, with its own `compute_advantages`.
"""

import logging
import time
from functools import partial

import torch
from peft import PeftModel

from open_instruct import rl
from open_instruct.data.batches import PromptBatch
from open_instruct.data.tokenizer import check_same_vocab, load_tokenizer
from open_instruct.generation.vllm_engine import Completion, engine_dtype
from open_instruct.learner import lora, models, saving
from open_instruct.learner.critic import Critic
from open_instruct.learner.experience import (
    Experience,
    MicroBatch,
    RolloutTensors,
    agreement_metrics,
    check_engine_matches_learner,
    engine_dtype_mismatch,
    layout_rollout,
    micro_batches,
    needs_learner_logprobs,
    old_logprobs,
    timed,
)
from open_instruct.learner.learner_state import LearnerState
from open_instruct.learner.lora import LoraSettings
from open_instruct.learner.models import ModelSpec
from open_instruct.learner.saving import SavedModel
from open_instruct.learner.seams import LearnerBackend
from open_instruct.learner.single_process import OptimizerSettings, SingleProcess
from open_instruct.learner.step_work import StepWork
from open_instruct.rewards.manager import Scorer
from open_instruct.rl.packing import pack_rows, plan_micro_batches
from open_instruct.run import checkpoint, devices
from open_instruct.run.args import Args, BatchSizes, old_logprobs_source
from open_instruct.run.flops import LearnerWork

log = logging.getLogger(__name__)


class PPOLearner(LearnerState, StepWork):
    """The learner of one process, or one rank of a DeepSpeed group (`backend`: seams.LearnerBackend).

    Subclasses change the algorithm through `uses_value_model` and `compute_advantages` (GRPO: grpo.py).

    Every rank holds the whole rollout, runs the forward passes of `make_experience` on its share of the
    rows and gathers them, so advantages, their whitening and every metric are computed over the global
    batch, identically on each rank. `train` draws the same minibatch order on every rank and gives each
    rank a share of each minibatch: every micro-batch's loss is its sum over the whole minibatch's real tokens
    (or responses), so the parts add up over micro-batches and ranks to the minibatch's mean, and the update is
    the single-process one whatever the micro-batch size, packing or rank count.
    """

    uses_value_model = True  # a critic, trained beside the policy, that GAE takes its baseline from

    def __init__(
        self, args: Args, sizes: BatchSizes, tokenizer, policy_path: str, stop_token_ids: list[int],
        backend: LearnerBackend | None = None,
        compute_dtype: tuple[torch.dtype, str] | None = None,
    ):  # fmt: skip
        """`compute_dtype`: (dtype, why) as `devices.learner_compute_dtype` chose it before the engine started loading
        (its probe times matmuls: best on quiet cores); None: this learner chooses now."""
        self.args, self.sizes, self.tokenizer = args, sizes, tokenizer
        self.stop_token_ids = stop_token_ids
        self.backend: LearnerBackend = backend or SingleProcess()
        self.device = self.backend.device
        self.choose_compute_dtype(compute_dtype)
        self.policy_path = policy_path
        model_args = args.model
        # The backend loads each model (under ZeRO-3 every rank only ever holds its share of it); each is wrapped so
        # that one forward gives per-token outputs (models.TokenLogprobs, models.TokenScores).
        chunk_size, load = args.ppo.logprob_chunk_size, self.backend.load_model
        # --lora_rank: adapters on the policy and the value model, their base frozen (lora.py); peft keeps each wrapper.
        self.lora = LoraSettings.of(model_args)
        self.adapters: dict[str, PeftModel] = {}
        policy = load(ModelSpec("policy", policy_path, model_args.model_revision))
        if self.lora is not None:
            self.adapters["policy"] = lora.add_adapters(policy, self.lora, args.run.seed)
        self.policy = models.TokenLogprobs(policy, chunk_size)
        # --beta 0 puts no KL in the reward or the loss: no reference model is loaded, and none runs. With LoRA the
        # reference is the policy with its adapters disabled (below, once the backend has built the policy's trainer):
        # the base model, not loaded a second time.
        self.ref_policy = None
        if args.ppo.beta != 0 and self.lora is None:
            reference = ModelSpec("reference policy", policy_path, model_args.model_revision, trainable=False)
            self.ref_policy = models.TokenLogprobs(load(reference), chunk_size)
        self.reward_model = self.load_reward_model()
        self.critic = Critic(args, tokenizer, policy_path, self.backend, self.lora) if self.uses_value_model else None
        self.initial_weight_norm = models.weight_norm(self.policy, self.backend)  # the divergence guard's yardstick
        if model_args.gradient_checkpointing:
            models.enable_gradient_checkpointing(self.policy.hf_model)
        self.policy.train()
        self.policy_trainer = self.backend.trainable(self.policy, self.optimizer_settings(args.ppo.learning_rate))
        # From here on forward passes go through what the backend built (a DeepSpeed engine, or the module itself).
        self.policy = self.policy_trainer.model
        if self.critic is not None:
            value_lr = args.ppo.value_learning_rate or args.ppo.learning_rate
            self.critic.make_trainable(self.backend, self.optimizer_settings(value_lr))
        if self.ref_policy is not None:
            self.ref_policy = self.backend.frozen(self.ref_policy)
        elif args.ppo.beta != 0:  # LoRA: through the policy's engine (under ZeRO-3 it gathers the base's shards)
            self.ref_policy = lora.AdaptersDisabled(self.policy)
        if self.reward_model is not None:
            self.reward_model = self.backend.frozen(self.reward_model)
        self.shuffle_generator = torch.Generator().manual_seed(args.run.seed)
        self.model_flops = self.flops_of_models()
        self.work = LearnerWork()  # the step's work so far: make_experience starts it, train adds to it and logs it
        if self.backend.rank == 0:
            peak, source = devices.peak_flops_per_second(self.device, self.compute_dtype)
            log.info(f"[learner] peak {peak / 1e12:.3g} TFLOP/s a device ({source}): the FLOPs utilization's yardstick")

    def choose_compute_dtype(self, compute_dtype: tuple[torch.dtype, str] | None) -> None:
        """The dtype this learner computes in (`compute_dtype`, else chosen now), the same on every rank, said once."""
        args = self.args
        if compute_dtype is None:
            compute_dtype = devices.learner_compute_dtype(args.model.learner_compute_dtype, self.device)
        self.compute_dtype, why = compute_dtype
        # Each rank probed its own CPU; they must compute alike (one process: the sum is its own choice).
        self.compute_dtype, why = devices.compute_dtype_of_all_ranks(self.compute_dtype, why, self.backend.all_sum)
        self.compute_dtype_reason = why  # said by the driver (a Ray rank's own output goes to the Ray logs)
        self.dtype_warning = engine_dtype_mismatch(args, self.compute_dtype, self.device)
        if self.backend.rank == 0:
            log.info(f"[learner] {self.device.type}: computing in {why}")
            if args.ppo.old_logprobs_from == "auto":
                log.info(f"[learner] old logprobs (--old_logprobs_from auto): {self.old_logprobs_choice[2]}")
            if self.dtype_warning:
                log.warning(self.dtype_warning)

    def load_reward_model(self) -> models.TokenScores | None:
        """The frozen reward model, with --reward_model_multiplier non-zero (its tokenizer must be the policy's)."""
        model_args = self.args.model
        if self.args.reward.reward_model_multiplier == 0:
            return None
        if model_args.reward_model_path is None:
            raise ValueError("--reward_model_multiplier is non-zero but no --reward_model_path was given.")
        check_same_vocab(self.tokenizer, load_tokenizer(model_args.reward_model_path), self.policy_path,
                         model_args.reward_model_path)  # fmt: skip
        reward = ModelSpec("reward model", model_args.reward_model_path, model_args.reward_model_revision,
                           trainable=False, scalar_head=True, pad_token_id=self.tokenizer.pad_token_id)  # fmt: skip
        return models.TokenScores(self.backend.load_model(reward))

    @property
    def value_model(self):  # None: no critic (GRPO)
        return None if self.critic is None else self.critic.model

    @property
    def value_trainer(self):
        return None if self.critic is None else self.critic.trainer

    def optimizer_settings(self, learning_rate: float) -> OptimizerSettings:
        ppo = self.args.ppo
        optimizer_steps = self.sizes.num_training_steps * ppo.num_epochs * ppo.num_mini_batches
        return OptimizerSettings(
            learning_rate=learning_rate,
            weight_decay=ppo.weight_decay,
            lr_scheduler_type=ppo.lr_scheduler_type,
            warmup_steps=int(ppo.warmup_ratio * optimizer_steps),
            optimizer_steps=optimizer_steps,
            max_grad_norm=ppo.max_grad_norm,
            gradient_accumulation_steps=self.sizes.gradient_accumulation_steps,
            micro_batch_size=ppo.per_device_train_batch_size,
        )

    def weights_for_engine(self, slot: int | None = None) -> list[tuple[str, torch.Tensor]] | None:
        """The policy's weights, copied in the engine's dtype (on rank 0; None on the other ranks), into reusable
        buffer `slot` where the backend keeps one (see learner_backend)."""
        dtype = getattr(torch, engine_dtype(self.args.gen.vllm_dtype))
        if self.args.model.lora_weight_sync == "adapter":  # the engine serves the adapters (validation: --lora_rank)
            return lora.adapter_weights(self.backend.hf_model(self.policy), dtype)
        return self.backend.named_weights(self.policy, dtype, slot)  # with LoRA: merged afresh, out of place

    @property
    def lr(self) -> float:
        return self.policy_trainer.lr

    def make_experience(
        self, prompts: PromptBatch, completions: list[Completion], reward_manager: Scorer
    ) -> tuple[Experience, dict[str, float], dict]:
        """Score a rollout and compute logprobs, values, KL-shaped rewards and advantages. Three parts: the rollout as
        tensors (`layout_rollout`), the forward passes that give logprobs and scores (`forward_logprobs`, `score`),
        and the rewards and advantages (`rewards_and_advantages`). Returns the experience for `train`, the step's
        metrics, and per-response scores and lengths (for the samples log)."""
        work_start = time.perf_counter()
        rollout = layout_rollout(prompts, completions, self.tokenizer.pad_token_id, self.stop_token_ids, self.device)
        timings: dict[str, float] = {}
        learner_logprob, ref_logprob = self.forward_logprobs(rollout, timings)
        logprob, source_metrics = old_logprobs(rollout, learner_logprob, self.old_logprobs_from)
        score, reward_metrics = self.score(rollout, prompts, completions, reward_manager, timings)
        experience, metrics = self.rewards_and_advantages(rollout, logprob, ref_logprob, score, completions, timings)
        tis_metrics = {}
        if self.tis_cap > 0:
            experience.tis_weight, tis_metrics = self.tis_weights(rollout, learner_logprob)
        # Without the learner's old forward, `train` measures the engine-vs-learner agreement on its first minibatch.
        if learner_logprob is None:
            experience.engine_logprob_to_check = rollout.engine_logprob
        else:
            metrics.update(agreement_metrics(learner_logprob, rollout.engine_logprob, rollout.response_mask))
        metrics.update({**source_metrics, **tis_metrics, **reward_metrics, **timings})
        # Lengths in the model's tokens (with --tools the response_length also counts the tools' outputs)
        samples = {"score": score.tolist(), "response_length": rollout.response_mask.sum(1).tolist()}
        self.work = self.experience_work(rollout, learner_logprob is not None)  # perf/*: see run/flops.py
        self.work.seconds = time.perf_counter() - work_start
        return experience, metrics, samples

    # ---- the parts of make_experience ----
    @property
    def old_logprobs_choice(self) -> tuple[str, float, str]:
        """(--old_logprobs_from resolved, the truncated-importance cap (0: off), why), for the dtype the learner computes
        in now (a resumed run takes its checkpoint's)."""
        learner, engine = devices.dtype_name(self.compute_dtype), engine_dtype(self.args.gen.vllm_dtype)
        return old_logprobs_source(self.args, learner, engine, self.device.type)

    @property
    def old_logprobs_from(self) -> str:
        return self.old_logprobs_choice[0]

    @property
    def tis_cap(self) -> float:
        """The truncated importance weight's cap, the off-policy correction (0: off)."""
        return self.old_logprobs_choice[1]

    def forward_logprobs(self, rollout: RolloutTensors, timings: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The learner's logprobs of the sampled tokens (only when `needs_learner_logprobs`) and the reference's (only
        with --beta non-zero), [batch, response_len] each or None; their seconds go to `timings`."""
        temperature = self.args.gen.temperature

        def logprob_of(model):
            return lambda qr, am: models.response_logprobs(model, qr, am, rollout.context_length, temperature)[0]

        def packed_logprob_of(model):
            return lambda packed: models.packed_response_logprobs(model, packed, temperature)[0]

        learner_logprob = ref_logprob = None
        if needs_learner_logprobs(rollout, self.old_logprobs_from, self.tis_cap):
            with timed(timings, "time/old_logprob_forward"):
                learner_logprob = self.forward_on_all_rows(
                    logprob_of(self.policy), rollout.query_response, rollout.attention_mask,
                    packed_fn=packed_logprob_of(self.policy), context_length=rollout.context_length,
                )  # fmt: skip
        if self.ref_policy is not None:
            with timed(timings, "time/ref_logprob_forward"):
                ref_logprob = self.forward_on_all_rows(
                    logprob_of(self.ref_policy), rollout.query_response, rollout.attention_mask,
                    packed_fn=packed_logprob_of(self.ref_policy), context_length=rollout.context_length,
                )  # fmt: skip
        return learner_logprob, ref_logprob

    def score(
        self, rollout: RolloutTensors, prompts: PromptBatch, completions: list[Completion],
        reward_manager: Scorer, timings: dict,
    ) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
        """Each response's score [batch] (on the learner's device): verifiers, the reward model's score (a forward
        pass, only with --reward_model_multiplier non-zero), the format reward and the non-stop penalty."""
        rm_score = None
        if self.reward_model is not None:
            with timed(timings, "time/reward_model_forward"):
                rm_score = self.forward_on_all_rows(
                    lambda qr, am, length: models.reward_model_scores(
                        self.reward_model, qr, am, rollout.context_length, length
                    ),
                    rollout.query_response, rollout.attention_mask, rollout.response_length,
                    packed_fn=lambda packed: models.packed_reward_model_scores(self.reward_model, packed),
                    context_length=rollout.context_length,
                ).cpu()  # fmt: skip
        score, reward_metrics = reward_manager.score(
            [c.text for c in completions],
            [prompts.ground_truths[c.prompt_index] for c in completions],
            [prompts.verifier_names[c.prompt_index] for c in completions],
            rollout.stopped,
            rm_score,
            rollout.response_length.tolist(),
        )
        score = score.to(self.device)
        if not torch.isfinite(score).all():
            raise checkpoint.NonFiniteError(f"a reward score is NaN or inf ({score.tolist()}); check the reward model")
        return score, reward_metrics

    def rewards_and_advantages(
        self, rollout: RolloutTensors, logprob: torch.Tensor, ref_logprob: torch.Tensor | None, score: torch.Tensor,
        completions: list[Completion], timings: dict,
    ) -> tuple[Experience, dict[str, float]]:  # fmt: skip
        """The KL to the reference, the per-token rewards (score on the last token, -beta * KL on each), the
        advantages (`compute_advantages`, whitened over the batch when asked), and the step's objective metrics."""
        ppo, response_mask = self.args.ppo, rollout.response_mask
        if ref_logprob is not None:
            kl = rl.compute_kl(logprob, ref_logprob, ppo.kl_estimator)
        else:  # --beta 0: no reference to measure a KL against, and none is used
            kl = torch.zeros_like(logprob)
        reward_beta = 0.0 if ppo.kl_in_loss else ppo.beta  # with --kl_in_loss the KL is a loss term instead
        # An environment's per-turn rewards (in `score`, summed) go on the tokens that earned them, so that GAE sees
        # when each was earned; the rest of the score stays on the last token. (GRPO reads the summed score alone.)
        turn_reward = None
        if any(c.turn_rewards for c in completions):
            turn_reward = rl.turn_rewards_at_tokens([c.turn_rewards for c in completions], response_mask)
        final_score = score if turn_reward is None else score - turn_reward.sum(1).to(score.dtype)
        reward, non_score_reward = rl.per_token_rewards(final_score, kl, response_mask, reward_beta, turn_reward)
        experience = Experience(rollout.query_response, rollout.attention_mask, rollout.context_length, response_mask,
                                logprob, ref_logprob)  # fmt: skip
        advantage_metrics = self.compute_advantages(experience, score, reward, completions, timings)
        if ppo.whiten_advantages:
            experience.advantage = rl.masked_whiten(experience.advantage, response_mask)
        if not torch.isfinite(torch.where(response_mask, experience.advantage, 0.0)).all():
            raise checkpoint.NonFiniteError("an advantage is NaN or inf (from the logprobs, values or KL of this batch)")
        masked_kl = torch.where(response_mask, kl, torch.zeros_like(kl))
        metrics = {
            # Absent with --beta 0: no reference model; policy/approxkl_avg still shows how far each update moves.
            **({"objective/kl": masked_kl.sum(1).mean().item()} if ref_logprob is not None else {}),
            "objective/entropy": (-torch.where(response_mask, logprob, torch.zeros_like(logprob))).sum(1).mean().item(),
            "objective/non_score_reward": non_score_reward.sum(1).mean().item(),
            "objective/rlhf_reward": (non_score_reward.sum(1) + score).mean().item(),
            "objective/scores": score.mean().item(),
            "val/sequence_lengths": response_mask.sum(1).float().mean().item(),  # the model's tokens, not the tools'
            "val/num_stop_token_ids": float(sum(rollout.stopped)),
            "val/advantage_mean": rl.masked_mean(experience.advantage, response_mask).item(),
            **advantage_metrics,
        }
        return experience, metrics

    def tis_weights(self, rollout: RolloutTensors, learner_logprob: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Truncated importance sampling: each token's policy-gradient weight min(pi_learner / pi_engine, cap)."""
        cap, mask = self.tis_cap, rollout.response_mask
        weight = rl.truncated_importance_weight(learner_logprob, rollout.engine_logprob, mask, cap)
        return weight, {
            "policy/tis_weight_mean": rl.masked_mean(weight, mask).item(),
            "policy/tis_capped_frac": rl.masked_mean((weight >= cap).float(), mask).item(),
        }

    def forward_on_all_rows(self, fn, *tensors: torch.Tensor, packed_fn=None, context_length: int = 0) -> torch.Tensor:
        """`fn` (no grad, in micro-batches) on this rank's rows, gathered: every rank gets the whole batch's outputs.
        With --max_tokens_per_micro_batch, `packed_fn` instead, on packed rows (tensors[0] and tensors[1] are the
        query_response and the attention mask) of this rank's share by tokens; 0 on padding."""
        if self.args.ppo.max_tokens_per_micro_batch:
            return self.packed_forward_on_all_rows(packed_fn, tensors[0], tensors[1], context_length)
        rows = self.backend.local_rows(tensors[0].shape[0])
        chunk = self.args.ppo.per_device_train_batch_size
        local = models.no_grad_in_chunks(
            fn, chunk, *(t[rows] for t in tensors), device=self.device, dtype=self.compute_dtype
        )
        return self.backend.gather_rows(local)

    def packed_forward_on_all_rows(
        self, packed_fn, query_response: torch.Tensor, attention_mask: torch.Tensor, context_length: int
    ) -> torch.Tensor:
        """`forward_on_all_rows` in packed micro-batches: this rank's groups of the whole batch's plan (rl/packing.py,
        the same on every rank), their outputs put in their rows of a zero tensor and summed over ranks."""
        budget, world_size = self.args.ppo.max_tokens_per_micro_batch, self.backend.world_size
        plan = plan_micro_batches(attention_mask.sum(dim=1).tolist(), budget, world_size)[self.backend.rank]
        outputs = None
        with torch.no_grad(), devices.autocast(self.device, self.compute_dtype, training=False):
            for group in plan:
                rows = torch.tensor(group, device=query_response.device)
                result = packed_fn(pack_rows(query_response[rows], attention_mask[rows], context_length)).float()
                if outputs is None:
                    outputs = result.new_zeros((query_response.shape[0], *result.shape[1:]))
                outputs[rows] = result
        return self.backend.all_sum(outputs)

    def compute_advantages(
        self, exp: Experience, score: torch.Tensor, reward: torch.Tensor, completions: list[Completion], timings: dict
    ) -> dict[str, float]:
        """PPO: the value model's values of the rollout, then GAE over the per-token rewards `reward` (the score on
        the last real token, and -beta * KL on every token unless --kl_in_loss). Sets exp.value, exp.advantage and
        exp.return_; returns metrics. `score` [batch] and `completions` are what other algorithms use instead."""
        ppo = self.args.ppo
        with timed(timings, "time/value_forward"):
            exp.value = self.critic.rollout_values(exp, self.forward_on_all_rows)
        if ppo.whiten_rewards:
            reward = rl.masked_whiten(reward, exp.response_mask, shift_mean=False)
        exp.advantage, exp.return_ = rl.compute_gae(reward, exp.value, exp.response_mask, ppo.gamma, ppo.lam)
        return {"val/value_mean": rl.masked_mean(exp.value, exp.response_mask).item()}

    def train(self, experience: Experience) -> dict[str, float]:
        """`num_epochs` PPO epochs over shuffled minibatches; one optimizer step per minibatch. Micro-batches are
        --per_device_train_batch_size padded rows, or packed by --max_tokens_per_micro_batch (experience.micro_batches):
        each one's losses are its part of the minibatch's mean, so the update and the metrics are those of the whole
        minibatch in one pass, however it is split (into micro-batches, packed or not, and over ranks)."""
        ppo = self.args.ppo
        stats: dict[str, list[float]] = {}  # key: [sum of values, sum of weights]
        work_start = time.perf_counter()
        skipped_updates = 0
        agreement: dict[str, float] = {}
        work = {"perf/real_tokens": 0, "perf/token_slots": 0}

        def record(weight: float, **values: torch.Tensor) -> None:
            for key, value in values.items():
                total = stats.setdefault(key, [0.0, 0.0])
                total[0] += value.item()
                total[1] += weight

        for epoch in range(ppo.num_epochs):
            # The same order on every rank (same seed); each rank trains on its share of each minibatch.
            order = torch.randperm(experience.query_response.shape[0], generator=self.shuffle_generator)
            # --num_mini_batches parts: an agent's batch may hold more or fewer samples than --rollout_batch_size.
            for index, minibatch in enumerate(order.tensor_split(ppo.num_mini_batches)):
                if len(minibatch) == 0:
                    continue
                # Before the first update the policy is still the one the batch was made with: its logprobs here are
                # the learner's old ones, which make_experience did not compute with --old_logprobs_from vllm.
                check_agreement = epoch == 0 and index == 0 and experience.engine_logprob_to_check is not None
                applied, checked = self.train_minibatch(experience, minibatch, check_agreement, record, work)
                agreement.update(checked)
                skipped_updates += not applied

        # Means over every micro-batch of every rank: [key, (sum, weight)] summed over ranks (a micro-batch's value is
        # its part of its minibatch's mean, its weight its share of the minibatch: a minibatch's weights sum to 1).
        totals = self.backend.all_sum(torch.tensor(list(stats.values()), dtype=torch.float64))
        work_totals = self.backend.all_sum(torch.tensor(list(work.values()), dtype=torch.float64))
        global_mean = {key: (total / count).item() for key, (total, count) in zip(stats, totals)}

        def mean(key: str) -> float:
            return global_mean[key]

        value_metrics = self.critic.metrics(mean) if self.critic is not None else {}
        norm = models.weight_norm(self.policy, self.backend)  # for the trainer's divergence guard (run/divergence.py)
        value_metrics["policy/weight_norm_vs_start"] = norm / self.initial_weight_norm
        # perf/*: see run/flops.py; the slots the micro-batches (padded or packed) computed on, per epoch
        self.add_training_work(experience, int(work_totals[1]) // ppo.num_epochs)
        self.work.seconds += time.perf_counter() - work_start
        return {
            "train/skipped_updates": float(skipped_updates),
            "loss/policy_avg": mean("pg_loss"),
            "objective/loss": mean("loss"),
            "policy/approxkl_avg": mean("approxkl"),
            "policy/clipfrac_avg": mean("pg_clipfrac"),
            "policy/entropy_avg": mean("entropy"),
            "val/ratio": mean("ratio"),
            **value_metrics,
            **agreement,
            # The tokens one model's passes computed on in this step, every epoch and rank (the value model runs the
            # same micro-batches): real ones, and every slot, real or padding.
            **{key: float(total) for key, total in zip(work, work_totals)},
            **self.perf_metrics(),
        }

    def train_minibatch(
        self, exp: Experience, minibatch: torch.Tensor, check_agreement: bool, record, work: dict[str, int]
    ) -> tuple[bool, dict[str, float]]:
        """One minibatch (`minibatch`: its rows of `exp`): this rank's micro-batches of it, then one optimizer step of
        each trained model. Returns whether the step was applied, and with `check_agreement` the engine-vs-learner
        agreement of its logprobs (checked before the update)."""
        ppo = self.args.ppo
        finite_losses = True
        agreement: dict[str, float] = {}
        first_logprobs = torch.zeros(len(minibatch), exp.response_mask.shape[1], device=self.device)
        plan = micro_batches(
            exp, minibatch, ppo.per_device_train_batch_size, ppo.max_tokens_per_micro_batch,
            self.backend.rank, self.backend.world_size,
        )  # fmt: skip
        for number, micro in enumerate(plan):
            finite, new_logprob = self.train_micro_batch(exp, micro, number == len(plan) - 1, record)
            finite_losses &= finite
            if check_agreement:
                first_logprobs[micro.positions] = new_logprob
            work["perf/real_tokens"] += micro.real_tokens
            work["perf/token_slots"] += micro.token_slots
        if check_agreement:  # summed over ranks: each rank filled its rows of the minibatch
            learner_logprob = self.backend.all_sum(first_logprobs)
            agreement = agreement_metrics(
                learner_logprob, exp.engine_logprob_to_check[minibatch], exp.response_mask[minibatch]
            )
            check_engine_matches_learner(agreement, self.args.gen.max_vllm_logprob_diff)  # before the update
        # A non-finite loss or gradient norm is never applied to the weights (see AdamWTrainer.step).
        applied = [trainer.step(apply=finite_losses) for trainer in self.trainers]
        if not all(applied) and not self.args.run.skip_nonfinite_updates:
            raise checkpoint.NonFiniteError(
                f"non-finite {'loss' if not finite_losses else 'gradient'} in a PPO minibatch; the update was "
                "not applied. Lower the learning rate, or pass --skip_nonfinite_updates true to skip such updates."
            )
        return all(applied), agreement

    def train_micro_batch(
        self, exp: Experience, micro: MicroBatch, last: bool, record
    ) -> tuple[bool, torch.Tensor]:
        """One micro-batch's forward and backward passes (policy, then value model), its stats recorded with its
        weight. Returns whether its loss is finite, and its new logprobs [rows, response_len] (detached)."""
        ppo, temperature, rows = self.args.ppo, self.args.gen.temperature, micro.rows
        mask = exp.response_mask[rows]
        with devices.autocast(self.device, self.compute_dtype):
            if micro.packed is None:
                qr, am = exp.query_response[rows], exp.attention_mask[rows]
                new_logprob, entropy = models.response_logprobs(
                    self.policy, qr, am, exp.context_length, temperature, with_entropy=True
                )
            else:
                new_logprob, entropy = models.packed_response_logprobs(
                    self.policy, micro.packed, temperature, with_entropy=True
                )
        tis_weight = exp.tis_weight[rows] if exp.tis_weight is not None else None
        pg_loss, pg_clipfrac, approxkl, ratio = rl.policy_loss(
            new_logprob, exp.logprob[rows], exp.advantage[rows], mask, ppo.cliprange, tis_weight,
            ppo.loss_aggregation, micro.whole,
        )  # fmt: skip
        policy_objective = pg_loss
        if ppo.kl_in_loss and exp.ref_logprob is not None:  # --beta 0: no KL term
            policy_objective = policy_objective + ppo.beta * rl.kl_penalty_loss(
                new_logprob, exp.ref_logprob[rows], mask, "k3", ppo.loss_aggregation, micro.whole
            )
        loss = policy_objective.detach()
        self.policy_trainer.backward(policy_objective, last)
        if self.critic is not None:  # the two models share no parameter: separate backward passes give the sum's
            loss = loss + self.critic.train_micro_batch(exp, micro, last, record, self.device, self.compute_dtype)
        # Of each position's distribution, computed beside the logprobs.
        entropy = rl.masked_aggregate(entropy, mask, "token", micro.whole)
        record(micro.weight, pg_loss=pg_loss, loss=loss, pg_clipfrac=pg_clipfrac, approxkl=approxkl, ratio=ratio,
               entropy=entropy)  # fmt: skip
        return bool(torch.isfinite(loss)), new_logprob.detach()

    def initial_weights(self):
        """The run's initial policy weights by name (`.get(name)`), for the rounding report: read one tensor at a
        time from the policy's safetensors files, or (a folder without them) loaded whole on the CPU."""
        reader = saving.CheckpointReader.of(self.policy_path)
        if reader is not None:
            return reader
        initial = models.load_policy(self.policy_path, torch.device("cpu"), self.args.model.model_revision)
        return dict(initial.named_parameters())

    def shutdown(self) -> None:
        """Nothing to stop: the models go with this process (Ray learner ranks are killed here)."""

    @property
    def trainers(self) -> tuple:
        return (self.policy_trainer,) if self.critic is None else (self.policy_trainer, self.critic.trainer)

    def save(self, output_dir: str, extra_files: dict[str, dict] | None = None) -> SavedModel | None:
        """Save the policy as an HF folder in `--save_dtype` (default fp32: exactly the trained master weights), in
        safetensors shards written one at a time. Rank 0 writes and returns what it wrote; the other ranks take part
        in gathering the weights (a collective per tensor under ZeRO) and return None. Non-finite weights are never
        written; a save in lower precision reports how much of the update its rounding removed."""
        dtype = getattr(torch, self.args.run.save_dtype)
        weights, write_more = self.backend.iter_master_weights(self.policy), None  # with LoRA: the merged fp32 ones
        if self.lora is not None:  # and the adapters in peft's format inside the folder
            adapters = self.backend.trained_masters(self.policy)  # a collective under ZeRO
            write_more = partial(lora.save_adapter, self.adapters["policy"], adapters)
        if self.backend.rank != 0:
            for _ in weights:
                pass
            return None
        initial = self.initial_weights() if dtype.itemsize < 4 else None
        return saving.save_hf_folder(self.backend.hf_model(self.policy), self.tokenizer, output_dir, weights, dtype,
                                     extra_files, initial, write_more=write_more)  # fmt: skip
