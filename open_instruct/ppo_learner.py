"""The PPO learner: turns a rollout into training tensors (`make_experience`) and runs the update (`train`).

It holds the trainable policy and value model, the frozen reference policy, and the reward model
when one is used. All the math it calls lives in `rl_utils` (pure and tested); this module only
arranges tensors and models around it. GRPO's learner (grpo_learner.py) is this one without the value
model and with its own `compute_advantages`.
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from open_instruct import model_utils as mu
from open_instruct import rl_utils as rl
from open_instruct import weight_sync as ws
from open_instruct.checkpoint import NonFiniteError, assert_finite
from open_instruct.dataset_transformation import left_pad
from open_instruct.ground_truth_utils import RewardManager
from open_instruct.learner_backend import OptimizerSettings, SingleProcess
from open_instruct.ppo_args import Args, BatchSizes
from open_instruct.vllm_utils import Completion, engine_dtype


@dataclass
class PromptBatch:
    """The prompts of one rollout request; each is sampled `number_samples_per_prompt` times."""

    token_ids: list[list[int]]
    ground_truths: list[str | None]
    verifier_names: list[str | None]
    texts: list[str]


@dataclass
class SavedModel:
    """What `PPOLearner.save` wrote: where, in which dtype, a digest of the weights as stored, and for a save
    in lower precision than training, how much of the update the rounding removed (`rounding_report`)."""

    path: str
    dtype: str
    weights_sha256: str
    rounding: dict[str, float] | None = None


@dataclass
class Experience:
    """Everything the PPO epochs need about one rollout batch (on the learner device)."""

    query_response: torch.Tensor  # [batch, context_length + response_len], left-padded queries
    attention_mask: torch.Tensor  # [batch, context_length + response_len]
    context_length: int
    response_mask: torch.Tensor  # [batch, response_len]
    logprob: torch.Tensor  # [batch, response_len] "old" logprobs: the learner's, or the engine's (--old_logprobs_from)
    ref_logprob: torch.Tensor | None  # [batch, response_len]; None with --beta 0 (no reference model)
    # Set by `compute_advantages`: [batch, response_len] each; value and return_ stay None without a value model.
    advantage: torch.Tensor | None = None
    value: torch.Tensor | None = None  # "old" values
    return_: torch.Tensor | None = None
    # [batch, response_len] per-token weight of the policy-gradient term (truncated importance sampling), or None.
    tis_weight: torch.Tensor | None = None
    # [batch, response_len] the engine's logprobs (NaN where it gave none), kept when make_experience ran no learner
    # forward to compare them with: `train` then compares them with the first minibatch's logprobs. Else None.
    engine_logprob_to_check: torch.Tensor | None = None


def engine_logprobs(completions: list[Completion], width: int) -> torch.Tensor:
    """The engine's logprob of each sampled token, [batch, width]; NaN where it gave none (a stop token added back
    after generation, logprobs not asked for) and on padding."""
    engine_logprob = torch.full((len(completions), width), torch.nan)
    for row, completion in enumerate(completions):
        if completion.logprobs is not None:
            logprobs = completion.logprobs[:width]
            engine_logprob[row, : len(logprobs)] = torch.tensor([torch.nan if lp is None else lp for lp in logprobs])
    return engine_logprob


@contextmanager
def timed(timings: dict[str, float], key: str):
    """Seconds the block took, in timings[key]; on a GPU, until its kernels finished (they run asynchronously)."""
    start = time.time()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    timings[key] = time.time() - start


def check_engine_matches_learner(metrics: dict, max_diff: float, step: int | None = None) -> None:
    """Stop before training on a rollout that the engine did not sample from the learner's weights.

    The agreement is measured in `make_experience` when it runs the learner's old-logprob forward, else (with
    --old_logprobs_from vllm) on the first minibatch in `train`, which checks it itself before its first update;
    a call without the metric does nothing.
    """
    if "debug/vllm_vs_learner_logprob_diff_mean" not in metrics:
        return
    diff = metrics["debug/vllm_vs_learner_logprob_diff_mean"]
    if max_diff > 0 and not diff <= max_diff:  # `not <=`: a NaN difference stops the run too
        where = f"Step {step}" if step is not None else "This rollout (first minibatch)"
        raise RuntimeError(
            f"{where}: vLLM and the learner disagree on the logprobs of the sampled tokens by {diff:.4g} nats "
            f"per token on average (limit --max_vllm_logprob_diff {max_diff:g}), so the engine is not sampling "
            f"from the learner's weights (a failed or partial weight sync) and the rollouts are off-policy. "
            f"Look at the debug/vllm_vs_learner_* metrics; if the gap is expected (a bf16 engine, async mode at a "
            f"high learning rate), raise --max_vllm_logprob_diff."
        )


def agreement_metrics(learner_logprob: torch.Tensor, engine_logprob: torch.Tensor, mask: torch.Tensor) -> dict:
    """The `debug/vllm_vs_learner_*` metrics (rl.logprob_agreement); inputs [batch, response_len]."""
    agreement = rl.logprob_agreement(learner_logprob, engine_logprob, mask)
    return {
        "debug/vllm_vs_learner_logprob_diff_mean": agreement["diff_mean"].item(),
        "debug/vllm_vs_learner_logprob_diff_max": agreement["diff_max"].item(),
        "debug/vllm_vs_learner_ratio_mean": agreement["ratio_mean"].item(),
        "debug/vllm_vs_learner_ratio_min": agreement["ratio_min"].item(),
        "debug/vllm_vs_learner_ratio_max": agreement["ratio_max"].item(),
    }


class PPOLearner:
    """The learner of one process, or one rank of a DeepSpeed group (`backend`, see learner_backend.py).

    Subclasses change the algorithm through `uses_value_model` and `compute_advantages` (GRPO: grpo_learner.py).

    Every rank holds the whole rollout, runs the forward passes of `make_experience` on its share of the
    rows and gathers them, so advantages, their whitening and every metric are computed over the global
    batch, identically on each rank. `train` draws the same minibatch order on every rank and gives each
    rank an equal slice of each minibatch: with gradients averaged over ranks and micro-batches, the update
    is the single-process one.
    """

    uses_value_model = True  # a critic, trained beside the policy, that GAE takes its baseline from

    def __init__(
        self, args: Args, sizes: BatchSizes, tokenizer, policy_path: str, stop_token_ids: list[int], backend=None,
        compute_dtype: tuple[torch.dtype, str] | None = None,
    ):  # fmt: skip
        """`compute_dtype`: (dtype, why) as `mu.learner_compute_dtype` chose it before the engine started loading
        (its probe times matmuls: best on quiet cores); None: this learner chooses now."""
        self.args, self.sizes, self.tokenizer = args, sizes, tokenizer
        self.stop_token_ids = stop_token_ids
        self.backend = backend or SingleProcess()
        self.device = self.backend.device
        model_args = args.model
        if compute_dtype is None:
            compute_dtype = mu.learner_compute_dtype(model_args.learner_compute_dtype, self.device)
        self.compute_dtype, why = compute_dtype
        # Each rank probed its own CPU; they must compute alike (one process: the sum is its own choice).
        self.compute_dtype, why = mu.compute_dtype_of_all_ranks(self.compute_dtype, why, self.backend.all_sum)
        if self.backend.rank == 0:
            print(f"[learner] computing in {why}")
        self.policy_path = policy_path
        self.policy = mu.load_policy(policy_path, self.device, model_args.model_revision, trainable=True)
        # --beta 0 puts no KL in the reward or the loss: no reference model is loaded, and none runs.
        self.ref_policy = None
        if args.ppo.beta != 0:
            self.ref_policy = mu.load_policy(policy_path, self.device, model_args.model_revision, trainable=False)
        self.reward_model = None
        if args.reward.reward_model_multiplier != 0:
            if model_args.reward_model_path is None:
                raise ValueError("--reward_model_multiplier is non-zero but no --reward_model_path was given.")
            mu.check_same_vocab(
                tokenizer, mu.load_tokenizer(model_args.reward_model_path), policy_path, model_args.reward_model_path
            )
            self.reward_model = mu.load_scalar_model(
                model_args.reward_model_path,
                self.device,
                trainable=False,
                pad_token_id=tokenizer.pad_token_id,
                revision=model_args.reward_model_revision,
            )
        self.value_model = self.value_trainer = None
        if self.uses_value_model:
            value_path = model_args.value_model_path or model_args.reward_model_path or policy_path
            self.value_model = mu.load_scalar_model(
                value_path, self.device, trainable=True, pad_token_id=tokenizer.pad_token_id
            )
        if model_args.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
        self.policy.train()
        self.policy_trainer = self.backend.trainable(self.policy, self.optimizer_settings(args.ppo.learning_rate))
        # From here on forward passes go through what the backend built (a DeepSpeed engine, or the model itself).
        self.policy = self.policy_trainer.model
        if self.value_model is not None:
            if model_args.gradient_checkpointing:
                self.value_model.gradient_checkpointing_enable()
            self.value_model.train()
            value_lr = args.ppo.value_learning_rate or args.ppo.learning_rate
            self.value_trainer = self.backend.trainable(self.value_model, self.optimizer_settings(value_lr))
            self.value_model = self.value_trainer.model
        if self.ref_policy is not None:
            self.ref_policy = self.backend.frozen(self.ref_policy)
        if self.reward_model is not None:
            self.reward_model = self.backend.frozen(self.reward_model)
        self.shuffle_generator = torch.Generator().manual_seed(args.run.seed)

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
        return self.backend.named_weights(self.policy, dtype, slot)

    # ---- the weight broadcast to vLLM engine actors (weight_sync.py) ----
    def weight_bucket_plan(self, bucket_bytes: int) -> list[ws.Bucket]:
        """How the policy is cut into broadcast buckets (the same on every rank; the engines get it once)."""
        dtype = getattr(torch, engine_dtype(self.args.gen.vllm_dtype))
        self.weight_plan = ws.plan_buckets(self.backend.weight_shapes(self.policy), dtype, bucket_bytes)
        return self.weight_plan

    def join_weight_group(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        """Rank 0 becomes rank 0 of the broadcast group (the engines' workers join at the same time)."""
        self.weight_group, self.weight_device = None, ws.buffer_device(backend, self.device)
        if getattr(self.backend, "rank", 0) == 0:
            self.weight_group = ws.init_group(host, port, 0, world_size, backend, timeout_s)

    def broadcast_weights(self) -> dict | None:
        """Send the policy to the engines in buckets (rank 0); under ZeRO-3 every rank takes part in gathering it.
        Returns, on rank 0, the checksum of what was sent, timings and sizes."""
        dtype = getattr(torch, engine_dtype(self.args.gen.vllm_dtype))
        named = self.backend.iter_named_weights(self.policy, dtype)
        if self.weight_group is None:
            for _ in named:  # gathers a parameter at each step under ZeRO-3
                pass
            return None
        return ws.send_buckets(self.weight_group, self.weight_plan, named, self.weight_device)

    @property
    def lr(self) -> float:
        return self.policy_trainer.lr

    def make_experience(
        self, prompts: PromptBatch, completions: list[Completion], reward_manager: RewardManager
    ) -> tuple[Experience, dict[str, float], dict]:
        """Score a rollout and compute logprobs, values, KL-shaped rewards and GAE advantages.

        Forward passes, each only when something needs it: the learner's old logprobs (--old_logprobs_from learner,
        truncated importance sampling, or a response token the engine gave no logprob for), the reference's
        (--beta non-zero), the value model's, and the reward model's (--reward_model_multiplier non-zero).
        """
        ppo, gen, device = self.args.ppo, self.args.gen, self.device
        pad = self.tokenizer.pad_token_id
        query, query_mask = left_pad([prompts.token_ids[c.prompt_index] for c in completions], pad)
        generated_length = torch.tensor([len(c.token_ids) for c in completions])
        # As wide as the longest response in this batch, not --response_length: no compute on padding.
        width = max(int(generated_length.max()), 1)
        raw_response = torch.full((len(completions), width), pad, dtype=torch.long)
        for row, completion in enumerate(completions):
            raw_response[row, : len(completion.token_ids)] = torch.tensor(completion.token_ids)
        # PPO detail: truncate at the first stop token; the mask comes from lengths (pad may equal eos).
        response, stop_length = rl.truncate_response(raw_response, self.stop_token_ids, pad)
        response_length = torch.minimum(stop_length, generated_length)
        response_mask = rl.response_mask_from_lengths(response_length, width)
        stopped = [c.finish_reason == "stop" for c in completions]

        context_length = query.shape[1]
        query_response = torch.cat([query, response], dim=1).to(device)
        attention_mask = torch.cat([query_mask, response_mask.long()], dim=1).to(device)
        response_mask, response_length = response_mask.to(device), response_length.to(device)

        def logprob_of(model):
            return lambda qr, am: mu.response_logprobs(model, qr, am, context_length, gen.temperature)[0]

        # Positions past the stop token (truncation) are padding: the engine's logprobs there are never read.
        engine_logprob = engine_logprobs(completions, width).to(device)  # [batch, response_len]
        engine_scored = response_mask & torch.isfinite(engine_logprob)
        tis_cap = ppo.truncated_importance_sampling_ratio_cap
        timings: dict[str, float] = {}
        learner_logprob = None
        if ppo.old_logprobs_from == "learner" or tis_cap > 0 or not bool(engine_scored[response_mask].all()):
            with timed(timings, "time/old_logprob_forward"):
                learner_logprob = self.forward_on_all_rows(logprob_of(self.policy), query_response, attention_mask)
        source_metrics = {}
        if ppo.old_logprobs_from == "learner":
            logprob = learner_logprob
        else:  # the engine's logprob where it gave one, the learner's where it did not; 0 on padding
            fallback = learner_logprob if learner_logprob is not None else torch.zeros_like(engine_logprob)
            logprob = torch.where(engine_scored, engine_logprob, torch.where(response_mask, fallback, 0.0))
            filled = (response_mask & ~engine_scored).float()
            source_metrics = {"debug/old_logprobs_from_learner_frac": rl.masked_mean(filled, response_mask).item()}
        ref_logprob = None
        if self.ref_policy is not None:
            with timed(timings, "time/ref_logprob_forward"):
                ref_logprob = self.forward_on_all_rows(logprob_of(self.ref_policy), query_response, attention_mask)
        rm_score = None
        if self.reward_model is not None:
            with timed(timings, "time/reward_model_forward"):
                rm_score = self.forward_on_all_rows(
                    lambda qr, am, length: mu.reward_model_scores(self.reward_model, qr, am, context_length, length),
                    query_response, attention_mask, response_length,
                ).cpu()
        score, reward_metrics = reward_manager.score(
            [c.text for c in completions],
            [prompts.ground_truths[c.prompt_index] for c in completions],
            [prompts.verifier_names[c.prompt_index] for c in completions],
            stopped,
            rm_score,
        )
        score = score.to(device)
        if not torch.isfinite(score).all():
            raise NonFiniteError(f"a reward score is NaN or inf ({score.tolist()}); check the reward model")

        tis_weight, tis_metrics = None, {}
        if tis_cap > 0:
            tis_weight = rl.truncated_importance_weight(learner_logprob, engine_logprob, response_mask, tis_cap)
            tis_metrics = {
                "policy/tis_weight_mean": rl.masked_mean(tis_weight, response_mask).item(),
                "policy/tis_capped_frac": rl.masked_mean((tis_weight >= tis_cap).float(), response_mask).item(),
            }

        if ref_logprob is not None:
            kl = rl.compute_kl(logprob, ref_logprob, ppo.kl_estimator)
        else:  # --beta 0: no reference to measure a KL against, and none is used
            kl = torch.zeros_like(logprob)
        reward_beta = 0.0 if ppo.kl_in_loss else ppo.beta  # with --kl_in_loss the KL is a loss term instead
        reward, non_score_reward = rl.per_token_rewards(score, kl, response_mask, reward_beta)
        experience = Experience(
            query_response, attention_mask, context_length, response_mask, logprob, ref_logprob,
            tis_weight=tis_weight, engine_logprob_to_check=engine_logprob if learner_logprob is None else None,
        )  # fmt: skip
        advantage_metrics = self.compute_advantages(experience, score, reward, completions, timings)
        if ppo.whiten_advantages:
            experience.advantage = rl.masked_whiten(experience.advantage, response_mask)
        if not torch.isfinite(torch.where(response_mask, experience.advantage, 0.0)).all():
            raise NonFiniteError("an advantage is NaN or inf (from the logprobs, values or KL of this batch)")

        masked_kl = torch.where(response_mask, kl, torch.zeros_like(kl))
        # Without the learner's old forward, `train` measures the engine-vs-learner agreement on its first minibatch.
        agreement = {} if learner_logprob is None else agreement_metrics(learner_logprob, engine_logprob, response_mask)
        metrics = {
            # Absent with --beta 0: no reference model; policy/approxkl_avg still shows how far each update moves.
            **({"objective/kl": masked_kl.sum(1).mean().item()} if ref_logprob is not None else {}),
            "objective/entropy": (-torch.where(response_mask, logprob, torch.zeros_like(logprob))).sum(1).mean().item(),
            "objective/non_score_reward": non_score_reward.sum(1).mean().item(),
            "objective/rlhf_reward": (non_score_reward.sum(1) + score).mean().item(),
            "objective/scores": score.mean().item(),
            "val/sequence_lengths": response_length.float().mean().item(),
            "val/num_stop_token_ids": float(sum(stopped)),
            "val/advantage_mean": rl.masked_mean(experience.advantage, response_mask).item(),
            **advantage_metrics,
            **agreement,
            **source_metrics,
            **tis_metrics,
            **reward_metrics,
            **timings,
        }
        samples = {"score": score.tolist(), "response_length": response_length.tolist()}
        return experience, metrics, samples

    def forward_on_all_rows(self, fn, *tensors: torch.Tensor) -> torch.Tensor:
        """`fn` (no grad, in micro-batches) on this rank's rows, gathered: every rank gets the whole batch's outputs."""
        rows = self.backend.local_rows(tensors[0].shape[0])
        chunk = self.args.ppo.per_device_train_batch_size
        local = mu.no_grad_in_chunks(
            fn, chunk, *(t[rows] for t in tensors), device=self.device, dtype=self.compute_dtype
        )
        return self.backend.gather_rows(local)

    def compute_advantages(
        self, exp: Experience, score: torch.Tensor, reward: torch.Tensor, completions: list[Completion], timings: dict
    ) -> dict[str, float]:
        """PPO: the value model's values of the rollout, then GAE over the per-token rewards `reward` (the score on
        the last real token, and -beta * KL on every token unless --kl_in_loss). Sets exp.value, exp.advantage and
        exp.return_; returns metrics. `score` [batch] and `completions` are what other algorithms use instead."""
        ppo = self.args.ppo
        with timed(timings, "time/value_forward"):
            exp.value = self.forward_on_all_rows(
                lambda qr, am: mu.response_values(self.value_model, qr, am, exp.context_length),
                exp.query_response, exp.attention_mask,
            )  # fmt: skip
        if ppo.whiten_rewards:
            reward = rl.masked_whiten(reward, exp.response_mask, shift_mean=False)
        exp.advantage, exp.return_ = rl.compute_gae(reward, exp.value, exp.response_mask, ppo.gamma, ppo.lam)
        return {"val/value_mean": rl.masked_mean(exp.value, exp.response_mask).item()}

    def train(self, exp: Experience) -> dict[str, float]:
        """`num_epochs` PPO epochs over shuffled minibatches; one optimizer step per minibatch."""
        ppo, temperature = self.args.ppo, self.args.gen.temperature
        micro_size = ppo.per_device_train_batch_size
        stats: dict[str, list[float]] = {}
        skipped_updates = 0
        agreement: dict[str, float] = {}

        def record(**values: torch.Tensor) -> None:
            for key, value in values.items():
                stats.setdefault(key, []).append(value.item())

        for epoch in range(ppo.num_epochs):
            # The same order on every rank (same seed); each rank trains on its equal slice of each minibatch.
            order = torch.randperm(exp.query_response.shape[0], generator=self.shuffle_generator)
            for index, minibatch in enumerate(order.split(self.sizes.mini_batch_size)):
                finite_losses = True
                # Before the first update the policy is still the one the batch was made with: its logprobs here are
                # the learner's old ones, which make_experience did not compute with --old_logprobs_from vllm.
                check_agreement = epoch == 0 and index == 0 and exp.engine_logprob_to_check is not None
                first_logprobs = []
                local_minibatch = minibatch.tensor_split(self.backend.world_size)[self.backend.rank]
                for micro in local_minibatch.split(micro_size):
                    mask = exp.response_mask[micro]
                    qr, am = exp.query_response[micro], exp.attention_mask[micro]
                    with mu.autocast(self.device, self.compute_dtype):
                        new_logprob, logits = mu.response_logprobs(self.policy, qr, am, exp.context_length, temperature)
                    if check_agreement:
                        first_logprobs.append(new_logprob.detach())
                    tis_weight = exp.tis_weight[micro] if exp.tis_weight is not None else None
                    pg_loss, pg_clipfrac, approxkl, ratio = rl.policy_loss(
                        new_logprob, exp.logprob[micro], exp.advantage[micro], mask, ppo.cliprange, tis_weight,
                        ppo.loss_aggregation,
                    )  # fmt: skip
                    policy_objective = pg_loss
                    if ppo.kl_in_loss and exp.ref_logprob is not None:  # --beta 0: no KL term
                        policy_objective = policy_objective + ppo.beta * rl.kl_penalty_loss(
                            new_logprob, exp.ref_logprob[micro], mask, "k3", ppo.loss_aggregation
                        )
                    loss = policy_objective.detach()
                    self.policy_trainer.backward(policy_objective)
                    if self.value_model is not None:
                        with mu.autocast(self.device, self.compute_dtype):
                            new_value = mu.response_values(self.value_model, qr, am, exp.context_length).float()
                        vf_loss, vf_clipfrac = rl.value_loss(
                            new_value, exp.value[micro], exp.return_[micro], mask, ppo.cliprange_value
                        )
                        # The two models share no parameter: separate backward passes give the gradients of the sum.
                        self.value_trainer.backward(ppo.vf_coef * vf_loss)
                        loss = loss + ppo.vf_coef * vf_loss.detach()  # vf_loss is logged unweighted
                        record(vf_loss=vf_loss, vf_clipfrac=vf_clipfrac)
                    finite_losses &= bool(torch.isfinite(loss))
                    with torch.no_grad():
                        entropy = rl.masked_mean(rl.entropy_from_logits(logits.float() / temperature), mask)
                    record(
                        pg_loss=pg_loss, loss=loss, pg_clipfrac=pg_clipfrac, approxkl=approxkl, ratio=ratio,
                        entropy=entropy,
                    )
                if check_agreement:  # gathered over ranks: the minibatch's rows in `minibatch` order
                    learner_logprob = self.backend.gather_rows(torch.cat(first_logprobs))
                    agreement = agreement_metrics(
                        learner_logprob, exp.engine_logprob_to_check[minibatch], exp.response_mask[minibatch]
                    )
                    check_engine_matches_learner(agreement, self.args.gen.max_vllm_logprob_diff)  # before the update
                # A non-finite loss or gradient norm is never applied to the weights (see AdamWTrainer.step).
                applied = [trainer.step(apply=finite_losses) for trainer in self.trainers]
                if not all(applied) and not self.args.run.skip_nonfinite_updates:
                    raise NonFiniteError(
                        f"non-finite {'loss' if not finite_losses else 'gradient'} in a PPO minibatch; the update was "
                        "not applied. Lower the learning rate, or pass --skip_nonfinite_updates true to skip such updates."
                    )
                skipped_updates += not all(applied)

        # Means over every micro-batch of every rank: [key, (sum, count)] summed over ranks.
        totals = self.backend.all_sum(
            torch.tensor([[sum(values), len(values)] for values in stats.values()], dtype=torch.float64)
        )
        global_mean = {key: (total / count).item() for key, (total, count) in zip(stats, totals)}

        def mean(key: str) -> float:
            return global_mean[key]

        value_metrics = {}
        if self.value_model is not None:
            value_metrics = {"loss/value_avg": mean("vf_loss"), "val/clipfrac_avg": mean("vf_clipfrac")}
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
        }

    def state_dict(self) -> dict:
        """Everything of the learner a resumed run needs; the frozen reference (and reward) model are reloaded from
        their original paths instead, so the KL reference stays the run's initial policy (with --beta 0 there is
        none, in the run and in its resumption: --beta must match the checkpoint's). Without a value model (GRPO)
        there is no "value_model" entry, and one optimizer and scheduler."""
        state = {"policy": self.policy.state_dict()}
        if self.value_model is not None:
            state["value_model"] = self.value_model.state_dict()
        return {
            **state,
            "optimizers": [trainer.optimizer.state_dict() for trainer in self.trainers],
            "schedulers": [trainer.scheduler.state_dict() for trainer in self.trainers],
            "shuffle_generator": self.shuffle_generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "compute_dtype": mu.dtype_name(self.compute_dtype),
        }

    def load_state_dict(self, state: dict) -> None:
        if ("value_model" in state) != (self.value_model is not None):
            held, wanted = ("a", "no") if "value_model" in state else ("no", "a")
            raise ValueError(
                f"the checkpoint holds {held} value model but this {type(self).__name__} trains {wanted} value model "
                "(a PPO checkpoint resumed by GRPO, or the reverse); resume with the trainer that wrote it."
            )
        self.policy.load_state_dict(state["policy"])
        if self.value_model is not None:
            self.value_model.load_state_dict(state["value_model"])
        for trainer, optimizer_state, scheduler_state in zip(self.trainers, state["optimizers"], state["schedulers"]):
            trainer.optimizer.load_state_dict(optimizer_state)
            trainer.scheduler.load_state_dict(scheduler_state)
        self.shuffle_generator.set_state(state["shuffle_generator"])
        torch.set_rng_state(state["torch_rng"])
        # `--learner_compute_dtype auto` decides by a timing probe, which a busy machine can tip the other way: a
        # resumed run computes in the dtype the run computed in, so that it goes on as the uninterrupted one would.
        run_dtype = state.get("compute_dtype")  # absent from checkpoints written before it was saved
        if run_dtype is not None and getattr(torch, run_dtype) != self.compute_dtype:
            if self.backend.rank == 0:
                print(f"[learner] computing in {run_dtype}, as the run did before this checkpoint "
                      f"(this start alone chose {mu.dtype_name(self.compute_dtype)})", flush=True)  # fmt: skip
            self.compute_dtype = getattr(torch, run_dtype)

    def initial_weights(self) -> dict[str, torch.Tensor]:
        """The run's initial policy weights: the reference model's, or (--beta 0: none loaded) read again, in fp32."""
        if self.ref_policy is not None:
            return dict(self.ref_policy.named_parameters())
        initial = mu.load_policy(self.policy_path, torch.device("cpu"), self.args.model.model_revision, trainable=True)
        return dict(initial.named_parameters())

    @property
    def trainers(self) -> tuple:
        return (self.policy_trainer,) if self.value_trainer is None else (self.policy_trainer, self.value_trainer)

    def save(self, output_dir: str, extra_files: dict[str, dict] | None = None) -> SavedModel | None:
        """Save the policy as an HF folder in `--save_dtype` (default fp32: exactly the trained weights).

        Rank 0 writes the full policy (gathered under ZeRO-3); other ranks only help gather and return None.
        Non-finite weights are never written.
        """
        dtype = getattr(torch, self.args.run.save_dtype)
        with self.backend.full_model(self.policy) as policy:
            if policy is None:
                return None
            assert_finite(policy.state_dict(), "the policy")
            state_dict = mu.state_dict_for_saving(policy, dtype)
            path = mu.save_hf_folder(policy, self.tokenizer, output_dir, state_dict, extra_files)
            rounding = None
            # Measured against the initial policy, which the reference model holds whole in one process only.
            if dtype.itemsize < 4 and self.backend.world_size == 1:
                rounding = mu.rounding_report(dict(policy.named_parameters()), self.initial_weights(), dtype)
            return SavedModel(path, self.args.run.save_dtype, mu.weights_sha256(state_dict), rounding)


def learner_class(algorithm: str) -> type[PPOLearner]:
    """The learner of --algorithm, for this process and for every Ray learner rank alike."""
    if algorithm == "grpo":
        from open_instruct.grpo_learner import GRPOLearner  # imports this module: a top-level import would be a cycle

        return GRPOLearner
    return PPOLearner
