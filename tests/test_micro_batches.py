"""How a minibatch's loss is split over micro-batches: each micro-batch's loss is its sum over its tokens
divided by the whole minibatch's real tokens (`--loss_aggregation token`) or responses (`sequence`), so its part of
the minibatch's mean, and the parts add up. A token then weighs the same whatever micro-batch it lands in; before,
each padded micro-batch took its own mean and the micro-batches were averaged, so a token of a micro-batch of short
responses weighed more than one of long responses.

- PPO (policy, value model and the k3 KL term in the loss) and GRPO, token and sequence aggregation, fp32, on a
  rollout of responses of 2 to 35 tokens: the padded path with 1, 2 and 4 micro-batches per minibatch hands every
  optimizer step the gradients of one pass over the whole minibatch (1e-6), and so does the packed path (1e-5: its
  attention sums in another order). The first step's are also computed here in one pass from the losses of `rl`.
- Two DeepSpeed ranks, padded and packed, against the single process: test_packing.py.
"""

import pytest
import torch

from open_instruct import rl
from open_instruct.learner import models
from tests.support.learner_steps import assert_same_gradients, learner_with_experience, recorded_gradients

# Minibatches of 4 rows (EQUIVALENCE_FLAGS: 8 responses, 2 minibatches, 2 epochs): how each is split.
SPLITS = {
    "1 padded micro-batch": ["--per_device_train_batch_size", "4"],
    "2 padded micro-batches": ["--per_device_train_batch_size", "2"],
    "4 padded micro-batches": ["--per_device_train_batch_size", "1"],
    "packed by 100 tokens": ["--per_device_train_batch_size", "2", "--max_tokens_per_micro_batch", "100"],
}
KL_IN_LOSS = {"ppo": ["--kl_in_loss", "true"], "grpo": []}  # GRPO puts the k3 term in the loss by default


def whole_minibatch_gradients(learner, exp) -> dict[str, torch.Tensor]:
    """The first minibatch's gradients from one pass over its 4 rows, with the losses of `rl` and no micro-batches."""
    ppo = learner.args.ppo
    rows = torch.randperm(exp.query_response.shape[0], generator=torch.Generator().manual_seed(learner.args.run.seed))
    rows = rows[: learner.sizes.mini_batch_size]
    qr, am, mask = exp.query_response[rows], exp.attention_mask[rows], exp.response_mask[rows]
    logprob, _ = models.response_logprobs(learner.policy, qr, am, exp.context_length, learner.args.gen.temperature)
    loss = rl.policy_loss(logprob, exp.logprob[rows], exp.advantage[rows], mask, ppo.cliprange,
                          aggregation=ppo.loss_aggregation)[0]  # fmt: skip
    loss = loss + ppo.beta * rl.kl_penalty_loss(logprob, exp.ref_logprob[rows], mask, "k3", ppo.loss_aggregation)
    loss.backward()
    models_by_role = {"policy": learner.policy}
    if learner.value_model is not None:
        value = models.response_values(learner.value_model, qr, am, exp.context_length)
        value_loss, _ = rl.value_loss(value, exp.value[rows], exp.return_[rows], mask, ppo.cliprange_value)
        (ppo.vf_coef * value_loss).backward()
        models_by_role["value"] = learner.value_model
    return {f"{role}:{name}": param.grad.clone()
            for role, model in models_by_role.items() for name, param in model.named_parameters()}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_every_split_of_a_minibatch_takes_the_gradients_of_the_whole_minibatch(tiny_model_dir, algorithm, aggregation):
    """Slow (about a minute a case on 2 cores): five real learners of the tiny model (one per split: 1, 2, 4 padded
    micro-batches and packed) each take two epochs of two minibatches, so that every optimizer step is compared."""
    flags = ["--loss_aggregation", aggregation, *KL_IN_LOSS[algorithm]]
    learner, exp, _ = learner_with_experience(tiny_model_dir, algorithm, *flags, *SPLITS["1 padded micro-batch"])
    lengths = exp.response_mask.sum(1)
    assert lengths.min() <= 2 and lengths.max() >= 30  # responses of very different lengths
    assert learner.args.ppo.beta > 0 and learner.args.ppo.kl_in_loss  # the k3 term is part of the loss
    whole = whole_minibatch_gradients(learner, exp)
    assert max(gradient.abs().max().item() for gradient in whole.values()) > 1e-3  # a comparison of real gradients

    steps_by_split = {}
    for split, split_flags in SPLITS.items():
        learner, exp, _ = learner_with_experience(tiny_model_dir, algorithm, *flags, *split_flags)
        steps_by_split[split] = recorded_gradients(learner)
        learner.train(exp)
    reference = steps_by_split["1 padded micro-batch"]
    # 2 minibatches x 2 epochs, each a step of every trained model
    assert len(reference) == 4 * len(learner.trainers) == 4 * (2 if algorithm == "ppo" else 1)
    first = {name: gradient for step in reference[: len(learner.trainers)] for name, gradient in step.items()}
    assert_same_gradients(first, whole, "1 padded micro-batch against the whole minibatch by hand, first step")
    for split, steps in steps_by_split.items():
        assert len(steps) == len(reference), split
        for number, (got, expected) in enumerate(zip(steps, reference)):
            # Packed, the attention sums each sequence alone (varlen_attention.py) and the tied embedding's gradient
            # adds its rows' parts in another order: a few elements of ~0.1 differ by 1.2e-6 at the first update, by
            # 2.3e-6 after three (measured), so 1e-5 as test_packing.py's weights; padded splits agree within 1e-6.
            atol = 1e-5 if split.startswith("packed") else 1e-6
            assert_same_gradients(got, expected, f"{split}, step {number}", atol)
